"""Elementwise operators: Add, Sub, Mul, RealDiv, FloorDiv (numpy broadcasting), BiasAdd,
PReLU, ReLU, ReLU6, GeLU, Tanh, Sigmoid, Abs, Square, Exp, Log and Cast.

Every output dimension is one iteration dimension. An input dimension of size 1 that
broadcasts against a larger one must have cut 1: that input is then replicated along the
device axis that splits the other, and its gradient contributions are summed over it (the
bias gradient of a data-parallel Dense is exactly this AllReduce).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from simpar.ops._base import OpSharding, Primitive, register
from simpar.ops.comm_spec import ONE_DEVICE, Collectives
from simpar.ops.facts import CostClass
from simpar.ops.kernels import Inline, Tape, gradient_needed
from simpar.ops.matmul import _unbroadcast
from simpar.ops.strategy import IterSpace, Strategy, StrategyError, dim_names

__all__ = ["GELU", "Abs", "Add", "BiasAdd", "Cast", "Exp", "FloorDiv", "GeLU", "Identity",
           "Log", "Mul", "PReLU", "RealDiv", "ReLU", "ReLU6", "Sigmoid", "Square", "Sub", "Tanh"]


@functools.lru_cache(maxsize=4096)  # kernels check their shapes on every call
def _broadcast_space(op: str, *shapes: tuple[int, ...]) -> IterSpace:
    try:
        out = tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"{op}: input shapes {list(shapes)} do not broadcast") from None
    names = dim_names(len(out))
    dims = []
    for shape in shapes:
        lead = len(out) - len(shape)
        dims.append(tuple(None if n == 1 and out[lead + d] != 1 else names[lead + d]
                          for d, n in enumerate(shape)))
    return IterSpace(tuple(dims), names, names)


class _Binary(Primitive):
    n_inputs = 2
    fn: ClassVar[Callable[..., Any]]
    #: The kernel and each input's gradient as Inline templates (None: no expression).
    expressions: ClassVar[tuple[str, tuple[str, str]] | None] = None

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        _broadcast_space(self.name, *shapes)
        return tuple(np.broadcast_shapes(*shapes))

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        return _broadcast_space(self.name, *shapes)

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.asarray(type(self).fn(*xs))

    def inline(self, shapes: tuple[tuple[int, ...], ...]) -> Inline | None:
        """The operator itself; a gradient only for an input of the output's shape (another
        is summed down by the VJP's ``_unbroadcast``). Not on 0-d shards, where numpy's
        operators give scalars, not arrays."""
        out = tuple(np.broadcast_shapes(*shapes))
        if self.expressions is None or not out:
            return None
        forward, grads = self.expressions
        x0, operator, x1 = forward.split(" ")
        return Inline(forward, tuple(g if s == out else None for s, g in zip(shapes, grads)),
                      f"{x0} {operator}= {x1}")

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray, need: tuple[bool, bool]
               ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Both inputs' gradients, each only when ``need`` says it is used (else None)."""
        raise NotImplementedError

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        a, b = xs
        ga, gb = self._grads(a, b, dy, (gradient_needed(0), gradient_needed(1)))
        # _unbroadcast only where it has work: a broadcast input, or a 0-d numpy scalar.
        if ga is not None and (ga.shape != a.shape or type(ga) is not np.ndarray):
            ga = _unbroadcast(ga, a.shape)
        if gb is not None and (gb.shape != b.shape or type(gb) is not np.ndarray):
            gb = _unbroadcast(gb, b.shape)
        return ga, gb


@register(mindspore_cost=CostClass.TENSOR_ADD, elementwise=False)
class Add(_Binary):
    """``x + y``."""

    tape = Tape.NOTHING   # dy is both gradients
    fn = staticmethod(np.add)
    expressions = ("{x0} + {x1}", ("{dy}", "{dy}"))

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray, need: tuple[bool, bool]
               ) -> tuple[np.ndarray | None, np.ndarray | None]:
        return dy, dy


@register(mindspore_cost=CostClass.SUB, elementwise=False)
class Sub(_Binary):
    """``x - y``."""

    tape = Tape.NOTHING   # dy and -dy
    fn = staticmethod(np.subtract)
    expressions = ("{x0} - {x1}", ("{dy}", "-{dy}"))

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray, need: tuple[bool, bool]
               ) -> tuple[np.ndarray | None, np.ndarray | None]:
        return dy, -dy if need[1] else None


@register(mindspore_cost=CostClass.MUL, elementwise=False)
class Mul(_Binary):
    """``x * y``."""

    tape = Tape.INPUTS   # dy times the other input
    fn = staticmethod(np.multiply)
    expressions = ("{x0} * {x1}", ("{dy} * {x1}", "{dy} * {x0}"))

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray, need: tuple[bool, bool]
               ) -> tuple[np.ndarray | None, np.ndarray | None]:
        return dy * y if need[0] else None, dy * x if need[1] else None


@register(mindspore_cost=CostClass.DIV, elementwise=False)
class RealDiv(_Binary):
    """``x / y``."""

    tape = Tape.INPUTS   # dy / y and -dy x / y^2
    fn = staticmethod(np.divide)

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray, need: tuple[bool, bool]
               ) -> tuple[np.ndarray | None, np.ndarray | None]:
        return dy / y if need[0] else None, -dy * x / (y * y) if need[1] else None

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return math.prod(local_out)


def _floor_divide(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Floats: floor of the true quotient, as MindSpore's kernels compute it (numpy's
    # floor_divide rounds through fmod and can differ by one next to an integer quotient).
    if np.result_type(x, y).kind == "f":
        return np.asarray(np.floor(np.divide(x, y)))
    return np.asarray(np.floor_divide(x, y))


@register(mindspore_cost=CostClass.FLOOR_DIV, elementwise=False)
class FloorDiv(_Binary):
    """``floor(x / y)`` with numpy broadcasting (MindSpore's FloorDiv); integer inputs divide
    exactly, rounding toward minus infinity.

    The sharding rule is Add's and RealDiv's (MindSpore's FloorDivInfo is an ArithmeticBase):
    every output dim is an iteration dim, a broadcast dim of size 1 must have cut 1 and the
    inputs' cuts of a shared dim must agree. Nothing is communicated forward.

    Floor is piecewise constant, so the gradient is zero with respect to both inputs
    (MindSpore's bprop returns ``zeros_like`` of each). simpar reports it as no gradient at
    all: both inputs are non-differentiable (``gives_gradient`` is False), the backward stops
    here, keeps nothing from the forward and runs no collective, and an input replicated over
    some device axes needs no gradient AllReduce.
    """

    nondiff_inputs = (0, 1)
    tape = Tape.NOTHING

    fn = staticmethod(_floor_divide)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return None, None

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 2 * math.prod(local_out)  # a division and a floor per element

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        return self.kernel(*xs), None

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        return None, None


@functools.lru_cache(maxsize=64)
def _all_but(ndim: int, axis: int) -> tuple[int, ...]:
    """Every axis of an ``ndim``-array but ``axis``: what a bias's gradient sums over."""
    return tuple(d for d in range(ndim) if d != axis)


@register(mindspore_cost=CostClass.BIAS_ADD, elementwise=False)
class BiasAdd(Primitive):
    """``x + bias`` along the channel dimension: dim 1 for ``data_format="NCHW"`` (MindSpore's
    default, also 2-D inputs), the last dim for ``"NHWC"``."""

    tape = Tape.NOTHING   # dy, and dy summed over all but the channel
    n_inputs = 2

    def __init__(self, data_format: str = "NCHW") -> None:
        super().__init__()
        if data_format not in ("NCHW", "NHWC", "NCDHW"):
            raise ValueError(f"BiasAdd: data_format must be 'NCHW', 'NHWC' or 'NCDHW', got "
                             f"{data_format!r}")
        self.data_format = data_format

    def attrs(self) -> dict[str, Any]:
        return {"data_format": self.data_format}

    def _channel(self, x: tuple[int, ...]) -> int:
        return len(x) - 1 if self.data_format == "NHWC" else 1

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x, b = shapes
        if len(x) < 2 or len(b) != 1 or b[0] != x[self._channel(x)]:
            raise ValueError(f"BiasAdd: bias of shape {b} must be 1-D and match channel "
                             f"dimension {self._channel(x) if len(x) >= 2 else 1} of input "
                             f"{x} (data_format {self.data_format})")
        return x

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        x = self.infer_shape(*shapes)
        names = dim_names(len(x))
        return IterSpace((names, (names[self._channel(x)],)), names, names)

    def _view(self, b: np.ndarray, ndim: int) -> np.ndarray:
        shape = [1] * ndim
        shape[self._channel(tuple(shape))] = b.shape[0]
        return b.reshape(shape)

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x, b = xs
        return x + (b if self.data_format == "NHWC" or x.ndim == 2 else self._view(b, x.ndim))

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return dy, (np.add.reduce(dy, axis=_all_but(dy.ndim, self._channel(dy.shape)))
                    if gradient_needed(1) else None)

    def inline(self, shapes: tuple[tuple[int, ...], ...]) -> Inline | None:
        x, b = shapes
        bias = "{x1}" if self.data_format == "NHWC" or len(x) == 2 else \
            "{x1}.reshape(" + repr(self._view(np.empty(b), len(x)).shape) + ")"
        return Inline("{x0} + " + bias,
                      ("{dy}", f"_sum({{dy}}, axis={_all_but(len(x), self._channel(x))!r})"),
                      "{x0} += " + bias)


@register(mindspore_cost=CostClass.PRELU, elementwise=False)
class PReLU(Primitive):
    """Parametric ReLU (MindSpore's PReLU): ``x`` where ``x > 0``, else ``weight[c] * x`` for
    the element's channel ``c``. ``x`` is (N, C, ...) of rank >= 2; ``weight`` is (C,), one
    slope per channel, or (1,), one slope shared by every channel.

    Sharding (MindSpore's PReLUInfo): any dimension of ``x`` may be cut; a (C,) weight's cut
    must equal the cut of x's channel dimension (dim 1), and a (1,) weight is never cut. The
    output has x's layout and nothing is communicated forward. The weight's gradient sums
    ``dy * x`` over the elements with ``x <= 0`` of every dimension but the channel: each rank
    sums its own slice, a partial sum that the AllReduce over the weight's replica axes (the
    device axes that cut N or a spatial dimension, and any repeated calculation) completes,
    MindSpore's Mirror of the weight. (MindSpore's own strategy generator never cuts C; simpar's
    candidates are every valid strategy, channel cuts included.)

    ``PReLU().shard(((2, 4, 1, 1), (4,)))`` on 8 devices, x (4, 8, 2, 2), weight (8,): device
    matrix [2, 4, 1, 1]; rank 5 (coordinate (1, 1, 0, 0)) holds x[2:4, 2:4] and weight[2:4],
    and its weight gradient is summed with rank 1's (the ranks that share channels 2..3).
    """

    n_inputs = 2

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x, w = shapes
        if len(x) < 2:
            raise ValueError(f"PReLU: x must have rank >= 2, (N, C, ...), got shape {tuple(x)}")
        if len(w) != 1 or w[0] not in (x[1], 1):
            raise ValueError(f"PReLU: weight must have shape ({x[1]},), one slope per channel "
                             f"of x {tuple(x)}, or (1,), one shared slope, got {tuple(w)}")
        return tuple(x)

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        x, w = shapes
        self.infer_shape(x, w)
        names = dim_names(len(x))
        # A (1,) weight against C > 1 channels broadcasts: it is replicated on every rank.
        return IterSpace((names, (names[1],) if w[0] == x[1] else (None,)), names, names)

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        x, w = shapes
        self.infer_shape(x, w)
        if w[0] == x[1] and strat[1][0] != strat[0][1]:
            raise StrategyError(
                f"PReLU: the weight's strategy {strat[1]} must equal the cut of x's channel "
                f"dimension: x's strategy {strat[0]} cuts dimension 1 (C = {x[1]}) into "
                f"{strat[0][1]}, so the weight's must be ({strat[0][1]},)")
        return super()._sharding(shapes, strat, out_strategy, device_num, enable_alltoall)

    @staticmethod
    def _slopes(w: np.ndarray, ndim: int) -> np.ndarray:
        return w.reshape((1, w.shape[0]) + (1,) * (ndim - 2))

    def _check(self, x: np.ndarray, w: np.ndarray) -> None:
        self.infer_shape(x.shape, w.shape)
        for what, a in (("x", x), ("weight", w)):
            if a.dtype.kind != "f":
                raise TypeError(f"PReLU: {what} must be a floating-point array, got dtype "
                                f"{a.dtype}")

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x, w = xs
        self._check(x, w)
        return np.where(x > 0, x, x * self._slopes(w, x.ndim)).astype(x.dtype, copy=False)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x, w = xs
        positive = x > 0
        dx = np.where(positive, dy, dy * self._slopes(w, x.ndim)).astype(x.dtype, copy=False)
        slope = np.where(positive, 0, dy * x)
        if w.shape[0] == x.shape[1]:  # per channel (a local (1,) weight has one channel too)
            dw = slope.sum(axis=tuple(d for d in range(x.ndim) if d != 1))
        else:
            dw = slope.sum().reshape(1)
        return dx, np.asarray(dw, dtype=w.dtype)

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 2 * math.prod(local_out)  # a comparison and a product per element


class _Unary(Primitive):
    n_inputs = 1
    flops_per_element: ClassVar[int] = 1

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        return shapes[0]

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        return IterSpace.pointwise(len(shapes[0]))

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return self.flops_per_element * math.prod(local_out)


@register(mindspore_cost=CostClass.CAST, elementwise=False)
class Identity(_Unary):
    """``x`` unchanged. Sharded, it moves ``x`` to the strategy's layout: ``Cell.shard``
    inserts it on the cell's annotated inputs, as MindSpore's ``reshard`` does."""

    output_aliases_input = True

    flops_per_element = 0

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return xs[0]

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy,)


@register(mindspore_cost=CostClass.SQRT, elementwise=True)
class ReLU(_Unary):
    """``max(x, 0)``."""

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.maximum(xs[0], 0)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy * (xs[0] > 0),)


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


@register(mindspore_cost=CostClass.GELU, elementwise=True)
class GeLU(_Unary):
    """Gaussian error linear unit, tanh form (MindSpore's GeLU primitive):
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    # A program's forward keeps x and the tanh for the backward (not the output, which the
    # backward does not read): no second tanh, the dearest part of the gradient.
    tape = Tape.INPUT_AND_NEW
    flops_per_element = 8

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x = xs[0]
        t = _gelu_tanh(x)
        t += 1.0
        t *= x
        t *= 0.5
        return t

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (_gelu_grad(xs[0], _gelu_tanh(xs[0]), dy),)

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        x = xs[0]
        t = _gelu_tanh(x)
        y = t + 1.0
        y *= x
        y *= 0.5
        return y, (x, t)

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        x, t = saved
        return (_gelu_grad(x, t, dy),)


def _gelu_grad(x: np.ndarray, t: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3a x^2), times ``dy``, in place on few
    temporaries (``t`` is left as it is)."""
    slope = x * x
    slope *= 3 * _GELU_A
    slope += 1.0
    slope *= _GELU_C
    slope *= x
    slope *= 1.0 - t * t
    slope += t + 1.0
    slope *= 0.5
    slope *= dy
    return slope


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """``tanh(c (x + a x^3))``, with the cube as products: numpy's power of a float32 array
    is about 50 times slower than two multiplications."""
    inner = x * x
    inner *= _GELU_A
    inner += 1.0
    inner *= x
    inner *= _GELU_C
    return np.tanh(inner, out=inner)


GELU = GeLU


@register(mindspore_cost=CostClass.SQRT, elementwise=True)
class Tanh(_Unary):
    """``tanh(x)``."""

    flops_per_element = 4

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.tanh(xs[0])

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        g = y * y                       # dy (1 - y^2), in one array
        np.subtract(1.0, g, out=g)
        g *= dy
        return (g,)


@register(mindspore_cost=CostClass.SQRT, elementwise=True)
class Sigmoid(_Unary):
    """``1 / (1 + exp(-x))``."""

    flops_per_element = 4

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x = xs[0]
        y = np.multiply(x, 0.5, dtype=x.dtype)   # 0.5 (1 + tanh(x / 2)), in one array
        np.tanh(y, out=y)
        y += 1.0
        y *= 0.5
        return y

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        g = dy * y
        g *= np.subtract(1.0, y)
        return (g,)


@register(mindspore_cost=CostClass.RELU6, elementwise=True)
class Abs(_Unary):
    """``|x|``. The gradient is ``sign(x) * dy``, so 0 at ``x == 0`` (MindSpore's AbsGrad)."""

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.abs(xs[0])

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy * np.sign(xs[0]),)


@register(mindspore_cost=CostClass.RELU6, elementwise=True)
class Square(_Unary):
    """``x * x``."""

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x = xs[0]
        return x * x

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        g = xs[0] * 2
        g *= dy
        return (g,)


@register(mindspore_cost=CostClass.RELU6, elementwise=True)
class ReLU6(_Unary):
    """``min(max(x, 0), 6)``. The gradient is ``dy`` where ``0 < x < 6`` and 0 elsewhere
    (MindSpore's ReLU6Grad)."""

    tape = Tape.INPUTS
    flops_per_element = 2

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.clip(xs[0], 0, 6)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x = xs[0]
        return (dy * ((x > 0) & (x < 6)),)


@register(mindspore_cost=CostClass.RELU6, elementwise=True)
class Exp(_Unary):
    """``e ** x``; its gradient ``dy * y`` reads the output, which the forward keeps."""

    tape = Tape.OUTPUT
    flops_per_element = 4

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.exp(xs[0])

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy * y,)

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        y = np.exp(xs[0])
        return y, y

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        return (dy * saved,)


@register(mindspore_cost=CostClass.RELU6, elementwise=True)
class Log(_Unary):
    """The natural logarithm; its gradient is ``dy / x``. A non-positive x gives -inf or
    nan, as numpy's and MindSpore's kernels do."""

    tape = Tape.INPUTS
    flops_per_element = 4

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(xs[0])

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        with np.errstate(divide="ignore", invalid="ignore"):
            return (dy / xs[0],)


_CASTS = ("float32", "float64", "int32", "int64")


@register(mindspore_cost=CostClass.CAST, elementwise=True)
class Cast(Primitive):
    """Convert to ``dst_type`` (one of float32, float64, int32, int64). MindSpore passes the
    type as a second input; simpar takes it as an attribute: ``Cast("float32")``."""

    n_inputs = 1

    def __init__(self, dst_type: str = "float32") -> None:
        super().__init__()
        name = np.dtype(dst_type).name if isinstance(dst_type, (str, type, np.dtype)) else None
        if name not in _CASTS:
            raise ValueError(f"Cast: dst_type must be one of {list(_CASTS)}, got {dst_type!r}")
        self.dst_type = name

    def attrs(self) -> dict[str, Any]:
        return {"dst_type": self.dst_type}

    def output_dtype(self, input_dtype: np.dtype) -> np.dtype:
        return np.dtype(self.dst_type)

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        return shapes[0]

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        return IterSpace.pointwise(len(shapes[0]))

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return xs[0].astype(self.dst_type)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x = xs[0]
        if x.dtype.kind != "f":
            return (None,)
        return (dy.astype(x.dtype),)
