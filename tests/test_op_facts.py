"""Each op owns its facts (simpar/ops/facts.py): every registered op declares them, the cost
model and the searches read them from the op, and an op added in one file (``Exp`` below, as
a contributor adds one to simpar/ops) is planned, lowered and priced with no other file
touched. Single process, pure.

    python -m pytest -q -p no:cacheprovider tests/test_op_facts.py
"""

from __future__ import annotations

import doctest
import math
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from simpar import context, graph, nn
from simpar.cost import MindSporeCostModel, evaluate, mindspore_ops, mindspore_redistribution
from simpar.cost.mindspore_ops import keeps_output, mindspore_cost_class, op_cost
from simpar.ops import Add, CostClass, IterSpace, MatMul, Primitive, ReLU, register, registry
from simpar.ops import facts as facts_module
from simpar.ops.facts import DEFAULTS
from simpar.runtime import lower
from simpar.search import plan_strategies, registered_searches
from simpar.search.cost_graph import build_cost_graph
from simpar.strategy_file import load_strategy, save_strategy

F32 = 4

# The class MindSpore's OperatorInfo of each built-in op uses, and its elementwise ops (its
# IsElementWiseOperator, the unary ones): what the string-keyed tables of cost/mindspore.py
# and search/pricing.py said before the ops declared it themselves.
COST_CLASSES = {
    "MatMul": "MatMulCost", "BatchMatMul": "MatMulCost", "ReLU": "SqrtCost",
    "Tanh": "SqrtCost", "Sigmoid": "SqrtCost", "GeLU": "GeLUCost", "Abs": "ReLU6Cost",
    "Square": "ReLU6Cost", "Cast": "CastCost", "Identity": "CastCost", "Concat": "ConcatCost",
    "Split": "SplitCost", "Transpose": "TransposeCost", "Softmax": "SoftmaxCost",
    "LogSoftmax": "SoftmaxCost", "Add": "TensorAddCost", "Sub": "SubCost",
    "BiasAdd": "BiasAddCost", "Mul": "MulCost", "RealDiv": "DivCost",
    "FloorDiv": "FloorDivCost", "Assign": "AssignCost", "PReLU": "PReLUCost",
    "BatchNorm": "BatchNormCost", "ReduceSum": "ReduceSumCost", "ReduceMean": "ReduceMeanCost",
    "ReduceMax": "ReduceMaxCost",
    "SparseSoftmaxCrossEntropyWithLogits": "SparseSoftmaxCrossEntropyWithLogitsCost",
    "LayerNorm": "LayerNormCost", "Gather": "GatherV2PCost", "Dropout": "DropOutCost",
    "Reshape": "ReshapeCost",
}
ELEMENTWISE = {"Abs", "Cast", "GeLU", "LogSoftmax", "ReLU", "Sigmoid", "Softmax", "Square",
               "Tanh"}


# ------------------------------------------------------------------ a new op, in one place
@register
class Exp(Primitive):
    """``e ** x``: added here exactly as a contributor adds an op to simpar/ops (kernel, VJP,
    sharding rule, facts), to show that nothing outside the op's own file has to change."""

    mindspore_cost = CostClass.RELU6   # MindSpore: ExpCost is ReLU6Cost
    elementwise = True                 # MindSpore's IsElementWiseOperator holds Exp

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        return shapes[0]

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.exp(xs[0])

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy * y,)

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        return IterSpace.pointwise(len(shapes[0]))


@pytest.fixture(autouse=True)
def _algo_defaults() -> Iterator[None]:
    yield
    context.reset_algo_parameters()


def _exp_net(exp: Primitive) -> Any:
    """x @ w1 -> Exp -> @ w2: the new op between two MatMuls (float64, shapes only)."""
    rng = np.random.default_rng(0)
    w1 = nn.Parameter(rng.standard_normal((16, 32)) * 0.1, name="w1")
    w2 = nn.Parameter(rng.standard_normal((32, 8)) * 0.1, name="w2")

    def f(x: Any) -> Any:
        return MatMul()(exp(MatMul()(x, w1)), w2)

    return graph.trace(f, [((8, 16), np.float64)], ["x"])


# ------------------------------------------------------------------ every op declares
def test_every_registered_op_declares_every_fact_in_its_own_body() -> None:
    missing = {name: op.undeclared_facts for name, op in registry().items()
               if op.undeclared_facts}
    assert missing == {}
    assert set(DEFAULTS) == {"mindspore_cost", "elementwise"}
    assert all(isinstance(op.mindspore_cost, CostClass) and isinstance(op.elementwise, bool)
               for op in registry().values())


def test_the_built_in_ops_declare_the_facts_the_old_tables_held() -> None:
    ops = registry()
    assert set(COST_CLASSES) <= set(ops)
    assert {name: mindspore_cost_class(ops[name]) for name in COST_CLASSES} == COST_CLASSES
    assert {name for name in COST_CLASSES if ops[name].elementwise} == ELEMENTWISE


def test_register_refuses_an_unknown_or_mistyped_fact() -> None:
    with pytest.raises(TypeError, match=r"register: 'cost' is not an op fact; the facts are "
                       r"mindspore_cost, elementwise"):
        register(cost=CostClass.SQRT)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"register: mindspore_cost must be a CostClass, got "
                       r"'SqrtCost' of type str"):
        register(mindspore_cost="SqrtCost")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"register: elementwise must be a bool, got 1 of type "
                       r"int"):
        register(elementwise=1)  # type: ignore[call-overload]


def test_a_subclass_is_another_op_and_inherits_no_fact() -> None:
    class Plus(Add):
        pass

    class Cubed(ReLU):
        elementwise = True

    assert Plus.undeclared_facts == ("mindspore_cost", "elementwise")
    assert (Plus.mindspore_cost, Plus.elementwise) == (CostClass.DEFAULT, False)
    assert Cubed.undeclared_facts == ("mindspore_cost",)
    assert (Cubed.mindspore_cost, Cubed.elementwise) == (CostClass.DEFAULT, True)
    assert ReLU.mindspore_cost is CostClass.SQRT        # the parent keeps its own


def test_the_cost_model_has_formulas_for_exactly_the_declared_classes() -> None:
    assert set(mindspore_ops._RULES) == set(CostClass)


def test_the_cost_functions_take_the_op_its_class_or_its_name() -> None:
    assert (mindspore_cost_class(ReLU) == mindspore_cost_class(ReLU())
            == mindspore_cost_class("ReLU") == "SqrtCost")
    assert keeps_output(ReLU, 1, involved={0}) and not keeps_output(ReLU(), 1)
    assert keeps_output("ReLU", 1, involved={0})
    with pytest.raises(ValueError, match=r"mindspore_cost_class: op 'Relu' is not a registered "
                       r"op; registered ops are .*ReLU"):
        mindspore_cost_class("Relu")
    with pytest.raises(TypeError, match=r"keeps_output: op must be a primitive, a primitive "
                       r"class or a registered op's name, got 3 of type int"):
        keeps_output(3, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("module", [facts_module, mindspore_ops, mindspore_redistribution],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 1 and result.failed == 0


# ------------------------------------------------------------------ the new op, end to end
def test_the_new_op_is_priced_by_the_class_it_declares() -> None:
    sh = Exp().sharding([(64, 32)], 8, ((8, 1),))
    x = 8 * 32 * F32                                  # 1024 bytes
    c = op_cost(sh, parameters={0})
    assert (c.cost_class, c.forward_computation, c.forward_communication) == ("ReLU6Cost", x, 0.0)
    assert (c.backward_communication, c.memory) == (0.0, x)   # split over all 8: no AllReduce
    assert op_cost(sh).memory == 0.0
    assert op_cost(sh, involved={0}).memory == x      # ReLU6Cost keeps x for dx
    assert op_cost(sh, involved={0}, prev_in_memory={0}).memory == 0.0


def test_the_new_op_plans_lowers_and_prices_in_semi_auto_parallel(
        tmp_path: pathlib.Path) -> None:
    g = _exp_net(Exp().shard(((4, 1),)))
    smap = plan_strategies(g, 4, "semi_auto_parallel")
    exp_node = next(n for n in g.nodes if n.op.name == "Exp")
    assert smap.ops[exp_node.name].in_strategy == ((4, 1),)
    report = evaluate(lower(g, smap), "cpu-local", "sgd")
    row = next(r for r in report.ops if r.op_type == "Exp")
    assert row.strategy == ((4, 1),) and row.compute > 0.0
    assert math.isfinite(report.step_seconds) and report.step_seconds > 0.0
    save_strategy(tmp_path / "exp.json", smap, g)
    loaded = load_strategy(tmp_path / "exp.json", g)
    assert {k: v.in_strategy for k, v in loaded.ops.items()} == {
        k: v.in_strategy for k, v in smap.ops.items()}


@pytest.mark.parametrize("search_mode", registered_searches())
def test_the_new_op_plans_lowers_and_prices_in_every_auto_parallel_search(
        search_mode: str) -> None:
    g = _exp_net(Exp().shard(((4, 1),)))
    smap = plan_strategies(g, 4, "auto_parallel", "data_parallel", search_mode=search_mode)
    exp_node = next(n for n in g.nodes if n.op.name == "Exp")
    assert math.prod(smap.ops[exp_node.name].in_strategy[0]) > 1
    report = evaluate(lower(g, smap), "cpu-local", "sgd")
    assert any(r.op_type == "Exp" for r in report.ops)
    assert math.isfinite(report.step_seconds) and report.step_seconds > 0.0


def test_the_new_ops_elementwise_fact_makes_its_out_edge_an_identity_edge() -> None:
    """With elementwise_op_strategy_follow the edge out of Exp allows only the pairs that
    need no redistribution, read from ``Exp.elementwise`` (no list of names anywhere)."""
    g = _exp_net(Exp())
    context.set_algo_parameters(elementwise_op_strategy_follow=True)
    cg = build_cost_graph(g, 4, MindSporeCostModel(), "data_parallel")
    out = [e for e in cg.edges if cg.nodes[e.producer].node.op.name == "Exp"]
    into = [e for e in cg.edges if cg.nodes[e.consumer].node.op.name == "Exp"]
    assert out and into
    assert all(any(math.isinf(x) for row in e.costs for x in row) for e in out)
    assert not any(math.isinf(x) for e in into for row in e.costs for x in row)
