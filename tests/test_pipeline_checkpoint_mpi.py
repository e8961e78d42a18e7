"""Checkpoints of pipelined training on real MPI ranks (mpirun -n 2, 4 or 8): saved under one
pipeline plan, resumed under another and under none, and the step after the resume equal to
one device's uninterrupted run (float64, relative 1e-10) on every rank.

Each stage saves its own parameters and their optimizer state (each block once, by the
stage's ranks: the manifest lists the ranks that hold a tensor); a resumed rank reads only the
blocks its own stage needs.

    mpirun -n 8 python -m pytest tests/test_pipeline_checkpoint_mpi.py -q --with-mpi -m mpi
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import checkpoint, nn
from simpar.check import relative_error
from simpar.layout import distribute
from tests.mpi_guard import abort_job_on_error, shared_dir
from tests.test_pipeline_mpi import LR, SEED, _batch, _cell, _gpt, _reference

pytestmark = pytest.mark.mpi(min_size=2)

Plan = tuple[str, int, str] | None     # (kind, micro-batches, scheduler), or no pipeline


def _unpipelined() -> nn.TrainOneStepCell:
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    cell = nn.WithLossCell(_gpt(), nn.SoftmaxCrossEntropyWithLogits())
    return nn.TrainOneStepCell(cell, nn.Adam(cell.trainable_params(), LR), seed=SEED)


def _built(plan: Plan) -> nn.TrainOneStepCell:
    train = _unpipelined() if plan is None else _cell(*plan)
    train.build(*_batch(0))
    return train


PAIRS: list[tuple[Plan, Plan]] = [
    (("pp2", 2, "1f1b"), ("ppdp", 4, "gpipe")),
    (("ppdp", 4, "1f1b"), None),
    (None, ("pp", 8, "1f1b")),
    (("pp2", 4, "interleaved-1f1b"), ("pp", 2, "gpipe")),
]


@pytest.mark.parametrize(("saved", "resumed"), PAIRS,
                         ids=[f"{a[0] if a else 'none'}-to-{b[0] if b else 'none'}"
                              for a, b in PAIRS])
def test_a_checkpoint_saved_under_one_pipeline_plan_resumes_under_another_and_under_none(
        saved: Plan, resumed: Plan, tmp_path: Path) -> None:
    rank = comm.get_rank()
    where = shared_dir(tmp_path) / "step_1"
    with abort_job_on_error(f"{saved} -> {resumed}"):
        ref_losses, ref_params = _reference()
        first = _built(saved)
        first(*_batch(0))
        checkpoint.save_training(first, where)
        simpar.reset_auto_parallel_context()
        second = _built(resumed)
        step = checkpoint.load_training(second, where)
        loss = second(*_batch(1))
        simpar.reset_auto_parallel_context()
    problems = []
    if step != 1 or second.step_count != 2:
        problems.append(f"rank {rank}: resumed after step {step}, now at {second.step_count}")
    err = relative_error(np.float64(loss), ref_losses[1])
    if not err <= 1e-10:
        problems.append(f"rank {rank}: the loss after the resume, {loss}, differs from one "
                        f"device's {ref_losses[1]} by {err:.2e}")
    runner, prog = second.pipeline, second.program
    assert prog is not None
    for name, value in second.params.items():
        lay = (runner.params()[name][0] if runner else prog).storage_layout(name)
        local = runner.local if runner else rank
        e = relative_error(value, distribute(ref_params[name], lay, local))
        if not e <= 1e-10:
            problems.append(f"rank {rank}: {name} differs from its slice of one device's by "
                            f"{e:.2e}")
    manifest = checkpoint.read_manifest(where)
    held = {t.ranks for t in manifest.tensors.values()}
    if saved is not None and None in held:
        problems.append(f"rank {rank}: a pipelined save lists a tensor without its stage's "
                        "ranks")
    if saved is None and held != {None}:
        problems.append(f"rank {rank}: an unpipelined save lists ranks {held}")
    count = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
    assert not problems and not count, "\n".join(problems) or "another rank failed"
