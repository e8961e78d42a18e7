"""MindSpore r1.0's small auto-parallel networks searched by simpar's dynamic programming
under MindSpore's cost model: the strategies MindSpore's own unit tests assert (one process).

    python -m pytest -q tests/test_search_mindspore_ut.py

Each test builds the network of one test of ``mindspore-ai/mindspore``'s
``tests/ut/python/parallel/`` with the same shapes, Parameters and primitives, traces the
network's forward output (MindSpore's ``VirtualLoss`` has no strategy and is left out), and
searches it on the test's device count with MindSpore r1.0's settings (the autouse fixture:
alpha 1, beta 400, gamma 0.001, communication threshold/const/bias 2048/3072/1024,
``fully_use_devices=True``; anything else the test sets is set in the test). Graph inputs are
free in any layout (``dataset_strategy=None``: MindSpore compiled these networks without a
``_VirtualDataset``), except for the tests that train through ``Model``, which inserts one
(data parallel). MindSpore's versions of the tests were dated by their API usage; a test that
asserts the same values before and after r1.0 is taken as r1.0's.

MindSpore's strategy keys (``'Default/network-Net/MatMul-op0'``) number the ops from the
output back; simpar's nodes are in trace (forward) order, so the expectations below are
listed in trace order with the MindSpore key in a comment. Where a node has several inputs
MindSpore's numbering visits the last one first: that is the only order in which
test_auto_parallel_cast's dict is a plan without redistributions (read in the other order,
it redistributes both of MatMul3's inputs: 6156030 against 1231486 under MindSporeCostModel);
every other dict reads the same in both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from simpar import context, graph, nn, ops
from simpar import cost_model_context as cmc
from simpar.cost.interface import MindSporeCostModel
from simpar.nn.cell import Cell
from simpar.nn.loss import SoftmaxCrossEntropyWithLogits
from simpar.parameter import Parameter
from simpar.search.cost_graph import CostGraph, brute_force, build_cost_graph
from simpar.search.dynamic_programming import DPSolution, solve_dynamic_programming
from simpar.search.exact import solve_exact

F32 = np.float32
Strategy = tuple[tuple[int, ...], ...]
Spec = tuple[tuple[int, ...], Any]

#: MindSpore r1.0's cost-model defaults (costmodel_context.h, _cost_model_context.py).
R1_0_COST_MODEL = {
    "device_memory_capacity": 16.0 * 1024.0 * 1024.0 * 1024.0,
    "costmodel_alpha": 1.0,
    "costmodel_beta": 400.0,
    "costmodel_gamma": 0.001,
    "costmodel_communi_threshold": 2048.0,
    "costmodel_communi_const": 3072.0,
    "costmodel_communi_bias": 1024.0,
}
#: MindSpore r1.0's algorithm defaults (reset_algo_parameters in test_auto_parallel_two_matmul).
R1_0_ALGO = {
    "fully_use_devices": True,
    "elementwise_op_strategy_follow": False,
    "tensor_slice_align_enable": False,
    "tensor_slice_align_size": 16,
    "enable_algo_approxi": False,
}


def _set_algo(**kwargs: Any) -> None:
    context.set_algo_parameters(**kwargs)


@pytest.fixture(autouse=True)
def _mindspore_r1_0(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """MindSpore r1.0's cost model and algorithm settings; the previous ones afterwards."""
    current = cmc.cost_model_context()
    cost = {f.name: getattr(current, f.name) for f in dataclasses.fields(cmc.CostModelContext)}
    algo = dataclasses.asdict(context.algo_parameters())
    monkeypatch.setattr(context, "_warned", set())  # keep the once-per-process warnings unspent
    try:
        cmc.set_cost_model_context(**R1_0_COST_MODEL)
        _set_algo(**R1_0_ALGO)
        yield
    finally:
        cmc.set_cost_model_context(**cost)
        _set_algo(**algo)


@dataclasses.dataclass(frozen=True)
class _Case:
    """A network, its inputs, and where MindSpore compiled it."""

    net: Callable[..., Any]
    specs: list[Spec]
    device_num: int
    dataset_strategy: Any = None  # None: no _VirtualDataset; "data_parallel": Model's


def _graph(case: _Case) -> CostGraph:
    g = graph.trace(case.net, case.specs)
    return build_cost_graph(g, case.device_num, MindSporeCostModel(),
                            dataset_strategy=case.dataset_strategy)


def _search(case: _Case) -> tuple[CostGraph, DPSolution, list[tuple[str, Strategy]]]:
    """The cost graph, DP's plan, and (op type, strategy) per node in trace order."""
    cg = _graph(case)
    sol = solve_dynamic_programming(cg)
    chosen = [(n.node.op.name, n.candidates[c].strategy) for n, c in zip(cg.nodes, sol.choice)]
    return cg, sol, chosen


def _choice(cg: CostGraph, expected: list[tuple[str, Strategy]]) -> tuple[int, ...]:
    """The candidates that give every node the expected strategy."""
    return tuple(next(i for i, c in enumerate(n.candidates) if c.strategy == s)
                 for n, (_, s) in zip(cg.nodes, expected))


# ------------------------------------------------------------------ the networks
def _two_matmul() -> _Case:
    class Net(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.matmul1, self.matmul2 = ops.MatMul(), ops.MatMul()

        def construct(self, x: Any, y: Any, b: Any) -> Any:
            return self.matmul2(self.matmul1(x, y), b)

    return _Case(Net(), [((128, 32), F32), ((32, 64), F32), ((64, 64), F32)], 16)


_ARITHMETIC_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "arithmetic": [(64, 32), (32, 128), (64, 128)],
    "broadcast_both": [(64, 32), (32, 1), (1, 64)],
    "broadcast_right": [(64, 32), (32, 32), (32,)],
    "broadcast_left": [(64, 32), (32, 32), (128, 64, 32)],
}


def _arithmetic(variant: str) -> _Case:
    class Net(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.matmul, self.floordiv = ops.MatMul(), ops.FloorDiv()

        def construct(self, x: Any, y: Any, b: Any) -> Any:
            return self.floordiv(self.matmul(x, y), b)

    return _Case(Net(), [(s, F32) for s in _ARITHMETIC_SHAPES[variant]], 8)


def _double_star_cast() -> _Case:
    class Net(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.matmul1, self.matmul2, self.matmul3 = ops.MatMul(), ops.MatMul(), ops.MatMul()
            # MindSpore casts to float16; simpar's Cast has no float16 (see the test)
            self.cast1, self.cast2 = ops.Cast("float32"), ops.Cast("float32")

        def construct(self, x: Any, y: Any, z: Any, w: Any) -> Any:
            m1 = self.matmul1(x, y)
            m2 = self.matmul2(z, w)
            return self.matmul3(self.cast1(m2), self.cast2(m1))

    return _Case(Net(), [((32, 8), F32), ((8, 16), F32), ((8, 16), F32), ((16, 32), F32)], 8)


def _two_matmul_transpose() -> _Case:
    class Net(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.matmul1, self.matmul2 = ops.MatMul(), ops.MatMul()
            self.transpose1, self.transpose2 = ops.Transpose((1, 0)), ops.Transpose((1, 0))

        def construct(self, x: Any, y: Any, b: Any) -> Any:
            out = self.matmul2(self.matmul1(x, y), b)
            return self.transpose2(self.transpose1(out))

    return _Case(Net(), [((128, 32), F32), ((32, 64), F32), ((64, 64), F32)], 16)


def _matmul_prelu() -> _Case:
    class Net(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.mul, self.prelu = ops.Mul(), ops.PReLU()

        def construct(self, x: Any, y: Any, b: Any) -> Any:
            return self.prelu(self.mul(x, y), b)

    x = (16, 3, 128, 32)
    return _Case(Net(), [(x, F32), (x, F32), ((3,), F32)], 16)


def _parameter_cast() -> _Case:
    class Net(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.weight1 = Parameter(np.ones([64, 64]).astype(np.float16) * 0.01, name="w")
            self.matmul1, self.matmul2, self.matmul3 = ops.MatMul(), ops.MatMul(), ops.MatMul()
            self.cast1, self.cast2 = ops.Cast("float32"), ops.Cast("float32")

        def construct(self, x: Any, y: Any, z: Any, w: Any) -> Any:
            m1 = self.matmul1(x, self.cast1(self.weight1))
            m2 = self.matmul2(z, self.cast2(self.weight1))
            return self.matmul3(m2, m1)

    return _Case(Net(), [((64, 64), F32)] * 4, 8)


def _two_bn() -> _Case:
    class Blockcell(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(64, momentum=0.9)

        def construct(self, x: Any) -> Any:
            return self.bn(x)

    class Net(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.block1, self.block2 = Blockcell(), Blockcell()
            self.relu, self.add = ops.ReLU(), ops.Add()
            self.bias = np.ones([64, 64], dtype=F32)  # a constant tensor, not a Parameter

        def construct(self, x: Any) -> Any:
            out = self.relu(self.block1(x))
            return self.block2(self.add(out, self.bias))

    return _Case(Net(), [((64, 64), F32)], 8)


def _prelu_cell() -> _Case:
    class PReLU(Cell):
        def __init__(self, channel: int = 256, w: float = 0.25) -> None:
            super().__init__()
            self.w = Parameter(np.full((channel,), w, dtype=F32), name="a")
            self.relu = ops.ReLU().shard(((1,),))
            self.sub = ops.Sub().shard(((1,), (1,)))
            self.prelu = ops.PReLU()

        def construct(self, x: Any) -> Any:
            u = self.relu(self.w)
            self.sub(self.w, u)  # fed AssignSub(w, .) under a depend; simpar has neither
            return self.prelu(x, u)

    class PReLUNet(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.prelu = PReLU(channel=256)
            self.loss = SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

        def construct(self, predict: Any, label: Any) -> Any:
            return self.loss(self.prelu(predict), label)

    return _Case(PReLUNet(), [((32, 256), F32), ((32,), np.int32)], 8, "data_parallel")


class _DoubleSubgraphsNet(Cell):
    """The Net and NetWithLoss of test_auto_parallel_double_subgraphs (one Mul used twice);
    ``cast_input`` adds the Cast MindSpore inserts before Mul for an int32 input."""

    def __init__(self, cast_input: bool) -> None:
        super().__init__()
        self.mul, self.relu = ops.Mul(), ops.ReLU()
        self.wd = Parameter(np.ones([8, 8, 8, 8], dtype=F32), name="wide")
        self.wt = Parameter(np.ones([8, 8, 8, 8], dtype=F32), name="l")
        self.cast = ops.Cast("float32") if cast_input else None
        self.sum, self.mean = ops.ReduceSum(axis=-1), ops.ReduceMean(axis=-1)

    def construct(self, x: Any) -> Any:
        if self.cast is not None:
            x = self.cast(x)
        predict = self.relu(self.mul(self.mul(x, self.wd), self.wt))
        return self.sum(predict), self.mean(predict)


def _double_subgraphs() -> _Case:
    return _Case(_DoubleSubgraphsNet(False), [((8, 8, 8, 8), F32)], 8)


def _double_subgraphs_train() -> _Case:
    return _Case(_DoubleSubgraphsNet(True), [((8, 8, 8, 8), np.int32)], 1, "data_parallel")


def _one_dev() -> _Case:
    class AllToAllNet(Cell):
        def __init__(self) -> None:
            super().__init__()
            self.matmul, self.transpose = ops.MatMul(), ops.Transpose((1, 0))
            self.weight = Parameter(np.ones([128, 32], dtype=F32), name="weight")
            self.loss = SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

        def construct(self, x: Any, label: Any) -> Any:
            return self.loss(self.transpose(self.matmul(x, self.weight)), label)

    return _Case(AllToAllNet(), [((32, 128), F32), ((32,), np.int32)], 1, "data_parallel")


#: Every network, with the algo parameters its MindSpore test sets.
CASES: dict[str, tuple[Callable[[], _Case], dict[str, Any]]] = {
    "two_matmul": (_two_matmul, {}),
    **{f"arithmetic_{v}": (functools.partial(_arithmetic, v), {}) for v in _ARITHMETIC_SHAPES},
    "double_star_cast": (_double_star_cast, {}),
    "two_matmul_transpose": (_two_matmul_transpose, {}),
    "matmul_prelu": (_matmul_prelu, {}),
    "parameter_cast": (_parameter_cast, {"elementwise_op_strategy_follow": True}),
    "two_bn": (_two_bn, {"elementwise_op_strategy_follow": True}),
    "prelu_cell": (_prelu_cell, {}),
    "double_subgraphs": (_double_subgraphs, {}),
    "double_subgraphs_train": (_double_subgraphs_train, {}),
    "one_dev": (_one_dev, {}),
}


# ------------------------------------------------------------------ the searches
@pytest.mark.parametrize("name", list(CASES))
def test_dynamic_programming_finds_the_optimum(name: str) -> None:
    """On every network DP's plan has the objective of the exact (ILP) optimum, and of brute
    force where the graph is small enough to enumerate."""
    build, algo = CASES[name]
    _set_algo(**algo)
    cg = _graph(build())
    sol = solve_dynamic_programming(cg)
    assert sol.cost == pytest.approx(solve_exact(cg).cost)
    if math.prod(len(n.candidates) for n in cg.nodes) <= 200_000:
        assert sol.cost == pytest.approx(brute_force(cg)[1])


def test_two_matmul() -> None:
    """tests/ut/python/parallel/test_auto_parallel_two_matmul.py::test_two_matmul (versions
    0d208e00, 0eb32593, bcfaff97, 70a98150, 14fe72f3: the same dict), 16 devices, after
    reset_cost_model_context and reset_algo_parameters (so r1.0's defaults)."""
    _, _, chosen = _search(_two_matmul())
    assert chosen == [
        ("MatMul", ((16, 1), (1, 1))),  # 'Default/network-Net/MatMul-op1'
        ("MatMul", ((16, 1), (1, 1))),  # 'Default/network-Net/MatMul-op0'
    ]


_ARITHMETIC_EXPECTED: dict[str, list[tuple[str, Strategy]]] = {
    # 'Default/network-Net/MatMul-op1', then 'Default/network-Net/FloorDiv-op0'
    "arithmetic": [("MatMul", ((2, 1), (1, 4))), ("FloorDiv", ((2, 4), (2, 4)))],
    "broadcast_both": [("MatMul", ((8, 1), (1, 1))), ("FloorDiv", ((8, 1), (1, 1)))],
    "broadcast_right": [("MatMul", ((4, 1), (1, 2))), ("FloorDiv", ((4, 2), (2,)))],
    "broadcast_left": [("MatMul", ((4, 1), (1, 2))), ("FloorDiv", ((4, 2), (1, 4, 2)))],
}


@pytest.mark.parametrize("variant", list(_ARITHMETIC_SHAPES))
def test_arithmetic(variant: str) -> None:
    """tests/ut/python/parallel/test_auto_parallel_arithmetic.py::test_auto_parallel_arithmetic
    and its _broadcast_both, _broadcast_right and _broadcast_left (versions 0eb32593, 1a54785f,
    a137fa1d: the same values), 8 devices: MatMul then FloorDiv, plain and broadcasting."""
    _, _, chosen = _search(_arithmetic(variant))
    assert chosen == _ARITHMETIC_EXPECTED[variant]


def test_double_star_cast() -> None:
    """tests/ut/python/parallel/test_auto_parallel_cast.py::test_double_star_graph (versions
    70a98150 and a137fa1d: the same dict), 8 devices: two MatMuls whose outputs are cast and
    multiplied. MindSpore casts to float16; simpar's Cast has no float16, so the casts keep
    float32 (pricing MatMul3 and the casts' outputs at 2 bytes instead, as MindSpore does,
    leads DP to the same plan)."""
    cg, sol, chosen = _search(_double_star_cast())
    assert chosen == [
        ("MatMul", ((8, 1), (1, 1))),   # 'Default/network-Net/MatMul-op2' (x @ y)
        ("MatMul", ((1, 1), (1, 8))),   # 'Default/network-Net/MatMul-op4' (z @ w)
        ("Cast", ((1, 8),)),            # 'Default/network-Net/Cast-op3' (cast of z @ w)
        ("Cast", ((8, 1),)),            # 'Default/network-Net/Cast-op1' (cast of x @ y)
        ("MatMul", ((1, 8), (8, 1))),   # 'Default/network-Net/MatMul-op0'
    ]
    assert all(e.costs[sol.choice[e.producer]][sol.choice[e.consumer]] == 0.0
               for e in cg.edges)  # nothing is redistributed


def test_two_matmul_transpose() -> None:
    """tests/ut/python/parallel/test_auto_parallel_transpose.py::test_two_matmul_transpose
    (versions 0eb32593, 1a54785f, a137fa1d: the same dict), 16 devices."""
    _, _, chosen = _search(_two_matmul_transpose())
    assert chosen == [
        ("MatMul", ((16, 1), (1, 1))),  # 'Default/network-Net/MatMul-op3'
        ("MatMul", ((16, 1), (1, 1))),  # 'Default/network-Net/MatMul-op2'
        ("Transpose", ((16, 1),)),      # 'Default/network-Net/Transpose-op1'
        ("Transpose", ((1, 16),)),      # 'Default/network-Net/Transpose-op0'
    ]


def test_matmul_prelu() -> None:
    """tests/ut/python/parallel/test_auto_parallel_matmul_prelu.py::test_matmul_prelu
    (version 0eb32593; the latest asserts the same), 16 devices: Mul then PReLU with a (3,)
    weight that is a graph input."""
    _, _, chosen = _search(_matmul_prelu())
    assert chosen == [
        ("Mul", ((16, 1, 1, 1), (16, 1, 1, 1))),  # 'Mul-op'
        ("PReLU", ((16, 1, 1, 1), (1,))),         # 'PReLU-op'
    ]


_PARAMETER_CAST_EXPECTED: list[tuple[str, Strategy]] = [
    ("Cast", ((1, 1),)),            # 'Default/network-Net/Cast-op2' (cast1)
    ("MatMul", ((8, 1), (1, 1))),   # 'Default/network-Net/MatMul-op1' (matmul1)
    ("Cast", ((1, 1),)),            # 'Default/network-Net/Cast-op4' (cast2)
    ("MatMul", ((8, 1), (1, 1))),   # 'Default/network-Net/MatMul-op3' (matmul2)
    ("MatMul", ((8, 1), (1, 1))),   # 'Default/network-Net/MatMul-op0' (matmul3)
]


def test_parameter_cast() -> None:
    """tests/ut/python/parallel/test_auto_parallel_parameter_cast.py::test_common_parameter
    (version 0eb32593; luojianet's regex version agrees), 8 devices with
    ``elementwise_op_strategy_follow=True``: a float16 Parameter cast twice to float32 and
    read by two MatMuls, whose outputs a third multiplies."""
    _set_algo(elementwise_op_strategy_follow=True)
    cg, sol, chosen = _search(_parameter_cast())
    mindspore = cg.total(_choice(cg, _PARAMETER_CAST_EXPECTED))
    assert chosen == _PARAMETER_CAST_EXPECTED, (
        f"MindSpore's plan costs {mindspore}, DP's {sol.cost}")


def test_two_bn() -> None:
    """tests/ut/python/parallel/test_auto_parallel_two_bn.py::test_two_bn (versions 0eb32593,
    a137fa1d, a83fb331: the same assertions), 8 devices with
    ``elementwise_op_strategy_follow=True``: BatchNorm, ReLU, Add of a constant, BatchNorm
    (a137fa1d's nn.BatchNorm1d, training). MindSpore asserts 4 strategies. (r1.0 had no
    BatchNormInfo and offered BatchNorm its batch split only; simpar offers every strategy of
    the later BatchNormInfo, and the search still picks the batch split.)"""
    _set_algo(elementwise_op_strategy_follow=True)
    cg, _, chosen = _search(_two_bn())
    bn = ((8, 1), (1,), (1,), (1,), (1,))
    assert len(cg.nodes) == 4
    assert chosen == [
        ("BatchNorm", bn),               # 'BatchNorm-op'
        ("ReLU", ((8, 1),)),             # 'ReLU-op'
        ("Add", ((8, 1), (8, 1))),       # 'TensorAdd-op'
        ("BatchNorm", bn),               # 'BatchNorm-op'
    ]


def test_prelu_cell() -> None:
    """tests/ut/python/parallel/test_prelu_cell.py::test_prelu_cell (version 0ec70068), 8
    devices: a PReLU cell whose slope is ReLU(w), ReLU and Sub set to ((1,),) by the user, then
    the sparse softmax cross entropy, trained through Model (a data-parallel _VirtualDataset).
    MindSpore runs it in semi_auto_parallel and asserts only that it compiles and trains; here
    the search plans it, the user strategies stay, and the rest is data parallel."""
    _, _, chosen = _search(_prelu_cell())
    assert chosen == [
        ("ReLU", ((1,),)),                                  # set by the user
        ("Sub", ((1,), (1,))),                              # set by the user
        ("PReLU", ((8, 1), (1,))),
        ("SparseSoftmaxCrossEntropyWithLogits", ((8, 1), (8,))),
    ]


def test_double_subgraphs() -> None:
    """tests/ut/python/parallel/test_auto_parallel_double_subgraphs.py::test_double_subgraphs
    (versions 06931889 and 28f47595: the same assertions), 8 devices: one Mul used twice,
    ReLU, then ReduceSum and ReduceMean over the last axis as two outputs. (MindSpore also sets
    _set_multi_subgraphs for its two optimizers' graphs; the forward searched here is one.)"""
    _, _, chosen = _search(_double_subgraphs())
    batch = ((8, 1, 1, 1),)
    assert chosen == [
        ("Mul", batch * 2),        # 'Mul-op'
        ("Mul", batch * 2),        # 'Mul-op'
        ("ReLU", batch),           # 'ReLU-op'
        ("ReduceSum", batch),      # 'ReduceSum-op'
        ("ReduceMean", batch),     # 'ReduceMean-op'
    ]


def test_double_subgraphs_train() -> None:
    """tests/ut/python/parallel/test_auto_parallel_double_subgraphs.py::
    test_double_subgraphs_train (versions 06931889 and 28f47595), 1 device through Model: the
    int32 input is cast to float32 before the Mul (MindSpore's 'Cast-op')."""
    _, _, chosen = _search(_double_subgraphs_train())
    whole = ((1, 1, 1, 1),)
    assert chosen == [
        ("Cast", whole),           # 'Cast-op'
        ("Mul", whole * 2),        # 'Mul-op'
        ("Mul", whole * 2),        # 'Mul-op'
        ("ReLU", whole),           # 'ReLU-op'
        ("ReduceSum", whole),      # 'ReduceSum-op'
        ("ReduceMean", whole),     # 'ReduceMean-op'
    ]


def test_one_dev() -> None:
    """tests/ut/python/parallel/test_one_dev.py::test_one_dev (versions 253c7eb9 and 086a8719:
    the same assertions), 1 device through Model: MatMul with a Parameter, Transpose, and
    the sparse softmax cross entropy (MindSpore's 'SoftmaxCrossEntropyWithLogits-op' reads
    one-hot (32, 32) labels: [[1, 1], [1, 1]]; simpar's sparse op reads the (32,) ids)."""
    _, _, chosen = _search(_one_dev())
    assert chosen == [
        ("MatMul", ((1, 1), (1, 1))),                         # 'MatMul-op'
        ("Transpose", ((1, 1),)),                             # 'Transpose-op'
        ("SparseSoftmaxCrossEntropyWithLogits", ((1, 1), (1,))),
    ]
