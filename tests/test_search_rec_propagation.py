"""search_mode "recursive_programming" and "sharding_propagation": held against the optimum
(brute force, the ILP, dynamic programming) and against MindSpore's unit tests (pure: one
process, shapes only).

The MindSpore tests reproduced (``tests/ut/python/parallel/`` of ``mindspore-ai/mindspore``
and ``mindspore-ai/mindspore_test``, MindSpore 2.x; commit prefixes where the stored copy
showed them):

- sharding propagation: ``test_auto_parallel_out_strategy_propagation.py`` @ 23cb3c29
  (``test_out_strategy_propagate1`` to ``6``, ``test_sharding_strategy_save_and_load1``),
  ``test_reshape_shard_propagation.py`` @ 384efc05 (``test_reshape_auto_8`` and ``_9``), and the
  mint layout test ``test_mint_relu_layout_propagate_back``;
- recursive programming: ``test_auto_parallel_sapp_opt_restrict.py`` @ 87101ed8 and
  ``test_auto_parallel_sapp_gather.py`` @ 71061200 (``_1``, ``_2``, ``_3``). No MindSpore test
  asserts a searched strategy for a Gather that shares its table with a MatMul
  (``test_auto_parallel_share_param.py`` only compiles); ``_Tied`` below checks the one layout
  both searches give it.

Where MindSpore's answer comes from a cost that simpar prices otherwise (MindSpore's planner
cannot reduce-scatter a partial sum onto the first dimension, its rec fills Gather by a fixed
rule), the test checks that simpar's plan costs no more than MindSpore's under the search's
cost model, with MindSpore's strategy imposed through ``.shard()``, and says which it is.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from simpar import context, graph, nn, ops
from simpar.context import NotHonouredWarning
from simpar.cost import SimparCostModel
from simpar.nn import Cell
from simpar.parallel import search_strategies
from simpar.search.cost_graph import brute_force, build_cost_graph, same_blocks
from simpar.search.dynamic_programming import NoAvailableCost, solve_dynamic_programming
from simpar.search.pricing import Pricer
from simpar.search.recursive_programming import prime_factors, solve_recursive_programming
from simpar.search.request import dataset_layouts
from simpar.search.sharding_propagation import propagate

F32, F64 = np.float32, np.float64
Strategy = tuple[tuple[int, ...], ...]


@pytest.fixture(autouse=True)
def _algo_defaults() -> Iterator[None]:
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotHonouredWarning)
        context.reset_algo_parameters()


def _fully(value: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotHonouredWarning)
        context.set_algo_parameters(fully_use_devices=value)


def _pricer(net: Any, specs: list[tuple[tuple[int, ...], Any]], devices: int,
            dataset: Any = "data_parallel", profile: str = "ascend910a") -> Pricer:
    g = graph.trace(net, specs)
    return Pricer(g, devices, SimparCostModel(profile),
                  dataset_layouts([v.shape for v in g.inputs], devices, dataset))


def _short(smap: Any) -> dict[str, Strategy]:
    return {name.rsplit("/", 1)[-1]: s.in_strategy for name, s in smap.ops.items()}


def _propagated(net: Any, specs: list[tuple[tuple[int, ...], Any]], devices: int,
                dataset: Any = "data_parallel") -> tuple[dict[str, Strategy], float]:
    """sharding_propagation's strategies (op name without scope) and their objective."""
    pricer = _pricer(net, specs, devices, dataset)
    smap = propagate(pricer, "auto_parallel", dataset_layouts(
        [v.shape for v in pricer.graph.inputs], devices, dataset))
    shardings = [pricer.price(s.index, smap.ops[s.name].in_strategy) for s in pricer.sites]
    assert all(p is not None for p in shardings)
    return _short(smap), pricer.total([p.sharding for p in shardings if p is not None])


# ------------------------------------------------------------------ tiny graphs
def _mlp() -> nn.MLP:
    return nn.MLP(16, 32, 8, n_hidden=1, dtype=F64)


def _two_layer_gpt() -> nn.GPT:
    return nn.GPT(vocab_size=64, seq_length=16, d_model=32, n_heads=4, n_layers=2, dtype=F32)


@pytest.mark.parametrize("devices", [2, 4])
def test_neither_search_beats_brute_force_on_an_mlp(devices: int) -> None:
    """Every candidate of every op (fully_use_devices=False), brute force: the optimum bounds
    both searches from below, and both return valid strategies of the same cost graph."""
    _fully(False)
    g = graph.trace(_mlp(), [((8, 16), F64)], ["x"])
    model = SimparCostModel("ascend910a")
    inputs = dataset_layouts([(8, 16)], devices, "data_parallel")
    cg = build_cost_graph(g, devices, model, input_layouts=inputs)
    _, best = brute_force(cg)
    pricer = Pricer(g, devices, model, inputs)
    rec = solve_recursive_programming(pricer)
    assert rec.cost >= best - 1e-12
    smap = propagate(pricer, "auto_parallel", inputs)
    for node in cg.nodes:  # both plans are choices of the cost graph
        strategies = [c.strategy for c in node.candidates]
        assert smap.ops[node.name].in_strategy in strategies
        assert rec.shardings[cg.nodes.index(node)].strategy in strategies
    choice = tuple(next(i for i, c in enumerate(n.candidates)
                        if c.strategy == smap.ops[n.name].in_strategy) for n in cg.nodes)
    assert math.isfinite(cg.total(choice))  # a valid plan of the graph
    # From the dataset's batch split and no user strategy, propagation is data parallel.
    assert all(s.in_strategy[0][0] == devices and math.prod(s.in_strategy[0]) == devices
               for s in smap.ops.values())
    assert rec.cost == pytest.approx(best)  # an MLP is within one refinement of the optimum


@pytest.mark.parametrize("devices", [8, 16])
def test_recursive_programming_reaches_the_optimum_of_a_two_layer_gpt(devices: int) -> None:
    """On the 2-layer GPT whose optimum test_search_dp proves (dynamic programming equals the
    ILP there), recursive programming reaches it; the rounds alone (MindSpore's greedy
    bisection, ``refine=0``) already do on this graph."""
    _fully(True)
    pricer = _pricer(_two_layer_gpt(), [((16, 16), np.int32)], devices, profile="cpu-local")
    rec = solve_recursive_programming(pricer)
    cg = build_cost_graph(pricer.graph, devices, pricer.model,
                          input_layouts=dataset_layouts([(16, 16)], devices, "data_parallel"))
    best = solve_dynamic_programming(cg).cost
    assert best - 1e-12 <= rec.cost <= rec.rounds_cost
    assert rec.cost == pytest.approx(best, rel=1e-9)
    greedy = solve_recursive_programming(pricer, refine=0)
    assert greedy.cost == greedy.rounds_cost >= best - 1e-12


def test_identical_layers_decide_once() -> None:
    """Planning grows with the distinct layers, not the depth: 3 and 6 identical layers make
    the same number of fresh decisions; every other decision is a remembered one."""
    fresh = []
    for layers in (3, 6):
        net = nn.GPT(vocab_size=64, seq_length=16, d_model=32, n_heads=4, n_layers=layers,
                     dtype=F32)
        rec = solve_recursive_programming(
            _pricer(net, [((16, 16), np.int32)], 8, profile="cpu-local"), refine=0)
        fresh.append(rec.decisions - rec.remembered)
        assert rec.decisions == 3 * len(graph.trace(net, [((16, 16), np.int32)]).nodes)
    assert fresh[0] == fresh[1]


def test_prime_factors_are_the_rounds() -> None:
    assert prime_factors(1) == []
    assert prime_factors(8) == [2, 2, 2]
    assert prime_factors(12) == [3, 2, 2]
    assert prime_factors(1024) == [2] * 10


def test_recursive_programming_on_six_devices() -> None:
    """A non-power-of-two device count (MindSpore halves only): one round of 3, one of 2, and
    the refined plan is brute force's optimum over every candidate."""
    _fully(False)
    pricer = _pricer(nn.MLP(12, 24, 6, n_hidden=1, dtype=F64), [((12, 12), F64)], 6,
                     dataset="full_batch")
    rec = solve_recursive_programming(pricer)
    assert {c for sh in rec.shardings for cuts in sh.strategy for c in cuts} >= {2, 3}
    cg = build_cost_graph(pricer.graph, 6, pricer.model, input_layouts=dataset_layouts(
        [(12, 12)], 6, "full_batch"))
    assert rec.cost == pytest.approx(brute_force(cg)[1])


def test_recursive_programming_keeps_user_strategies_and_parameter_plans() -> None:
    mlp = _mlp()
    mlp.fc2.matmul.shard(((1, 4), (1, 4)))
    mlp.fc1.shard(None, parameter_plan={"weight": (2, 2)})
    smap = search_strategies(mlp, [((8, 16), F64)], 4, "recursive_programming",
                             "data_parallel")
    by_name = {n.rsplit("/", 2)[-2] + "/" + n.rsplit("/", 1)[-1]: s for n, s in smap.ops.items()}
    assert by_name["fc2-Dense/MatMul-op3"].in_strategy == ((1, 4), (1, 4))
    assert str(by_name["fc2-Dense/MatMul-op3"].source) == "annotated"
    assert by_name["fc1-Dense/MatMul-op0"].in_strategy[1] == (2, 2)
    assert str(by_name["fc1-Dense/MatMul-op0"].source) == "searched"


class _Tied(Cell):
    """A table read by a Gather (embedding) and by a MatMul (the tied output projection)."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.table = nn.Parameter(np.ones((vocab, d), F32), name="table")
        self.gather = ops.Gather(0)
        self.head = ops.MatMul(transpose_b=True)

    def construct(self, ids: Any) -> Any:
        return self.head(ops.ReLU()(self.gather(self.table, ids)), self.table)


def test_a_shared_parameter_gets_one_layout_under_both_searches() -> None:
    for mode in ("recursive_programming", "sharding_propagation"):
        smap = search_strategies(_Tied(), [((8,), np.int32)], 4, mode, "data_parallel")
        assert same_blocks(smap.params["table"], _reader_layout(smap, "Gather", 0)), mode
        assert same_blocks(smap.params["table"], _reader_layout(smap, "MatMul", 1)), mode


def _reader_layout(smap: Any, op: str, k: int) -> Any:
    """The layout in which the ``op`` node of a traced _Tied reads its input ``k``."""
    g = graph.trace(_Tied(), [((8,), np.int32)])
    node = next(n for n in g.nodes if n.op.name == op)
    return node.op.sharding([v.shape for v in node.inputs], smap.device_num,
                            smap.ops[node.name].in_strategy).in_layouts[k]


def test_user_strategies_that_cut_a_shared_parameter_two_ways_are_refused() -> None:
    net = _Tied()
    net.gather.shard(((4, 1), (1,)))
    net.head.shard(((1, 4), (1, 4)))
    with pytest.raises(ValueError, match=r"sharding_propagation: .*Gather-op0 \(\.shard\("
                       r"\[\[4, 1\], \[1\]\]\)\) reads parameter table cut \(4, 1\), and "
                       r".*MatMul-op2 .* reads it cut \(1, 4\); a shared parameter has one "
                       r"layout"):
        search_strategies(net, [((8,), np.int32)], 4, "sharding_propagation")
    with pytest.raises(ValueError, match=r"recursive_programming: .*Gather-op0 \(\.shard\("
                       r"\[\[4, 1\], \[1\]\]\)\) reads parameter table cut \(4, 1\), and "
                       r".*MatMul-op2 .* reads it cut \(1, 4\); a shared parameter has one "
                       r"layout"):
        search_strategies(net, [((8,), np.int32)], 4, "recursive_programming")


def test_recursive_programming_checks_memory() -> None:
    import dataclasses

    from simpar.cost import load_profile
    from simpar.search import set_search_cost_model

    set_search_cost_model(SimparCostModel(dataclasses.replace(load_profile("cpu-local"),
                                                              memory_capacity=1024)))
    try:
        with pytest.raises(NoAvailableCost, match=r"recursive_programming's plan needs \d+ "
                           r"bytes per rank, over the memory capacity of 1024 .*the op that "
                           r"needs most of it is .*MatMul"):
            search_strategies(_mlp(), [((8, 16), F64)], 4, "recursive_programming")
    finally:
        set_search_cost_model(None)


def test_recursive_programming_descends_toward_a_cap_its_neighbourhood_cannot_reach(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a cap far below the rounds' plan, no plan one step from it fits: the refinement
    steps to its neighbourhood's plan of least memory, again until one fits, and then
    refines; without those steps recursive programming finds no plan."""
    from simpar.search import recursive_programming as rp
    from simpar.search.dynamic_programming import least_memory_plan

    net = nn.WithLossCell(nn.GPT(vocab_size=256, seq_length=32, d_model=64, n_heads=4,
                                 n_layers=2, dtype=F32),
                          nn.SoftmaxCrossEntropyWithLogits()).set_train()
    specs = [((16, 32), np.int32), ((16 * 32,), np.int32)]
    free = _pricer(net, specs, 8)
    rounds = solve_recursive_programming(free).memory
    cg = build_cost_graph(free.graph, 8, free.model, input_layouts=dataset_layouts(
        [v.shape for v in free.graph.inputs], 8, "data_parallel"))
    least = least_memory_plan(cg)
    assert least is not None
    cap = cg.memory(least) + 0.1 * (rounds - cg.memory(least))

    def capped() -> Pricer:
        g = graph.trace(net, specs)
        return Pricer(g, 8, SimparCostModel("ascend910a"), dataset_layouts(
            [v.shape for v in g.inputs], 8, "data_parallel"), memory_capacity=cap)

    found = solve_recursive_programming(capped())
    assert found.memory <= cap < rounds
    monkeypatch.setattr(rp, "MAX_DESCENTS", 0)
    with pytest.raises(NoAvailableCost, match="recursive_programming's plan needs"):
        solve_recursive_programming(capped())


# ------------------------------------------------------------------ sharding propagation
class _Chain(Cell):
    """``x -> [ReLU] -> MatMul(transpose_b) -> [Reshape] -> Add(b) -> ReLU`` as in
    MindSpore's out_strategy propagation tests (w [8, 32], b a parameter)."""

    def __init__(self, pre_relu: bool = False, reshape: tuple[int, ...] | None = None,
                 out_strategy: Strategy | None = None, add: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(np.ones((8, 32), F32), name="w")
        self.matmul = ops.MatMul(transpose_b=True).shard(((4, 2), (1, 2)), out_strategy)
        self.pre = ops.ReLU() if pre_relu else None
        self.reshape = ops.Reshape(reshape) if reshape else None
        shape = reshape or (64, 8)
        self.b = nn.Parameter(np.ones(shape, F32), name="b") if add else None
        self.add, self.relu = ops.Add(), ops.ReLU()

    def construct(self, x: Any) -> Any:
        if self.pre is not None:
            x = self.pre(x)
        y = self.matmul(x, self.w)
        if self.reshape is not None:
            y = self.reshape(y)
        if self.b is not None:
            y = self.add(y, self.b)
        return self.relu(y)


def test_out_strategy_propagates_forward() -> None:
    """test_out_strategy_propagate2: out_strategy ((8, 1),) reaches the Add."""
    got, _ = _propagated(_Chain(pre_relu=True, out_strategy=((8, 1),)), [((64, 32), F32)], 8)
    assert got["Add-op2"] == ((8, 1), (8, 1))


def test_a_partial_output_is_reduce_scattered_where_mindspore_reduce_scatters() -> None:
    """test_out_strategy_propagate1: MindSpore gives the Add [[4, 2], [4, 2]] (a ReduceScatter
    of the MatMul's partial sums onto dimension 1). simpar's planner reduce-scatters onto
    dimension 0 as cheaply, and the tie goes to the larger batch cut: [[8, 1], [8, 1]], one
    ReduceScatter of the same bytes. MindSpore's choice, imposed, costs the same."""
    got, cost = _propagated(_Chain(), [((64, 32), F32)], 8)
    assert got["Add-op1"] == ((8, 1), (8, 1))
    net = _Chain()
    net.add.shard(((4, 2), (4, 2)))
    _, theirs = _propagated(net, [((64, 32), F32)], 8)
    assert cost == pytest.approx(theirs)


@pytest.mark.parametrize(("reshape", "expected"), [
    ((4, 128), ((4, 2),)), ((16, 32), ((8, 1),))])
def test_out_strategy_through_a_reshape(reshape: tuple[int, ...], expected: Strategy) -> None:
    """test_out_strategy_propagate4 and 5: MatMul(out ((8, 1),)) -> Reshape -> ReLU; the ReLU
    keeps the rows split 8 ways where they divide (16 rows), else 4 x 2 (4 rows)."""
    got, _ = _propagated(_Chain(reshape=reshape, out_strategy=((8, 1),), add=False),
                         [((64, 32), F32)], 8)
    assert got["ReLU-op2"] == expected


class _ReshapeFirst(Cell):
    """test_out_strategy_propagate3: x [32, 64] -> Reshape(-1, 32) -> MatMul(out ((8, 1),))
    -> ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(np.ones((8, 32), F32), name="w")
        self.reshape = ops.Reshape((64, 32))
        self.matmul = ops.MatMul(transpose_b=True).shard(((4, 2), (1, 2)), ((8, 1),))
        self.relu = ops.ReLU()

    def construct(self, x: Any) -> Any:
        return self.relu(self.matmul(self.reshape(x), self.w))


def test_out_strategy_after_a_reshape() -> None:
    got, _ = _propagated(_ReshapeFirst(), [((32, 64), F32)], 8)
    assert got["ReLU-op2"] == ((8, 1),)


def test_out_strategy_then_reshape_then_add() -> None:
    """test_out_strategy_propagate6: MatMul(out ((8, 1),)) -> Reshape(-1, 16) -> Add."""
    got, _ = _propagated(_Chain(reshape=(32, 16), out_strategy=((8, 1),)), [((64, 32), F32)], 8)
    assert got["Add-op2"] == ((8, 1), (8, 1))


class _TwoSeeds(Cell):
    """test_sharding_strategy_save_and_load1: x -> Add1 -> MatMul1.shard(((4,2),(1,2))) ->
    Add2 -> MatMul2.shard(((2,4),(1,4))) -> Add3 (transpose_b; w1 [8,32], w2 [16,8])."""

    def __init__(self) -> None:
        super().__init__()
        self.b1 = nn.Parameter(np.ones((64, 32), F32), name="b1")
        self.b2 = nn.Parameter(np.ones((64, 8), F32), name="b2")
        self.b3 = nn.Parameter(np.ones((64, 16), F32), name="b3")
        self.w1 = nn.Parameter(np.ones((8, 32), F32), name="w1")
        self.w2 = nn.Parameter(np.ones((16, 8), F32), name="w2")
        self.add1, self.add2, self.add3 = ops.Add(), ops.Add(), ops.Add()
        self.mm1 = ops.MatMul(transpose_b=True).shard(((4, 2), (1, 2)))
        self.mm2 = ops.MatMul(transpose_b=True).shard(((2, 4), (1, 4)))

    def construct(self, x: Any) -> Any:
        y = self.mm1(self.add1(x, self.b1), self.w1)
        return self.add3(self.mm2(self.add2(y, self.b2), self.w2), self.b3)


def test_two_user_strategies_propagate_between_them() -> None:
    """As MindSpore asserts: Add1 takes MatMul1's input layout (the move from the dataset's
    layout meets the user's strategy), Add2 between the MatMuls takes MatMul2's input
    layout, and the user strategies are kept unchanged. Add3: MindSpore [[2, 4], [2, 4]],
    a ReduceScatter of MatMul2's partial sums. simpar's MatMul completes its partial sums
    itself (its AllReduce), after which Add3 cuts the rows 8 ways by a free slice,
    [[8, 1], [8, 1]]; MindSpore's choice, imposed, costs the same."""
    got, cost = _propagated(_TwoSeeds(), [((64, 32), F32)], 8)
    assert got["Add-op0"] == ((4, 2), (4, 2))
    assert got["MatMul-op1"] == ((4, 2), (1, 2))
    assert got["Add-op2"] == ((2, 4), (2, 4))
    assert got["MatMul-op3"] == ((2, 4), (1, 4))
    assert got["Add-op4"] == ((8, 1), (8, 1))
    net = _TwoSeeds()
    net.add3.shard(((2, 4), (2, 4)))
    assert cost == pytest.approx(_propagated(net, [((64, 32), F32)], 8)[1])


class _BackFromMatMul(Cell):
    """test_mint_relu_layout_propagate_back: y [96, 96] -> ReLU -> MatMul(x [128, 96], .)
    sharded ((4, 2), (2, 1)); full_batch."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = ops.ReLU()
        self.matmul = ops.MatMul().shard(((4, 2), (2, 1)))

    def construct(self, x: Any, y: Any) -> Any:
        return self.matmul(x, self.relu(y))


def test_propagation_runs_backward_from_a_consumer() -> None:
    """The ReLU is reached from the MatMul it feeds. MindSpore gives it [[2, 1]] built on the
    MatMul's device matrix, where its 2 row blocks sit on the MatMul's k axis and nothing
    moves. simpar builds an op's layouts on its own device matrix (cuts first, repeats
    last), where [[2, 1]] puts the blocks on other ranks and costs an exchange; so the
    ReLU stays whole and the MatMul takes its blocks by a free slice, and imposing [[2, 1]]
    costs more. (Candidates on a neighbour's device matrix are not built in simpar.)"""
    specs = [((128, 96), F32), ((96, 96), F32)]
    got, cost = _propagated(_BackFromMatMul(), specs, 8, "full_batch")
    assert got["ReLU-op0"] == ((1, 1),)
    net = _BackFromMatMul()
    net.relu.shard(((2, 1),))
    assert _propagated(net, specs, 8, "full_batch")[1] > cost


class _Gamma(Cell):
    """test_reshape_auto_8/9: gamma [2048, 2048] read by ReLU and by MatMul (as input 1)."""

    def __init__(self, matmul: Strategy) -> None:
        super().__init__()
        self.gamma = nn.Parameter(np.ones((64, 64), F32), name="gamma")
        self.relu = ops.ReLU().shard(((1, 1),))
        self.add = ops.Add()
        self.matmul = ops.MatMul().shard(matmul)

    def construct(self, x: Any) -> Any:
        return self.matmul(self.add(x, self.relu(self.gamma)), self.gamma)


def test_configured_readers_of_one_parameter_must_agree() -> None:
    """test_reshape_auto_8 raises (ReLU reads gamma whole, the MatMul cuts it 8 ways);
    test_reshape_auto_9 (the MatMul reads it whole too) compiles."""
    with pytest.raises(ValueError, match=r"reads parameter gamma cut \(1, 1\), and .*MatMul"
                       r".* reads it cut \(1, 8\)"):
        _propagated(_Gamma(((1, 1), (1, 8))), [((64, 64), F32)], 8, "full_batch")
    got, _ = _propagated(_Gamma(((8, 1), (1, 1))), [((64, 64), F32)], 8, "full_batch")
    assert got["MatMul-op2"] == ((8, 1), (1, 1)) and got["ReLU-op0"] == ((1, 1),)


def test_propagation_from_the_dataset_alone_is_data_parallel() -> None:
    """No user strategy: every op of a 2-layer GPT takes the dataset's batch split on its
    first input, no parameter is cut but the embedding's gathered ids, and the plan is a
    valid choice of the cost graph (finite: one layout per parameter, no forbidden pair)."""
    _fully(True)
    pricer = _pricer(_two_layer_gpt(), [((16, 16), np.int32)], 8, profile="cpu-local")
    inputs = dataset_layouts([(16, 16)], 8, "data_parallel")
    smap = propagate(pricer, "auto_parallel", inputs)
    assert {str(s.source) for s in smap.ops.values()} == {"propagated"}
    for name, s in smap.ops.items():
        batch = s.in_strategy[1] if s.op_type == "Gather" else s.in_strategy[0]
        assert batch[0] == 8 and math.prod(batch) == 8, (name, s.in_strategy)
    assert all(math.prod(lay.cuts) == 1 for lay in smap.params.values())
    cg = build_cost_graph(pricer.graph, 8, pricer.model, input_layouts=inputs)
    choice = tuple(next(i for i, c in enumerate(n.candidates)
                        if c.strategy == smap.ops[n.name].in_strategy) for n in cg.nodes)
    assert math.isfinite(cg.total(choice))


# ------------------------------------------------------------------ recursive programming
class _MatMul(Cell):
    def __init__(self) -> None:
        super().__init__()
        self.matmul = ops.MatMul()

    def construct(self, x: Any, y: Any) -> Any:
        return self.matmul(x, y)


def test_rec_cuts_the_wide_matmul_by_columns() -> None:
    """test_auto_parallel_sapp_optimizer_parallel_restrict: MatMul [160, 320] x [320, 320000]
    on 8 devices, full_batch: [[1, 1], [1, 8]] (on an Ascend profile, where reading the
    whole 400 MB right operand is what a column cut saves)."""
    for profile in ("ascend910a", "ascend910b"):
        rec = solve_recursive_programming(_pricer(
            _MatMul(), [((160, 320), F32), ((320, 320000), F32)], 8, "full_batch", profile))
        assert rec.shardings[0].strategy == ((1, 1), (1, 8)), profile


class _GatherMatMul(Cell):
    """test_auto_parallel_sapp_gather: Gather(x, index, 0) -> Reshape(128, 2048) -> MatMul."""

    def __init__(self) -> None:
        super().__init__()
        self.gather = ops.Gather(0)
        self.reshape = ops.Reshape((128, 2048))
        self.matmul = ops.MatMul()

    def construct(self, x: Any, index: Any, y: Any) -> Any:
        return self.matmul(self.reshape(self.gather(x, index)), y)


def test_rec_gather_1() -> None:
    """test_auto_parallel_sapp_gather_1: x [64, 64], index [64, 64]: Gather [[1, 1], [8, 1]]."""
    smap = search_strategies(_GatherMatMul(), [((64, 64), F32), ((64, 64), np.int32),
                                               ((2048, 64), F32)], 8, "recursive_programming")
    assert _short(smap)["Gather-op0"] == ((1, 1), (8, 1))


def test_rec_gather_2_costs_no_more_than_mindspore_s() -> None:
    """test_auto_parallel_sapp_gather_2: x [1024, 128], index [2, 1024]. MindSpore's rec
    fills Gather by a fixed rule, [[4, 1], [2, 1]] (rows of the table cut 4 ways: partial sums
    to AllReduce); simpar's rec prices Gather like any op and cuts the indices 2 x 4 instead,
    which moves nothing. Imposing MindSpore's strategy costs more under the search's model."""
    specs = [((1024, 128), F32), ((2, 1024), np.int32), ((2048, 64), F32)]
    ours = _pricer(_GatherMatMul(), specs, 8, "full_batch", "cpu-local")
    rec = solve_recursive_programming(ours)
    assert rec.shardings[0].strategy == ((1, 1), (2, 4))
    net = _GatherMatMul()
    net.gather.shard(((4, 1), (2, 1)))
    theirs = solve_recursive_programming(_pricer(net, specs, 8, "full_batch", "cpu-local"))
    assert rec.cost < theirs.cost


def test_rec_leaves_devices_idle_rather_than_cut_a_small_gather_table() -> None:
    """test_auto_parallel_sapp_gather_3: x [128], index [4]: [[1], [4]]. The 4 indices are
    cut 4 ways; cutting the table too would cost an AllReduce of the partial rows, more than
    it saves, so the last round keeps the strategy (MindSpore's "no cut") and 2 ranks compute
    each shard."""

    class _Gather1(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.gather = ops.Gather(0)

        def construct(self, x: Any, index: Any) -> Any:
            return self.gather(x, index)

    specs = [((128,), F32), ((4,), np.int32)]
    rec = solve_recursive_programming(_pricer(_Gather1(), specs, 8, "full_batch", "cpu-local"))
    assert rec.shardings[0].strategy == ((1,), (4,)) and rec.shardings[0].repeat == 2


def test_both_searches_plan_a_gpt_on_64_devices() -> None:
    """Not a timing test: on 64 devices both searches return a plan for every op of a
    4-layer GPT, each strategy valid for its op (what the benchmark times at full size)."""
    net = nn.GPT(vocab_size=512, seq_length=64, d_model=64, n_heads=8, n_layers=4, dtype=F32)
    for mode in ("recursive_programming", "sharding_propagation"):
        smap = search_strategies(net, [((64, 64), np.int32)], 64, mode, "data_parallel")
        g = graph.trace(net, [((64, 64), np.int32)])
        for node in g.nodes:
            node.op.sharding([v.shape for v in node.inputs], 64, smap.ops[node.name].in_strategy)
        assert set(smap.ops) == {node.name for node in g.nodes}


def test_rec_neighbourhoods_are_one_step_away() -> None:
    """From MatMul's ((4, 1), (1, 2)) (i=4, j=2) on 16 devices: move a factor 2 (i -> j, i -> k,
    j -> i, j -> k), drop one (i or j), or add one (to i, j or k)."""
    from simpar.search.recursive_programming import _Rec

    pricer = _pricer(_MatMul(), [((16, 16), F32), ((16, 16), F32)], 16, "full_batch")
    rec = _Rec(pricer)
    rec.set(0, ((4, 1), (1, 2)))
    want = {((4, 1), (1, 2)),                                                      # itself
            ((2, 1), (1, 4)), ((2, 2), (2, 2)), ((8, 1), (1, 1)), ((4, 2), (2, 1)),  # moved
            ((2, 1), (1, 2)), ((4, 1), (1, 1)),                                    # dropped
            ((8, 1), (1, 2)), ((4, 1), (1, 4)), ((4, 2), (2, 2))}                  # added
    assert set(rec.neighbourhood(0)) == want
