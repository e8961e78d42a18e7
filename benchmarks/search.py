"""Planning time, objective and planner memory of auto_parallel's searches on GPT models.

Alpa's GPT suite (125M to 39B, sequence 1024, vocabulary 51200) plus GPT-3 175B, on 8, 64,
512 and 1024 devices, for each search mode; the objective is simpar's step-time model on the
``ascend910b`` profile, and each search's is given as a ratio to the exact ILP's where that
solves within the time limit, and to dynamic programming's. Every plan runs in its own process
(shapes only: no MPI, no data), so its peak resident memory is the planner's own; a plan that
takes longer than ``--timeout`` seconds is reported as such. ``--depth`` times
recursive_programming against the number of layers instead, with a straight-line fit.

    python benchmarks/search.py                          # the default grid, into RESULTS.md
    python benchmarks/search.py --models 125M --devices 8 --modes dynamic_programming exact
    python benchmarks/search.py --models 1.3B --devices 64 --depth 6 12 24 48 96
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

#: The searches, in the order they are run (the ratios read dynamic_programming and exact).
MODES = ("dynamic_programming", "exact", "recursive_programming", "sharding_propagation")
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
    from simpar.search.pricing import NoAvailableCost, Pricer
    from simpar.search.propagation import dataset_layouts
    from simpar.search.recursive_programming import solve_recursive_programming
    from simpar.search.sharding_propagation import propagate

    context.set_algo_parameters(fully_use_devices=spec["fully_use_devices"])
    layers, hidden, heads = GPT_SUITE[spec["model"]]
    layers = spec.get("layers") or layers
    net = nn.GPT(51200, 1024, hidden, layers, heads, dtype=np.float16)
    start = time.perf_counter()
    g = graph.trace(net, [((spec["batch"], 1024), np.int32)], ["ids"])
    model = SimparCostModel(spec["profile"])
    if spec["mode"] in ("recursive_programming", "sharding_propagation"):
        inputs = dataset_layouts([v.shape for v in g.inputs], spec["devices"], "data_parallel")
        pricer = Pricer(g, spec["devices"], model, inputs)
        built = time.perf_counter()
        try:
            if spec["mode"] == "recursive_programming":
                shardings = list(solve_recursive_programming(pricer).shardings)
            else:
                smap = propagate(pricer, "auto_parallel", inputs)
                priced = [pricer.price(s.index, smap.ops[s.name].in_strategy)
                          for s in pricer.sites]
                shardings = [p.sharding for p in priced if p is not None]
        except NoAvailableCost as e:  # the time to find out counts as planning time
            need = float(str(e).split("plan needs ")[1].split(" bytes")[0])
            return {"error": f"its plan needs {need / 2**30:.0f} GiB per rank, over the cap",
                    "build": built - start, "solve": time.perf_counter() - built}
        done = time.perf_counter()
        return {"ops": len(g.nodes), "candidates": 0, "build": built - start,
                "solve": done - built, "objective": pricer.total(shardings),
                "memory": pricer.memory(shardings), "capacity": model.memory_capacity,
                "gap": math.nan,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    cg = build_cost_graph(g, spec["devices"], model, "data_parallel")
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
            took = time.perf_counter() - started
            if "minimum memory cost is " in last:
                need = last.split("minimum memory cost is ")[1].split(" bytes")[0]
                return {"error": f"nothing fits: at least {float(need) / 2**30:.0f} GiB per "
                                 f"rank (found in {took:.1f} s)", "seconds": took}
            need = last.split("plan needs ")[1].split(" bytes")[0]
            return {"error": f"its plan needs {float(need) / 2**30:.0f} GiB per rank, over "
                             f"the cap (found in {took:.1f} s)", "seconds": took}
        return {"error": last or f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/search.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", default=["125M", "350M", "1.3B", "175B"],
                   choices=list(GPT_SUITE))
    p.add_argument("--devices", nargs="+", type=int, default=[8, 64])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--exact-up-to", type=int, default=8, metavar="N",
                   help="run exact only on up to N devices (default 8: beyond, HiGHS does "
                   "not finish in minutes)")
    p.add_argument("--dp-up-to", type=int, default=1024, metavar="N",
                   help="run dynamic_programming only on up to N devices (default 1024)")
    p.add_argument("--depth", nargs="*", type=int, default=None,
                   help="instead of the grid: --depth-mode on --models[0]'s widths with these "
                   "numbers of layers, on --devices[0] devices, and a straight-line fit of "
                   "planning time against depth")
    p.add_argument("--depth-mode", default="recursive_programming",
                   choices=["recursive_programming", "dynamic_programming"])
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
    if args.depth is not None:
        return depth_fit(args, argv)
    rows = []
    for model in args.models:
        for devices in args.devices:
            results = {}
            for mode in args.modes:
                limit = {"exact": args.exact_up_to, "dynamic_programming": args.dp_up_to}
                if devices > limit.get(mode, devices):
                    continue
                spec = {"model": model, "devices": devices, "mode": mode,
                        "batch": max(args.batch, devices), "profile": args.profile,
                        "timeout": args.timeout, "fully_use_devices": not args.all_devices}
                results[mode] = r = run(spec)
                print(model, devices, mode, r, flush=True)
            ref = results.get("exact", {})
            dp = results.get("dynamic_programming", {})
            for mode, r in results.items():
                if "error" in r:
                    took = f"{r['build']:.2f} + {r['solve']:.2f}: " if "build" in r else ""
                    rows.append([model, devices, mode, "", "", took + r["error"], "", "", "",
                                 "", ""])
                    continue
                ratio = (f"{r['objective'] / ref['objective']:.6f}"
                         if "objective" in ref and ref["gap"] == 0 else "")
                to_dp = (f"{r['objective'] / dp['objective']:.4f}" if "objective" in dp
                         else "")
                rows.append([model, devices, mode, r["ops"], r["candidates"] or "-",
                             f"{r['build']:.2f} + {r['solve']:.2f}",
                             f"{r['objective'] * 1e3:.3f}", ratio, to_dp,
                             f"{r['memory'] / 2**30:.2f} / {r['capacity'] / 2**30:.0f}",
                             f"{r['peak_rss'] / 2**20:.0f}"])
    header = ["model", "devices", "search", "ops", "max candidates",
              "planning s (build + solve)", "predicted step ms", "ratio to exact",
              "ratio to DP", "memory GiB / cap", "planner peak RSS MiB"]
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


def depth_fit(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Planning time of one search against depth, with a least-squares line."""
    model, devices = args.models[0], args.devices[0]
    depths = args.depth or [6, 12, 24, 48, 96]
    rows, xs, ys = [], [], []
    for layers in depths:
        spec = {"model": model, "layers": layers, "devices": devices,
                "mode": args.depth_mode, "batch": max(args.batch, devices),
                "profile": args.profile, "timeout": args.timeout,
                "fully_use_devices": not args.all_devices}
        r = run(spec)
        print(layers, r, flush=True)
        seconds = r["build"] + r["solve"] if "build" in r else r.get("seconds", math.nan)
        if "objective" not in r:
            print(f"{layers} layers: {r['error']}", flush=True)
        xs.append(layers)
        ys.append(seconds)
        rows.append([layers, r.get("ops", ""), f"{seconds:.2f}",
                     f"{r['objective'] * 1e3:.3f}" if "objective" in r else r["error"]])
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    icept = my - slope * mx
    ss_res = sum((y - icept - slope * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    fit = (f"least-squares line: seconds = {icept:.3f} + {slope * 1e3:.2f} ms x layers, "
           f"R^2 = {1 - ss_res / ss_tot:.4f}")
    table = markdown_table(["layers", "ops", "planning s (build + solve)",
                            "predicted step ms"], rows)
    print(table)
    print(fit)
    if not args.no_write:
        command = "python benchmarks/search.py " + " ".join(argv if argv is not None
                                                            else sys.argv[1:])
        width = GPT_SUITE[model]
        body = (f"Command: `{command.strip()}` · date: {today()}\n\n"
                f"{args.depth_mode} on GPT hidden {width[1]}, {width[2]} heads, "
                f"sequence 1024, batch {max(args.batch, devices)}, {devices} devices, "
                f"profile {args.profile}, one process per plan.\n\n{table}\n\n{fit}. "
                f"{host_line()}.\n")
        write_section("search", body, subheading=f"{args.depth_mode} against depth, "
                      f"{devices} devices")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
