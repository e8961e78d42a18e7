"""Distributed checkpoints of a training cell (mpirun -n 2, 4, 8): each rank saves its own
blocks, a resumed run is bit-identical to an uninterrupted one, a run on another strategy
resumes within the single-device tolerance, and damaged or foreign checkpoints fail on every
rank, naming what is wrong.

    mpirun -n 4 python -m pytest tests/test_checkpoint_mpi.py -q
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn
from simpar.checkpoint import latest_checkpoint, load_training, read_manifest, save_training
from simpar.checkpoint import training as checkpoint_training
from simpar.dataset import random_classification
from simpar.nn import presets
from tests.mpi_guard import abort_job_on_error, raised_everywhere, searched_context, shared_dir

pytestmark = pytest.mark.mpi(min_size=2)

SIZES, BATCH, STEPS, SAVED_AT = (16, 32, 8), 8, 4, 2


@pytest.fixture(autouse=True)
def _context() -> Iterator[None]:
    with searched_context():
        yield


def _make(mode: str = "semi_auto_parallel", megatron: bool = True,
          dtype: type = np.float64) -> nn.TrainOneStepCell:
    """The MLP under Megatron's strategies over every rank (semi_auto_parallel: its weights are
    cut into one block per rank, so every rank writes and reads its own files), or searched."""
    net = nn.MLP(*SIZES, n_hidden=1, dtype=dtype)
    if megatron:
        presets.megatron_mlp(net, 1, comm.get_group_size())
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                               nn.Adam(net.trainable_params(), 1e-2), parallel_mode=mode,
                               seed=9)


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    return [random_classification(k, BATCH, SIZES[0], SIZES[2], 2, np.dtype(np.float64))
            for k in range(STEPS)]


def _saved_run(directory: Path) -> tuple[list[float], dict[str, np.ndarray]]:
    """Train STEPS steps, saving after SAVED_AT; the losses and the final global parameters."""
    train = _make()
    losses = []
    for k, batch in enumerate(_batches()):
        losses.append(train(*batch))
        if k + 1 == SAVED_AT:
            save_training(train, directory / f"step_{SAVED_AT:06d}")
    return losses, train.global_parameters()


def test_a_resumed_run_is_bit_identical(tmp_path: Path) -> None:
    root = shared_dir(tmp_path)
    with abort_job_on_error("a run that saves"):
        losses, params = _saved_run(root)
    found = latest_checkpoint(root)
    assert found is not None and found.endswith(f"step_{SAVED_AT:06d}")
    manifest = read_manifest(found)
    assert manifest.step == SAVED_AT and manifest.world_size == comm.get_group_size()
    # Each block is written once, by one of the ranks holding it, into that rank's folder:
    # fc1's weight (cut over every rank) by every rank, fc2's bias (replicated) by one.
    for entry in manifest.tensors.values():
        assert len(entry.files) == math.prod(entry.layout.cuts), entry.name
        assert all(f.path.startswith(f"rank_{f.rank}/") for f in entry.files)
    assert {f.rank for f in manifest.tensors["params/fc1.weight"].files} == \
        set(range(comm.get_group_size()))
    assert len(manifest.tensors["params/fc2.bias"].files) == 1

    resumed = _make()
    batches = _batches()
    with abort_job_on_error("a resumed run"):
        resumed.build(*batches[0])
        assert load_training(resumed, found) == SAVED_AT
        again = [resumed(*b) for b in batches[SAVED_AT:]]
        final = resumed.global_parameters()
    assert resumed.step_count == STEPS
    assert again == losses[SAVED_AT:]  # bit for bit
    for name, value in params.items():
        assert np.array_equal(final[name], value), name


def test_a_run_on_another_strategy_resumes_from_the_blocks_it_needs(tmp_path: Path) -> None:
    """Saved under Megatron's strategies, resumed under the searched plan (data parallel for
    this MLP: every rank needs every block): the run matches the uninterrupted one within
    float64's tolerance."""
    root = shared_dir(tmp_path)
    with abort_job_on_error("a run that saves"):
        losses, params = _saved_run(root)
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel")
    other = _make("auto_parallel", megatron=False)
    batches = _batches()
    with abort_job_on_error("a run on another strategy"):
        other.build(*batches[0])
        load_training(other, root / f"step_{SAVED_AT:06d}")
        again = [other(*b) for b in batches[SAVED_AT:]]
        final = other.global_parameters()
    np.testing.assert_allclose(again, losses[SAVED_AT:], rtol=1e-10)
    for name, value in params.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-9, atol=1e-12)


def test_damaged_and_foreign_checkpoints_fail_on_every_rank(tmp_path: Path) -> None:
    root = shared_dir(tmp_path)
    with abort_job_on_error("a run that saves"):
        _saved_run(root)
    saved = root / f"step_{SAVED_AT:06d}"
    manifest = read_manifest(saved)
    # The block of fc1's weight that rank 1 alone holds and reads: the other ranks find no
    # fault of their own, and must raise with rank 1's.
    victim = saved / next(f.path for f in manifest.tensors["params/fc1.weight"].files
                          if f.rank == 1)
    comm.barrier()
    if comm.get_rank() == 0:
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF  # one flipped byte: same size, another checksum
        victim.write_bytes(bytes(data))
    comm.barrier()
    fresh = _make()
    fresh.build(*_batches()[0])
    raised_everywhere(lambda: load_training(fresh, saved), ValueError, "rank 1: ")
    raised_everywhere(lambda: load_training(fresh, saved), ValueError, "checksum")
    # The same network in float32: a float64 checkpoint is refused, not silently upcast.
    single = _make(dtype=np.float32)
    single.build(*_batches()[0])
    raised_everywhere(lambda: load_training(single, saved), ValueError, "float64")
    # A checkpoint of another network: fc1 is wider.
    wide = nn.MLP(SIZES[0], 64, SIZES[2], n_hidden=1, dtype=np.float64)
    foreign = nn.TrainOneStepCell(nn.WithLossCell(wide, nn.SoftmaxCrossEntropyWithLogits()),
                                  nn.Adam(wide.trainable_params(), 1e-2), seed=9)
    foreign.build(*_batches()[0])
    raised_everywhere(lambda: load_training(foreign, saved), ValueError, "fc1.weight")


def test_a_save_cut_short_leaves_the_previous_checkpoint_the_latest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = shared_dir(tmp_path)
    train = _make()
    batches = _batches()
    with abort_job_on_error("a run that saves"):
        train(*batches[0])
        save_training(train, root / "step_000001")
        train(*batches[1])

    def dies(*args: object, **kwargs: object) -> None:
        raise OSError("disk full (injected)")

    # rank 0 dies before the manifest
    monkeypatch.setattr(checkpoint_training, "finish_checkpoint", dies)
    raised_everywhere(lambda: save_training(train, root / "step_000002"), ValueError,
                      "disk full (injected)")
    monkeypatch.undo()
    latest = latest_checkpoint(root)
    assert latest is not None and Path(latest).resolve() == (root / "step_000001").resolve()
    resumed = _make()
    with abort_job_on_error("resuming from the previous checkpoint"):
        resumed.build(*batches[0])
        assert load_training(resumed, latest) == 1
