"""Planning time, objective and planner memory of auto_parallel's searches on GPT models.

Alpa's GPT suite (125M to 39B, sequence 1024, vocabulary 51200) plus GPT-3 175B, on 8, 64,
512 and 1024 devices, for each search mode; the objective is simpar's step-time model on the
``ascend910b`` profile, and each search's is given as a ratio to the exact ILP's where that
solves within the time limit. Every plan runs in its own process (shapes only: no MPI, no
data), so its peak resident memory is the planner's own; a plan that takes longer than
``--timeout`` seconds is reported as such.

    python benchmarks/search.py                          # the default grid, into RESULTS.md
    python benchmarks/search.py --models 125M --devices 8 --modes dynamic_programming exact
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import host_line, markdown_table, today, write_section  # noqa: E402

#: name: (layers, hidden, heads); sequence 1024 and vocabulary 51200 throughout.
GPT_SUITE = {
    "125M": (12, 768, 12), "350M": (24, 1024, 16), "760M": (24, 1536, 16),
    "1.3B": (24, 2048, 32), "2.6B": (32, 2560, 32), "6.7B": (32, 4096, 32),
    "15B": (48, 5120, 40), "39B": (48, 8192, 64), "175B": (96, 12288, 96),
}


def plan_once(spec: dict) -> dict:
    """Plan one configuration in this process and return the figures (child side)."""
    import numpy as np

    from simpar import context, graph, nn
    from simpar.cost import SimparCostModel
    from simpar.search.cost_graph import build_cost_graph
    from simpar.search.dynamic_programming import solve_dynamic_programming
    from simpar.search.exact import solve_exact

    context.set_algo_parameters(fully_use_devices=spec["fully_use_devices"])
    layers, hidden, heads = GPT_SUITE[spec["model"]]
    net = nn.GPT(51200, 1024, hidden, layers, heads, dtype=np.float16)
    start = time.perf_counter()
    g = graph.trace(net, [((spec["batch"], 1024), np.int32)], ["ids"])
    cg = build_cost_graph(g, spec["devices"], SimparCostModel(spec["profile"]), "data_parallel")
    built = time.perf_counter()
    if spec["mode"] == "exact":
        sol = solve_exact(cg, time_limit=spec["timeout"])
        choice, gap = sol.choice, sol.gap
    else:
        dp = solve_dynamic_programming(cg)
        choice, gap = dp.choice, 0.0 if dp.exact else math.nan
    done = time.perf_counter()
    return {"ops": len(cg.nodes), "candidates": max(len(n.candidates) for n in cg.nodes),
            "build": built - start, "solve": done - built, "objective": cg.total(choice),
            "memory": cg.memory(choice), "capacity": cg.memory_capacity, "gap": gap,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run(spec: dict) -> dict:
    """Plan ``spec`` in a child process, within the time limit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    started = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                             capture_output=True, text=True, timeout=spec["timeout"] + 30,
                             env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"over {spec['timeout'] + 30:.0f} s"}
    if out.returncode:
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
        if "No available cost" in last:  # the figure that matters, not the whole advice
            need = last.split("minimum memory cost is ")[1].split(" bytes")[0]
            return {"error": f"nothing fits: at least {float(need) / 2**30:.0f} GiB per rank "
                             f"(found in {time.perf_counter() - started:.0f} s)"}
        return {"error": last or f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/search.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", default=["125M", "350M", "1.3B", "175B"],
                   choices=list(GPT_SUITE))
    p.add_argument("--devices", nargs="+", type=int, default=[8, 64])
    p.add_argument("--modes", nargs="+", default=["dynamic_programming", "exact"],
                   choices=["dynamic_programming", "exact"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--profile", default="ascend910b")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per plan (the exact search's own limit; a plan is stopped "
                   "30 s after it)")
    p.add_argument("--all-devices", action="store_true",
                   help="fully_use_devices=False (MindSpore >= 2.5's default): every cut "
                   "whose product divides the device count, far more candidates")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(plan_once(json.loads(args.child))))
        return 0
    rows = []
    for model in args.models:
        for devices in args.devices:
            results = {}
            for mode in args.modes:
                spec = {"model": model, "devices": devices, "mode": mode,
                        "batch": max(args.batch, devices), "profile": args.profile,
                        "timeout": args.timeout, "fully_use_devices": not args.all_devices}
                results[mode] = r = run(spec)
                print(model, devices, mode, r, flush=True)
            ref = results.get("exact", {})
            for mode, r in results.items():
                if "error" in r:
                    rows.append([model, devices, mode, "", "", r["error"], "", "", "", ""])
                    continue
                ratio = (f"{r['objective'] / ref['objective']:.6f}"
                         if "objective" in ref and ref["gap"] == 0 else "")
                rows.append([model, devices, mode, r["ops"], r["candidates"],
                             f"{r['build']:.1f} + {r['solve']:.1f}",
                             f"{r['objective'] * 1e3:.3f}", ratio,
                             f"{r['memory'] / 2**30:.2f} / {r['capacity'] / 2**30:.0f}",
                             f"{r['peak_rss'] / 2**20:.0f}"])
    header = ["model", "devices", "search", "ops", "max candidates",
              "planning s (build + solve)", "predicted step ms", "ratio to exact",
              "memory GiB / cap", "planner peak RSS MiB"]
    table = markdown_table(header, rows)
    print(table)
    if not args.no_write:
        command = "python benchmarks/search.py " + " ".join(argv if argv is not None
                                                            else sys.argv[1:])
        body = (f"Command: `{command.strip()}` · date: {today()}\n\n{table}\n\n"
                f"Profile {args.profile}, batch {args.batch} (at least the device count), "
                f"sequence 1024, float16, fully_use_devices={not args.all_devices}. "
                f"{host_line()}.\n")
        write_section("search", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
