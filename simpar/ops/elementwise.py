"""Elementwise operators: Add, Sub, Mul, RealDiv (numpy broadcasting), BiasAdd, ReLU, GeLU,
Tanh, Sigmoid, Abs, Square and Cast.

Every output dimension is one iteration dimension. An input dimension of size 1 that
broadcasts against a larger one must have cut 1: that input is then replicated along the
device axis that splits the other, and its gradient contributions are summed over it (the
bias gradient of a data-parallel Dense is exactly this AllReduce).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from simpar.ops._base import IterSpace, Primitive, dim_names, register
from simpar.ops.matmul import _unbroadcast

__all__ = ["GELU", "Abs", "Add", "BiasAdd", "Cast", "GeLU", "Identity", "Mul", "RealDiv",
           "ReLU", "Sigmoid", "Square", "Sub", "Tanh"]


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

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        _broadcast_space(self.name, *shapes)
        return tuple(np.broadcast_shapes(*shapes))

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        return _broadcast_space(self.name, *shapes)

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x, y = xs
        _broadcast_space(self.name, x.shape, y.shape)
        return np.asarray(type(self).fn(x, y))

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        a, b = xs
        ga, gb = self._grads(a, b, dy)
        return _unbroadcast(ga, a.shape), _unbroadcast(gb, b.shape)


@register
class Add(_Binary):
    """``x + y``."""

    fn = staticmethod(np.add)

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        return dy, dy


@register
class Sub(_Binary):
    """``x - y``."""

    fn = staticmethod(np.subtract)

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        return dy, -dy


@register
class Mul(_Binary):
    """``x * y``."""

    fn = staticmethod(np.multiply)

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        return dy * y, dy * x


@register
class RealDiv(_Binary):
    """``x / y``."""

    fn = staticmethod(np.divide)

    def _grads(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        return dy / y, -dy * x / (y * y)

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return math.prod(local_out)


@register
class BiasAdd(Primitive):
    """``x + bias`` along the channel dimension: dim 1 for ``data_format="NCHW"`` (MindSpore's
    default, also 2-D inputs), the last dim for ``"NHWC"``."""

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
        self.infer_shape(x.shape, b.shape)
        return x + self._view(b, x.ndim)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x = xs[0]
        c = self._channel(x.shape)
        return dy, dy.sum(axis=tuple(d for d in range(dy.ndim) if d != c))


class _Unary(Primitive):
    n_inputs = 1
    flops_per_element: ClassVar[int] = 1

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        return shapes[0]

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        return IterSpace.pointwise(len(shapes[0]))

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return self.flops_per_element * math.prod(local_out)


@register
class Identity(_Unary):
    """``x`` unchanged. Sharded, it moves ``x`` to the strategy's layout: ``Cell.shard`` and
    :func:`simpar.parallel.reshard` insert it (MindSpore's ``reshard``)."""

    output_aliases_input = True

    flops_per_element = 0

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return xs[0]

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy,)


@register
class ReLU(_Unary):
    """``max(x, 0)``."""

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.maximum(xs[0], 0)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy * (xs[0] > 0),)


_GELU_C = math.sqrt(2.0 / math.pi)


@register
class GeLU(_Unary):
    """Gaussian error linear unit, tanh form (MindSpore's GeLU primitive):
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    flops_per_element = 8

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x = xs[0]
        return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + 0.044715 * x ** 3)))

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x = xs[0]
        t = np.tanh(_GELU_C * (x + 0.044715 * x ** 3))
        dt = (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x * x)
        return (dy * (0.5 * (1.0 + t) + 0.5 * x * dt),)


GELU = GeLU


@register
class Tanh(_Unary):
    """``tanh(x)``."""

    flops_per_element = 4

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.tanh(xs[0])

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy * (1.0 - y * y),)


@register
class Sigmoid(_Unary):
    """``1 / (1 + exp(-x))``."""

    flops_per_element = 4

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x = xs[0]
        return np.asarray(0.5 * (1.0 + np.tanh(0.5 * x)), dtype=x.dtype)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy * y * (1.0 - y),)


@register
class Abs(_Unary):
    """``|x|``. The gradient is ``sign(x) * dy``, so 0 at ``x == 0`` (MindSpore's AbsGrad)."""

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.abs(xs[0])

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy * np.sign(xs[0]),)


@register
class Square(_Unary):
    """``x * x``."""

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.square(xs[0])

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (2 * xs[0] * dy,)


_CASTS = ("float32", "float64", "int32", "int64")


@register
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
