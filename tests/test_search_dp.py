"""search_mode="dynamic_programming": the elimination search against brute force and the ILP
(pure: one process, shapes only)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from simpar import context, graph, nn, ops
from simpar.cost import MindSporeCostModel, SimparCostModel
from simpar.graph import Node
from simpar.layout import TensorLayout
from simpar.parallel import search_strategies
from simpar.search.cost_graph import (
    CostEdge,
    CostGraph,
    CostNode,
    brute_force,
    build_cost_graph,
    canonical,
    distinct_blocks,
    same_blocks,
)
from simpar.search.dynamic_programming import NoAvailableCost, solve_dynamic_programming
from simpar.search.exact import solve_exact


@pytest.fixture(autouse=True)
def _algo_defaults() -> Any:
    yield
    context.reset_algo_parameters()


def _random_graph(rng: np.random.Generator, n: int, density: float,
                  edge_memories: float = 0.0) -> CostGraph:
    """Synthetic nodes (1-4 candidates, random costs and memories, a few forbidden pairs)
    joined by random edges, dense enough at high ``density`` to need star eliminations; a
    share ``edge_memories`` of the edges add memory too (whole bytes, 0 for some pairs, as
    a copy only some pairs make)."""
    nodes = []
    for k in range(n):
        size = int(rng.integers(1, 5))
        nodes.append(CostNode(Node(k, ops.Identity(), ()), tuple(range(size)),  # type: ignore
                              tuple(rng.uniform(0, 10, size).round(3)), False,
                              tuple(rng.integers(1, 20, size).astype(float))))
    edges = []
    for p, c in itertools.combinations(range(n), 2):
        if rng.random() < density:
            m = rng.uniform(0, 10, (len(nodes[p].costs), len(nodes[c].costs))).round(3)
            m[rng.random(m.shape) < 0.15] = math.inf
            mem = None
            if edge_memories and rng.random() < edge_memories:
                mem = tuple(map(tuple, (rng.integers(0, 3, m.shape)
                                        * rng.integers(1, 12, m.shape[1])).astype(float)))
            edges.append(CostEdge(p, 0, c, 0, tuple(map(tuple, m.tolist())), mem))
            if rng.random() < 0.2:  # a second edge between the same pair
                edges.append(CostEdge(p, 1, c, 1, tuple(map(tuple, np.ones_like(m).tolist()))))
    return CostGraph(tuple(nodes), tuple(edges))


def _cheapest(cg: CostGraph) -> float:
    """The brute-force optimum, inf when no combination is allowed."""
    try:
        return brute_force(cg)[1]
    except ValueError:
        return math.inf


@dataclass(frozen=True)
class _Reads:
    """A synthetic candidate: only the layouts it reads its inputs in, which is all that the
    shared-parameter constraints look at."""

    in_layouts: tuple[TensorLayout, ...]


#: Layouts of an (8, 8) parameter on 4 devices: replicated, rows cut 4, 2 x 2 blocks, and rows
#: cut 4 written on a (2, 2) device matrix (the same blocks as the second: one layout).
_PARAM_LAYOUTS = (TensorLayout.from_dim_axes((4,), ((), ()), (8, 8)),
                  TensorLayout.from_dim_axes((4,), ((0,), ()), (8, 8)),
                  TensorLayout.from_dim_axes((2, 2), ((0,), (1,)), (8, 8)),
                  TensorLayout.from_dim_axes((2, 2), ((0, 1), ()), (8, 8)))


def _share_parameters(rng: np.random.Generator, cg: CostGraph) -> CostGraph:
    """``cg`` with two parameters, each read by 2-3 random nodes (input 0 reads w0, input 1
    w1, and sometimes a reader of w1 reads it twice, at inputs 1 and 2), every candidate
    reading them in a random layout of :data:`_PARAM_LAYOUTS`."""
    nodes = [dataclasses.replace(node, candidates=tuple(
        _Reads(tuple(_PARAM_LAYOUTS[int(k)] for k in rng.integers(0, 4, 3)))  # type: ignore[misc]
        for _ in node.candidates)) for node in cg.nodes]
    shared = {}
    for p in (0, 1):
        readers = sorted(rng.choice(len(nodes), int(rng.integers(2, min(3, len(nodes)) + 1)),
                                    replace=False).tolist())
        uses = [(n, p) for n in readers]
        if p == 1 and rng.random() < 0.3:
            uses.insert(1, (readers[0], 2))
        shared[f"w{p}"] = tuple(uses)
    return dataclasses.replace(cg, nodes=tuple(nodes), shared=shared)


def _allowed(cg: CostGraph) -> list[tuple[int, ...]]:
    """Every combination that satisfies the constraints (memory aside)."""
    return [c for c in itertools.product(*(range(len(n.costs)) for n in cg.nodes))
            if not math.isinf(cg.total(c))]


def _one_layout_each(cg: CostGraph, choice: tuple[int, ...]) -> bool:
    return all(len(distinct_blocks({cg.nodes[n].candidates[choice[n]].in_layouts[k]
                                    for n, k in uses})) == 1 for uses in cg.shared.values())


@pytest.mark.parametrize("density, edge_memories", [(0.3, 0.0), (0.6, 0.0), (1.0, 0.0),
                                                    (0.6, 0.7)])
def test_dp_and_exact_equal_brute_force_with_shared_parameters_and_memory_caps(
        density: float, edge_memories: float) -> None:
    """Tiny random graphs (2-6 ops, 1-4 candidates each) with two shared parameters: brute
    force, dynamic_programming and exact find the same optimum, each parameter in one layout;
    under a memory cap that binds (the uncapped optimum does not fit) all three find the
    same, dearer, optimum within the cap; below the least memory, or with no combination
    allowed, both searches refuse. With memories on edges too (a consumer's copy), the
    same."""
    rng = np.random.default_rng(100 + int(density * 10) + int(edge_memories * 100))
    assert same_blocks(_PARAM_LAYOUTS[1], _PARAM_LAYOUTS[3])
    solved = capped_count = refused = 0
    for _ in range(150):
        cg = _share_parameters(rng, _random_graph(rng, int(rng.integers(2, 7)), density,
                                                  edge_memories))
        allowed = _allowed(cg)
        if not allowed:
            refused += 1
            with pytest.raises(ValueError, match="no plan satisfies every constraint"):
                solve_dynamic_programming(cg)
            with pytest.raises(ValueError, match="no strategy satisfies every constraint"):
                solve_exact(cg)
            continue
        solved += 1
        best = brute_force(cg)[1]
        dp, ex = solve_dynamic_programming(cg), solve_exact(cg)
        assert dp.cost == pytest.approx(best) and ex.cost == pytest.approx(best)
        assert ex.gap == 0 and _one_layout_each(cg, dp.choice) and _one_layout_each(cg, ex.choice)
        # Memories are whole numbers and caps end in .5: no plan sits exactly on the cap.
        least = min(cg.memory(c) for c in allowed)
        optimal = min(cg.memory(c) for c in allowed if cg.total(c) <= best + 1e-9)
        tight = dataclasses.replace(cg, memory_capacity=least - 0.5)
        with pytest.raises(NoAvailableCost, match=f"minimum memory cost is {least:.0f} "):
            solve_dynamic_programming(tight)
        with pytest.raises(ValueError, match="no strategy satisfies every constraint"):
            solve_exact(tight)
        below = sorted({cg.memory(c) for c in allowed if cg.memory(c) < optimal})
        if not below:  # the cheapest plan needs the least memory: no cap binds
            continue
        capped = dataclasses.replace(cg, memory_capacity=below[int(rng.integers(len(below)))]
                                     + 0.5)
        capped_count += 1
        best_capped = brute_force(capped)[1]
        assert best_capped > best + 1e-9
        dp, ex = solve_dynamic_programming(capped), solve_exact(capped)
        assert dp.passes == 2 and dp.exact and dp.memory <= capped.memory_capacity
        assert capped.fits(ex.choice) and ex.gap == 0
        assert dp.cost == pytest.approx(best_capped) and ex.cost == pytest.approx(best_capped)
        assert _one_layout_each(cg, dp.choice) and _one_layout_each(cg, ex.choice)
    assert solved >= 30 and capped_count >= 15 and refused >= 20, (solved, capped_count, refused)


def test_a_plan_that_fills_the_memory_cap_exactly_fits_every_search() -> None:
    """One op whose cheaper candidate needs exactly the cap (10 bytes): it fits
    (``CostGraph.fits`` is ``<=``), for brute force, dynamic_programming and exact alike."""
    node = CostNode(Node(0, ops.Identity(), ()), (0, 1), (1.0, 2.0), False,  # type: ignore
                    (10.0, 5.0))
    cg = CostGraph((node,), (), memory_capacity=10.0)
    assert brute_force(cg) == ((0,), 1.0)
    assert solve_dynamic_programming(cg).choice == (0,)
    assert solve_exact(cg).choice == (0,)


def test_a_plan_over_the_memory_cap_by_a_hair_is_refused_by_every_search() -> None:
    """Over the cap by 1e-10 of it, within HiGHS's feasibility tolerance: the exact search
    must still not take it (it solves again with a lowered bound), like brute force and DP."""
    node = CostNode(Node(0, ops.Identity(), ()), (0, 1), (1.0, 2.0), False,  # type: ignore
                    (10.0 * (1 + 1e-10), 5.0))
    cg = CostGraph((node,), (), memory_capacity=10.0)
    assert not cg.fits((0,))
    assert brute_force(cg) == ((1,), 2.0)
    assert solve_dynamic_programming(cg).choice == (1,)
    assert solve_exact(cg).choice == (1,)


@pytest.mark.parametrize("density", [0.3, 0.6, 1.0])
def test_dp_equals_brute_force_on_random_graphs(density: float) -> None:
    """Up to 6 ops with every elimination (op, edge, merge, contract, triangle and, on dense
    graphs, star): the same optimum as trying every combination, with and without a memory
    cap that binds."""
    rng = np.random.default_rng(int(density * 10))
    kinds: set[str] = set()
    for _ in range(60):
        cg = _random_graph(rng, int(rng.integers(2, 7)), density)
        best = _cheapest(cg)
        if math.isinf(best):
            with pytest.raises(ValueError, match="no plan satisfies every constraint"):
                solve_dynamic_programming(cg)
            continue
        dp = solve_dynamic_programming(cg)
        kinds.update(dp.eliminations)
        assert dp.cost == pytest.approx(best) and cg.total(dp.choice) == pytest.approx(best)
        # a cap between the least and the most memory any allowed plan needs
        allowed = [c for c in itertools.product(*(range(len(n.costs)) for n in cg.nodes))
                   if not math.isinf(cg.total(c))]
        mems = sorted({cg.memory(c) for c in allowed})
        capped = dataclasses.replace(cg, memory_capacity=mems[len(mems) // 3])
        dp = solve_dynamic_programming(capped)
        assert dp.memory <= capped.memory_capacity and dp.exact
        assert dp.cost == pytest.approx(_cheapest(capped))
        tight = dataclasses.replace(cg, memory_capacity=mems[0] - 0.5)
        with pytest.raises(NoAvailableCost, match=f"minimum memory cost is {mems[0]:.0f} "):
            solve_dynamic_programming(tight)
    if density == 1.0:
        assert "star" in kinds
    else:
        assert {"op", "merge", "contract"} <= kinds


def test_dp_exact_and_brute_force_agree_on_an_mlp_under_both_models() -> None:
    mlp = nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64)
    g = graph.trace(mlp, [((8, 16), np.float64)], ["x"])
    for model in (SimparCostModel("ascend910a"), MindSporeCostModel()):
        cg = build_cost_graph(g, 4, model, ((4, 1),), True)
        _, best = brute_force(cg)
        assert solve_dynamic_programming(cg).cost == pytest.approx(best)
        assert solve_exact(cg).cost == pytest.approx(best)


def test_the_memory_cap_binds_on_a_real_graph_and_exact_agrees() -> None:
    """An MLP on 4 devices whose cheapest plan does not fit: the second pass finds the
    cheapest plan that does, as brute force and the ILP do."""
    mlp = nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64)
    g = graph.trace(mlp, [((8, 16), np.float64)], ["x"])
    free = build_cost_graph(g, 4, SimparCostModel("ascend910a"), ((4, 1),))
    first = solve_dynamic_programming(free)
    assert first.passes == 1
    cg = dataclasses.replace(free, memory_capacity=first.memory - 1)
    dp = solve_dynamic_programming(cg)
    _, best = brute_force(cg)
    assert dp.passes == 2 and dp.memory <= cg.memory_capacity
    assert dp.cost == pytest.approx(best) == pytest.approx(solve_exact(cg).cost)
    assert dp.cost > first.cost


def _capped_graphs(rng: np.random.Generator, count: int) -> Iterator[CostGraph]:
    """Random graphs whose memory cap is the median memory of their allowed plans."""
    for _ in range(count):
        cg = _random_graph(rng, int(rng.integers(3, 7)), 0.5)
        allowed = [c for c in itertools.product(*(range(len(n.costs)) for n in cg.nodes))
                   if not math.isinf(cg.total(c))]
        if allowed:
            mems = sorted({cg.memory(c) for c in allowed})
            yield dataclasses.replace(cg, memory_capacity=mems[len(mems) // 2])


def test_the_lagrangian_pass_fits_when_lists_would_be_too_long(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With no budget for Pareto lists the second pass prices memory instead: its plan fits
    the cap, costs at least the optimum, and says it is not proven exact."""
    import simpar.search.dynamic_programming as dpm
    monkeypatch.setattr(dpm, "_BUDGET", 0)
    rng = np.random.default_rng(7)
    checked = 0
    for capped in _capped_graphs(rng, 40):
        dp = solve_dynamic_programming(capped)
        assert dp.memory <= capped.memory_capacity
        assert dp.cost >= _cheapest(capped) - 1e-9
        if dp.passes == 2:
            checked += 1
            assert not dp.exact
    assert checked > 10


def test_the_pareto_pass_is_skipped_when_one_entry_lists_outgrow_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When the first pass alone combines more entries than the budget, the Pareto pass
    would stop at the budget: it is not run, and the plan is the one it would give."""
    import simpar.search.dynamic_programming as dpm
    rng = np.random.default_rng(8)
    widths: list[int] = []
    real_solve, real_counting = dpm._solve, dpm._solve_counting

    def solve(cg: CostGraph, width: int, *args: Any, **kwargs: Any) -> Any:
        widths.append(width)
        return real_solve(cg, width, *args, **kwargs)

    def unaware(*args: Any, **kwargs: Any) -> Any:   # as if the first pass counted nothing
        return (*real_counting(*args, **kwargs)[:3], 0)

    monkeypatch.setattr(dpm, "_solve", solve)
    skipped = 0
    for capped in _capped_graphs(rng, 40):
        monkeypatch.setattr(dpm, "_BUDGET", real_counting(capped, 1, math.inf)[3] - 1)
        monkeypatch.setattr(dpm, "_solve_counting", real_counting)
        widths.clear()
        fast = solve_dynamic_programming(capped)
        if fast.passes == 2 and not fast.eliminations.get("star"):
            assert 128 not in widths
            skipped += 1
        monkeypatch.setattr(dpm, "_solve_counting", unaware)
        widths.clear()
        slow = solve_dynamic_programming(capped)
        assert slow.choice == fast.choice and slow.exact == fast.exact
        assert (128 in widths) == (fast.passes == 2)
    assert skipped > 10


def test_a_shared_parameter_gets_one_layout() -> None:
    """w feeds three MatMuls (a star of its virtual node): DP keeps it in one layout and
    matches brute force."""
    w = nn.Parameter(np.ones((16, 16)), name="w")
    mm = [ops.MatMul() for _ in range(3)]
    g = graph.trace(lambda x: mm[2](ops.ReLU()(mm[1](mm[0](x, w), w)), w),
                    [((8, 16), np.float64)], ["x"])
    cg = build_cost_graph(g, 4, SimparCostModel("ascend910a"))
    assert len(cg.shared["w"]) == 3
    dp = solve_dynamic_programming(cg)
    assert dp.cost == pytest.approx(brute_force(cg)[1])
    layouts = [cg.nodes[n].candidates[dp.choice[n]].in_layouts[k] for n, k in cg.shared["w"]]
    assert all(same_blocks(layouts[0], lay) for lay in layouts[1:])


def test_a_user_strategy_that_splits_a_shared_parameter_two_ways_is_refused() -> None:
    w = nn.Parameter(np.ones((16, 16)), name="w")
    first, second = ops.MatMul().shard(((1, 4), (4, 1))), ops.MatMul().shard(((4, 1), (1, 1)))
    g = graph.trace(lambda x: second(first(x, w), w), [((8, 16), np.float64)], ["x"])
    cg = build_cost_graph(g, 4, SimparCostModel("ascend910a"))
    with pytest.raises(ValueError, match="no plan satisfies every constraint"):
        solve_dynamic_programming(cg)


@pytest.mark.parametrize("device_num", [8, 16])
def test_dp_equals_exact_on_a_two_layer_gpt(device_num: int) -> None:
    """The medium graph of the issue: a 2-layer GPT (88 ops) under simpar's model; every
    elimination but star applies, and DP's objective is the ILP's proven optimum."""
    net = nn.GPT(vocab_size=64, seq_length=16, d_model=32, n_heads=4, n_layers=2,
                 dtype=np.float32)
    g = graph.trace(net, [((16, 16), np.int32)], ["ids"])
    cg = build_cost_graph(g, device_num, SimparCostModel("cpu-local"), "data_parallel")
    dp = solve_dynamic_programming(cg)
    ex = solve_exact(cg)
    assert ex.gap == 0 and dp.exact
    assert dp.cost == pytest.approx(ex.cost, rel=1e-9)
    assert {"op", "triangle", "edge", "merge"} <= set(dp.eliminations)


def test_identical_layers_are_priced_once() -> None:
    """Nodes of identical layers share their candidate tuples (one pricing per distinct
    op), and the edges between them their matrices."""
    net = nn.GPT(vocab_size=64, seq_length=16, d_model=32, n_heads=4, n_layers=3,
                 dtype=np.float32)
    g = graph.trace(net, [((8, 16), np.int32)], ["ids"])
    cg = build_cost_graph(g, 4, SimparCostModel("cpu-local"), "data_parallel")
    blocks = [[n for n in cg.nodes if f"/block{b}-" in n.name] for b in range(3)]
    assert len(blocks[0]) == len(blocks[1]) == len(blocks[2]) > 20
    for a, b in zip(blocks[1], blocks[2]):
        assert a.candidates is b.candidates and a.costs is b.costs
    matrices = {id(e.costs) for e in cg.edges}
    assert len(matrices) < len(cg.edges) / 2


def test_canonical_layout_keys_match_same_blocks() -> None:
    """Two layouts with one canonical key give every rank the same block (checked over all
    candidate layouts of a GPT block's ops on 8 devices)."""
    net = nn.GPT(vocab_size=64, seq_length=16, d_model=32, n_heads=4, n_layers=1,
                 dtype=np.float32)
    g = graph.trace(net, [((8, 16), np.int32)], ["ids"])
    layouts = set()
    for node in g.nodes:
        shapes = [v.shape for v in node.inputs]
        for strat in node.op.candidate_strategies(shapes, 8):
            sh = node.op.sharding(shapes, 8, strat)
            layouts.update(sh.in_layouts)
            layouts.update(out for _, out, _ in sh.outputs)
    by_key: dict[Any, list[Any]] = {}
    for lay in layouts:
        by_key.setdefault(canonical(lay), []).append(lay)
    assert len(by_key) < len(layouts)
    for group in by_key.values():
        for a in group[1:]:
            assert same_blocks(a, group[0])
            assert a.partial_group(0) == group[0].partial_group(0)


@pytest.mark.parametrize("mesh", [(2, 2, 2), (2, 1, 2), (4, 2), (2, 2, 1, 2)])
def test_canonical_keys_on_every_layout_of_small_meshes(mesh: tuple[int, ...]) -> None:
    """Every way to split an (8, 8) tensor over the mesh's axes (each axis splitting one
    dimension, in either order, or pending sums, or repeating): one key exactly when every
    rank holds the same block with the same pending-sum group."""
    n = len(mesh)
    layouts = []
    for roles in itertools.product(range(4), repeat=n):  # 0, 1: a dimension; 2: sum; 3: repeat
        dims = [[a for a in range(n) if roles[a] == d] for d in (0, 1)]
        for orders in itertools.product(*(itertools.permutations(d) for d in dims)):
            layouts.append(TensorLayout.from_dim_axes(
                mesh, orders, (8, 8), partial_axes=[a for a in range(n) if roles[a] == 2]))
    size = math.prod(mesh)
    for a, b in itertools.combinations(layouts, 2):
        same = same_blocks(a, b) and all(
            a.partial_group(r) == b.partial_group(r) for r in range(size))
        assert (canonical(a) == canonical(b)) == same, (a, b)


def test_algo_approximation_keeps_the_cheapest_candidates() -> None:
    g = graph.trace(nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64),
                    [((8, 16), np.float64)], ["x"])
    full = build_cost_graph(g, 8, SimparCostModel("ascend910a"), "data_parallel")
    context.set_algo_parameters(enable_algo_approxi=True, algo_approxi_epsilon=0.25)
    approx = build_cost_graph(g, 8, SimparCostModel("ascend910a"), "data_parallel")
    for a, f in zip(approx.nodes, full.nodes):
        assert len(a.candidates) == min(4, len(f.candidates))
        assert sorted(a.costs) == sorted(f.costs)[:len(a.costs)]
    assert solve_dynamic_programming(approx).cost >= solve_dynamic_programming(full).cost


def test_elementwise_ops_follow_their_producer() -> None:
    """With elementwise_op_strategy_follow, the edge out of ReLU is an identity edge: the
    next MatMul reads ReLU's output as it is laid out (MindSpore's rule)."""
    g = graph.trace(nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64),
                    [((8, 16), np.float64)], ["x"])
    context.set_algo_parameters(elementwise_op_strategy_follow=True)
    cg = build_cost_graph(g, 4, SimparCostModel("ascend910a"), "data_parallel")
    dp = solve_dynamic_programming(cg)
    identity = [e for e in cg.edges if cg.nodes[e.producer].node.op.name == "ReLU"]
    assert identity
    for e in identity:
        assert e.costs[dp.choice[e.producer]][dp.choice[e.consumer]] == 0.0
        assert any(math.isinf(x) for row in e.costs for x in row)
    assert all(not math.isinf(x) for e in cg.edges if e not in identity
               for row in e.costs for x in row)


def test_search_strategies_with_dynamic_programming_and_bad_inputs() -> None:
    mlp = nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64)
    smap = search_strategies(mlp, [((8, 16), np.float64)], 4,
                             search_mode="dynamic_programming", dataset_strategy="data_parallel")
    exact = search_strategies(mlp, [((8, 16), np.float64)], 4, search_mode="exact",
                              dataset_strategy="data_parallel")
    assert set(smap.ops) == set(exact.ops)
    with pytest.raises(NotImplementedError, match="search_mode 'nonsense'"):
        search_strategies(mlp, [((8, 16), np.float64)], 4, search_mode="nonsense")
    # with fully_use_devices a MatMul must use all 3 devices, and no dimension splits in 3
    context.set_algo_parameters(fully_use_devices=True)
    with pytest.raises(ValueError, match=r"MatMul-op0: no strategy of MatMul fits shapes "
                       r"\[\(8, 16\), \(32, 16\)\] on 3 devices"):
        search_strategies(mlp, [((8, 16), np.float64)], 3, search_mode="dynamic_programming")


def _computed(cg: CostGraph) -> int:
    """How many eliminations a one-entry pass computes (the rest come from the memo)."""
    import simpar.search.dynamic_programming as dpm
    elim = dpm._Eliminator(cg, 1, math.inf, False)
    elim.run(0.0)
    return len(elim.memo)


def test_a_chain_of_identical_layers_is_joined_in_log_steps() -> None:
    """With one entry per table, eliminations the memo holds go first: a GPT's residual
    stream, a chain of identical blocks, halves into identical pairs, quadruples, ..., so
    doubling the depth adds a couple of computed eliminations, not one per block; and the
    plan stays the ILP's optimum."""
    graphs = {}
    for layers in (8, 16, 32):
        net = nn.GPT(vocab_size=64, seq_length=16, d_model=32, n_heads=4, n_layers=layers,
                     dtype=np.float32)
        g = graph.trace(net, [((8, 16), np.int32)], ["ids"])
        graphs[layers] = build_cost_graph(g, 4, SimparCostModel("cpu-local"), "data_parallel")
    computed = {n: _computed(cg) for n, cg in graphs.items()}
    assert computed[32] - computed[16] <= 4 and computed[16] - computed[8] <= 4
    assert solve_dynamic_programming(graphs[8]).cost == pytest.approx(
        solve_exact(graphs[8]).cost, rel=1e-9)


def test_a_pass_under_another_weight_reuses_the_first_pass_s_eliminations(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One-entry passes over one graph that share their passes build its elimination graph
    once and recompute only its distinct eliminations under each weight (and for the least
    memory): every plan is the one a fresh pass finds. Graphs that need a star elimination
    build it afresh each time (its merged node keeps only the rows finite under one weight)."""
    import simpar.search.dynamic_programming as dpm
    net = nn.GPT(vocab_size=64, seq_length=16, d_model=32, n_heads=4, n_layers=8,
                 dtype=np.float32)
    g = graph.trace(net, [((8, 16), np.int32)], ["ids"])
    graphs = [build_cost_graph(g, 4, SimparCostModel("cpu-local"), "data_parallel")]
    rng = np.random.default_rng(41)
    graphs += [_random_graph(rng, int(rng.integers(3, 9)), density, 0.5)
               for density in (0.3, 0.9) for _ in range(12)]
    built = []
    real = dpm._Eliminator.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(dpm._Eliminator, "__init__", counting)
    reused = stars = 0
    for cg in graphs:
        scale = max(1.0, *(n.costs[0] for n in cg.nodes)) / max(
            1.0, *(n.memories[0] for n in cg.nodes))
        passes = dpm._Passes()
        built.clear()
        asked = [(False, 0.0), (False, scale), (True, 0.0), (False, 7 * scale),
                 (False, 0.01 * scale)]
        for memory_as_cost, weight in asked:
            got, _, counts = dpm._solve(cg, 1, math.inf, memory_as_cost, weight, passes)
            want, _, _ = dpm._solve(cg, 1, math.inf, memory_as_cost, weight)
            assert got == want, (memory_as_cost, weight)
        if counts["star"]:
            stars += 1
            assert passes.elim is None and len(built) == 2 * len(asked)
        else:
            reused += 1
            assert passes.elim is not None and len(built) == 1 + len(asked)
    assert reused > 8 and stars > 3


def _cheapest_fitting_corner(cg: CostGraph) -> float:
    """Every plan's (memory, cost) by brute force; the corners of their lower convex hull
    (the plans some weight of ``cost + weight * memory`` makes least); the cheapest corner
    within the cap."""
    points = set()
    for choice in itertools.product(*(range(len(n.candidates)) for n in cg.nodes)):
        cost = cg.total(choice)
        if math.isfinite(cost):
            points.add((cg.memory(choice), round(cost, 9)))
    hull: list[tuple[float, float]] = []
    for m, c in sorted(points):   # lower hull, by memory then cost (monotone chain)
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (c - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (m - hull[-2][0])) <= 0:
            hull.pop()
        hull.append((m, c))
    falling = [hull[0]]           # the part from least memory down to the cheapest
    for m, c in hull[1:]:
        if c < falling[-1][1]:
            falling.append((m, c))
    return min(c for m, c in falling if m <= cg.memory_capacity)


@pytest.mark.parametrize("edge_memories", [0.0, 0.5])
def test_the_lagrangian_pass_finds_the_cheapest_fitting_corner(edge_memories: float) -> None:
    """The hull walk ends at the cheapest plan that some weight makes least and that fits
    (what bisecting the weight reaches only in the limit); from a caller's fitting plan it
    returns one at least as cheap. Memories on edges weigh as the nodes'."""
    rng = np.random.default_rng(12 + int(edge_memories * 10))
    checked = 0
    for _ in range(60):
        cg = _random_graph(rng, 6, 0.5, edge_memories)
        mems = sorted(cg.memory(c) for c in itertools.product(
            *(range(len(n.candidates)) for n in cg.nodes)) if math.isfinite(cg.total(c)))
        if not mems:
            continue
        capped = dataclasses.replace(cg, memory_capacity=mems[len(mems) // 3])
        dp = solve_dynamic_programming(capped, pareto=False, secant=50)
        assert capped.fits(dp.choice)
        if dp.passes == 2:
            checked += 1
            assert dp.cost == pytest.approx(_cheapest_fitting_corner(capped), abs=1e-6)
            fitting = [c for c in itertools.product(*(range(len(n.candidates))
                                                      for n in capped.nodes))
                       if capped.fits(c) and math.isfinite(capped.total(c))]
            start = max(fitting, key=capped.total)
            again = solve_dynamic_programming(capped, pareto=False, start=start)
            assert capped.fits(again.choice) and again.cost <= capped.total(start) + 1e-9
    assert checked > 20


def test_later_passes_look_first_where_earlier_ones_found_the_least(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Lagrangian pass hands its products' choices to the next as hints, over the
    same elimination keys; the plans are those of passes without hints, and the plan of
    least memory is searched for only when no weighted plan fits."""
    import simpar.search.dynamic_programming as dpm
    real_min_plus, real_solve = dpm.min_plus, dpm._solve
    hinted: list[bool] = []
    least: list[bool] = []

    def recording(*args: Any, hint: Any = None) -> Any:
        hinted.append(hint is not None)
        return real_min_plus(*args, hint=hint)

    def blind(*args: Any, hint: Any = None) -> Any:
        return real_min_plus(*args)

    def solve(cg: CostGraph, width: int, cap: float, memory_as_cost: bool = False,
              *args: Any, **kwargs: Any) -> Any:
        least.append(memory_as_cost)
        return real_solve(cg, width, cap, memory_as_cost, *args, **kwargs)

    monkeypatch.setattr(dpm, "_solve", solve)
    rng = np.random.default_rng(31)
    weighted = products = skipped = 0
    for capped in _capped_graphs(rng, 40):
        monkeypatch.setattr(dpm, "min_plus", blind)
        want = solve_dynamic_programming(capped, pareto=False)
        monkeypatch.setattr(dpm, "min_plus", recording)
        hinted.clear()
        least.clear()
        got = solve_dynamic_programming(capped, pareto=False)
        assert got.choice == want.choice
        if got.passes == 2:   # the first pass (cheapest plan) had nothing to look at
            weighted += 1
            products += any(hinted)
            assert not hinted or not hinted[0]
            assert least.count(True) <= 1
            skipped += not any(least)
    assert weighted > 10 and products > 5 and skipped > 5


def test_nothing_fits_is_reported_when_no_weight_gives_a_plan_that_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(32)
    for capped in _capped_graphs(rng, 10):
        none_fit = dataclasses.replace(capped, memory_capacity=min(
            capped.memory(c) for c in _allowed(capped)) - 1.0)
        with pytest.raises(NoAvailableCost, match="The minimum memory cost is"):
            solve_dynamic_programming(none_fit, pareto=False)


def test_solve_dynamic_programming_refuses_bad_options_by_name() -> None:
    cg = _random_graph(np.random.default_rng(1), 4, 0.6)
    for kwargs, error, text in [
            ({"secant": 0}, ValueError, "secant must be an int >= 1, got 0"),
            ({"secant": True}, ValueError, "secant must be an int >= 1, got True"),
            ({"pareto": "no"}, TypeError, "pareto must be a bool, got 'no'"),
            ({"start": [0]}, ValueError, "start must give each of the 4 nodes"),
            ({"start": [0, 0, 0, 99]}, ValueError, r"got \[0, 0, 0, 99\]"),
            ({"start": [0, -1, 0, 0]}, ValueError, "0 <= c < its count")]:
        with pytest.raises(error, match=text):
            solve_dynamic_programming(cg, **kwargs)


def test_the_lagrangian_stops_at_a_fitting_end_of_infinite_cost() -> None:
    """The secant's weight through a fitting plan of infinite cost (a caller's, as recursive
    programming's restricted graphs give) is infinite: no line to follow, so the plan stands,
    with no 0 x inf weighed (it used to warn "invalid value encountered in multiply")."""
    from simpar.search.dynamic_programming import _lagrangian
    over = CostNode(Node(0, ops.Identity(), ()), (0, 1), (1.0, math.inf), False,  # type: ignore
                    (20.0, 5.0))
    free = CostNode(Node(1, ops.Identity(), ()), (0,), (1.0,), False, (0.0,))  # type: ignore
    cg = CostGraph((over, free), (), memory_capacity=10.0)
    with np.errstate(invalid="raise"):
        assert _lagrangian(cg, (0, 0), (1, 0), bracket=False) == (1, 0)
