"""Planning time, predicted step and planner memory of auto_parallel's searches on GPT models,
end to end as a user of ``python -m simpar.plan`` waits for them.

Alpa's GPT suite (125M to 39B, sequence 1024, vocabulary 51200) plus GPT-3 175B, on 8, 64,
512 and 1024 devices, for each search mode. Every plan is made as ``python -m simpar.plan``
makes it, with its defaults (float32, the batch whole on every device, fully_use_devices
False, ``--batch`` 1024 unless given), in its own process (shapes only: no MPI, no data, so
its peak resident memory is the planner's own): the planning time is what the command prints
as "planned in": trace, search, lowering and the final pricing. The predicted step is the
final pricing's (simpar's step-time model on the ``ascend910b`` profile); each search's is
given as a ratio to the exact ILP's and to dynamic programming's. The exact search runs within
``--exact-time-limit`` seconds: a plan it proved optimal gives plain ratios; one it stopped
with an optimality gap ``g`` gives the range the true ratio to the optimum lies in,
``[r, r / (1 - g)]``, marked as bounds. Exact is not attempted where its ILP would exceed
``--exact-max-variables`` (HiGHS needs about 1 KiB a variable), and the row says so. A plan
that takes longer than ``--timeout`` seconds is reported as such. ``--configs`` plans given
configurations instead of the grid (``350M:64:512``: model, devices, batch, and optionally
the layers at the model's widths), ``--repeats`` plans each several times (the table gives
the fastest and the median) and ``--subsection`` writes the table under a subsection of
RESULTS.md's search section. ``--memory-dimensions`` runs benchmarks/memory_search.py
instead: each search against exact with the optimizer level, recomputation and micro-batches
searched with the cuts; ``--pipelines`` runs benchmarks/pipeline_search.py: the pipeline
search from 1.3B to 1T parameters against Megatron-LM's configurations. ``--depth`` times one
search against the number of layers instead, with a straight-line fit.

    python benchmarks/search.py                          # the default grid, into RESULTS.md
    python benchmarks/search.py --configs 350M:64:512 1.3B:1024:1024:96 \
        --modes recursive_programming dynamic_programming --repeats 3 \
        --subsection "planning time end to end"
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
import shlex
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
    """Plan one configuration in this process as ``python -m simpar.plan`` does, with its
    defaults (float32, the batch whole on every device, fully_use_devices False unless the
    spec says otherwise), and return the figures (child side). The planning time is the
    plan's own: trace + search + lowering + final pricing, what the command prints as
    "planned in"."""
    from simpar import context, graph, plan
    from simpar.search import request_from_context
    from simpar.search.auto import cost_graph_of
    from simpar.search.exact import product_variables

    if spec["fully_use_devices"]:
        context.set_algo_parameters(fully_use_devices=True)
    layers, hidden, heads = GPT_SUITE[spec["model"]]
    layers = spec.get("layers") or layers
    argv = ["--model", "gpt", "--layers", str(layers), "--hidden", str(hidden), "--heads",
            str(heads), "--seq", "1024", "--batch", str(spec["batch"]), "--device-num",
            str(spec["devices"]), "--search-mode", spec["mode"], "--profile", spec["profile"]]
    if spec["mode"] == "exact":
        argv += ["--time-limit", str(spec["exact_time_limit"])]
    opts, _ = plan.parse_args(argv)
    ilp: dict = {}
    if spec["mode"] == "exact":  # its size first, untimed: HiGHS needs about 1 KiB a variable
        net, specs = plan.build_network(opts)
        g = graph.trace(net, specs, ["data", "label"])
        size = product_variables(cost_graph_of(request_from_context(
            g, cell=net, device_num=opts.device_num, mode="auto_parallel",
            search_mode="exact", cost_model=plan.search_model(opts))))
        if size > spec["exact_max_variables"]:
            return {"error": f"not attempted: its ILP would have {size / 1e6:.1f}M variables, "
                             f"over --exact-max-variables {spec['exact_max_variables'] / 1e6:g}M "
                             "(about 1 KiB each in HiGHS)"}
        ilp = {"product_variables": size}
    start = time.perf_counter()
    try:
        made = plan.make_plan(opts)
    except (ValueError, TimeoutError) as error:  # the time to find out counts as planning
        took = time.perf_counter() - start
        text = str(error)
        if "minimum memory cost is " in text:
            need = float(text.split("minimum memory cost is ")[1].split(" bytes")[0])
            text = f"nothing fits: at least {need / 2**30:.0f} GiB per rank"
        elif "plan needs " in text:
            need = float(text.split("plan needs ")[1].split(" bytes")[0])
            text = f"its plan needs {need / 2**30:.0f} GiB per rank, over the cap"
        return {"error": f"{text} (found in {took:.1f} s)", "total": took}
    report, gap = made.report, made.strategy_map.optimality_gap
    return {"ops": len(made.strategy_map.ops), "seconds": dict(made.seconds),
            "total": sum(made.seconds.values()), "objective": report.step_seconds,
            "memory": report.peak_memory, "capacity": opts.profile.memory_capacity,
            "gap": math.nan if gap is None else gap,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **ilp}


def run(spec: dict, repeats: int = 1) -> dict:
    """Plan ``spec`` in a child process ``repeats`` times, each within the time limit (exact:
    its own limit on top); the figures of the fastest run, with every run's seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    timeout = spec["timeout"] + (spec["exact_time_limit"] if spec["mode"] == "exact" else 0.0)
    runs = []
    for _ in range(repeats):
        try:
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                                 capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"stopped after {timeout:.0f} s"}
        if out.returncode:
            last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
            return {"error": last or f"exit {out.returncode}"}
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if "total" not in runs[-1]:
            return runs[-1]
    best = min(runs, key=lambda r: r["total"])
    return {**best, "runs": sorted(r["total"] for r in runs)}


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
    p.add_argument("--batch", type=int, default=1024,
                   help="global batch (default 1024, simpar.plan's)")
    p.add_argument("--configs", nargs="+", default=None, metavar="MODEL:DEVICES[:BATCH[:LAYERS]]",
                   help="instead of --models x --devices: these configurations, e.g. "
                   "350M:64:512 1.3B:1024:1024:96")
    p.add_argument("--repeats", type=int, default=1,
                   help="plan each configuration this many times (one process each); the "
                   "table gives the fastest and the median")
    p.add_argument("--subsection", default=None, metavar="TITLE",
                   help="write the table under '### TITLE' of the search section instead of "
                   "replacing the grid")
    p.add_argument("--profile", default="ascend910b")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per plan before its process is stopped (exact: on top of "
                   "--exact-time-limit)")
    p.add_argument("--fully-use-devices", action="store_true",
                   help="fully_use_devices=True (earlier tables'): only cuts that use every "
                   "device, far fewer candidates; the default is simpar's and MindSpore's "
                   "(False)")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(plan_once(json.loads(args.child))))
        return 0
    if args.depth is not None:
        return depth_fit(args, argv)
    configs = ([_config(text, args.batch) for text in args.configs] if args.configs else
               [(model, devices, args.batch, None) for model in args.models
                for devices in args.devices])
    rows, checks = [], []
    for model, devices, batch, layers in configs:
        results = {}
        for mode in args.modes:
            if mode == "dynamic_programming" and devices > args.dp_up_to:
                continue
            spec = {"model": model, "devices": devices, "mode": mode, "batch": batch,
                    "layers": layers, "profile": args.profile, "timeout": args.timeout,
                    "exact_time_limit": args.exact_time_limit,
                    "exact_max_variables": args.exact_max_variables,
                    "fully_use_devices": args.fully_use_devices}
            results[mode] = r = run(spec, args.repeats)
            print(model, devices, mode, r, flush=True)
        name = model if layers is None else f"{model} widths, {layers} layers"
        rows += _grid_rows(f"{name}, batch {batch}", devices, results)
        checks.append((model, devices, layers, results))
    header = ["model", "devices", "search", "ops",
              "planning s end to end: fastest / median (trace + search + lower + cost)",
              "predicted step ms", "optimality gap", "ratio to exact", "ratio to DP",
              "peak memory GiB / cap", "planner peak RSS MiB", "ILP variables"]
    table = markdown_table(header, rows)
    summary = _summary(checks, args.exact_time_limit)
    print(table)
    print(summary)
    if not args.no_write:
        command = "python benchmarks/search.py " + shlex.join(argv if argv is not None
                                                             else sys.argv[1:])
        repeats = (f", the fastest and the median of {args.repeats} runs"
                   if args.repeats > 1 else "")
        body = (f"Command: `{command.strip()}` · date: {today()}\n\n{table}\n\n"
                "Each plan as `python -m simpar.plan` makes it, in its own process: planning "
                "time is what it prints as \"planned in\" (trace, search, lowering and the "
                f"final pricing){repeats}; the predicted step and peak memory are the final "
                f"pricing's. Profile {args.profile}, sequence 1024, float32, the batch whole "
                f"on every device (simpar.plan's defaults), fully_use_devices="
                f"{args.fully_use_devices}; exact within {args.exact_time_limit:g} s and up to "
                f"{args.exact_max_variables / 1e6:g}M ILP variables. Optimality gap: 0 is "
                "exact's proven optimum, - is none claimed. A ratio to exact given as a range "
                "bounds the ratio to the optimum where exact stopped with a gap. "
                f"{host_line()}.\n\n{summary}\n")
        if args.subsection:
            write_section("search", body, subheading=args.subsection)
        else:
            write_section("search", body + _depth_subsections())
    return 0


def _config(text: str, batch: int) -> tuple[str, int, int, int | None]:
    """``MODEL:DEVICES[:BATCH[:LAYERS]]`` as (model, devices, batch, layers or None)."""
    parts = text.split(":")
    if not 2 <= len(parts) <= 4 or parts[0] not in GPT_SUITE or not all(
            x.isdigit() for x in parts[1:]):
        raise SystemExit(f"--configs: {text!r} is not MODEL:DEVICES[:BATCH[:LAYERS]] with "
                         f"MODEL one of {list(GPT_SUITE)}")
    numbers = [int(x) for x in parts[1:]]
    return (parts[0], numbers[0], numbers[1] if len(numbers) > 1 else batch,
            numbers[2] if len(numbers) > 2 else None)


def _seconds(r: dict) -> str:
    """Planning seconds of a result: fastest / median (the fastest's stages)."""
    runs = r.get("runs", [r["total"]])
    stages = " + ".join(f"{r['seconds'][k]:.2f}" for k in ("trace", "search", "lower", "cost"))
    return f"{runs[0]:.2f} / {runs[len(runs) // 2]:.2f} ({stages})"


def _grid_rows(model: str, devices: int, results: dict[str, dict]) -> list[list[object]]:
    """The table's rows of one (model, devices): every search, with its ratios."""
    ref = results.get("exact", {})
    dp = results.get("dynamic_programming", {})
    rows: list[list[object]] = []
    for mode, r in results.items():
        if "error" in r:
            rows.append([model, devices, mode, "", r["error"], "", "", "", "", "", "", ""])
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
        ilp = f"{r['product_variables'] / 1e6:.2f}M" if "product_variables" in r else ""
        rows.append([model, devices, mode, r["ops"], _seconds(r),
                     f"{r['objective'] * 1e3:.3f}", gap_text, ratio, to_dp,
                     f"{r['memory'] / 2**30:.2f} / {r['capacity'] / 2**30:.0f}",
                     f"{r['peak_rss'] / 2**20:.0f}", ilp])
    return rows


def _summary(checks: list[tuple[str, int, int | None, dict[str, dict]]], limit: float) -> str:
    """The issue's targets, checked: DP's objective against exact's proven optima, and the
    planning time end to end of GPT 350M on 64 devices (recursive programming 1 s, dynamic
    programming 3 s) and of the 96-layer GPT of 1.3B widths on 1024 (3 s and 30 s)."""
    equal, differ, proven = [], [], 0
    for model, devices, _, results in checks:
        ex, dp = results.get("exact", {}), results.get("dynamic_programming", {})
        if "objective" in ex and ex["gap"] == 0:
            proven += 1
            if "objective" in dp:
                same = math.isclose(dp["objective"], ex["objective"], rel_tol=1e-9)
                (equal if same else differ).append(f"{model} x {devices}")
    lines = [f"- exact proved its optimum on {proven} configurations within {limit:g} s; "
             f"dynamic programming's objective equals it on {len(equal)} of them"
             + (f" and differs on {', '.join(differ)}" if differ else "") + "."
             ] if any("exact" in results for *_, results in checks) else []
    targets = {("350M", 64, 24): {"recursive_programming": 1.0, "dynamic_programming": 3.0},
               ("1.3B", 1024, 96): {"recursive_programming": 3.0, "dynamic_programming": 30.0}}
    for model, devices, layers, results in checks:
        wanted = targets.get((model, devices, layers or GPT_SUITE[model][0]), {})
        for mode, target in wanted.items():
            r = results.get(mode)
            if not r or "total" not in r:
                continue
            runs = r.get("runs", [r["total"]])
            lines.append(f"- {mode}, {model} widths with {layers or GPT_SUITE[model][0]} "
                         f"layers on {devices} devices (target <= {target:g} s end to end): "
                         f"{runs[0]:.1f} s fastest, {runs[len(runs) // 2]:.1f} s median: "
                         + ("met" if runs[len(runs) // 2] <= target else "missed") + ".")
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
                "mode": args.depth_mode, "batch": args.batch, "profile": args.profile,
                "timeout": args.timeout, "fully_use_devices": args.fully_use_devices}
        r = run(spec, args.repeats)
        print(layers, r, flush=True)
        seconds = r.get("total", math.nan)
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
    table = markdown_table(["layers", "ops", "planning s end to end", "predicted step ms"],
                           rows)
    print(table)
    print(fit)
    if not args.no_write:
        command = "python benchmarks/search.py " + shlex.join(argv if argv is not None
                                                             else sys.argv[1:])
        width = GPT_SUITE[model]
        body = (f"Command: `{command.strip()}` · date: {today()}\n\n"
                f"{args.depth_mode} on GPT hidden {width[1]}, {width[2]} heads, "
                f"sequence 1024, batch {args.batch}, {devices} devices, profile "
                f"{args.profile}, fully_use_devices={args.fully_use_devices}, one process per "
                f"plan as `python -m simpar.plan` makes it (trace, search, lowering and final "
                f"pricing).\n\n{table}\n\n{fit}. "
                f"{host_line()}.\n")
        write_section("search", body, subheading=f"{args.depth_mode} against depth, "
                      f"{devices} devices")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
