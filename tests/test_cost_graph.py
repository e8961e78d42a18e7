"""The cost graph of auto_parallel's searches (pure: one process, shapes only)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import warnings
from typing import Any

import numpy as np
import pytest

from simpar import graph, nn, ops
from simpar.comm_fusion import AllReduceFusion
from simpar.cost import MindSporeCostModel, SimparCostModel, evaluate
from simpar.runtime import lower
from simpar.search import OpStrategy, Source, StrategyMap, request_from_context
from simpar.search import dynamic_programming as dpm
from simpar.search.auto import cost_graph_of, pricer_of, strategy_map_of
from simpar.search.cost_graph import brute_force, build_cost_graph
from simpar.search.dynamic_programming import solve_dynamic_programming
from simpar.search.planner import complete_plan
from simpar.search.request import dataset_layouts


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
        total += model.op(s.sharding, params, s.node.outputs[0].dtype.itemsize,
                          [v.dtype.itemsize for v in s.node.inputs])
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


def test_a_user_strategy_that_does_not_fit_is_refused_with_the_op_s_reason() -> None:
    """A ``.shard()`` strategy is an op's only candidate: when it cannot run, the error gives
    the op's own reason, not only that no strategy fits."""
    w = nn.Parameter(np.ones((16, 16)), name="w")
    odd = ops.MatMul().shard(((3, 1), (1, 1)))
    g = graph.trace(lambda x: odd(x, w), [((8, 16), np.float64)], ["x"])
    with pytest.raises(ValueError, match=r"MatMul-op0: no strategy of MatMul fits shapes "
                       r"\[\(8, 16\), \(16, 16\)\] on 4 devices: its \.shard\(\) strategy is "
                       r"refused: .*\(3, 1\)"):
        build_cost_graph(g, 4, SimparCostModel("ascend910a"))


@pytest.mark.parametrize("device_num", [2, 4, 8])
def test_the_exact_search_finds_the_brute_force_optimum(device_num: int) -> None:
    from simpar.search.exact import solve_exact

    g = _mlp()
    for model in (SimparCostModel("ascend910a"), MindSporeCostModel()):
        cg = build_cost_graph(g, device_num, model, ((device_num, 1),), True)
        _, best = brute_force(cg)
        found = solve_exact(cg)
        assert found.cost == pytest.approx(best) and found.gap == 0.0


def test_the_exact_search_says_when_its_time_limit_ran_out_before_any_solution() -> None:
    """A limit of 0 s stops HiGHS before it has any solution: that is a timeout, not "no
    strategy satisfies every constraint" (which the same graph without a limit disproves)."""
    from simpar.search.exact import solve_exact

    cg = build_cost_graph(_mlp(), 4, SimparCostModel("ascend910a"), ((4, 1),), True)
    with pytest.raises(TimeoutError, match="time limit of 0.0 s ran out before HiGHS found"):
        solve_exact(cg, time_limit=0.0)
    assert solve_exact(cg).gap == 0.0


def test_the_exact_search_keeps_a_shared_parameter_in_one_layout() -> None:
    from simpar.search.exact import solve_exact

    w = nn.Parameter(np.ones((16, 16)), name="w")
    g = graph.trace(lambda x: ops.MatMul()(ops.MatMul()(x, w), w), [((8, 16), np.float64)],
                    ["x"])
    cg = build_cost_graph(g, 4, SimparCostModel("ascend910a"))
    found = solve_exact(cg)
    _, best = brute_force(cg)
    assert found.cost == pytest.approx(best)
    a, b = (cg.nodes[k].candidates[found.choice[k]].in_layouts[1] for k in (0, 1))
    assert all(a.slice_of(r) == b.slice_of(r) for r in range(4))


def test_auto_parallel_plans_with_the_registered_exact_search() -> None:
    """plan_strategies(auto_parallel, search_mode="exact") returns a searched map that lowers."""
    from simpar.search import plan_strategies

    g = _mlp()
    smap = plan_strategies(g, 4, "auto_parallel", ((4, 1),), True, search_mode="exact")
    assert {s.source for s in smap.ops.values()} == {Source.SEARCHED}
    program = lower(g, smap, enable_alltoall=True)
    assert len(program.steps) == len(g.nodes)


def test_search_strategies_plans_a_cell_from_shapes_alone() -> None:
    """simpar.parallel.search_strategies: trace, search and return every op's strategy by its
    MindSpore-style name; the map is the cost graph's optimum and lowers."""
    from simpar.parallel import search_strategies
    from simpar.search import set_search_cost_model

    mlp = nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64)
    model = SimparCostModel("ascend910a")
    set_search_cost_model(model)
    try:
        smap = search_strategies(mlp, [((8, 16), np.float64)], 4, dataset_strategy=((4, 1),),
                                 enable_alltoall=True, input_names=["x"])
    finally:
        set_search_cost_model(None)
    g = _mlp()
    assert set(smap.ops) == {n.name for n in g.nodes}
    assert {s.source for s in smap.ops.values()} == {Source.SEARCHED}
    cg = build_cost_graph(g, 4, model, ((4, 1),), True)
    chosen = tuple(next(i for i, c in enumerate(n.candidates)
                        if c.strategy == smap.ops[n.name].in_strategy) for n in cg.nodes)
    assert cg.total(chosen) == pytest.approx(brute_force(cg)[1])
    assert len(lower(g, smap, enable_alltoall=True).steps) == len(g.nodes)


def _gpt_request(device_num: int = 8) -> Any:
    gpt = nn.GPT(vocab_size=64, seq_length=16, d_model=32, n_layers=2, n_heads=4)
    net = nn.WithLossCell(gpt, nn.SoftmaxCrossEntropyWithLogits()).set_train()
    g = graph.trace(net, [((8, 16), np.int32), ((8 * 16,), np.int32)], ["data", "label"])
    return request_from_context(g, cell=net, device_num=device_num, mode="auto_parallel",
                                dataset_strategy="full_batch",
                                search_mode="dynamic_programming",
                                cost_model=SimparCostModel("ascend910b"))


def _priced_memory(request: Any, cg: Any, choice: tuple[int, ...]) -> int:
    """What the final pricing counts of the choice, less its transient buffers (the most
    over the ranks)."""
    smap = complete_plan(request, strategy_map_of(request, cg, choice))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = evaluate(lower(request.graph, smap), "ascend910b", "momentum")
    return max(m.parameters + m.gradients + m.optimizer + m.activations
               for m in report.memory)


def _arrays_request() -> Any:
    """:func:`_gpt_request` with every gradient summed by itself (comm_fusion openstate
    False): the search then counts the arrays alone, no gradient bucket."""
    return dataclasses.replace(_gpt_request(), comm_fusion=AllReduceFusion(openstate=False))


def test_a_moved_input_that_several_ops_keep_is_counted_once_per_copy() -> None:
    """q, k and v read one LayerNorm output and each keeps it for its backward. When each
    moves it into another layout (here: the whole output, sliced by rows), each keeps its
    own copy: the search counts the first as q's and the other two on their edges, and its
    memory of the plan is the final pricing's; without the edges' memory it is two copies
    short per block."""
    request = _arrays_request()
    cg = cost_graph_of(request)
    choice = [next(c for c, sh in enumerate(node.candidates)   # the tiny model whole
                   if all(cut == 1 for dims in sh.strategy for cut in dims))
              for node in cg.nodes]
    projections = [n for n, node in enumerate(cg.nodes) if node.node.op.name == "MatMul"
                   and re.search(r"attn-.*/(q|k|v)-Dense", node.name)]
    assert len(projections) == 6
    for n in projections:   # rows cut 8 ways: each slices the whole input
        choice[n] = next(c for c, sh in enumerate(cg.nodes[n].candidates)
                         if sh.strategy == ((8, 1), (1, 1)))
    copies = [e for e in cg.edges if e.memories is not None
              and e.memories[choice[e.producer]][choice[e.consumer]] > 0]
    assert len(copies) == 4                       # k and v in both blocks
    edges = sum(float(e.memories[choice[e.producer]][choice[e.consumer]]) for e in copies)
    assert edges == 4 * 16 * 32 * 4               # a (16, 32) float32 slice each
    assert cg.memory(choice) == _priced_memory(request, cg, tuple(choice))


def test_searched_memory_is_the_priced_memory_of_the_plans_the_weights_give() -> None:
    """From the cheapest plan to the least memory, the search's memory of each plan that
    dynamic programming gives is what the final pricing counts (its transients aside)."""
    request = _arrays_request()
    cg = cost_graph_of(request)
    for weight in (0.0, 1e-9, 1e-7, 1e-6):
        choice, _, _ = dpm._solve(cg, 1, math.inf, weight=weight)
        assert choice is not None
        assert cg.memory(choice) == _priced_memory(request, cg, choice)


def test_an_edge_s_memory_matrix_is_its_memory_pair_by_pair() -> None:
    """``Pricer.edge_memory_matrix`` (what the cost graph holds) and ``edge_memory`` (what
    recursive programming and sharding propagation add) agree on every pair of every edge
    that carries a copy, and those edges are the ones into q, k and v's views and products."""
    request = _gpt_request()
    pricer = pricer_of(request)
    cg = cost_graph_of(request)
    carrying = 0
    for e, (se, edge) in enumerate(zip(pricer.edges, cg.edges)):
        producers = cg.nodes[se.producer].candidates
        consumers = cg.nodes[se.consumer].candidates
        matrix = pricer.edge_memory_matrix(e, producers, consumers)
        assert (matrix is None) == (edge.memories is None)
        if matrix is None:
            continue
        carrying += 1
        assert re.search(r"attn-.*/(k|v)-Dense|BatchMatMul", cg.nodes[se.consumer].name)
        want = [[pricer.edge_memory(e, p, c) for c in consumers] for p in producers]
        assert matrix.tolist() == want and np.asarray(edge.memories).tolist() == want
        assert matrix.any() and not matrix.all()   # a copy only where the pair moves
    assert carrying >= 6


def test_the_searched_memory_holds_every_gradient_bucket_the_mirrors_pack() -> None:
    """Under the default comm_fusion one bucket may pack all of a group's gradients: the
    search counts each replicated gradient again, so its memory of a data-parallel plan is
    the final pricing's arrays plus every bucket the rank's Mirrors pack, which bounds the
    communication buffer the final pricing adds; the plan the cap gives fits when priced.
    Under a size threshold ("auto": 64 MB) the threshold is held back from the cap instead, or
    every gradient whole when they are fewer bytes."""
    request = dataclasses.replace(_gpt_request(), input_layouts=dataset_layouts(
        [(8, 16), (8 * 16,)], 8, ((8, 1), (8,))))
    cg = cost_graph_of(request)
    choice = solve_dynamic_programming(cg).choice
    smap = complete_plan(request, strategy_map_of(request, cg, choice))
    program = lower(request.graph, smap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = evaluate(program, "ascend910b", "momentum")
    buckets = [s.buffer_bytes for s in program.schedule(0) if s.role == "mirror"]
    assert len(buckets) == 2 and min(buckets) > 0   # over all 8 ranks, and the head's pair
    row = report.memory[0]
    arrays = row.parameters + row.gradients + row.optimizer + row.activations
    assert cg.memory(choice) == arrays + sum(buckets)
    assert row.comm_buffer == max(buckets)
    # A cap between the arrays and the arrays with the buckets: the plan found fits priced.
    capped = dataclasses.replace(request, memory_capacity=float(arrays + sum(buckets) // 2))
    cg = cost_graph_of(capped)
    choice = solve_dynamic_programming(cg).choice
    program = lower(capped.graph, complete_plan(capped, strategy_map_of(capped, cg, choice)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert evaluate(program, "ascend910b", "momentum").peak_memory <= \
            capped.memory_capacity
    # The threshold, or every gradient whole when they are fewer bytes (this tiny GPT's).
    wide = nn.WithLossCell(nn.GPT(vocab_size=64, seq_length=16, d_model=512, n_layers=1,
                                  n_heads=4), nn.SoftmaxCrossEntropyWithLogits()).set_train()
    for req in (request, dataclasses.replace(request, graph=graph.trace(
            wide, [((8, 16), np.int32), ((8 * 16,), np.int32)], ["data", "label"]))):
        gradients = sum(math.prod(v.shape) * v.dtype.itemsize for v in req.graph.params)
        sized = pricer_of(dataclasses.replace(req, comm_fusion=AllReduceFusion("size", 1)))
        assert sized.reserve == min(2**20, gradients) > 0
        assert sized.memory_capacity == req.cost_model.memory_capacity - sized.reserve
        assert pricer_of(req).reserve == 0
    assert sized.reserve == 2**20 < gradients


def test_a_replicated_gradient_pays_its_share_of_its_bucket_s_calls() -> None:
    """The search prices a replicated gradient's Mirror by its bytes and, where the calls
    depend on the cuts, its share of their fixed costs: nothing more under the default (one
    call per group, whatever the cuts), bytes / threshold of a call under a size threshold,
    a whole call without fusion. Ops with no replicated gradient cost alike under all three."""
    request = dataclasses.replace(_gpt_request(), input_layouts=dataset_layouts(
        [(8, 16), (8 * 16,)], 8, ((8, 1), (8,))))
    model = request.cost_model
    pricers = {name: pricer_of(dataclasses.replace(request, comm_fusion=fusion))
               for name, fusion in (("one", AllReduceFusion()),
                                    ("size", AllReduceFusion("size", 1)),
                                    ("off", AllReduceFusion(openstate=False)))}
    shared = 0
    for site in pricers["one"].sites:
        strategy = pricers["one"].candidates(site.index, False)[0]
        prices = {name: p.price(site.index, strategy) for name, p in pricers.items()}
        if prices["one"] is None:
            continue
        sh = prices["one"].sharding
        specs = [(sh.in_layouts[k].local_size() * 4, sh.input_grad_spec(k))
                 for k in site.positions("new")]
        specs = [(nbytes, spec) for nbytes, spec in specs if spec is not None]
        calls = [model.mirror_call_seconds(spec) for _, spec in specs]
        assert all(c > 0 for c in calls)
        size = sum(min(1.0, nbytes / 2**20) * c for (nbytes, _), c in zip(specs, calls))
        assert prices["size"].cost == pytest.approx(prices["one"].cost + size, rel=1e-12)
        assert prices["off"].cost == pytest.approx(prices["one"].cost + sum(calls), rel=1e-12)
        shared += bool(specs)
    assert shared >= 10
