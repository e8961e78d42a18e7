"""The backward pass planned with layouts (simpar.cotangent): Megatron's communication
and no more, asserted from the CommTrace, with every rank's shards checked against one device.

- a Megatron MLP (column-parallel fc1 -> GeLU -> row-parallel fc2) over every rank runs one
  AllReduce per step when its input needs no gradient (fc2's, forward) and two when it does
  (a LayerNorm with trainable parameters in front: the column-parallel input's gradient is
  summed before it);
- a Megatron GPT runs two AllReduces per block forward and two backward, and no Mirror;
- pure data parallel runs only the loss's forward AllReduce and the bucketed Mirrors;
- a parameter is never reduced over ranks that computed its gradient alike (fc2's bias after
  a dp x mp Megatron MLP is summed over dp only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import simpar
from simpar import comm, nn
from simpar.comm import CommEvent, CommTrace
from simpar.nn import presets
from tests.mpi_guard import abort_job_on_error

pytestmark = pytest.mark.mpi

SEED = 7


@dataclass
class Run:
    train: nn.TrainOneStepCell
    losses: list[float]
    events: list[CommEvent]


class NormedMLP(nn.Cell):
    """A trainable LayerNorm in front of an MLP (and, ``trained``, a Dense in front of that):
    the MLP's input needs a gradient, and with ``trained`` so does the LayerNorm's."""

    def __init__(self, width: int, hidden: int, out: int, trained: bool) -> None:
        super().__init__()
        self.first = nn.Dense(width, width, dtype=np.float64) if trained else None
        self.norm = nn.LayerNorm((width,), dtype=np.float64)
        self.mlp = nn.MLP(width, hidden, out, activation="gelu", dtype=np.float64)

    def construct(self, x: Any) -> Any:
        return self.mlp(self.norm(x if self.first is None else self.first(x)))


def _mlp(variant: str) -> tuple[nn.Cell, nn.MLP]:
    if variant != "plain":
        net = NormedMLP(16, 32, 8, trained=variant == "dense-normed")
        return net, net.mlp
    mlp = nn.MLP(16, 32, 8, activation="gelu", dtype=np.float64)
    return mlp, mlp


def _mlp_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((8, 16)), rng.standard_normal((8, 8))


def _gpt_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(200 + step)
    return rng.integers(0, 64, (4, 16)).astype(np.int32), \
        rng.integers(0, 64, (4, 16)).astype(np.int32)


def _train(net: nn.Cell, loss: nn.Cell, mode: str, batch: Any, steps: int = 2,
           dataset: Any = "full_batch", fusion: Any = None) -> Run:
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode=mode, dataset_strategy=dataset,
                                     gradients_mean=True)
    if fusion is not None:
        simpar.set_auto_parallel_context(comm_fusion=fusion)
    try:
        cell = nn.WithLossCell(net, loss)
        train = nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), 0.05),
                                    parallel_mode=mode, seed=SEED)
        run = Run(train, [], [])
        with abort_job_on_error(f"{type(net).__name__} under {mode}"):
            for k in range(steps):
                with CommTrace() as trace:
                    run.losses.append(train(*batch(k)))
                run.events = list(trace.events)
    finally:
        simpar.reset_auto_parallel_context()
    return run


def _same_as_one_device(run: Run, ref: Run) -> None:
    """Every rank's losses and parameter shards equal the single-device run's (float64)."""
    rank = comm.get_rank()
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-10, atol=0)
    layouts = run.train.program.param_layouts
    for name, local in run.train.params.items():
        whole = ref.train.params[name]
        part = whole[tuple(slice(lo, hi) for lo, hi in layouts[name].slice_of(rank))]
        np.testing.assert_allclose(local, part, rtol=1e-10, atol=1e-12, err_msg=name)


def _phases(run: Run) -> tuple[list[CommEvent], list[CommEvent]]:
    """The traced step's collectives, forward and backward (from the schedule)."""
    steps = run.train.program.schedule(comm.get_rank())
    fwd = [e for e in run.events if e.step is not None and not steps[e.step].backward]
    bwd = [e for e in run.events if e.step is not None and steps[e.step].backward]
    assert len(fwd) + len(bwd) == len(run.events)
    return fwd, bwd


def _op(run: Run, e: CommEvent) -> str:
    assert e.step is not None
    return run.train.program.schedule(comm.get_rank())[e.step].op


@pytest.mark.parametrize("variant", ["plain", "normed", "dense-normed"])
def test_megatron_mlp_runs_one_allreduce_per_step_or_two_with_a_trainable_input(
        variant: str) -> None:
    """plain: the MLP's input is the data, one AllReduce (fc2's, forward). normed: a
    LayerNorm of the data in front, whose gain and bias get gradients pending over the model
    parallel ranks (fc1 is column parallel): one Mirror of those two over the world, fused.
    dense-normed: a Dense before the LayerNorm, so the LayerNorm's input needs a gradient too:
    fc1's pending input gradient is summed once, before the LayerNorm (Megatron's backward
    AllReduce), and nothing is mirrored."""
    n = comm.get_group_size()
    net, mlp = _mlp(variant)
    presets.megatron_mlp(mlp, 1, n)
    run = _train(net, nn.MSELoss(), "semi_auto_parallel", _mlp_batch)
    ref_net, _ = _mlp(variant)
    ref = _train(ref_net, nn.MSELoss(), "stand_alone", _mlp_batch)
    _same_as_one_device(run, ref)
    fwd, bwd = _phases(run)
    world = tuple(range(n))
    rank = comm.get_rank()
    prog = run.train.program
    if n == 1:
        assert fwd == bwd == []
        return
    assert [(e.kind, e.group) for e in fwd] == [("AllReduce", world)]
    assert "fc2" in _op(run, fwd[0])
    mirrored = {p for p in prog.param_layouts if len(prog.mirror_group(p, rank)) > 1}
    if variant == "plain":
        assert bwd == [] and mirrored == set()
    elif variant == "normed":
        assert [(e.kind, e.group, e.shape) for e in bwd] == [("AllReduce", world, (32,))]
        assert bwd[0].label.startswith("Mirror:2 params")
        assert mirrored == {"_backbone.norm.gamma", "_backbone.norm.beta"}
    else:
        assert [(e.kind, e.group, e.shape) for e in bwd] == [("AllReduce", world, (8, 16))]
        assert "norm" in _op(run, bwd[0]) and mirrored == set()


def test_megatron_gpt_runs_two_allreduces_per_block_each_way_and_no_mirror() -> None:
    n = comm.get_group_size()
    kw = {"vocab_size": 64, "seq_length": 16, "d_model": 32, "n_layers": 2, "n_heads": 8,
          "dtype": np.float64}
    gpt, loss = nn.GPT(**kw), nn.SoftmaxCrossEntropyWithLogits()
    presets.megatron_gpt(gpt, 1, n, loss)
    run = _train(gpt, loss, "semi_auto_parallel", _gpt_batch)
    ref = _train(nn.GPT(**kw), nn.SoftmaxCrossEntropyWithLogits(), "stand_alone", _gpt_batch)
    _same_as_one_device(run, ref)
    fwd, bwd = _phases(run)
    if n == 1:
        assert fwd == bwd == []
        return
    assert all(e.kind == "AllReduce" for e in fwd + bwd)
    assert not [e for e in bwd if e.label.startswith("Mirror")]
    for block in ("block0", "block1"):
        mine_fwd = [_op(run, e) for e in fwd if f"/{block}-" in _op(run, e)]
        mine_bwd = [_op(run, e) for e in bwd if f"/{block}-" in _op(run, e)]
        assert len(mine_fwd) == 2 and any("proj" in o for o in mine_fwd) and any(
            "fc2" in o for o in mine_fwd), mine_fwd
        # Megatron's two: the gradients of the column-parallel inputs (q, k, v's and fc1's),
        # each summed once, before the LayerNorm that produced it.
        assert len(mine_bwd) == 2 and all("LayerNorm" in o for o in mine_bwd), mine_bwd
    # Outside the blocks: the head's input gradient, summed before the final LayerNorm.
    rest = [_op(run, e) for e in bwd if "/block" not in _op(run, e)]
    assert len(rest) == 1 and "ln_f" in rest[0], rest


def test_data_parallel_runs_only_the_loss_and_the_bucketed_mirrors() -> None:
    n = comm.get_group_size()
    mlp = nn.MLP(16, 32, 8, activation="gelu", dtype=np.float64)
    run = _train(mlp, nn.MSELoss(), "data_parallel", _mlp_batch, dataset="data_parallel")
    ref = _train(nn.MLP(16, 32, 8, activation="gelu", dtype=np.float64), nn.MSELoss(),
                 "stand_alone", _mlp_batch)
    _same_as_one_device(run, ref)
    fwd, bwd = _phases(run)
    world = tuple(range(n))
    if n == 1:
        assert fwd == bwd == []
        return
    assert [(e.kind, e.group, e.shape) for e in fwd] == [("AllReduce", world, ())]
    assert [(e.kind, e.group) for e in bwd] == [("AllReduce", world)]
    assert bwd[0].label.startswith("Mirror:4 params")


@pytest.mark.parametrize("fusion, buckets", [
    ({"allreduce": {"mode": "auto", "config": None}}, [(4, 544 + 264)]),
    ({"allreduce": {"mode": "index", "config": [1, 3]}}, [(1, 512), (2, 32 + 256), (1, 8)]),
    ({"openstate": False}, [(1, 512), (1, 32), (1, 256), (1, 8)])])
def test_comm_fusion_buckets_the_mirrors(fusion: Any, buckets: list[tuple[int, int]]) -> None:
    """MindSpore's comm_fusion: "auto" fuses the MLP's 6.4 KB of gradients into one
    AllReduce (under 64 MB), "index" [1, 3] into three (fc1's weight; its bias and fc2's
    weight; fc2's bias), no fusion into one per parameter; each the same as one device."""
    n = comm.get_group_size()
    mlp = nn.MLP(16, 32, 8, activation="gelu", dtype=np.float64)
    run = _train(mlp, nn.MSELoss(), "data_parallel", _mlp_batch, dataset="data_parallel",
                 fusion=fusion)
    ref = _train(nn.MLP(16, 32, 8, activation="gelu", dtype=np.float64), nn.MSELoss(),
                 "stand_alone", _mlp_batch)
    _same_as_one_device(run, ref)
    _, bwd = _phases(run)
    if n == 1:
        assert bwd == []
        return
    world = tuple(range(n))
    assert [(e.kind, e.group, e.shape) for e in bwd] == [
        ("AllReduce", world, (size,)) for _, size in buckets]
    assert [e.label.split(" ")[0] for e in bwd] == [f"Mirror:{k}" for k, _ in buckets]
    mirrors = [s for s in run.train.program.schedule(comm.get_rank()) if s.role == "mirror"]
    assert [s.buffer_bytes for s in mirrors] == [8 * size for _, size in buckets]


def test_no_parameter_is_summed_over_ranks_that_computed_its_gradient_alike() -> None:
    n = comm.get_group_size()
    if n < 4:
        pytest.skip("dp x mp needs 4 ranks or more")
    dp, mp = 2, n // 2
    mlp = nn.MLP(16, 32, 8, activation="gelu", dtype=np.float64)
    presets.megatron_mlp(mlp, dp, mp)
    run = _train(mlp, nn.MSELoss(), "semi_auto_parallel", _mlp_batch,
                 dataset=((dp, 1), (dp, 1)))
    ref = _train(nn.MLP(16, 32, 8, activation="gelu", dtype=np.float64), nn.MSELoss(),
                 "stand_alone", _mlp_batch)
    _same_as_one_device(run, ref)
    rank = comm.get_rank()
    dp_group = tuple(range(rank % mp, n, mp))
    prog = run.train.program
    # Every parameter, fc2's replicated bias included, is summed over the dp ranks only.
    assert {name: prog.mirror_group(name, rank) for name in prog.param_layouts} == {
        name: dp_group for name in prog.param_layouts}
    _, bwd = _phases(run)
    assert [(e.kind, e.group) for e in bwd] == [("AllReduce", dp_group)]
