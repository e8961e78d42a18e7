"""The strategy map between planning and lowering, in one process: a frozen, printable,
JSON-serialisable value that every planner produces and ``lower`` consumes.

    python -m pytest tests/test_strategy_map.py -q
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import numpy as np
import pytest

from simpar import context, graph, nn, ops, seed
from simpar.comm_fusion import AllReduceFusion
from simpar.layout import TensorLayout
from simpar.nn import presets
from simpar.runtime import NothingParallelWarning, backward_plan, build_program, lower
from simpar.search import (
    OpStrategy,
    Source,
    StrategyMap,
    follow_producers,
    plan_strategies,
    register_search,
)
from simpar.search import planner as planner_module

SEMI = "semi_auto_parallel"


def _mlp(dp: int = 2, mp: int = 4, annotate: bool = True) -> tuple[nn.Cell, graph.Graph]:
    model = nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64)
    if annotate:
        presets.megatron_mlp(model, dp, mp)
    net = nn.WithLossCell(model, nn.SoftmaxCrossEntropyWithLogits())
    net.name_parameters()
    g = graph.trace(net, [((8, 16), np.float64), ((8,), np.int32)], ["data", "label"])
    return net, g


def _dense() -> graph.Graph:
    dense = nn.Dense(16, 8, has_bias=False, dtype=np.float64)
    dense.name_parameters()
    return graph.trace(dense, [((4, 16), np.float64)], ["x"])


MATMUL = "Default/network-Dense/MatMul-op0"


def test_a_planner_records_every_op_and_where_its_strategy_came_from() -> None:
    net, g = _mlp()
    smap = plan_strategies(g, 8, SEMI, ((2, 1), (2,)), True)
    assert set(smap.ops) == {n.name for n in g.nodes}
    assert set(smap.params) == {v.name for v in g.params}
    assert set(smap.inputs) == {"data", "label"}
    fc1 = next(s for n, s in smap.ops.items() if "fc1-Dense/MatMul" in n)
    assert fc1 == OpStrategy("MatMul", ((2, 1), (4, 1)), source=Source.USER)
    assert smap.count(Source.USER) == 4 and smap.count(Source.PROPAGATED) > 0
    # Source values are the strings simpar always printed.
    assert Source.USER == "annotated" and Source.PROPAGATED == "propagated"
    text = str(smap)
    assert text.startswith(f"StrategyMap: semi_auto_parallel, 8 devices, {len(g.nodes)} ops")
    assert "MatMul [[2,1],[4,1]] (annotated)" in text


def test_the_map_is_frozen_and_round_trips_through_json() -> None:
    _, g = _mlp()
    smap = plan_strategies(g, 8, SEMI, ((2, 1), (2,)), True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        smap.device_num = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        smap.ops["x"] = smap.ops[next(iter(smap.ops))]  # type: ignore[index]
    back = StrategyMap.from_dict(json.loads(json.dumps(smap.to_dict())))
    assert back == smap
    assert lower(g, back).strategies() == lower(g, smap).strategies()
    assert "comm_fusion" not in smap.to_dict()   # the default: one bucket per group
    fused = dataclasses.replace(smap, comm_fusion=AllReduceFusion("index", (1, 3)))
    again = StrategyMap.from_dict(json.loads(json.dumps(fused.to_dict())))
    assert again == fused != smap and lower(g, again).comm_fusion == fused.comm_fusion
    with pytest.raises(TypeError, match="comm_fusion must be an AllReduceFusion, got dict"):
        dataclasses.replace(smap, comm_fusion={"openstate": False})


def test_lower_chooses_nothing_it_follows_the_map() -> None:
    """A hand-written map: every op as given, parameters laid out by their consumer."""
    g = _dense()
    smap = StrategyMap(8, SEMI, {MATMUL: OpStrategy("MatMul", ((1, 1), (8, 1)))})
    program = lower(g, smap)
    assert program.strategy_map is smap
    assert program.strategies() == {MATMUL: [[1, 1], [8, 1]]}
    assert program.param_layouts["weight"].cuts == (8, 1)
    assert program.input_layouts()[0].cuts == (1, 1)       # no entry: held whole
    # The same layer with another map gives another program: lowering adds no choice.
    other = lower(g, StrategyMap(8, SEMI, {MATMUL: OpStrategy("MatMul", ((4, 1), (1, 1)))}))
    assert other.strategies() == {MATMUL: [[4, 1], [1, 1]]}


def test_program_steps_are_frozen_values() -> None:
    program = lower(_dense(), StrategyMap(8, SEMI, {MATMUL: OpStrategy("MatMul",
                                                                          ((1, 1), (8, 1)))}))
    step = program.steps[0]
    assert isinstance(program.steps, tuple) and step.chosen is Source.USER
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.chosen = Source.PROPAGATED  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.steps = ()  # type: ignore[misc]


@pytest.mark.parametrize(("smap", "error", "words"), [
    (StrategyMap(8, SEMI, {}), ValueError, "has no strategy for 1 ops, e.g. "
     "['Default/network-Dense/MatMul-op0']"),
    (StrategyMap(8, SEMI, {MATMUL: OpStrategy("BatchMatMul", ((1, 1), (8, 1)))}), ValueError,
     "is a MatMul, but the strategy map holds a BatchMatMul strategy"),
    (StrategyMap(8, SEMI, {MATMUL: OpStrategy("MatMul", ((1, 3), (3, 1)))}), ValueError,
     "16 is not divisible by 3"),
])
def test_lower_refuses_a_map_that_does_not_fit(smap: StrategyMap, error: type, words: str
                                               ) -> None:
    with pytest.raises(error, match=re.escape(words)):
        lower(_dense(), smap)
    with pytest.raises(TypeError, match="strategy_map must be a simpar.search.StrategyMap, got "
                       "dict"):
        lower(_dense(), {})  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"device_num": 0}, ValueError, "device_num must be an int >= 1, got 0"),
    ({"ops": {"a": ((1,),)}}, TypeError, "ops['a'] must be a OpStrategy, got tuple"),
    ({"params": {"w": (8, 1)}}, TypeError, "params['w'] must be a TensorLayout, got tuple"),
])
def test_strategy_map_validates_what_it_holds(kwargs: dict[str, object], error: type,
                                              words: str) -> None:
    args: dict[str, object] = {"device_num": 8, "mode": SEMI, **kwargs}
    with pytest.raises(error, match=re.escape(words)):
        StrategyMap(**args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cuts must be >= 1"):
        OpStrategy("MatMul", ((0, 1), (1, 1)))


def test_repeated_compute_is_reported_per_op() -> None:
    """Megatron computes what follows a row-parallel layer on its whole mp group alike."""
    net, g = _mlp(dp=2, mp=4)
    program = build_program(g, 8, SEMI, ((2, 1), (2,)), cell=net)
    repeated = program.repeated()
    fc2_bias = next(n for n in repeated if "fc2-Dense/BiasAdd" in n)
    assert repeated[fc2_bias] == 4                       # row-parallel output, on 4 ranks alike
    assert not any("fc1-Dense/MatMul" in n for n in repeated)
    assert "computed alike on 4 ranks" in str(program)


def test_a_model_that_computes_everything_everywhere_warns() -> None:
    net, g = _mlp(annotate=False)
    with pytest.warns(NothingParallelWarning, match="computes the whole tensor on all 8 "
                      "ranks: nothing is parallel"):
        build_program(g, 8, SEMI, "full_batch", cell=net)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingParallelWarning)
        build_program(g, 8, "data_parallel", cell=net)      # batch cut: parallel, no warning
        build_program(g, 1, SEMI, cell=net)                 # one device: nothing to warn of


def test_input_layouts_come_from_the_map() -> None:
    g = _dense()
    x = TensorLayout((2, 4), (1, -1), (4, 16))              # rows over 2, repeated on 4
    smap = StrategyMap(8, SEMI, {MATMUL: OpStrategy("MatMul", ((2, 1), (1, 1)))}, inputs={"x": x})
    program = lower(g, smap)
    assert program.input_layouts()[0] == x


def test_executing_a_program_writes_nothing_into_the_graph() -> None:
    """Dropout draws per training step from ``seed.training_step``, not from op state."""
    gpt = nn.GPT(32, 8, 16, 1, 2, dropout=0.2, dtype=np.float64)
    train = nn.TrainOneStepCell(nn.WithLossCell(gpt, nn.SoftmaxCrossEntropyWithLogits()),
                                nn.SGD(gpt.trainable_params(), 0.1), parallel_mode="stand_alone")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 32, (2, 8)).astype(np.int32)
    train(ids, ids)
    assert train.program is not None
    before = [repr(vars(s.node.op)) for s in train.program.steps]
    train(ids, ids)
    train(ids, ids)
    assert [repr(vars(s.node.op)) for s in train.program.steps] == before
    drop = next(s.node.op for s in train.program.steps if s.node.op.name == "Dropout")
    with seed.training_step(0):
        first = drop.keep_mask((4, 16))
    with seed.training_step(1):
        second = drop.keep_mask((4, 16))
    assert not np.array_equal(first, second)
    assert np.array_equal(first, drop.keep_mask((4, 16)))  # outside a step: the op's own (0)


def _planned_mlp(plan: dict[str, tuple[int, ...]], annotate: bool) -> None:
    model = nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64)
    if annotate:
        presets.megatron_mlp(model, 2, 4)
    model.layers[0].shard(None, parameter_plan=plan)
    net = nn.WithLossCell(model, nn.SoftmaxCrossEntropyWithLogits())
    net.name_parameters()
    g = graph.trace(net, [((8, 16), np.float64), ((8,), np.int32)], ["data", "label"])
    build_program(g, 8, SEMI, "full_batch", cell=net)


def test_parameter_plan_refuses_unknown_names_and_wrong_lengths() -> None:
    with pytest.raises(ValueError, match=r"parameter_plan: the network has no parameter named "
                       r"'_backbone.fc1.weigth'; did you mean '_backbone.fc1.weight'"):
        _planned_mlp({"weigth": (4, 1)}, annotate=False)
    with pytest.raises(TypeError, match=r"the type of each key and value in 'parameter_plan' "
                       r"must be str and tuple, but got str and int \(Dense.shard: 'weight': 4"):
        _planned_mlp({"weight": 4}, annotate=False)  # type: ignore[dict-item]
    for bad in ((4,), (0, 1), (3, 1)):
        with pytest.raises(ValueError, match=r"_backbone.fc1.weight has shape \(32, 16\), so "
                           r"its plan needs 2 int cuts >= 1 that divide their dimensions, got"):
            _planned_mlp({"weight": bad}, annotate=False)  # type: ignore[dict-item]


def test_parameter_plan_that_contradicts_an_annotated_consumer_is_refused() -> None:
    with pytest.raises(ValueError, match=r"parameter_plan gives _backbone.fc1.weight the "
                       r"cuts \(1, 8\), but .*fc1-Dense/MatMul-op\d+ \(.shard\(\[\[2, 1\], "
                       r"\[4, 1\]\]\)\) reads it cut \(4, 1\)"):
        _planned_mlp({"weight": (1, 8)}, annotate=True)
    _planned_mlp({"weight": (4, 1)}, annotate=True)  # agreeing: fine


def test_a_map_names_only_this_graphs_ops_and_a_known_mode() -> None:
    g = _dense()
    stray = StrategyMap(8, SEMI, {MATMUL: OpStrategy("MatMul", ((1, 1), (8, 1))),
                                  "Default/other/MatMul-op9": OpStrategy("MatMul",
                                                                         ((1, 1), (1, 1)))})
    with pytest.raises(ValueError, match="names 1 ops this graph does not have"):
        lower(g, stray)
    with pytest.raises(ValueError, match="mode must be one of .*got 'banana'"):
        StrategyMap(8, "banana")
    assert StrategyMap(np.int64(8), SEMI).device_num == 8  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="StrategyMap.from_dict: not a strategy map dict"):
        StrategyMap.from_dict({"device_num": 8, "mode": SEMI, "ops": {"x": {}}})


def test_auto_parallel_runs_the_search_registered_for_its_search_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The searches of the next issues plug in through one interface: a planner registered
    under a search_mode gets the request (graph, devices, input layouts, plans) and its map is
    what lowers; an unregistered search_mode says it is not implemented."""
    monkeypatch.setattr(planner_module, "_SEARCHES", {})
    monkeypatch.setattr(context, "_SEARCH_MODES", list(context.search_modes()))
    seen = []

    def data_parallel_search(request: planner_module.PlanRequest) -> StrategyMap:
        seen.append((request.device_num, request.mode,
                     [lay.cuts for lay in request.input_layouts]))
        dp = follow_producers(dataclasses.replace(request, mode="data_parallel"))
        ops = {k: dataclasses.replace(v, source=Source.SEARCHED) for k, v in dp.ops.items()}
        return StrategyMap(request.device_num, "auto_parallel", ops, dp.params, dp.inputs)

    register_search("test_dp_search", data_parallel_search)
    _, g = _mlp(annotate=False)
    smap = plan_strategies(g, 8, "auto_parallel", ((8, 1), (8,)), search_mode="test_dp_search")
    assert seen == [(8, "auto_parallel", [(8, 1), (8,)])]
    assert {s.source for s in smap.ops.values()} == {Source.SEARCHED}
    program = lower(g, smap)
    assert all(s.chosen == "searched" and s.repeat == 1 for s in program.steps)
    with pytest.raises(NotImplementedError, match="strategy search, which is not implemented "
                       r"yet \(search_mode 'dynamic_programming'; implemented: "
                       r"\['test_dp_search'\]\)"):
        plan_strategies(g, 8, "auto_parallel", search_mode="dynamic_programming")


def test_complete_lays_out_every_parameter_the_map_leaves_open() -> None:
    """One owner of both rules: a parameter takes its first consumer's layout, one no op
    reads stays whole, one the map gives keeps it."""

    class TwoReaders(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(np.zeros((16, 16)), "w")
            self.v = nn.Parameter(np.zeros((16, 16)), "v")
            self.spare = nn.Parameter(np.zeros((3, 5)), "spare")

        def construct(self, x: object) -> object:
            first = ops.MatMul().shard(((1, 1), (1, 8)))(x, self.w)
            second = ops.MatMul()(first, self.w)   # semi_auto: the fill-in's strategy
            return ops.MatMul()(second, self.v), self.spare   # an output no op reads

    net = TwoReaders()
    net.name_parameters()
    g = graph.trace(net, [((4, 16), np.float64)], ["x"])
    smap = plan_strategies(g, 8, SEMI)
    given = TensorLayout((8,), (-1, 0), (16, 16))
    steps = lower(g, smap).steps
    done = dataclasses.replace(smap, params={"v": given}).complete(
        g, [s.sharding.in_layouts for s in steps])
    assert list(done.params) == ["v", "w", "spare"]
    assert done.params["v"] == given
    assert done.params["w"] == steps[0].sharding.in_layouts[1]      # its first reader's
    assert done.params["w"].cuts == (1, 8)
    assert done.params["spare"] == TensorLayout((8,), (-1, -1), (3, 5))    # read by none
    assert smap.complete(g, [s.sharding.in_layouts for s in steps]) == smap


def test_lowering_plans_the_backward_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager-or-lazy choice is made once per set of seeded outputs lowering names, when
    the program first reads it (a pipeline's rank lowers its neighbours' stages for their
    layouts, and never runs their backward): running it again plans nothing."""
    net, g = _mlp()
    made: list[tuple[bool, ...]] = []
    real = backward_plan.plan_backward
    monkeypatch.setattr(backward_plan, "plan_backward",
                        lambda lowered, seeds: made.append(tuple(seeds)) or real(lowered, seeds))
    program = build_program(g, 8, SEMI, ((2, 1), (2,)), cell=net)
    assert set(program.backward_plans) == {(True,), (False,)} and made == []
    assert program.backward_plan() is program.backward_plans[(True,)]
    assert program.backward_plan() is program.backward_plans[(True,)] and made == [(True,)]
    program.schedule(0)
    assert made == [(True,)]
    assert not any(isinstance(getattr(program, f.name), dict) and f.name.startswith("_")
                   for f in dataclasses.fields(program))
    only = lower(g, program.strategy_map, seeds=[(True,)])   # type: ignore[arg-type]
    assert set(only.backward_plans) == {(True,)}
    with pytest.raises(ValueError, match=re.escape("seeded [False] has no backward plan")):
        only.backward_plan((False,))


def test_identical_layers_plan_each_op_backward_once_per_walk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward of a Megatron GPT of 4 identical blocks: each distinct op backward (its
    layouts and its cotangents' pending axes) is planned once per walk, and the plan equals
    the one planned op by op."""
    net, loss = nn.GPT(64, 8, 16, 4, 4), nn.SoftmaxCrossEntropyWithLogits()
    presets.megatron_gpt(net, 2, 4, loss)
    cell = nn.WithLossCell(net, loss)
    ids = ((8, 8), np.dtype(np.int32))
    g = graph.trace(cell, [ids, ids], ["data", "label"])
    program = build_program(g, 8, SEMI, ((2, 1), (2, 1)), cell=cell)
    calls = []
    real = backward_plan.op_backward
    monkeypatch.setattr(backward_plan, "op_backward",
                        lambda *a: calls.append(a[0]) or real(*a))
    shared = backward_plan.plan_backward(program, (True,))
    grads = len(program.grad_nodes)
    assert 0 < len(calls) < grads, (len(calls), grads)   # the eager and the lazy walk
    monkeypatch.setattr(backward_plan, "op_backward", lambda *a: real(*a))
    monkeypatch.setattr(backward_plan, "id", lambda x: object(), raising=False)
    alone = backward_plan.plan_backward(program, (True,))
    assert alone == shared


def test_semi_auto_refuses_a_parameter_two_strategies_cut_differently() -> None:
    """As MindSpore does, and as every auto_parallel search does: a parameter has one
    layout, so two .shard() readers that cut it differently cannot both hold."""
    w = nn.Parameter(np.zeros((16, 16)), "w")
    m1, m2 = ops.MatMul().shard(((1, 1), (1, 8))), ops.MatMul().shard(((1, 8), (8, 1)))
    g = graph.trace(lambda x: m2(m1(x, w), w), [((4, 16), np.float64)], ["x"])
    with pytest.raises(ValueError, match=r"semi_auto_parallel: Default/MatMul-op0 \(.shard\(\[\["
                       r"1, 1\], \[1, 8\]\]\)\) reads parameter w cut \(1, 8\), and Default/"
                       r"MatMul-op1 .* reads it cut \(8, 1\); a shared parameter has one layout"):
        plan_strategies(g, 8, SEMI)
    agreeing = ops.MatMul().shard(((1, 1), (1, 8)))
    g = graph.trace(lambda x: agreeing(m1(x, w), w), [((4, 16), np.float64)], ["x"])
    assert plan_strategies(g, 8, SEMI).params["w"].cuts == (1, 8)
