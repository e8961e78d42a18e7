"""The pipeline equality matrix (issue 31): every case of ``tests/test_pipeline_mpi.py``
against one device, with its errors recorded.

    mpirun -n 8 python benchmarks/pipeline_equality.py            # "## pipeline_equality"
    mpirun -n 8 python benchmarks/pipeline_equality.py --no-write

The float64 GPT of the test (6 blocks; 14 where pp 8 interleaves two chunks) is trained 2
Adam steps as pp 2 x tp 2 x dp 2, pp 4 x dp 2 and pp 8, with 1, 2, 4 and 8 micro-batches,
under GPipe, 1F1B and the interleaved schedules, with and without optimizer parallel and
recomputation: the test's cases, run by the test's own code. Each row gives, over every
rank, the largest relative error of the losses and of a stored parameter slice against the
single-device run (the test's bound: 1e-10), and the point-to-point messages the last step
sent (every rank's, as the trace records them).
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import simpar.comm as comm

import numpy as np
from _common import host_line, markdown_table, today, write_section

from simpar.check import relative_error
from simpar.layout import distribute
from tests import test_pipeline_mpi as matrix

SCRIPT = "benchmarks/pipeline_equality.py"
LAYOUTS = {"pp2": "pp 2 x tp 2 x dp 2", "ppdp": "pp 4 x dp 2", "pp": "pp 8"}


def run_case(kind: str, micro: int, scheduler: str, level: str | None, recompute: bool
             ) -> tuple[float, float, int, float]:
    """One case: (largest loss error, largest parameter error, messages sent, seconds),
    each over every rank."""
    n = comm.get_group_size()
    stages = matrix._layout(kind, n)[0]
    chunks = 2 if scheduler.startswith("interleaved") else 1
    ref_losses, ref_params = matrix._reference(matrix._layers(stages, chunks))
    started = time.perf_counter()
    train, losses, events = matrix._train(kind, micro, scheduler, level, recompute)
    took = time.perf_counter() - started
    runner = train.pipeline
    assert runner is not None
    # np.max keeps a NaN (Python's max drops one); a NaN becomes inf before MPI's max
    loss_err = float(np.max([relative_error(np.float64(a), b)
                             for a, b in zip(losses, ref_losses)]))
    param_err = float(np.max([relative_error(train.params[name], distribute(
        ref_params[name], owner.storage_layout(name), runner.local))
        for name, (owner, _) in runner.params().items()], initial=0.0))
    sent = sum(1 for e in events if e.kind == "Send")
    errors = np.nan_to_num(np.array([loss_err, param_err, took]), nan=np.inf)
    most = comm.all_reduce(errors, op="max")
    total = comm.all_reduce(np.array([sent], dtype=np.int64))
    return float(most[0]), float(most[1]), int(total[0]), float(most[2])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    n, rank = comm.get_group_size(), comm.get_rank()
    if n != 8:
        raise SystemExit(f"{SCRIPT}: run it on 8 ranks (mpirun -n 8), not {n}")
    rows, worst = [], 0.0
    for kind, micro, scheduler, level, recompute in matrix.CASES:
        loss_err, param_err, sent, took = run_case(kind, micro, scheduler, level, recompute)
        worst = float(np.max([worst, loss_err, param_err]))   # inf for a NaN: not within
        rows.append([LAYOUTS[kind], str(micro), scheduler, level or "-",
                     "yes" if recompute else "-", f"{loss_err:.1e}", f"{param_err:.1e}",
                     str(sent), f"{took:.2f}"])
        if rank == 0:
            print(" | ".join(rows[-1]), flush=True)
    if rank == 0:
        table = markdown_table(["layout", "micro-batches", "schedule", "optimizer parallel",
                                "recompute", "loss error", "parameter error",
                                "messages sent (last step)", "s (2 steps, with planning)"],
                               rows)
        body = "\n\n".join([
            f"`mpirun -n 8 python {SCRIPT}` ({today()}; the cases of "
            "`tests/test_pipeline_mpi.py`, float64, 2 Adam steps; errors: the largest "
            "relative error over every rank against one device, bound 1e-10)", table,
            f"{len(rows)} cases; the largest error of all: {worst:.1e} "
            f"({'within' if worst <= 1e-10 else 'OVER'} 1e-10).", host_line()])
        print(body)
        if not args.no_write:
            write_section("pipeline_equality", body)
            print("written to benchmarks/RESULTS.md (## pipeline_equality)")
    return 0 if worst <= 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())
