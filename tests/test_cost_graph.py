"""The cost graph of auto_parallel's searches (pure: one process, shapes only)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from simpar import graph, nn, ops
from simpar.cost import MindSporeCostModel, SimparCostModel
from simpar.runtime import lower
from simpar.search import OpStrategy, Source, StrategyMap
from simpar.search.cost_graph import brute_force, build_cost_graph


def _mlp(n_hidden: int = 1) -> graph.Graph:
    mlp = nn.MLP(16, 32, 8, n_hidden=n_hidden, dtype=np.float64)
    return graph.trace(mlp, [((8, 16), np.float64)], ["x"])


def _lowered_total(g: graph.Graph, cg: Any, choice: tuple[int, ...], model: Any,
                   dataset: Any) -> float:
    """The same objective recomputed from the program that lowering the choice gives: each
    op's cost and every redistribution its inputs really need."""
    smap = StrategyMap(cg.device_num, "auto_parallel", {
        n.name: OpStrategy(n.node.op.name, n.candidates[c].strategy, None, Source.SEARCHED)
        for n, c in zip(cg.nodes, choice)},
        inputs={v.name: lay for v, lay in zip(g.inputs, _inputs(g, cg.device_num, dataset))})
    program = lower(g, smap, enable_alltoall=True)
    total = 0.0
    for s in program.steps:
        params = {k for k, v in enumerate(s.node.inputs) if v.kind == "param"}
        total += model.op(s.sharding, params, s.node.outputs[0].dtype.itemsize)
        total += sum(model.edge(p, v.dtype.itemsize)
                     for v, p in zip(s.node.inputs, s.in_plans) if p.steps)
    return total


def _inputs(g: graph.Graph, n: int, dataset: Any) -> list[Any]:
    from simpar.search import dataset_layouts
    return dataset_layouts([v.shape for v in g.inputs], n, dataset)


@pytest.mark.parametrize("model", [SimparCostModel("ascend910a"), MindSporeCostModel()],
                         ids=["simpar", "mindspore"])
def test_what_the_graph_costs_is_what_lowering_runs(model: Any) -> None:
    """For every combination of a small MLP's candidates on 4 devices, the cost graph's
    objective equals the one recomputed from the lowered program's own redistributions."""
    g, dataset = _mlp(), ((4, 1),)
    cg = build_cost_graph(g, 4, model, dataset, enable_alltoall=True)
    assert [len(n.candidates) for n in cg.nodes] == [10, 6, 6, 10, 6] and len(cg.edges) == 4
    rng = np.random.default_rng(0)
    combos = list(itertools.product(*(range(len(n.candidates)) for n in cg.nodes)))
    for k in rng.choice(len(combos), 40, replace=False):
        choice = combos[k]
        assert cg.total(choice) == pytest.approx(_lowered_total(g, cg, choice, model, dataset))


def test_brute_force_finds_the_cheapest_combination() -> None:
    g = _mlp()
    cg = build_cost_graph(g, 4, SimparCostModel("ascend910a"), ((4, 1),), True)
    choice, cost = brute_force(cg)
    every = [cg.total(c) for c in itertools.product(*(range(len(n.candidates))
                                                     for n in cg.nodes))]
    assert cost == min(every) and cg.total(choice) == cost
    assert set(cg.strategies(choice)) == {n.name for n in g.nodes}
    with pytest.raises(ValueError, match="combinations exceed the limit 10"):
        brute_force(cg, limit=10)


def test_a_shared_parameter_gets_one_layout_and_user_strategies_stay() -> None:
    """w feeds two MatMuls: a choice that reads it in two layouts costs inf. The second
    MatMul's .shard() strategy is its only candidate."""
    w = nn.Parameter(np.ones((16, 16)), name="w")
    second = ops.MatMul().shard(((1, 4), (4, 1)))
    g = graph.trace(lambda x: second(ops.MatMul()(x, w), w), [((8, 16), np.float64)], ["x"])
    cg = build_cost_graph(g, 4, SimparCostModel("ascend910a"))
    assert dict(cg.shared) == {"w": ((0, 1), (1, 1))}
    assert cg.nodes[1].user_set and len(cg.nodes[1].candidates) == 1
    bad = [c for c in range(len(cg.nodes[0].candidates))
           if cg.nodes[0].candidates[c].in_layouts[1].cuts != (4, 1)]
    assert bad and all(math.isinf(cg.total((c, 0))) for c in bad)
    choice, _ = brute_force(cg)
    assert cg.nodes[0].candidates[choice[0]].in_layouts[1].cuts == (4, 1)
