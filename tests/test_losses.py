"""MSELoss, L1Loss and their primitives Abs and Square, in one process: values against numpy,
gradients against finite differences, bad input, and the plan of a sharded loss (planning is
pure, so an 8-device plan needs no MPI). Training on real ranks: tests/test_losses_mpi.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from simpar import graph, nn, ops
from simpar.nn import presets
from simpar.parallel import get_parallel_info
from simpar.runtime import OpStep, ParallelProgram, build_program
from tests.ophelpers import fd_check

RNG = np.random.default_rng(5)
LOSSES: dict[str, tuple[type[nn.MSELoss] | type[nn.L1Loss], Callable[[np.ndarray], Any]]] = {
    "MSELoss": (nn.MSELoss, lambda d: d * d), "L1Loss": (nn.L1Loss, np.abs)}
REDUCE: dict[str, Callable[[np.ndarray], Any]] = {
    "none": lambda e: e, "mean": np.mean, "sum": np.sum}
SHAPES = [((8, 4), (8, 4)), ((3,), (2, 3)), ((6, 1), (6, 5)), ((2, 3, 4), (4,)), ((), (5,))]


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


# ------------------------------------------------------------------ Abs and Square
@pytest.mark.parametrize("make,want", [(ops.Abs, np.abs), (ops.Square, np.square)],
                         ids=["Abs", "Square"])
def test_unary_kernels_match_numpy(make, want):
    for x in (_r(4, 5), _r(7), np.asarray(-2.5), _r(2, 3).astype(np.float32)):
        y = make()(x)
        assert y.dtype == x.dtype and y.shape == x.shape
        np.testing.assert_array_equal(y, want(x))


@pytest.mark.parametrize("make", [ops.Abs, ops.Square], ids=["Abs", "Square"])
def test_unary_vjp_matches_finite_differences(make):
    fd_check(make(), [_r(3, 4)])


def test_abs_gradient_at_zero_is_zero_and_sign_elsewhere():
    x = np.array([-2.0, -0.0, 0.0, 3.0])
    dy = np.array([5.0, 7.0, 11.0, 13.0])
    (g,) = ops.Abs().vjp([x], np.abs(x), dy)
    np.testing.assert_array_equal(g, [-5.0, 0.0, 0.0, 13.0])
    (g,) = ops.Square().vjp([x], np.square(x), dy)
    np.testing.assert_array_equal(g, [-20.0, 0.0, 0.0, 78.0])


@pytest.mark.parametrize("make", [ops.Abs, ops.Square], ids=["Abs", "Square"])
def test_unary_sharding_is_pointwise(make):
    """Cut (2, 4) on 8 devices: rank 5, at (1, 1), holds and computes block [4:8, 4:8];
    no collective either way."""
    info = get_parallel_info(make().shard(((2, 4),)), [(8, 16)], 8, 5)
    assert info["device_matrix"] == [2, 4]
    assert info["inputs_tensor_map"] == [[1, 0]] and info["outputs_tensor_map"] == [[1, 0]]
    assert info["inputs_slice_shape"] == [[4, 4]]
    assert info["forward_comm"] == [] and info["backward_comm"] == []


def test_registered_and_exported():
    assert {"Abs", "Square"} <= set(ops.registry())
    assert {"Abs", "Square"} <= set(ops.__all__)
    assert {"MSELoss", "L1Loss"} <= set(nn.__all__)


# ------------------------------------------------------------------ loss values
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_loss_matches_numpy(name, reduction, shapes):
    cls, elementwise = LOSSES[name]
    x, y = _r(*shapes[0]), _r(*shapes[1])
    got = cls(reduction)(x, y)
    want = REDUCE[reduction](elementwise(x - y))
    assert np.shape(got) == np.shape(want) == (np.broadcast_shapes(x.shape, y.shape)
                                               if reduction == "none" else ())
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)


def test_mindspore_doc_examples_and_defaults():
    assert nn.MSELoss().reduction == nn.L1Loss().reduction == "mean"
    x = np.array([1.0, 2.0, 3.0])
    assert np.isclose(nn.MSELoss()(x, np.array([1.0, 1.0, 1.0])), 5.0 / 3.0)
    assert np.isclose(nn.L1Loss()(x, np.array([1.0, 2.0, 2.0])), 1.0 / 3.0)
    both = np.array([[1.0, 1.0, 1.0], [1.0, 2.0, 2.0]])
    np.testing.assert_array_equal(nn.MSELoss("none")(x, both), [[0, 1, 4], [0, 0, 1]])
    np.testing.assert_array_equal(nn.L1Loss("none")(x, both), [[0, 1, 2], [0, 0, 1]])


def test_float32_stays_float32():
    x, y = _r(4, 3).astype(np.float32), _r(4, 3).astype(np.float32)
    for cls in (nn.MSELoss, nn.L1Loss):
        for reduction in REDUCE:
            assert np.asarray(cls(reduction)(x, y)).dtype == np.float32


# ------------------------------------------------------------------ gradients
class _Pair(nn.Cell):
    """``loss(a + x, b + y)`` with x, y Parameters: the program's gradients of x and y are the
    loss's gradients with respect to its logits and labels."""

    def __init__(self, loss: nn.Cell, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__()
        self.x, self.y = nn.Parameter(x), nn.Parameter(y)
        self.add_x, self.add_y = ops.Add(), ops.Add()
        self.loss = loss

    def construct(self, a, b):
        return self.loss(self.add_x(a, self.x), self.add_y(b, self.y))


def _program(loss: nn.Cell, x: np.ndarray, y: np.ndarray, device_num: int = 1,
             mode: str = "stand_alone", dataset: object = "full_batch") -> ParallelProgram:
    cell = _Pair(loss, x, y)
    cell.name_parameters()
    g = graph.trace(cell, [(x.shape, x.dtype), (y.shape, y.dtype)], ["a", "b"])
    return build_program(g, device_num, mode, dataset, cell=cell)


def _loss_and_grads(loss: nn.Cell, x: np.ndarray, y: np.ndarray, dy: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    prog = _program(loss, x, y)
    outs, tape = prog.forward([np.zeros_like(x), np.zeros_like(y)], {"x": x, "y": y})
    grads = prog.backward(tape, [dy])
    return outs[0], grads["x"], grads["y"]


def _numerical(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    for k in range(x.size):
        up, down = x.copy(), x.copy()
        up.flat[k] += eps
        down.flat[k] -= eps
        g.flat[k] = (f(up) - f(down)) / (2 * eps)
    return g


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("shapes", SHAPES[:4], ids=str)
def test_loss_gradients_match_finite_differences(name, reduction, shapes):
    """The traced loss's backward (Sub, Square/Abs, ReduceMean/ReduceSum VJPs chained by the
    runtime) against central differences of <dy, numpy loss>, for logits and labels."""
    cls, elementwise = LOSSES[name]
    x, y = _r(*shapes[0]), _r(*shapes[1])
    out_shape = np.broadcast_shapes(x.shape, y.shape) if reduction == "none" else ()
    dy = _r(*out_shape)

    def f(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.vdot(dy, REDUCE[reduction](elementwise(a - b))))

    loss, gx, gy = _loss_and_grads(cls(reduction), x, y, dy)
    np.testing.assert_allclose(loss, REDUCE[reduction](elementwise(x - y)), rtol=1e-14)
    np.testing.assert_allclose(gx, _numerical(lambda a: f(a, y), x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gy, _numerical(lambda b: f(x, b), y), rtol=1e-6, atol=1e-8)


def test_l1_gradient_is_zero_where_logits_equal_labels():
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    y = np.array([[1.0, 0.0], [3.0, 5.0]])
    _, gx, gy = _loss_and_grads(nn.L1Loss("sum"), x, y, np.asarray(1.0))
    np.testing.assert_array_equal(gx, [[0.0, 1.0], [0.0, -1.0]])
    np.testing.assert_array_equal(gy, -gx)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("cls", [nn.MSELoss, nn.L1Loss])
@pytest.mark.parametrize("bad", ["avg", "MEAN", "", None, 1])
def test_bad_reduction(cls, bad):
    with pytest.raises(ValueError) as err:
        cls(bad)
    assert str(err.value) == (f"{cls.__name__}: reduction must be 'none', 'mean' or 'sum', "
                              f"got {bad!r}")


@pytest.mark.parametrize("cls", [nn.MSELoss, nn.L1Loss])
def test_shapes_that_do_not_broadcast(cls):
    msg = (rf"{cls.__name__}: logits of shape \(8, 4\) and labels of shape \(8, 3\) must have "
           "the same shape or broadcast to each other")
    with pytest.raises(ValueError, match=msg):
        cls()(_r(8, 4), _r(8, 3))
    with pytest.raises(ValueError, match=msg):  # traced: the same check, on global shapes
        _program(cls(), _r(8, 4), _r(8, 3))


@pytest.mark.parametrize("cls", [nn.MSELoss, nn.L1Loss])
def test_dtypes_must_match_and_be_float(cls):
    with pytest.raises(TypeError, match=f"{cls.__name__}: logits and labels must be floating "
                       "point of one dtype, got float64 and float32"):
        cls()(_r(4), _r(4).astype(np.float32))
    with pytest.raises(TypeError, match="got int64 and int64"):
        cls()(np.arange(4), np.arange(4))


# ------------------------------------------------------------------ the sharded plan
def _loss_steps(prog: ParallelProgram) -> dict[str, OpStep]:
    return {s.node.op.name: s for s in prog.steps if "/loss-" in s.node.name}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("cls", [nn.MSELoss, nn.L1Loss])
def test_feature_split_loss_plans_partial_sums_and_one_allreduce(cls, reduction):
    """Logits cut (2, 4) on 8 devices (batch and feature axis): Sub and the pointwise op stay
    local, the reduction over every axis leaves partial sums, and one AllReduce(sum) over all
    8 ranks completes them. Nothing is gathered; the labels, cut (2, 1), are only sliced."""
    x, y = _r(8, 16), _r(8, 16)
    loss = cls(reduction)
    loss.sub.shard(((2, 4), (2, 4)))
    prog = _program(loss, x, y, 8, "semi_auto_parallel", ((2, 4), (2, 1)))
    steps = _loss_steps(prog)
    reducer = "ReduceMean" if reduction == "mean" else "ReduceSum"
    pointwise = "Square" if cls is nn.MSELoss else "Abs"
    assert list(steps) == ["Sub", pointwise, reducer]
    for name, s in steps.items():
        assert s.sharding.in_layouts[0].cuts == (2, 4), name
    for name in ("Sub", pointwise):
        assert steps[name].sharding.forward_comm == steps[name].sharding.backward_comm == []
    red = steps[reducer].sharding
    assert red.in_layouts[0].local_shape() == (4, 4)
    world = [tuple(range(8))]
    assert [(c.kind, c.groups(), c.elements) for c in red.forward_comm] == [
        ("AllReduce", world, 1)]
    # Backward: the adjoint of that AllReduce on the scalar cotangent (each of the 8 loss
    # replicas is seeded 1/8 under loss_repeated_mean); then everything stays local.
    assert [(c.kind, c.groups(), c.elements) for c in red.backward_comm] == [
        ("AllReduce", world, 1)]
    kinds = [st.kind for s in prog.steps for p in s.in_plans for st in p.steps]
    assert kinds == ["Slice"], kinds  # the labels: (2, 1) -> (2, 4), a local slice


def test_megatron_mlp_regression_head_never_gathers():
    """MLP with fc3 column-parallel: its output (the logits) is feature-split, and the loss
    follows that layout instead of gathering it."""
    net = nn.MLP(8, 16, 8, n_hidden=2, dtype=np.float64)
    presets.megatron_mlp(net, 2, 4)
    loss = nn.MSELoss()
    cell = nn.WithLossCell(net, loss)
    cell.name_parameters()
    g = graph.trace(cell, [((8, 8), np.float64), ((8, 8), np.float64)], ["data", "label"])
    prog = build_program(g, 8, "semi_auto_parallel", ((2, 1), (2, 1)), cell=cell)
    steps = {s.node.op.name: s for s in prog.steps if "_loss_fn-MSELoss" in s.node.name}
    assert all(s.chosen == "propagated" for s in steps.values())
    assert steps["Square"].sharding.in_layouts[0].cuts == (2, 4)
    red = steps["ReduceMean"].sharding
    assert [(c.kind, c.groups()) for c in red.forward_comm] == [("AllReduce", [tuple(range(8))])]
    moves = [st.kind for s in prog.steps for p in s.in_plans for st in p.steps]
    assert "AllGather" not in moves and moves.count("Slice") == 1, moves
