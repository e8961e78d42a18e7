"""When each parallel mode wins: three models, each trained on every rank under seven plans,
on 1, 2, 4 and 8 devices.

    python benchmarks/strategies.py --sweep 1 2 4 8          # one mpirun per count, then all
    mpirun -n 8 python benchmarks/strategies.py              # one count: its rows, then all
    mpirun -n 8 python benchmarks/strategies.py --no-write   # print only
    mpirun -n 8 python benchmarks/strategies.py --only mlp   # some rows only (no writing)

The models, their batches and the measurements are cost_fidelity's (its ``_build``,
``_batch`` and ``measure``): the main job's GPT (float64, Adam), the Megatron MLP (float32,
Momentum) and the small ResNet-18 (float32, Momentum, 32 x 32 images). Each trains under

* pure data parallel (``parallel_mode="data_parallel"``);
* tensor parallel over all n ranks (``semi_auto_parallel``, Megatron 1 x n; for the ResNet
  the classifier's classes cut n ways, :func:`simpar.nn.resnet.shard_classifier` 1 x n);
* the hybrid 2 x n/2 (the same with the batch cut 2 ways);
* the plan of each ``auto_parallel`` search (dynamic_programming, recursive_programming,
  sharding_propagation; dataset_strategy "data_parallel"; each search minimises simpar's
  cost model on the profile, for the model's optimizer, as the main job's does);
* a naive plan: everything replicated (``semi_auto_parallel`` with no ``.shard()`` and the
  batch whole: propagation keeps every op whole, so every rank computes the whole step).

Per row: the step time (the slowest rank's median over ``--steps`` timed steps), the bytes
moved per rank per step (:class:`simpar.comm.CommTrace` over one untimed step: the largest
bytes_sent + bytes_recv over the ranks), the measured peak memory per rank (the rank with the
largest: tracemalloc over one step plus the parameters and optimizer state held before it),
the prediction of both (``program.cost(profile, optimizer)``), and the single-device check
(:func:`simpar.check.check_against_single_device`) over the two untimed steps that start every
row, against the same model built stand-alone. On one device each model trains once,
stand-alone: the baseline the device counts are read against.

A run keeps its rows in ``benchmarks/strategies.json`` (under its device count, replacing that
count's earlier rows) and then writes, from every count the file holds, ``## strategies`` in
RESULTS.md, ``benchmarks/strategies.png`` (the largest count), ``strategies-devices.png``
(every count) and ``docs/strategies.md``, a page generated from the figures: every sentence
in it is computed from them, so it is never edited by hand. ``--sweep`` starts afresh: it
empties the file and, for each count ``k`` in turn, calibrates a profile at ``k`` ranks
(``mpirun -n k python -m simpar.calibrate``: with 2 cores, a rank is a different device at
each count) and runs ``mpirun -n k`` of this script on it. Every row is also priced on the
shipped ``cpu-local`` profile: one device speed at every count, for how a plan scales.
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar.comm as comm

import numpy as np
import cost_fidelity
from _common import host_line, today, write_section
from _strategies_page import (MIB, MODELS, NAIVE, ONE, PAGE, PNG, RUNS, SCALING_PNG, SCRIPT, Row,
                              Run, _kind, _mib, load_runs, page, plan_digest, results, save_run,
                              table)
from cost_fidelity import Strategy, _batch, _build, _classifier, _megatron, _none, measure

from simpar import viz
from simpar.check import check_against_single_device
from simpar.cost import SimparCostModel, load_profile
from simpar.cost_model_context import set_search_cost_model
from simpar.launch.mpi import find_mpirun, job_env
from simpar.runtime import NothingParallelWarning

FIXED = load_profile("cpu-local")   # the shipped device: one speed at every count
SEARCHES = ("dynamic_programming", "recursive_programming", "sharding_propagation")


def _cut(model: str, d: int) -> Any:
    """The dataset strategy that cuts the batch ``d`` ways (data and label)."""
    return {"resnet": ((d, 1, 1, 1), (d,)), "mlp": ((d, 1), (d,))}.get(model, ((d, 1), (d, 1)))


def plans(n: int) -> list[tuple[str, Strategy]]:
    """(mode, strategy) for every row: per model, the seven plans of the module docstring
    (on one device, the model stand-alone)."""
    semi, half = "semi_auto_parallel", max(1, n // 2)
    rows: list[tuple[str, Strategy]] = []
    for model, (_, opt) in MODELS.items():
        if n == 1:
            rows.append((ONE, Strategy(f"{model} one device", model, "stand_alone", "data_parallel",
                                       _none, opt)))
            continue
        if model == "resnet":
            tensor, hybrid = _classifier(1, n), _classifier(2, half)
        else:
            tensor, hybrid = _megatron(1, n), _megatron(2, half)
        rows += [
            ("data parallel", Strategy(f"{model} data parallel", model, "data_parallel",
                                       "data_parallel", _none, opt)),
            (f"tensor parallel 1x{n}", Strategy(f"{model} tensor parallel 1x{n}", model, semi,
                                                _cut(model, 1), tensor, opt)),
            (f"hybrid 2x{half}", Strategy(f"{model} hybrid 2x{half}", model, semi,
                                          _cut(model, 2), hybrid, opt)),
        ]
        rows += [(f"auto: {search}", Strategy(f"{model} auto {search}", model, "auto_parallel",
                                              "data_parallel", _none, opt, search=search))
                 for search in SEARCHES]
        rows.append((NAIVE, Strategy(f"{model} replicated", model, semi, _cut(model, 1),
                                     _none, opt)))
    return rows


def run(mode: str, s: Strategy, n: int, steps: int) -> Row:
    """Train ``s`` (collective): the check and the traced step first, then cost_fidelity's
    timed steps and memory step."""
    got: dict[str, Any] = {}

    def warmup(train: Any, batches: list[Any]) -> None:
        reference = replace(s, mode="stand_alone", dataset=None, annotate=_none, search=None)
        got["check"] = check_against_single_device(
            train, lambda: _build(reference, 1, context=False), batches)
        batch = _batch(s.model, 2)
        comm.barrier()
        with comm.CommTrace() as trace:
            start = time.perf_counter()
            train(*batch)
            seconds = time.perf_counter() - start
        mine = np.array([[trace.bytes_sent() + trace.bytes_recv(), trace.count(),
                          trace.seconds(), seconds - trace.seconds()]])
        every = comm.all_gather(mine, axis=0)
        got["comm"] = (int(every[:, 0].max()), int(every[:, 1].max()),
                       float(np.median(every[:, 2])) * 1e3, float(np.median(every[:, 3])) * 1e3)
        program = train.program
        got["fixed"] = program.cost(FIXED, s.optimizer).step_seconds * 1e3
        got["strategies"] = plan_digest(program.strategies())
        got["whole"] = sum(st.repeat == n for st in program.steps), len(program.steps)
        got["grad_bytes"] = sum(
            int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
            for v in program.param_values.values()
            if v.param is not None and v.param.requires_grad)

    if s.mode == "auto_parallel":   # as the main job: simpar's model, for this optimizer
        set_search_cost_model(SimparCostModel(cost_fidelity.PROFILE, s.optimizer))
    try:
        with warnings.catch_warnings():   # the naive plan is meant to parallelise nothing
            warnings.simplefilter("ignore", NothingParallelWarning)
            seconds, predicted, peaks, report = measure(s, n, steps, warmup)
    finally:
        set_search_cost_model(None)
    worst = max(range(len(peaks)), key=lambda r: peaks[r])
    memory = {m.rank: m for m in report.memory}
    row = memory.get(worst, max(report.memory, key=lambda m: m.peak))
    check = got["check"]
    return Row(s.model, mode, seconds * 1e3, predicted * 1e3, got["fixed"],
               report.compute * 1e3,
               (report.op_comm + report.redistribution + report.grad_sync) * 1e3,
               *got["comm"], peaks[worst], row.peak,
               row.parameters + row.gradients + row.optimizer, row.activations,
               got["grad_bytes"], *got["whole"], got["strategies"], check.verdict,
               check.summary())


def _pngs(runs: dict[int, Run]) -> str:
    """The bar chart of the largest count and the lines against the count (the markdown that
    shows them from RESULTS.md, or why there are none)."""
    groups: dict[str, dict[str, float]] = {}
    for r in runs[max(runs)].rows:
        groups.setdefault(MODELS[r.model][0], {})[r.mode] = r.ms
    panels: dict[str, dict[str, dict[int, float]]] = {}
    for what, key in (("measured", "ms"), ("predicted, the count's profile", "pred_ms"),
                      ("predicted, cpu-local devices", "fixed_ms")):
        for model, (name, _) in MODELS.items():
            lines = panels.setdefault(f"{name}, {what}", {})
            for n, entry in sorted(runs.items()):
                for r in entry.rows:
                    if r.model == model and r.mode != ONE:
                        lines.setdefault(_kind(r.mode, n), {})[n] = getattr(r, key)
            for r in runs[1].rows if 1 in runs else []:   # every plan on one device
                for points in lines.values():
                    if r.model == model:
                        points[1] = getattr(r, key)
    try:
        viz.bars_png(groups, PNG, "measured step (ms)")
        viz.scaling_png({k: v for k, v in panels.items() if v}, SCALING_PNG, "step (ms)")
    except ImportError:
        return "(No charts: matplotlib is not installed; `pip install -e .[viz]` adds it.)"
    return (f"![measured step time per model and mode]({PNG.name})\n\n"
            f"![step time against the device count]({SCALING_PNG.name})")


def sweep(counts: list[int], args: argparse.Namespace) -> int:
    """One ``mpirun -n k`` of this script per count, from an empty store (not under MPI)."""
    if comm.get_group_size() != 1:
        raise ValueError(f"--sweep runs mpirun itself: start it with python, not under "
                         f"mpirun ({comm.get_group_size()} ranks here)")
    if not counts or any(k < 1 for k in counts):
        raise ValueError(f"--sweep: device counts must be positive ints, got {counts}")
    mpirun, env = find_mpirun(), job_env()   # each rank sizes its own threads and waiting
    RUNS.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="simpar-strategies-") as tmp:
        for k in counts:
            profile = Path(tmp) / f"cpu-n{k}.json"
            for cmd in ([mpirun, "-n", str(k), sys.executable, "-m", "simpar.calibrate",
                         "--name", f"cpu-local-{k}", "--out",
                         str(profile)],
                        [mpirun, "-n", str(k), sys.executable, __file__, "--steps",
                         str(args.steps), "--profile", str(profile)]):
                print("+ " + " ".join(cmd), flush=True)
                subprocess.run(cmd, check=True, env=env)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="cpu-local", help="a shipped name or a JSON path")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="only the rows whose name contains one of these (implies "
                             "--no-write)")
    parser.add_argument("--sweep", nargs="+", type=int, default=None, metavar="N",
                        help="run mpirun -n N of this script for each N, from an empty "
                             "benchmarks/strategies.json")
    parser.add_argument("--rewrite", action="store_true",
                        help="measure nothing: rewrite RESULTS.md's section, the PNGs and the "
                             "page from benchmarks/strategies.json")
    args = parser.parse_args()
    if args.sweep is not None:
        return sweep(args.sweep, args)
    if args.rewrite:
        return write(load_runs(), None)
    cost_fidelity.PROFILE = load_profile(args.profile)
    n, rank = comm.get_group_size(), comm.get_rank()
    host = host_line()   # the load before this run
    rows: list[Row] = []
    for mode, s in plans(n):
        if args.only and not any(text in s.name for text in args.only):
            continue
        row = run(mode, s, n, args.steps)
        rows.append(row)
        if rank == 0:
            print(f"{s.name}: {row.ms:.1f} ms (predicted {row.pred_ms:.1f}), moved "
                  f"{_mib(row.moved)}, peak {row.peak / MIB:.2f} MiB (predicted "
                  f"{row.pred_peak / MIB:.2f}), {row.whole_ops}/{row.ops} ops whole on every "
                  f"rank; {row.summary.splitlines()[0]}", flush=True)
            if row.verdict != "PASS":
                print(row.summary, flush=True)
    if rank != 0:
        return 0
    print(table(rows))
    if args.only or args.no_write:
        return 0
    profile = cost_fidelity.PROFILE
    save_run(Run(n, today(), host, args.steps, profile.name, profile.memory_capacity,
                 str(profile.sources.get("profile", "")), rows))
    return write(load_runs(), n)


def write(runs: dict[int, Run], n: int | None) -> int:
    """RESULTS.md's section, the PNGs and the page, from ``runs`` (``n``: the count just
    measured, or None)."""
    if not runs:
        raise ValueError(f"--rewrite: {RUNS} holds no run (run {SCRIPT} under mpirun first)")
    write_section("strategies", results(runs) + "\n\n" + _pngs(runs))
    PAGE.write_text(page(runs))
    print(("" if n is None else f"written to {RUNS.name} ({n} devices), ")
          + f"benchmarks/RESULTS.md (## strategies: {', '.join(map(str, sorted(runs)))} "
          f"devices), {PNG.name}, {SCALING_PNG.name} and docs/{PAGE.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
