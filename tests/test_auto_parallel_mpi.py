"""auto_parallel end to end (mpirun -n 2, 4, 8): the searched strategies train like one device."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import context, graph, nn, ops, plan
from simpar.check import check_against_single_device
from simpar.comm import CommTrace
from simpar.cost import SimparCostModel, load_profile
from simpar.dataset import random_classification
from simpar.parallel import run_op, search_strategies
from simpar.search import Source, parameter_plans, plan_strategies, set_search_cost_model
from simpar.search.dynamic_programming import NoAvailableCost
from simpar.strategy_table import display_names, strategy_table
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


@pytest.mark.parametrize("search", ["dynamic_programming", "exact", "recursive_programming"])
def test_user_strategies_are_kept_and_labelled_next_to_the_searched_ones(search: str) -> None:
    """fc1's MatMul cut along k and fc2's BiasAdd along its features by ``.shard()``, every
    other op searched: the program keeps the two strategies exactly as given and labels them
    "annotated", and every other op "searched", in its steps, its comm table, its printout
    and the strategy table; three steps match one device on every rank; the traced
    collectives are the schedule's, among them the forward AllReduce of fc1's partial sums."""
    n = comm.get_group_size()
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode=search,
                                     gradients_mean=True, dataset_strategy="data_parallel",
                                     enable_alltoall=True)
    try:
        train = _make("auto_parallel")
        mlp = train.network._backbone
        mlp.layers[0].matmul.shard(((1, n), (1, n)))
        mlp.layers[1].bias_add.shard(((1, n), (n,)))
        given = {"fc1-Dense/MatMul": ((1, n), (1, n)), "fc2-Dense/BiasAdd": ((1, n), (n,))}
        batches = _batches("mlp", np.float64, 4)
        report = check_against_single_device(train, lambda: _make("stand_alone"), batches[:3])
        assert report.passed, str(report)
        program = train.program
        assert program is not None
        # "Default/network-WithLossCell/_backbone-MLP/fc1-Dense/MatMul-op0" -> "fc1-Dense/MatMul"
        cell_op = {s.node.name: "/".join(s.node.name.split("/")[-2:]).rsplit("-op", 1)[0]
                   for s in program.steps}
        kept = {cell_op[s.node.name]: s.sharding.strategy for s in program.steps
                if cell_op[s.node.name] in given}
        assert kept == given
        chosen = {name: Source.USER if op in given else Source.SEARCHED
                  for name, op in cell_op.items()}
        assert list(chosen.values()).count(Source.USER) == 2 and len(chosen) == 6
        assert {s.node.name: s.chosen for s in program.steps} == chosen
        assert {r["op"]: r["chosen"] for r in program.comm_table()} == chosen
        printed = str(program).splitlines()
        for name, source in chosen.items():
            (line,) = [x for x in printed if x.endswith(f"  {name}")]
            assert f"({source}" in line, line
        table = strategy_table(program)
        assert "the rest searched" in table.splitlines()[1]
        names = display_names(list(chosen))
        rows = {row.split()[0]: row for row in table.splitlines()[3:-1]}
        assert {names[k] for k, v in chosen.items() if v is Source.USER} <= set(rows)
        for name, source in chosen.items():   # the last column says where each came from
            if names[name] in rows:
                assert rows[names[name]].endswith(
                    "user .shard()" if source is Source.USER else "search"), rows[names[name]]
        with CommTrace() as trace:
            train(*batches[3])
        steps = program.schedule(comm.get_rank())
        collectives = [s for s in steps if s.collective]
        assert [e.step for e in trace.events] == [s.index for s in collectives]
        assert [e.kind for e in trace.events] == [str(s.collective) for s in collectives]
        fc1 = next(name for name, op in cell_op.items() if op == "fc1-Dense/MatMul")
        assert any(s.op == fc1 and not s.backward and str(s.collective) == "AllReduce"
                   for s in collectives)
    finally:
        simpar.reset_auto_parallel_context()


@pytest.mark.parametrize("search", ["dynamic_programming", "exact"])
def test_a_device_num_that_no_cut_can_use_fails_on_every_rank(search: str) -> None:
    """An MLP whose every dimension is odd (3 -> 5 -> 7, batch 3) on 2, 4 or 8 ranks: with
    fully_use_devices an op must use every device and no cut divides its dimension, so each
    rank refuses with the op, its shapes, the device count and the setting that rules out
    repeated calculation; split by the dataset, the batch of 3 is refused the same way."""
    n = comm.get_group_size()
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode=search,
                                     dataset_strategy="full_batch")

    def build() -> None:
        net = nn.MLP(3, 5, 7, n_hidden=1, dtype=np.float64)
        train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
                                    nn.SGD(net.trainable_params(), 0.1),
                                    parallel_mode="auto_parallel")
        train.build(np.ones((3, 3)), np.zeros((3, 7)))
    try:
        context.set_algo_parameters(fully_use_devices=True)
        raised_everywhere(build, ValueError,
                          f"fc1-Dense/MatMul-op0: no strategy of MatMul fits shapes [(3, 3), "
                          f"(5, 3)] on {n} devices: a cut must divide its dimension, and "
                          f"fully_use_devices=True keeps only strategies that use all {n} "
                          "devices")
        context.set_algo_parameters(fully_use_devices=False)
        simpar.set_auto_parallel_context(dataset_strategy="data_parallel")
        raised_everywhere(build, ValueError,
                          f"dataset_strategy 'data_parallel': input 0 of shape (3, 3) has "
                          f"batch 3, which does not split over {n} devices")
    finally:
        context.reset_algo_parameters()
        simpar.reset_auto_parallel_context()


def test_training_and_every_entry_point_plan_one_request_alike() -> None:
    """On the MPI world, the training cell, the AutoParallel wrapper's compilation,
    search_strategies, plan_strategies and simpar.plan's make_plan plan one GPT from the
    context alike; run_op runs an op under the plan of its one-op network."""
    world = comm.get_group_size()
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel",
                                     search_mode="dynamic_programming",
                                     dataset_strategy="data_parallel", enable_alltoall=True)
    set_search_cost_model(SimparCostModel("cpu-local", "momentum"))
    opts = plan.PlanOptions(model="gpt", hidden=16, layers=1, batch=8, device_num=world,
                            search_mode="dynamic_programming", profile=load_profile("cpu-local"),
                            heads=4, seq=8, vocab=32, dtype="float64", optimizer="momentum",
                            dataset_strategy="data_parallel", enable_alltoall=True)
    try:
        net, specs = plan.build_network(opts)
        data, label = _batches("gpt", np.float64, 1)[0]
        maps = {"make_plan": plan.make_plan(opts).strategy_map,
                "search_strategies": search_strategies(net, specs, input_names=["data", "label"])}
        g = graph.trace(net, specs, ["data", "label"])
        maps["plan_strategies"] = plan_strategies(g, world, "auto_parallel", "data_parallel",
                                                  True, parameter_plans(net))
        for name, network in (("training", net),
                              ("AutoParallel", nn.AutoParallel(net, "dynamic_programming"))):
            train = nn.TrainOneStepCell(network, nn.SGD(net.trainable_params(), 0.1))
            program = train.build(data, label)
            assert program.strategy_map is not None
            maps[name] = program.strategy_map
        for name, smap in maps.items():
            assert smap == maps["plan_strategies"], name
        op = ops.MatMul().shard(((world, 1), (1, 1)))
        a, b = np.ones((8, 4)), np.ones((4, 2))
        one_op = plan_strategies(graph.trace(op, [(a.shape, a.dtype), (b.shape, b.dtype)]),
                                 world, "semi_auto_parallel")
        assert run_op(op, a, b, full=True).sharding.strategy == next(
            iter(one_op.ops.values())).in_strategy
    finally:
        set_search_cost_model(None)
        simpar.reset_auto_parallel_context()
