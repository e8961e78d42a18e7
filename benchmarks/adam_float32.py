"""How far apart two correct float32 runs of the main job's GPT end up, with Adam and Momentum.

    mpirun -n 8 python benchmarks/adam_float32.py             # writes "## adam_float32"
    mpirun -n 8 python benchmarks/adam_float32.py --no-write

The README's "The single-device check" quotes these figures. Every run is the main job's GPT
(``simpar.train.parse_args(["--dtype", "float32"])``: 20 steps, seed 0, Adam lr 3e-3 or
Momentum lr 0.1), and every figure is the largest over parameters of ``max |Δ| / max |ref|``
(``simpar.check.relative_error``) and of ``max |Δp| / lr``:

1. the parallel run (all ranks, the job's default mesh) against one device;
2. one device against one device that sums each batch's gradient from its two halves (the
   same arithmetic in another order), seeds 0, 1 and 2;
3. one device with 1 against 2 BLAS threads (threadpoolctl, on rank 0);
4. one device in float32 against the same run in float64 from the same float32 start;
5. the parallel gradients against one device's at identical parameters (the check's);
6. the check's Adam allowance ``lr·√S·u·√(1-β₂)/ε`` against the measured difference;
7. a 1% gradient-scale bug (the loss seed times 1.01): what it does to the parameters, and
   to the gradients at identical parameters.

Rank 0 runs every single-device baseline (the other ranks wait without spinning). Every BLAS
runs one thread, except the second run of row 3. The script exits 1 on every rank unless
``check_against_single_device`` passes the clean Adam run and fails the bug run.
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar.comm as comm
from simpar import _env

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits
from _common import host_line, markdown_table, today, write_section

import simpar
from simpar import train as T
from simpar.check import CheckReport, check_against_single_device, relative_error

SCRIPT = "python benchmarks/adam_float32.py"
MAIN_JOB = ["--dtype", "float32"]
SEEDS = (0, 1, 2)
BUG_SCALE = 1.01


@dataclass(frozen=True, slots=True)
class Difference:
    """Two runs' parameters (or gradients): the largest ``max |Δ| / max |ref|`` over
    parameters, the parameter that has it, and the largest ``max |Δ|`` in units of lr."""

    relative: float
    worst: str
    per_lr: float


@dataclass(frozen=True, slots=True)
class Trained:
    """One run's global parameters at the start and the end, and its first step's gradients."""

    initial: dict[str, np.ndarray]
    final: dict[str, np.ndarray]
    first_grads: dict[str, np.ndarray]
    lr: float


@dataclass(frozen=True, slots=True)
class Parallel:
    final: dict[str, np.ndarray]
    report: CheckReport
    lr: float
    mesh: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Row:
    number: str
    runs: str
    optimizer: str
    relative: float | None
    worst: str
    per_lr: float | None

    def cells(self) -> list[str]:
        return [self.number, self.runs, self.optimizer,
                "—" if self.relative is None else f"{self.relative:.1e}", self.worst or "—",
                "—" if self.per_lr is None else f"{self.per_lr:.2g}"]


def _short(name: str) -> str:
    return name.removeprefix("_backbone.")


def _difference(got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray],
                lr: float) -> Difference:
    """``relative_error`` per parameter (inf on a non-finite value, never NaN)."""
    rel = {n: relative_error(got[n], ref[n]) for n in ref}
    worst = max(rel, key=rel.__getitem__)
    absolute = 0.0
    for n in ref:
        d = np.abs(got[n].astype(np.float64) - ref[n].astype(np.float64))
        absolute = max(absolute, float(d.max()) if np.isfinite(d).all() else math.inf)
    return Difference(rel[worst], _short(worst), absolute / lr)


def _args(*extra: str) -> argparse.Namespace:
    return T.parse_args([*MAIN_JOB, *extra])


def _set_parallel_context(args: argparse.Namespace, world: int) -> tuple[int, int]:
    """The main job's context (simpar.train.main), so the parallel runs are the job's."""
    simpar.set_auto_parallel_context(parallel_mode=args.parallel_mode, device_num=world,
                                     gradients_mean=args.gradients_mean, enable_alltoall=True)
    comm.check_context()
    return T.mesh(args, world)


def _parallel(args: argparse.Namespace, world: int, bug: bool = False) -> Parallel:
    """Train on every rank as the main job does, then run its single-device check
    (collective)."""
    simpar.set_seed(args.seed)
    dp, mp = _set_parallel_context(args, world)
    train = T.build(args, args.parallel_mode, world)
    simpar.set_auto_parallel_context(dataset_strategy=T.dataset_strategy(args, dp, mp, world))
    get_batch = T.batches(args)
    data = [get_batch(k) for k in range(args.steps)]
    train.build(*data[0])
    if bug:  # a wrong loss seed scales every gradient by 1.01 (tests/test_check_mpi.py)
        train._seed *= BUG_SCALE
    losses = [train(x, y) for x, y in data]
    final = train.global_parameters()
    report = check_against_single_device(train, lambda: T.build(args, "stand_alone", 1), data,
                                         losses=losses)
    return Parallel(final, report, train.optimizer.learning_rate, (dp, mp))


def _one_device(args: argparse.Namespace, halves: bool = False,
                start: Mapping[str, np.ndarray] | None = None) -> Trained:
    """The single-device run the check's twin makes; ``halves``: each step's gradient is
    ``(g(first half) + g(second half)) / 2``, the full batch's in another summation order;
    ``start``: these initial values (cast to the run's dtype) instead of the seeded ones."""
    simpar.set_seed(args.seed)
    cell = T.build(args, "stand_alone", 1)
    get_batch = T.batches(args)
    data = [get_batch(k) for k in range(args.steps)]
    h = len(data[0][0]) // 2
    x0, y0 = data[0]
    cell.build(x0[:h], y0[:h]) if halves else cell.build(x0, y0)
    if start is not None:
        for name, value in start.items():
            cell.params[name][...] = value.astype(cell.params[name].dtype)
    initial = {n: v.copy() for n, v in cell.params.items()}
    first: dict[str, np.ndarray] = {}
    for k, (x, y) in enumerate(data):
        if halves:
            _, ga = cell.value_and_grad(x[:h], y[:h], step=k)
            _, gb = cell.value_and_grad(x[h:], y[h:], step=k)
            grads = {n: (ga[n] + gb[n]) * ga[n].dtype.type(0.5) for n in ga}
            cell.optimizer.step(cell.params, grads)
            cell.step_count += 1
        else:
            cell(x, y)
            grads = cell.last_grads
        if k == 0:
            first = {n: g.copy() for n, g in grads.items()}
    return Trained(initial, {n: v.copy() for n, v in cell.params.items()}, first,
                   cell.optimizer.learning_rate)


def _blas_threads() -> list[int]:
    return [int(i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"]


def _wait_for_rank_0(world: Any) -> None:
    """A barrier that sleeps between polls, so waiting ranks leave rank 0 the cores."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.02)


def _baseline_rows(adam: Parallel, momentum: Parallel, bug: Parallel
                   ) -> tuple[list[Row], list[str], list[str]]:
    """Rank 0: every single-device run, and the rows. Returns (rows, notes, problems)."""
    rows: list[Row] = []
    notes: list[str] = []
    problems: list[str] = []
    dp, mp = adam.mesh
    world = dp * mp
    optimizers = {"Adam": (), "Momentum": ("--optimizer", "momentum")}
    base: dict[tuple[str, int], Trained] = {}
    for opt, extra in optimizers.items():
        for seed in SEEDS:
            base[opt, seed] = _one_device(_args(*extra, "--seed", str(seed)))

    # 1. parallel against one device.
    for opt, run in (("Adam", adam), ("Momentum", momentum)):
        ref = base[opt, 0]
        d = _difference(run.final, ref.final, ref.lr)
        rows.append(Row("1", f"parallel ({world} ranks, dp×mp = {dp}×{mp}) vs one device",
                        f"{opt} (lr {ref.lr:g})", d.relative, d.worst, d.per_lr))
    theirs, mine = adam.report.max_param_error, rows[0].relative
    notes.append(f"Row 1 (Adam) is {mine:.3e} here and {theirs:.3e} in the check, whose twin "
                 "is the same single-device run" + (
                     "." if mine == theirs else "; they differ, so the baseline here is not "
                     "the twin bit for bit."))

    # 2. the batch's gradient summed from its two halves.
    for opt, extra in optimizers.items():
        for seed in SEEDS:
            ref = base[opt, seed]
            split = _one_device(_args(*extra, "--seed", str(seed)), halves=True)
            g = _difference(split.first_grads, ref.first_grads, 1.0)
            if not g.relative <= 1e-5:
                problems.append(f"{opt} seed {seed}: the two halves' first gradient differs "
                                f"from the batch's by {g.relative:.1e} (> 1e-5): the split "
                                "changed the math, not only the order")
            d = _difference(split.final, ref.final, ref.lr)
            rows.append(Row("2", f"one device vs batch gradient summed in two halves, seed "
                            f"{seed}", f"{opt} (lr {ref.lr:g})", d.relative, d.worst,
                            d.per_lr))

    # 3. one against two BLAS threads.
    threads: list[int] = []
    for opt, extra in optimizers.items():
        ref = base[opt, 0]
        with threadpool_limits(limits=2, user_api="blas"):
            threads = _blas_threads()
            two = _one_device(_args(*extra))
        d = _difference(two.final, ref.final, ref.lr)
        rows.append(Row("3", "one device, 1 vs 2 BLAS threads", f"{opt} (lr {ref.lr:g})",
                        d.relative, d.worst, d.per_lr))
    notes.append(f"Row 3: threadpoolctl reported {threads} BLAS threads inside the "
                 "2-thread limit (1 everywhere else).")

    # 4. float32 against float64 from the same float32 start.
    ref32 = base["Adam", 0]
    exact = _one_device(_args("--dtype", "float64"), start=ref32.initial)
    d = _difference(ref32.final, exact.final, ref32.lr)
    rows.append(Row("4", "one device float32 vs float64 from the same float32 start",
                    f"Adam (lr {ref32.lr:g})", d.relative, d.worst, d.per_lr))

    # 5. gradients at identical parameters.
    name, rank, err = adam.report.worst_grad
    rows.append(Row("5", "gradients at identical parameters: parallel vs one device",
                    f"Adam (lr {adam.lr:g})", err, f"{_short(name)} (rank {rank})", None))

    # 6. the allowance against the measurement, in units of lr.
    steps = adam.report.steps
    allowance = adam.report.tolerance.param_atol / adam.lr
    rows.append(Row("6", f"the check's allowance lr·√S·u·√(1-β₂)/ε, S = {steps}",
                    f"Adam (lr {adam.lr:g})", None, "", allowance))
    rows.append(Row("6", "measured: parallel vs one device (row 1)",
                    f"Adam (lr {adam.lr:g})", None, rows[0].worst, rows[0].per_lr))

    # 7. a 1% gradient-scale bug.
    d = _difference(bug.final, ref32.final, ref32.lr)
    rows.append(Row("7", f"gradient scale ×{BUG_SCALE} bug: parallel vs one device, parameters",
                    f"Adam (lr {bug.lr:g})", d.relative, d.worst, d.per_lr))
    name, rank, err = bug.report.worst_grad
    rows.append(Row("7", f"gradient scale ×{BUG_SCALE} bug: gradients at identical parameters",
                    f"Adam (lr {bug.lr:g})", err, f"{_short(name)} (rank {rank})", None))
    return rows, notes, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    options = parser.parse_args()
    comm.init()
    from mpi4py import MPI

    world_comm = MPI.COMM_WORLD
    rank, world = comm.get_rank(), comm.get_group_size()
    load = host_line()
    started = time.perf_counter()
    with threadpool_limits(limits=1, user_api="blas"):
        adam = _parallel(_args(), world)
        momentum = _parallel(_args("--optimizer", "momentum"), world)
        bug = _parallel(_args(), world, bug=True)
        rows: list[Row] = []
        notes: list[str] = []
        problems: list[str] = []
        if rank == 0:
            try:
                rows, notes, problems = _baseline_rows(adam, momentum, bug)
            except Exception as e:  # the other ranks must hear of it, not wait forever
                traceback.print_exc()
                problems = [f"rank 0's single-device runs raised {type(e).__name__}: {e}"]
        _wait_for_rank_0(world_comm)
    verdicts = [("clean Adam run", adam.report, True), ("×1.01 gradient bug", bug.report, False)]
    problems += [f"the check {'failed' if want else 'passed'} the {what}; it must "
                 f"{'pass' if want else 'fail'} it" for what, report, want in verdicts
                 if report.passed != want]
    failed = int(comm.broadcast(np.array([len(problems)]), root=0)[0]) > 0 or bool(problems)
    if rank != 0:
        return 1 if failed else 0

    bug_grads = sum(f.startswith("gradient of ") for f in bug.report.failures)
    table = markdown_table(
        ["#", "runs compared", "optimizer", "max relative difference", "worst parameter",
         "max \\|Δp\\| / lr"], [r.cells() for r in rows])
    s = _env.SETTINGS
    body = "\n\n".join([
        f"Command: `mpirun -n {world} {SCRIPT}` · date: {today()}",
        "The main job's GPT (`simpar.train` options `--dtype float32`: 20 steps, seed 0; "
        "Adam lr 3e-3, Momentum lr 0.1). Relative difference: the largest over parameters "
        "of max \\|Δ\\| / max \\|reference\\| (parameters after the last step; rows 5 and "
        "the last row 7: the first batch's gradients at the parallel run's final parameters, from "
        "`check_against_single_device`, worst rank named). max \\|Δp\\| / lr: the largest "
        "absolute parameter difference in units of the learning rate. References: one device "
        "(rows 1-3, 7), float64 (row 4). Every BLAS runs 1 thread but the second run of "
        "row 3.",
        table,
        "Check verdicts: clean Adam run — " + adam.report.summary(),
        "×1.01 gradient bug — " + bug.report.summary().split("\n")[0] + f". Of its "
        f"{len(bug.report.failures)} failures, {bug_grads} are gradients at identical "
        f"parameters and {len(bug.report.failures) - bug_grads} are parameters or losses.",
        *notes,
        *(["PROBLEMS: " + "; ".join(problems)] if problems else []),
        f"ranks {world}, wait policy {s.get('wait_policy')}; took "
        f"{time.perf_counter() - started:.0f} s; {load}.",
    ])
    print(body)
    if not options.no_write and not failed:
        write_section("adam_float32", body)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
