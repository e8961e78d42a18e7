"""FloorDiv, PReLU, BatchNorm and Assign (the ops of MindSpore's r1.0 auto-parallel tests that
simpar lacked), in one process: kernels against closed forms and MindSpore's own examples,
VJPs against finite differences, the sharding rules (layouts, the op's own collectives,
accepted and refused strategies), their cost classes, and the nn Cells.

    python -m pytest -q tests/test_ops_floordiv_prelu_bn_assign.py

The multi-rank checks are in tests/test_ops_floordiv_prelu_bn_assign_mpi.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from simpar import graph, nn, ops
from simpar.cost import mindspore as ms
from simpar.cost.interface import MindSporeCostModel, SimparCostModel
from simpar.mesh import DeviceMesh
from simpar.ops import StrategyError
from simpar.ops.kernels import Tape
from simpar.parallel import get_parallel_info
from simpar.runtime.lowering import build_program
from tests.ophelpers import fd_check

RNG = np.random.default_rng(23)
F32 = 4


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def _bn_inputs(x_shape: tuple[int, ...]) -> list[np.ndarray]:
    c = x_shape[1]
    return [3.0 + _r(*x_shape), _r(c), _r(c), _r(c), 0.5 + np.abs(_r(c))]


# ------------------------------------------------------------------ kernels
def test_prelu_matches_mindsporess_example() -> None:
    # mindspore.ops.PReLU's docstring: a negative slope makes negative inputs positive.
    x = np.arange(-6, 6, dtype=np.float32).reshape(2, 3, 2)
    w = np.array([0.1, 0.6, -0.3], dtype=np.float32)
    want = np.array([[[-0.6, -0.5], [-2.4, -1.8], [0.6, 0.3]],
                     [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]], dtype=np.float32)
    y = ops.PReLU().kernel(x, w)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-6)
    shared = ops.PReLU().kernel(x, np.array([0.25], dtype=np.float32))
    np.testing.assert_allclose(shared, np.where(x > 0, x, 0.25 * x))


def test_floordiv_rounds_toward_minus_infinity() -> None:
    op = ops.FloorDiv()
    np.testing.assert_array_equal(op.kernel(np.array([-7.0, 7.0, 5.5, 1.0]),
                                            np.array([2.0, -2.0, 0.5, 3.0])),
                                  [-4.0, -4.0, 11.0, 0.0])
    ints = op.kernel(np.array([[-7], [7]], dtype=np.int32), np.array([2, -2, 3], dtype=np.int32))
    assert ints.dtype == np.int32
    np.testing.assert_array_equal(ints, [[-4, 3, -3], [3, -4, 2]])
    # Broadcasting as Add's: (4, 1) against (3,)
    assert op.kernel(_r(4, 1), 1.0 + np.abs(_r(3))).shape == (4, 3)


def test_batch_norm_training_and_inference_match_the_formula() -> None:
    x, scale, bias, mean, var = _bn_inputs((4, 3, 2, 5))
    view = (1, 3, 1, 1)
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    sigma2 = x.var(axis=(0, 2, 3), keepdims=True)       # biased, as MindSpore's training
    want = (x - mu) / np.sqrt(sigma2 + 1e-5) * scale.reshape(view) + bias.reshape(view)
    y, batch_mean, batch_var = ops.BatchNorm(True).kernel(x, scale, bias, mean, var)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    # the statistics the moving ones are updated with: the mean, the unbiased variance
    np.testing.assert_allclose(batch_mean, mu.reshape(-1), rtol=1e-12)
    np.testing.assert_allclose(batch_var, x.var(axis=(0, 2, 3), ddof=1), rtol=1e-12)
    infer = (x - mean.reshape(view)) / np.sqrt(var.reshape(view) + 1e-3) * scale.reshape(
        view) + bias.reshape(view)
    np.testing.assert_allclose(ops.BatchNorm(False, 1e-3).kernel(x, scale, bias, mean, var),
                               infer, rtol=1e-12)
    x2 = _bn_inputs((6, 3))
    y2 = ops.BatchNorm(True).kernel(*x2)[0]
    np.testing.assert_allclose(y2.mean(axis=0), x2[2], atol=1e-12)  # the mean is the bias
    f32 = ops.BatchNorm(True).kernel(*(a.astype(np.float32) for a in x2))
    assert [a.dtype for a in f32] == [np.float32] * 3


def test_assign_returns_the_value_in_the_variables_dtype() -> None:
    variable, value = _r(2, 3).astype(np.float32), _r(2, 3)
    y = ops.Assign().kernel(variable, value)
    assert y.dtype == np.float32 and y is not value
    np.testing.assert_allclose(y, value.astype(np.float32))
    assert not np.array_equal(variable, value.astype(np.float32))  # the variable is untouched


# ------------------------------------------------------------------ gradients
class _FirstOutput:
    """A training BatchNorm seen through its first output (y), for ``fd_check``: its
    statistics outputs carry no gradient."""

    def __init__(self, op: ops.BatchNorm) -> None:
        self.op = op

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return self.op.kernel(*xs)[0]

    def vjp(self, xs: list[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return self.op.vjp(xs, None, (dy, None, None))


FD = [
    ("PReLU", ops.PReLU(), [_r(3, 4, 2), _r(4)], (0, 1)),
    ("PReLU_2d", ops.PReLU(), [_r(5, 3), _r(3)], (0, 1)),
    ("PReLU_shared", ops.PReLU(), [_r(2, 3, 2), _r(1)], (0, 1)),
    ("BatchNorm_train_4d", _FirstOutput(ops.BatchNorm(True)), _bn_inputs((3, 2, 2, 2)),
     (0, 1, 2)),
    ("BatchNorm_train_2d", _FirstOutput(ops.BatchNorm(True, 1e-3)), _bn_inputs((5, 3)),
     (0, 1, 2)),
    ("BatchNorm_infer", ops.BatchNorm(False), _bn_inputs((3, 2, 2, 2)), (0, 1, 2)),
]


@pytest.mark.parametrize("name,op,inputs,diff", FD, ids=[f[0] for f in FD])
def test_vjp_matches_finite_differences(name: str, op: Any, inputs: list[np.ndarray],
                                        diff: tuple[int, ...]) -> None:
    fd_check(op, inputs, diff=diff)


def test_batch_norm_gives_the_moving_statistics_no_gradient() -> None:
    xs = _bn_inputs((3, 2, 2, 2))
    op = ops.BatchNorm(True)
    y, dy = op.kernel(*xs), _r(3, 2, 2, 2)
    grads = op.vjp(xs, y, (dy, _r(2), _r(2)))
    assert grads[3] is None and grads[4] is None
    # only y's cotangent reaches x, as in MindSpore's bprop: the statistics' are not used
    for g, h in zip(grads[:3], op.vjp(xs, y, (dy, None, None))[:3]):
        np.testing.assert_array_equal(g, h)
    assert [op.gives_gradient(i, np.dtype(np.float64)) for i in range(5)] == [
        True, True, True, False, False]


def test_floordiv_gives_no_gradient_to_either_input() -> None:
    op = ops.FloorDiv()
    x, y = _r(4, 8), 1.0 + np.abs(_r(1, 8))
    assert op.vjp([x, y], op.kernel(x, y), _r(4, 8)) == (None, None)
    assert not op.gives_gradient(0, np.dtype(np.float64))
    assert not op.gives_gradient(1, np.dtype(np.float64))
    assert op.tape is Tape.NOTHING
    # y is replicated over the row cut, yet no gradient AllReduce is planned for it.
    info = get_parallel_info(op.shard(((2, 4), (1, 4))), [(4, 8), (1, 8)], 8, 0)
    assert info["forward_comm"] == [] and info["backward_comm"] == []


def test_assign_sends_the_cotangent_to_the_variable_as_mindspore_does() -> None:
    # MindSpore's bprop for Assign is (dout, zeros_like(value)).
    op = ops.Assign()
    variable, value, dy = _r(2, 3), _r(2, 3), _r(2, 3)
    dvar, dval = op.vjp([variable, value], op.kernel(variable, value), dy)
    assert dval is None and dvar is not None
    np.testing.assert_array_equal(dvar, dy)
    assert op.gives_gradient(0, np.dtype(np.float32)) and not op.gives_gradient(
        1, np.dtype(np.float32))
    ints = np.zeros((2, 3), dtype=np.int32)
    assert op.vjp([ints, value], op.kernel(ints, value), dy) == (None, None)


# ------------------------------------------------------------------ sharding rules
def test_prelu_weight_follows_the_channel_cut() -> None:
    info = get_parallel_info(ops.PReLU().shard(((2, 4, 1, 1), (4,))), [(4, 8, 2, 2), (8,)],
                             8, 5)
    assert info["device_matrix"] == [2, 4, 1, 1]
    assert info["inputs_tensor_map"] == [[3, 2, 1, 0], [2]]
    assert info["outputs_tensor_map"] == [[3, 2, 1, 0]]
    assert info["inputs_slice_shape"] == [[2, 2, 2, 2], [2]]
    assert info["forward_comm"] == []
    # The weight's gradient: this rank's partial sum, completed over the batch cut [1, 5].
    assert [(c["op"], c["group"]) for c in info["backward_comm"]] == [("AllReduce", [1, 5])]
    assert info["backward_comm"][0]["reason"] == "gradient of input 1 (sum over its replicas)"
    assert info["flops"] == 2 * 2 * 2 * 2 * 2


def test_prelu_shared_weight_is_replicated() -> None:
    sh = ops.PReLU().sharding([(4, 8, 2), (1,)], 8, ((1, 4, 2), (1,)))
    assert sh.in_layouts[1].local_shape() == (1,)
    assert [c.groups() for c in sh.backward_comm] == [[tuple(range(8))]]  # weight on every rank


@pytest.mark.parametrize("shapes,strategy,exc,words", [
    ([(4, 8, 2, 2), (8,)], ((2, 4, 1, 1), (2,)), StrategyError,
     r"PReLU: the weight's strategy \(2,\) must equal the cut of x's channel dimension: x's "
     r"strategy \(2, 4, 1, 1\) cuts dimension 1 \(C = 8\) into 4, so the weight's must be "
     r"\(4,\)"),
    ([(4, 8, 2, 2), (1,)], ((1, 4, 1, 1), (2,)), StrategyError,
     r"strategy \(2,\) for input 1 cuts dimension 0 of shape \(1,\) into 2 parts, but that "
     "dimension has size 1"),
    ([(4, 8, 2, 2), (8,)], ((2, 4, 1), (4,)), StrategyError,
     "has 3 entries but the input has 4 dimensions"),
    ([(4, 8, 2, 2), (8,)], ((3, 1, 1, 1), (1,)), StrategyError, "4 is not divisible by 3"),
    ([(8,), (1,)], ((2,), (1,)), ValueError, r"PReLU: x must have rank >= 2, \(N, C, ...\)"),
    ([(4, 8), (4,)], ((1, 1), (1,)), ValueError,
     r"PReLU: weight must have shape \(8,\), one slope per channel of x \(4, 8\), or \(1,\)"),
])
def test_prelu_refuses(shapes: list[tuple[int, ...]], strategy: Any, exc: type,
                       words: str) -> None:
    with pytest.raises(exc, match=words):
        ops.PReLU().sharding(shapes, 8, strategy)


def test_prelu_candidates_cut_the_weight_with_the_channel() -> None:
    cands = ops.PReLU().candidate_strategies([(4, 8, 2, 2), (8,)], 8)
    assert ((1, 8, 1, 1), (8,)) in cands and ((4, 2, 1, 1), (2,)) in cands
    assert all(s[1][0] == s[0][1] for s in cands)
    shared = ops.PReLU().candidate_strategies([(4, 8, 2, 2), (1,)], 8)
    assert ((1, 8, 1, 1), (1,)) in shared and all(s[1] == (1,) for s in shared)


BN_SHAPES = [(8, 4, 2, 2), (4,), (4,), (4,), (4,)]


def test_batch_norm_batch_split_allreduces_channel_statistics() -> None:
    op = ops.BatchNorm(True).shard(((4, 2, 1, 1), (2,), (2,), (2,), (2,)))
    info = get_parallel_info(op, BN_SHAPES, 8, 5, "float64")
    assert info["device_matrix"] == [4, 2, 1, 1]
    assert info["inputs_tensor_map"] == [[3, 2, 1, 0], [2], [2], [2], [2]]
    assert info["inputs_slice_shape"][:2] == [[2, 2, 2, 2], [2]]
    group = [1, 3, 5, 7]  # rank 5's channels 2..3 over every batch block
    assert [(c["op"], c["group"]) for c in info["forward_comm"]] == [("AllReduce", group)] * 2
    assert [c["bytes"] for c in info["forward_comm"]] == [2 * 3 * 2 * 8 // 4] * 2  # 2 numbers
    bwd = info["backward_comm"]
    # dx's stacked sums (4 numbers), then scale's and bias's gradients (their Mirror); the
    # moving mean and variance get none.
    assert [(c["op"], c["group"]) for c in bwd] == [("AllReduce", group)] * 3
    assert [c["bytes"] for c in bwd] == [2 * 3 * 4 * 8 // 4] + [2 * 3 * 2 * 8 // 4] * 2
    assert "dy and dy*xhat" in bwd[0]["reason"]


def test_batch_norm_spatial_split_is_a_statistics_axis_too() -> None:
    # MindSpore's BatchNormInfo: N, H and W cuts all join the statistics' AllReduce group.
    sh = ops.BatchNorm(True).sharding(BN_SHAPES, 8, ((2, 1, 2, 2), (1,), (1,), (1,), (1,)))
    assert [c.groups() for c in sh.internal_forward] == [[tuple(range(8))]] * 2


def test_batch_norm_without_a_statistics_cut_communicates_nothing() -> None:
    only_c = ops.BatchNorm(True).sharding(BN_SHAPES, 4, ((1, 4, 1, 1), (4,), (4,), (4,), (4,)))
    assert only_c.forward_comm == [] and only_c.backward_comm == []
    infer = ops.BatchNorm(False).sharding(BN_SHAPES, 8, ((4, 2, 1, 1), (2,), (2,), (2,), (2,)))
    assert infer.forward_comm == [] and infer.internal_backward == ()
    assert [c.reason for c in infer.backward_comm] == [
        "gradient of input 1 (sum over its replicas)", "gradient of input 2 (sum over its "
        "replicas)"]


def test_batch_norm_repeated_calculation_stays_out_of_the_statistics_group() -> None:
    sh = ops.BatchNorm(True).sharding([(4, 4), (4,), (4,), (4,), (4,)], 8,
                                      ((2, 1), (1,), (1,), (1,), (1,)))
    assert sh.device_matrix == (2, 1, 4) and sh.repeat == 4
    group = DeviceMesh(sh.device_matrix).group_of(0, (0,))
    assert [c.group(0) for c in sh.internal_forward] == [group, group] == [(0, 4), (0, 4)]


@pytest.mark.parametrize("shapes,strategy,exc,words", [
    (BN_SHAPES, ((2, 2, 1, 1), (2,), (1,), (2,), (2,)), StrategyError,
     "Strategies of relevant dimensions are not equal: input 0 dim 1 is cut 2 but input 2 "
     "dim 0 is cut 1"),
    (BN_SHAPES, ((2, 2, 1, 1), (2,), (2,), (2,)), StrategyError,
     "has 4 entries but the operator has 5 inputs"),
    (BN_SHAPES, ((3, 1, 1, 1), (1,), (1,), (1,), (1,)), StrategyError,
     "8 is not divisible by 3"),
    ([(8, 4, 2), (4,), (4,), (4,), (4,)], ((1, 1, 1), (1,), (1,), (1,), (1,)), ValueError,
     r"BatchNorm: x must be \(N, C, H, W\) or \(N, C\), got shape \(8, 4, 2\)"),
    ([(8, 4), (4,), (4,), (4,), (2,)], ((1, 1), (1,), (1,), (1,), (1,)), ValueError,
     r"BatchNorm: variance has shape \(2,\) but must have shape \(4,\)"),
])
def test_batch_norm_refuses(shapes: list[tuple[int, ...]], strategy: Any, exc: type,
                            words: str) -> None:
    with pytest.raises(exc, match=words):
        ops.BatchNorm(True).sharding(shapes, 8, strategy)


@pytest.mark.parametrize("make,exc,words", [
    (lambda: ops.BatchNorm(is_training=1), TypeError, "is_training must be a bool, got int 1"),
    (lambda: ops.BatchNorm(epsilon=0.0), ValueError, r"epsilon must be in \(0, 1\], got 0.0"),
    (lambda: ops.BatchNorm(epsilon="1e-5"), TypeError, "epsilon must be a float"),
    (lambda: ops.BatchNorm(momentum=1.5), ValueError, r"momentum must be in \[0, 1\], got 1.5"),
    (lambda: ops.BatchNorm(data_format="NHWC"), ValueError,
     "data_format must be 'NCHW' .* got 'NHWC'"),
])
def test_batch_norm_refuses_bad_attributes(make: Any, exc: type, words: str) -> None:
    with pytest.raises(exc, match=words):
        make()


def test_bad_values_are_refused_by_the_kernels() -> None:
    with pytest.raises(TypeError, match="PReLU: weight must be a floating-point array"):
        ops.PReLU().kernel(_r(2, 3), np.ones(3, dtype=np.int32))
    with pytest.raises(TypeError, match="BatchNorm: scale must be a floating-point array"):
        ops.BatchNorm(True).kernel(_r(4, 2), np.ones(2, dtype=np.int64), *(_r(2),) * 3)
    # Shapes are checked where arrays come in (op(...) eagerly, tracing in a program), not by
    # the kernel on every step.
    with pytest.raises(ValueError, match="FloorDiv: input shapes .* do not broadcast"):
        ops.FloorDiv()(_r(2, 3), _r(2, 4))
    with pytest.raises(ValueError, match=r"Assign: value has shape \(3, 2\) but must have the "
                                         r"variable's shape \(2, 3\)"):
        ops.Assign().kernel(_r(2, 3), _r(3, 2))


def test_floordiv_and_assign_rules_are_the_arithmetic_ones() -> None:
    sh = ops.FloorDiv().sharding([(8, 1, 8), (4, 8)], 8, ((2, 1, 4), (1, 4)))
    assert sh.device_matrix == (2, 1, 4)
    with pytest.raises(StrategyError, match="has size 1"):
        ops.FloorDiv().sharding([(8, 1, 8), (4, 8)], 8, ((2, 2, 2), (2, 2)))
    with pytest.raises(StrategyError, match="Strategies of relevant dimensions are not equal: "
                                            "input 0 dim 1 is cut 4 but input 1 dim 1 is cut 2"):
        ops.Assign().sharding([(8, 16), (8, 16)], 8, ((2, 4), (2, 2)))
    info = get_parallel_info(ops.Assign().shard(((2, 4), (2, 4))), [(8, 16), (8, 16)], 8, 5)
    assert info["inputs_tensor_map"] == [[1, 0], [1, 0]] and info["forward_comm"] == []
    assert info["backward_comm"] == [] and info["flops"] == 0
    # Repeated: only the variable's gradient is completed over its replicas.
    rep = ops.Assign().sharding([(8, 16), (8, 16)], 8, ((2, 1), (2, 1)))
    assert [c.reason for c in rep.backward_comm] == ["gradient of input 0 (sum over its "
                                                     "replicas)"]


# ------------------------------------------------------------------ cost models
def test_mindspore_cost_classes_are_registered() -> None:
    assert [ms.mindspore_cost_class(n) for n in ("FloorDiv", "PReLU", "BatchNorm", "Assign")] == [
        "FloorDivCost", "PReLUCost", "BatchNormCost", "AssignCost"]


def test_prelu_cost_worked_by_hand() -> None:
    # x (64, 32, 4, 4) cut (8, 1, 1, 1), weight (32,) a Parameter replicated on 8 devices.
    sh = ops.PReLU().sharding([(64, 32, 4, 4), (32,)], 8, ((8, 1, 1, 1), (1,)))
    x, w = 8 * 32 * 16 * F32, 32 * F32
    c = ms.op_cost(sh, parameters={1})
    assert c == ms.MindSporeOpCost("PReLU", "PReLUCost", x + w, w, 0.0, w, x + w, x)
    assert ms.op_cost(sh).memory == 0.0       # nothing parameter-involved: nothing kept
    assert ms.op_cost(sh, parameters={1}, prev_in_memory={0}).memory == w


def test_batch_norm_cost_worked_by_hand() -> None:
    shapes = [(64, 32, 4, 4)] + [(32,)] * 4
    dp = ops.BatchNorm(True).sharding(shapes, 8, ((8, 1, 1, 1),) + ((1,),) * 4)
    x, p = 8 * 32 * 16 * F32, 32 * F32
    c = ms.op_cost(dp, parameters={1, 2, 3, 4})
    # MindSpore charges forward communication only for a channel cut, and every Parameter
    # among the last four at scale's slice when it is not split over every device.
    assert (c.cost_class, c.forward_computation, c.forward_communication) == (
        "BatchNormCost", x + 4 * p, 0.0)
    assert (c.backward_communication, c.backward_computation) == (4 * p, 0.0)
    # the outputs, always (y and the two (C,) batch statistics), and x
    assert c.memory == x + x + 2 * p
    mp = ops.BatchNorm(True).sharding(shapes, 8, ((1, 8, 1, 1),) + ((8,),) * 4)
    cm = ms.op_cost(mp, parameters={1, 2})
    x_mp, p_mp = 64 * 4 * 16 * F32, 4 * F32
    assert (cm.forward_computation, cm.forward_communication, cm.backward_communication) == (
        x_mp + 4 * p_mp, x_mp, 0.0)


def test_floordiv_and_assign_costs_worked_by_hand() -> None:
    sh = ops.FloorDiv().sharding([(64, 32), (64, 32)], 8, ((2, 2), (2, 2)))
    x = 32 * 16 * F32
    c = ms.op_cost(sh, parameters={1})
    assert (c.cost_class, c.forward_computation, c.backward_communication, c.memory) == (
        "FloorDivCost", 2 * x, x, x)
    sa = ops.Assign().sharding([(64, 32), (64, 32)], 8, ((2, 2), (2, 2)))
    a = ms.op_cost(sa, parameters={0}, involved={0, 1})
    assert (a.cost_class, a.forward_computation, a.backward_communication) == (
        "AssignCost", 2 * x, x)
    assert a.memory == x                      # the variable (involved), not the value
    assert ms.op_cost(sa, parameters={0, 1}, prev_in_memory={0}).memory == x


class _Net(nn.Cell):
    """BatchNorm2d -> PReLU, then FloorDiv and Assign branches added back (shapes only)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4, dtype=np.float64)
        self.prelu = nn.PReLU(4, dtype=np.float64)
        self.v = nn.Parameter(np.zeros((8, 4, 2, 2)))
        self.floordiv, self.assign = ops.FloorDiv(), ops.Assign()
        self.add1, self.add2 = ops.Add(), ops.Add()

    def construct(self, x: Any) -> Any:
        h = self.prelu(self.bn(x))
        h = self.add1(h, self.assign(self.v, h))
        return self.add2(h, self.floordiv(h, np.asarray(0.5)))


def test_both_cost_models_price_a_program_of_the_new_ops() -> None:
    net = nn.WithLossCell(_Net(), nn.MSELoss()).set_train()   # BatchNorm's batch statistics
    net.name_parameters()
    g = graph.trace(net, [((8, 4, 2, 2), np.float64), ((8, 4, 2, 2), np.float64)])
    program = build_program(g, 8, "data_parallel", "data_parallel")
    report = program.cost("ascend910a")
    by_type = {r.op_type: r for r in report.ops}
    assert {"BatchNorm", "PReLU", "FloorDiv", "Assign"} <= set(by_type)
    assert by_type["BatchNorm"].op_comm > 0        # the split-batch statistics
    assert by_type["FloorDiv"].op_comm == 0 and by_type["Assign"].op_comm == 0
    assert report.memory[0].activations > 0
    for model in (SimparCostModel("ascend910a"), MindSporeCostModel()):
        assert model.program(program) > 0
    # The backward never reaches past FloorDiv; Assign's value gets no gradient either.
    bwd = [s for s in program.schedule(0) if s.backward and s.collective is not None]
    assert not any("FloorDiv" in s.label for s in bwd)
    names = set(program.param_layouts)
    assert {f"_backbone.{p}" for p in ("bn.gamma", "bn.beta", "bn.moving_mean",
                                        "bn.moving_variance", "prelu.w", "v")} <= names


# ------------------------------------------------------------------ nn Cells
def test_nn_prelu_weight_starts_at_a_quarter() -> None:
    cell = nn.PReLU(3)
    assert cell.w.shape == (3,) and np.all(cell.w.data == 0.25)
    assert cell.w.dtype == np.float32 and cell.w.requires_grad
    assert nn.PReLU().w.shape == (1,)
    np.testing.assert_allclose(nn.PReLU(2, [0.1, 0.2], np.float64).w.data, [0.1, 0.2])
    x = _r(2, 3, 2).astype(np.float32)
    np.testing.assert_allclose(cell(x), np.where(x > 0, x, 0.25 * x))


@pytest.mark.parametrize("make,exc,words", [
    (lambda: nn.PReLU(0), ValueError, "PReLU: channel must be an int >= 1, got 0"),
    (lambda: nn.PReLU(2, [0.1, 0.2, 0.3]), ValueError, "w must be one float or 2 values"),
    (lambda: nn.PReLU(2, "a"), TypeError, "w must be a float"),
    (lambda: nn.BatchNorm2d(0), ValueError, "BatchNorm2d: num_features must be an int >= 1"),
    (lambda: nn.BatchNorm1d(4, momentum=2.0), ValueError, r"momentum must be a float in \[0, 1"),
    (lambda: nn.BatchNorm2d(4, affine=1), TypeError, "affine must be a bool"),
    (lambda: nn.BatchNorm2d(4)(np.ones((2, 4), np.float32)), ValueError,
     r"BatchNorm2d: x must have rank 4"),
])
def test_nn_cells_refuse(make: Any, exc: type, words: str) -> None:
    with pytest.raises(exc, match=words):
        make()


def test_nn_batch_norm_parameters_and_modes() -> None:
    bn = nn.BatchNorm2d(3, eps=1e-3, dtype=np.float64)
    assert not bn.training                             # a Cell starts in evaluation mode,
    bn.set_train()                                     # as MindSpore's do
    params = dict(bn.parameters_and_names())
    assert set(params) == {"gamma", "beta", "moving_mean", "moving_variance"}
    assert [p.requires_grad for p in params.values()] == [True, True, False, False]
    assert {p.name for p in bn.trainable_params()} == {"gamma", "beta"}
    assert bn.bn_train.is_training and not bn.bn_infer.is_training
    assert bn.bn_train.momentum == pytest.approx(0.1)   # nn's 0.9 weighs the moving stats
    x = 2.0 + _r(4, 3, 2, 2)
    y = bn(x)                                          # training: batch statistics
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), 0.0, atol=1e-12)
    # that forward folded the batch statistics into the moving ones (0 and 1 before)
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3), ddof=1)
    np.testing.assert_allclose(bn.moving_mean.data, 0.1 * mean, rtol=1e-12)
    np.testing.assert_allclose(bn.moving_variance.data, 0.9 + 0.1 * var, rtol=1e-12)
    bn.set_train(False)                                # normalised with the moving ones
    view = (1, 3, 1, 1)
    np.testing.assert_allclose(bn(x), (x - 0.1 * mean.reshape(view)) / np.sqrt(
        0.9 + 0.1 * var.reshape(view) + 1e-3), rtol=1e-12)
    fixed = nn.BatchNorm1d(3, use_batch_statistics=True, dtype=np.float64).set_train(False)
    np.testing.assert_allclose(fixed(_r(5, 3)).std(axis=0), 1.0, rtol=1e-3)
    assert not nn.BatchNorm2d(2, affine=False).gamma.requires_grad
