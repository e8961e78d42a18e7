"""Planning time, objective and planner memory of auto_parallel's searches on GPT models.

Alpa's GPT suite (125M to 39B, sequence 1024, vocabulary 51200) plus GPT-3 175B, on 8, 64,
512 and 1024 devices, for each search mode; the objective is simpar's step-time model on the
``ascend910b`` profile. Each search's objective is given as a ratio to the exact ILP's and to
dynamic programming's. The exact search runs within ``--exact-time-limit`` seconds: a plan it
proved optimal gives plain ratios; one it stopped with an optimality gap ``g`` gives the
range the true ratio to the optimum lies in, ``[r, r / (1 - g)]``, marked as bounds. Exact is
not attempted where its ILP would exceed ``--exact-max-variables`` (HiGHS needs about 1 KiB a
variable), and the row says so. Every plan runs in its own process (shapes only: no MPI, no
data), so its peak resident memory is the planner's own; a plan that takes longer than
``--timeout`` seconds is reported as such. ``--memory-dimensions`` runs
benchmarks/memory_search.py instead: each search against exact with the optimizer level,
recomputation and micro-batches searched with the cuts; ``--pipelines`` runs
benchmarks/pipeline_search.py: the pipeline search from 1.3B to 1T parameters against
Megatron-LM's configurations. ``--depth`` times one search against
the number of layers instead, with a straight-line fit.

The default grid (9 models x 4 device counts x 4 searches) took 11 minutes on a 2-core machine
(2026-12-04); no exact plan needed its whole limit of 120 s there.

    python benchmarks/search.py                          # the default grid, into RESULTS.md
    python benchmarks/search.py --models 125M --devices 8 64 --modes exact --no-write
    python benchmarks/search.py --models 1.3B --devices 64 --depth 6 12 24 48 96
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, host_line, markdown_table, today, write_section  # noqa: E402

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
    from simpar.search.exact import product_variables, solve_exact
    from simpar.search.pricing import NoAvailableCost, Pricer
    from simpar.search.recursive_programming import solve_recursive_programming
    from simpar.search.request import dataset_layouts
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
    ilp: dict = {}
    if spec["mode"] == "exact":
        size = product_variables(cg)
        if size > spec["exact_max_variables"]:
            return {"error": f"not attempted: its ILP would have {size / 1e6:.1f}M variables, "
                             f"over --exact-max-variables {spec['exact_max_variables'] / 1e6:g}M "
                             "(about 1 KiB each in HiGHS)", "build": built - start, "solve": 0.0}
        try:
            sol = solve_exact(cg, time_limit=spec["exact_time_limit"])
        except TimeoutError:
            return {"error": f"the time limit of {spec['exact_time_limit']:g} s ran out before "
                             "any plan (the LP relaxation did not finish)",
                    "build": built - start, "solve": time.perf_counter() - built}
        except ValueError:
            return {"error": "no plan fits: HiGHS proves the ILP infeasible",
                    "build": built - start, "solve": time.perf_counter() - built}
        choice, gap = sol.choice, sol.gap
        ilp = {"variables": sol.variables, "product_variables": sol.product_variables}
    else:
        dp = solve_dynamic_programming(cg)
        choice, gap = dp.choice, 0.0 if dp.exact else math.nan
    done = time.perf_counter()
    return {"ops": len(cg.nodes), "candidates": max(len(n.candidates) for n in cg.nodes),
            "build": built - start, "solve": done - built, "objective": cg.total(choice),
            "memory": cg.memory(choice), "capacity": cg.memory_capacity, "gap": gap,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **ilp}


def run(spec: dict) -> dict:
    """Plan ``spec`` in a child process, within the time limit (exact: its own limit, and
    the cost graph's build on top)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    started = time.perf_counter()
    timeout = spec["timeout"] + (spec["exact_time_limit"] if spec["mode"] == "exact" else 0.0)
    try:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                             capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s"}
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
    argv = sys.argv[1:] if argv is None else argv
    if "--memory-dimensions" in argv:   # each search against exact, the dimensions searched
        import memory_search  # noqa: PLC0415 (benchmarks/memory_search.py)
        return memory_search.main([a for a in argv if a != "--memory-dimensions"])
    if "--pipelines" in argv:   # the pipeline search, 1.3B to 1T, against Megatron-LM's
        import pipeline_search  # noqa: PLC0415 (benchmarks/pipeline_search.py)
        return pipeline_search.main([a for a in argv if a != "--pipelines"])
    p = argparse.ArgumentParser(prog="python benchmarks/search.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", default=list(GPT_SUITE), choices=list(GPT_SUITE))
    p.add_argument("--devices", nargs="+", type=int, default=[8, 64, 512, 1024])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--exact-time-limit", type=float, default=120.0, metavar="S",
                   help="seconds for the exact search's ILP (default 120; the longest exact "
                   "plan of the default grid took 43 s); on running out it reports its best "
                   "plan and its optimality gap")
    p.add_argument("--exact-max-variables", type=float, default=10e6, metavar="N",
                   help="do not attempt exact where its ILP would have more than N variables "
                   "(default 10e6, about 10 GiB in HiGHS)")
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
                   help="seconds per plan before its process is stopped (exact: on top of "
                   "--exact-time-limit)")
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
    rows, checks = [], []
    for model in args.models:
        for devices in args.devices:
            results = {}
            for mode in args.modes:
                if mode == "dynamic_programming" and devices > args.dp_up_to:
                    continue
                spec = {"model": model, "devices": devices, "mode": mode,
                        "batch": max(args.batch, devices), "profile": args.profile,
                        "timeout": args.timeout, "exact_time_limit": args.exact_time_limit,
                        "exact_max_variables": args.exact_max_variables,
                        "fully_use_devices": not args.all_devices}
                results[mode] = r = run(spec)
                print(model, devices, mode, r, flush=True)
            rows += _grid_rows(model, devices, results)
            checks.append((model, devices, results))
    header = ["model", "devices", "search", "ops", "max candidates",
              "planning s (build + solve)", "predicted step ms", "optimality gap",
              "ratio to exact", "ratio to DP", "memory GiB / cap", "planner peak RSS MiB",
              "ILP variables (product -> model)"]
    table = markdown_table(header, rows)
    summary = _summary(checks, args.exact_time_limit)
    print(table)
    print(summary)
    if not args.no_write:
        command = "python benchmarks/search.py " + " ".join(argv if argv is not None
                                                            else sys.argv[1:])
        body = (f"Command: `{command.strip()}` · date: {today()}\n\n{table}\n\n"
                f"Profile {args.profile}, batch {args.batch} (at least the device count), "
                f"sequence 1024, float16, fully_use_devices={not args.all_devices}; exact "
                f"within {args.exact_time_limit:g} s and up to "
                f"{args.exact_max_variables / 1e6:g}M ILP variables. Optimality gap: 0 is a "
                "proven optimum (exact's ILP, or dynamic programming's elimination when it "
                "reduced the graph completely), - is none claimed. A ratio to exact given as a "
                "range bounds the ratio to the optimum where exact stopped with a gap. "
                f"{host_line()}.\n\n{summary}\n")
        write_section("search", body + _depth_subsections())
    return 0


def _grid_rows(model: str, devices: int, results: dict[str, dict]) -> list[list[object]]:
    """The table's rows of one (model, devices): every search, with its ratios."""
    ref = results.get("exact", {})
    dp = results.get("dynamic_programming", {})
    rows: list[list[object]] = []
    for mode, r in results.items():
        if "error" in r:
            took = f"{r['build']:.2f} + {r['solve']:.2f}: " if "build" in r else ""
            rows.append([model, devices, mode, "", "", took + r["error"], "", "", "", "", "",
                         "", ""])
            continue
        gap = r["gap"]
        gap_text = "-" if math.isnan(gap) else "0" if gap == 0 else f"{gap:.2%}"
        ratio = ""
        if "objective" in ref:
            x = r["objective"] / ref["objective"]
            ratio = (f"{x:.6f}" if ref["gap"] == 0 else
                     f"{x:.4f} to {x / (1 - ref['gap']):.4f} (bounds)" if ref["gap"] < 1 else
                     f">= {x:.4f} (bound)")
        to_dp = f"{r['objective'] / dp['objective']:.4f}" if "objective" in dp else ""
        ilp = (f"{r['product_variables'] / 1e6:.2f}M -> {r['variables'] / 1e6:.2f}M"
               if "variables" in r else "")
        rows.append([model, devices, mode, r["ops"], r["candidates"] or "-",
                     f"{r['build']:.2f} + {r['solve']:.2f}", f"{r['objective'] * 1e3:.3f}",
                     gap_text, ratio, to_dp,
                     f"{r['memory'] / 2**30:.2f} / {r['capacity'] / 2**30:.0f}",
                     f"{r['peak_rss'] / 2**20:.0f}", ilp])
    return rows


def _summary(checks: list[tuple[str, int, dict[str, dict]]], limit: float) -> str:
    """The issue's targets, checked on the grid: DP's objective against exact's proven optima,
    and DP's planning time for 24 layers on 64 devices and 96 layers on 1024."""
    equal, differ, proven = [], [], 0
    for model, devices, results in checks:
        ex, dp = results.get("exact", {}), results.get("dynamic_programming", {})
        if "objective" in ex and ex["gap"] == 0:
            proven += 1
            if "objective" in dp:
                same = math.isclose(dp["objective"], ex["objective"], rel_tol=1e-9)
                (equal if same else differ).append(f"{model} x {devices}")
    lines = [f"- exact proved its optimum on {proven} configurations within {limit:g} s; "
             f"dynamic programming's objective equals it on {len(equal)} of them"
             + (f" and differs on {', '.join(differ)}" if differ else "") + "."]
    for layers, devices, target in ((24, 64, 10.0), (96, 1024, 30.0)):
        times = []
        for model, d, results in checks:
            r = results.get("dynamic_programming", {})
            if d != devices or GPT_SUITE[model][0] != layers or not r:
                continue
            if "objective" in r:
                times.append(f"{model} planned in {r['build'] + r['solve']:.1f} s")
            else:
                times.append(f"{model} {r['error']}")
        if times:
            lines.append(f"- dynamic programming, {layers} layers on {devices} devices "
                         f"(target <= {target:g} s): {', '.join(times)}.")
    return "\n".join(lines)


def _depth_subsections() -> str:
    """The ``###`` subsections of RESULTS.md's search section (the depth fits), which a new
    grid keeps."""
    text = RESULTS.read_text() if RESULTS.exists() else ""
    section = re.search(r"^## search[ \t]*\n(.*?)(?=^#{1,2} |\Z)", text, flags=re.M | re.S)
    first = re.search(r"^### ", section.group(1), flags=re.M) if section else None
    return "\n" + section.group(1)[first.start():] if section and first else ""


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
