"""auto_parallel end to end (mpirun -n 2, 4, 8): the searched strategies train like one device."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn, ops
from simpar.check import check_against_single_device
from simpar.comm import CommTrace
from simpar.cost import SimparCostModel, load_profile
from simpar.dataset import random_classification
from simpar.search import set_search_cost_model
from simpar.search.dynamic_programming import NoAvailableCost
from tests.mpi_guard import raised_everywhere

pytestmark = pytest.mark.mpi(min_size=2)


def _make(mode: str, model: str = "mlp", dtype: type = np.float64) -> nn.TrainOneStepCell:
    net: nn.Cell
    if model == "mlp":
        net = nn.MLP(16, 32, 8, n_hidden=1, dtype=dtype)
    else:
        net = nn.GPT(vocab_size=32, seq_length=8, d_model=16, n_layers=1, n_heads=4,
                     dtype=dtype)
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                               nn.SGD(net.trainable_params(), 0.1), parallel_mode=mode, seed=3)


def _batches(model: str, dtype: type, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    if model == "mlp":
        return [random_classification(k, 8, 16, 8, 0, np.dtype(dtype)) for k in range(n)]
    rng = np.random.default_rng(5)
    return [(rng.integers(0, 32, (8, 8)).astype(np.int32),
             rng.integers(0, 32, (8, 8)).astype(np.int32)) for _ in range(n)]


@pytest.mark.parametrize(("search", "model", "dtype"), [
    ("dynamic_programming", "mlp", np.float64), ("dynamic_programming", "mlp", np.float32),
    ("dynamic_programming", "gpt", np.float64), ("dynamic_programming", "gpt", np.float32),
    ("recursive_programming", "mlp", np.float64), ("recursive_programming", "gpt", np.float32),
    ("sharding_propagation", "mlp", np.float32), ("sharding_propagation", "gpt", np.float64)])
def test_each_search_trains_like_one_device(search: str, model: str, dtype: type) -> None:
    """Each search_mode (the cpu-local model): three steps match one device on every rank
    (1e-10 relative in float64, 1e-5 in float32), every op is "searched" (propagated from
    the dataset, for sharding_propagation without user strategies), and the traced
    collectives are exactly the schedule's, in order."""
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode=search,
                                     gradients_mean=True, dataset_strategy="data_parallel",
                                     enable_alltoall=True)
    try:
        train = _make("auto_parallel", model, dtype)
        batches = _batches(model, dtype, 4)
        report = check_against_single_device(
            train, lambda: _make("stand_alone", model, dtype), batches[:3])
        assert report.passed, str(report)
        assert train.program is not None
        source = "propagated" if search == "sharding_propagation" else "searched"
        assert {str(s.chosen) for s in train.program.steps} == {source}
        with CommTrace() as trace:
            train(*batches[3])
        steps = train.program.schedule(comm.get_rank())
        assert [e.step for e in trace.events] == [s.index for s in steps if s.collective]
        assert [e.kind for e in trace.events] == [str(s.collective) for s in steps
                                                  if s.collective]
    finally:
        simpar.reset_auto_parallel_context()


def test_exact_search_trains_like_one_device_and_runs_its_schedule() -> None:
    """search_mode "exact" picks every op's strategy (marked "searched"); three steps match
    one device on every rank's shards, and the traced collectives are the schedule's."""
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="exact",
                                     gradients_mean=True, dataset_strategy="data_parallel",
                                     enable_alltoall=True)
    try:
        train = _make("auto_parallel")
        batches = [random_classification(k, 8, 16, 8, 0, np.dtype(np.float64))
                   for k in range(3)]
        report = check_against_single_device(train, lambda: _make("stand_alone"), batches)
        assert report.passed, str(report)
        assert train.program is not None
        assert {str(s.chosen) for s in train.program.steps} == {"searched"}
        with CommTrace() as trace:
            train(*random_classification(3, 8, 16, 8, 0, np.dtype(np.float64)))
        steps = train.program.schedule(comm.get_rank())
        assert [e.step for e in trace.events] == [s.index for s in steps if s.collective]
    finally:
        simpar.reset_auto_parallel_context()


class _SharedW(nn.Cell):
    """w read by two MatMuls whose user strategies cut it two ways."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(np.ones((16, 16)), name="w")
        n = comm.get_group_size()
        self.a = ops.MatMul().shard(((1, n), (n, 1)))
        self.b = ops.MatMul().shard(((n, 1), (1, 1)))

    def construct(self, x: Any) -> Any:
        return self.b(self.a(x, self.w), self.w)


def test_bad_searches_fail_on_every_rank() -> None:
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel",
                                     search_mode="dynamic_programming",
                                     dataset_strategy="full_batch")
    try:
        raised_everywhere(lambda: simpar.set_auto_parallel_context(search_mode="greedy"),
                           ValueError, "'greedy'")

        def conflict() -> None:
            net = _SharedW()
            x = np.ones((8, 16))
            train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
                                        nn.SGD(net.trainable_params(), 0.1),
                                        parallel_mode="auto_parallel")
            train.build(x, np.zeros((8, 16)))
        raised_everywhere(conflict, ValueError, "no plan satisfies every constraint")
        simpar.set_auto_parallel_context(search_mode="sharding_propagation")
        raised_everywhere(conflict, ValueError, "reads parameter w cut")
        simpar.set_auto_parallel_context(search_mode="recursive_programming")
        raised_everywhere(conflict, ValueError, "a shared parameter has one layout")
        simpar.set_auto_parallel_context(search_mode="dynamic_programming")

        tiny = dataclasses.replace(load_profile("cpu-local"), memory_capacity=1024)
        set_search_cost_model(SimparCostModel(tiny))

        def no_memory() -> None:
            train = _make("auto_parallel")
            train.build(*random_classification(0, 8, 16, 8, 0, np.dtype(np.float64)))
        raised_everywhere(no_memory, NoAvailableCost, "The minimum memory cost is")
        simpar.set_auto_parallel_context(search_mode="recursive_programming")
        raised_everywhere(no_memory, NoAvailableCost, "recursive_programming's plan needs")
    finally:
        set_search_cost_model(None)
        simpar.reset_auto_parallel_context()
