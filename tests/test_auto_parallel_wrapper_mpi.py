"""``AutoParallel`` end to end (mpirun -n 2, 4, 8): a Megatron MLP wrapped in
``AutoParallel(parallel_mode="semi_auto")`` trains like one device on every rank's shards,
runs exactly the collectives its strategies imply, and leaves the global context as it was.

    mpirun -n 4 python -m pytest tests/test_auto_parallel_wrapper_mpi.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import context, nn
from simpar.auto_parallel import AutoParallel
from simpar.check import check_against_single_device
from simpar.comm import CommTrace
from simpar.dataset import random_classification
from simpar.layout import distribute
from simpar.nn import presets
from tests.mpi_guard import abort_job_on_error

pytestmark = pytest.mark.mpi(min_size=2)

SIZES = (16, 32, 8)  # in, hidden, classes: fc1 column-parallel, fc2 row-parallel
BATCH, SEED, STEPS = 8, 7, 3
BACKBONE = "Default/network-WithLossCell/_backbone-MLP/"


@pytest.fixture(autouse=True)
def _global_context() -> Iterator[context.ParallelContext]:
    """A global context that disagrees with the wrapper on every key it sets (snapshot taken
    with MPI started, so that device_num reads as the world size before and after)."""
    comm.init()
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=False,
                                     dataset_strategy="full_batch", enable_alltoall=False)
    yield context.auto_parallel_context()
    simpar.reset_auto_parallel_context()


def _dp_mp() -> tuple[int, int]:
    n = comm.get_group_size()
    dp = 2 if n >= 4 else 1
    return dp, n // dp


def _batches(count: int, start: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    return [random_classification(k, BATCH, SIZES[0], SIZES[2], SEED, np.dtype(np.float64))
            for k in range(start, start + count)]


def _megatron_mlp() -> nn.MLP:
    mlp = nn.MLP(*SIZES, n_hidden=1, dtype=np.float64)
    presets.megatron_mlp(mlp, *_dp_mp())
    return mlp


def _make() -> nn.TrainOneStepCell:
    """MindSpore 2.x's way: the network with its loss wrapped, its settings on the wrapper."""
    dp, _ = _dp_mp()
    mlp = _megatron_mlp()
    parallel_net = AutoParallel(nn.WithLossCell(mlp, nn.SoftmaxCrossEntropyWithLogits()),
                                parallel_mode="semi_auto")
    parallel_net.dataset_strategy(((dp, 1), (dp,)))
    parallel_net.enable_gradients_mean()
    return nn.TrainOneStepCell(parallel_net, nn.Momentum(mlp.trainable_params(), 0.1, 0.9),
                               seed=SEED)


def test_semi_auto_trains_like_one_device_with_the_strategys_collectives(
        _global_context: context.ParallelContext) -> None:
    rank, n = comm.get_rank(), comm.get_group_size()
    dp, mp = _dp_mp()
    train = _make()
    assert train.mode == "semi_auto_parallel"  # the wrapper's, not the global data_parallel
    with abort_job_on_error("AutoParallel semi_auto training"):
        report = check_against_single_device(train, _make, _batches(STEPS))
        assert report.passed, str(report)
        assert context.auto_parallel_context() == _global_context
        prog = train.program
        assert prog is not None and prog.mode == "semi_auto_parallel" and prog.device_num == n
        assert train.gradients_mean is True  # the wrapper's (the global context says False)

        # Every rank holds exactly its block of each parameter: the cake cut of the strategy.
        want_shapes = {"fc1.weight": (SIZES[1] // mp, SIZES[0]), "fc1.bias": (SIZES[1] // mp,),
                       "fc2.weight": (SIZES[2], SIZES[1] // mp), "fc2.bias": (SIZES[2],)}
        assert {k: v.shape for k, v in train.params.items()} == want_shapes
        for name, whole in train.global_parameters().items():
            assert np.array_equal(train.params[name],
                                  distribute(whole, prog.param_layouts[name], rank)), name

        # One more step, traced: exactly the schedule's collectives, in order.
        with CommTrace() as trace:
            train(*_batches(1, start=STEPS)[0])
    steps = prog.schedule(rank)
    assert [e.step for e in trace.events] == [s.index for s in steps if s.collective]
    # The Megatron MLP: fc2's partial output summed over the mp group forward, and nothing
    # else inside the backbone: the loss's cotangent is whole on the mp ranks, so that
    # AllReduce needs no adjoint, and fc1's input is the data, which needs no gradient.
    mp_group = tuple(range(rank - rank % mp, rank - rank % mp + mp))
    backbone = [e for e in trace.events if e.label.startswith(BACKBONE)]
    assert [(e.kind, e.op, e.group) for e in backbone] == [("AllReduce", "sum", mp_group)], \
        [str(e) for e in backbone]
    (forward,) = backbone
    assert ":backward" not in forward.label and "fc2-Dense/MatMul" in forward.label
    assert forward.shape == (BATCH // dp, SIZES[2])
    # The gradients: one fused Mirror AllReduce per group of replicating ranks.
    mirrors = [e for e in trace.events if e.label.startswith("Mirror:")]
    groups = {prog.mirror_group(name, rank) for name in prog.param_layouts}
    assert sorted(e.group for e in mirrors) == sorted(g for g in groups if len(g) > 1)
    assert context.auto_parallel_context() == _global_context


def test_the_wrapper_builds_the_program_the_global_context_would() -> None:
    """AutoParallel(parallel_mode="semi_auto") is semi_auto_parallel with the wrapper's
    settings: the same schedule and bit-identical losses as the global-context path."""
    dp, _ = _dp_mp()
    wrapped = _make()
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                                     dataset_strategy=((dp, 1), (dp,)), enable_alltoall=True)
    mlp = _megatron_mlp()
    plain = nn.TrainOneStepCell(nn.WithLossCell(mlp, nn.SoftmaxCrossEntropyWithLogits()),
                                nn.Momentum(mlp.trainable_params(), 0.1, 0.9), seed=SEED)
    with abort_job_on_error("AutoParallel vs the global context"):
        for data, label in _batches(STEPS):
            assert wrapped(data, label) == plain(data, label)
    assert wrapped.program is not None and plain.program is not None
    rank = comm.get_rank()
    assert [str(s) for s in wrapped.program.schedule(rank)] == \
        [str(s) for s in plain.program.schedule(rank)]
    for name, value in plain.params.items():
        assert np.array_equal(wrapped.params[name], value), name


def test_a_registered_search_trains_through_the_wrapper() -> None:
    """simpar-only: AutoParallel(parallel_mode="exact") plans with the exact search."""

    def make() -> nn.TrainOneStepCell:
        net = nn.MLP(*SIZES, n_hidden=1, dtype=np.float64)
        parallel_net = AutoParallel(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                                    parallel_mode="exact")
        parallel_net.enable_gradients_mean()
        return nn.TrainOneStepCell(parallel_net, nn.SGD(net.trainable_params(), 0.1),
                                   seed=SEED)

    train = make()
    assert train.mode == "auto_parallel"
    with abort_job_on_error("AutoParallel exact training"):
        report = check_against_single_device(train, make, _batches(STEPS))
    assert report.passed, str(report)
    assert train.program is not None
    assert {str(s.chosen) for s in train.program.steps} == {"searched"}


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming"])
def test_mindspore_s_searches_train_through_the_wrapper(mode: str) -> None:
    """AutoParallel(parallel_mode="sharding_propagation" / "recursive_programming") trains
    like one device on every rank. Propagation starts from the one op the user shards (fc1's
    MatMul, column-parallel): fc1's bias and ReLU follow it, and fc2's MatMul takes the
    row-parallel strategy that reads the split hidden layer where it is, so the forward runs
    one AllReduce of the model (fc2's partial sums, over the model-parallel ranks) besides
    the loss's mean over the batch shards."""
    dp, mp = _dp_mp()

    def make() -> nn.TrainOneStepCell:
        net = nn.MLP(*SIZES, n_hidden=1, dtype=np.float64)
        if mode == "sharding_propagation":
            net.fc1.matmul.shard(((dp, 1), (mp, 1)))
        parallel_net = AutoParallel(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                                    parallel_mode=mode)
        parallel_net.dataset_strategy(((dp, 1), (dp,)))
        parallel_net.enable_gradients_mean()
        return nn.TrainOneStepCell(parallel_net, nn.SGD(net.trainable_params(), 0.1),
                                   seed=SEED)

    train = make()
    assert train.mode == "auto_parallel"
    with abort_job_on_error(f"AutoParallel {mode} training"):
        report = check_against_single_device(train, make, _batches(STEPS))
    assert report.passed, str(report)
    program = train.program
    assert program is not None
    chosen = {s.node.name.removeprefix(BACKBONE): str(s.chosen) for s in program.steps}
    if mode == "recursive_programming":
        assert set(chosen.values()) == {"searched"}
        return
    assert chosen.pop("fc1-Dense/MatMul-op0") == "annotated"
    assert set(chosen.values()) == {"propagated"}
    strategies = {s.node.name.removeprefix(BACKBONE): s.sharding.strategy
                  for s in program.steps}
    assert strategies["fc1-Dense/BiasAdd-op1"] == ((dp, mp), (mp,))
    assert strategies["fc2-Dense/MatMul-op3"][0] == (dp, mp)
    with CommTrace() as trace:
        train(*_batches(1, STEPS)[0])
    steps = program.schedule(comm.get_rank())
    assert [e.step for e in trace.events] == [s.index for s in steps if s.collective]
    forward = [(s.op.removeprefix("Default/network-WithLossCell/"), e.kind, len(e.group))
               for e, s in zip(trace.events, [s for s in steps if s.collective])
               if not s.backward]
    loss = [("_loss_fn-SoftmaxCrossEntropyWithLogits/SparseSoftmaxCrossEntropyWithLogits-op5",
             "AllReduce", dp)] if dp > 1 else []  # the loss's mean over the batch shards
    assert forward == [("_backbone-MLP/fc2-Dense/MatMul-op3", "AllReduce", mp), *loss], forward
