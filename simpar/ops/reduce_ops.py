"""Reductions: ReduceSum, ReduceMean and ReduceMax over some tensor dimensions.

MindSpore passes the reduced axes as a call input (``ReduceSum(keep_dims)(x, axis)``); simpar
ops take array inputs only, so the axes are an attribute: ``ReduceSum(keep_dims=False,
axis=(1,))``. ``axis`` is an int or a tuple of ints, negative values count from the end, and
``()`` or ``None`` reduces every axis (as in MindSpore), giving a 0-d output without
``keep_dims``.

Every tensor dimension is one iteration dimension, and the reduced ones do not reach the
output. Cutting a reduced dimension leaves each rank with a reduction over its own slice:

* ReduceSum and ReduceMean: a partial sum (ReduceMean divides by the *global* count locally),
  which the output plan completes with one AllReduce(sum) over the ranks sharing the slice of
  the kept dimensions.
* ReduceMax: a local max, completed inside the op by one AllReduce(max) over the same ranks.
  Its backward first sums the output cotangent over those ranks (one AllReduce, the adjoint of
  the max's replication, as in MindSpore's AllReduce(max) bprop) and then routes it.

``ReduceMax`` ties: the cotangent goes, undivided, to *every* input position equal to the
maximum, on one device and sharded alike. MindSpore's bprop instead divides it evenly among the
ties; doing that sharded needs the global tie count, a second AllReduce per step, for a case
(exact float ties) that random data almost never hits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding, Primitive, register
from simpar.ops._base import build_sharding as _build_sharding
from simpar.ops.comm_spec import ONE_DEVICE, Collectives, CommSpec
from simpar.ops.facts import CostClass
from simpar.ops.kernels import Tape
from simpar.ops.strategy import IterSpace, Strategy, dim_names
from simpar.redistribution import StepKind, plan

__all__ = ["ReduceMax", "ReduceMean", "ReduceSum"]

Axis = int | tuple[int, ...] | list[int] | None


class _Reduce(Primitive):
    """Shared attribute handling, shapes, iteration space and sharding of the reductions."""

    n_inputs = 1
    reduce_kind: ClassVar[str] = "sum"
    float_only: ClassVar[bool] = False
    #: What the reduction of an empty dim is called in the error, or "" when it is defined.
    empty_error: ClassVar[str] = ""

    def __init__(self, keep_dims: bool = False, axis: Axis = ()) -> None:
        super().__init__()
        if not isinstance(keep_dims, bool):
            raise TypeError(f"{self.name}: keep_dims must be a bool, got "
                            f"{type(keep_dims).__name__} {keep_dims!r}")
        self.keep_dims = keep_dims
        self.axis = self._check_axis(axis)

    def _check_axis(self, axis: object) -> tuple[int, ...]:
        if axis is None:
            return ()
        items: list[object] = list(axis) if isinstance(axis, (tuple, list)) else [axis]
        out: list[int] = []
        for a in items:
            if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
                raise TypeError(f"{self.name}: axis must be an int, a tuple of ints, () or None, "
                                f"got {axis!r}")
            out.append(int(a))
        if len(set(out)) != len(out):
            raise ValueError(f"{self.name}: axis {tuple(out)} lists an axis more than once; "
                             "each reduced axis may appear only once")
        return tuple(out)

    def attrs(self) -> dict[str, Any]:
        return {"keep_dims": self.keep_dims, "axis": self.axis}

    def reduced_axes(self, ndim: int) -> tuple[int, ...]:
        """The reduced tensor dims of an ``ndim``-D input, non-negative and sorted.

        ``ReduceSum(axis=-1).reduced_axes(3) == (2,)``; ``axis=()`` gives every dim.
        """
        if not self.axis:
            return tuple(range(ndim))
        out = []
        for a in self.axis:
            if not -ndim <= a < ndim:
                raise ValueError(f"{self.name}: axis {a} is out of range for a {ndim}-D input; "
                                 f"allowed {-ndim}..{ndim - 1}" if ndim else
                                 f"{self.name}: axis {a} is out of range for a 0-d input; "
                                 "only () or None is allowed")
            out.append(a % ndim)
        if len(set(out)) != len(out):
            raise ValueError(f"{self.name}: axis {self.axis} names the same dimension twice "
                             f"for a {ndim}-D input")
        return tuple(sorted(out))

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        (x,) = shapes
        axes = self.reduced_axes(len(x))
        if self.keep_dims:
            return tuple(1 if d in axes else n for d, n in enumerate(x))
        return tuple(n for d, n in enumerate(x) if d not in axes)

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        """``d0..d{n-1}``; the output lists the kept dims only (a ``keep_dims`` size-1 dim maps
        to no iteration dim, see :meth:`_sharding`)."""
        (x,) = shapes
        names = dim_names(len(x))
        axes = self.reduced_axes(len(x))
        kept = tuple(it for d, it in enumerate(names) if d not in axes)
        return IterSpace((names,), kept, names, reduce=self.reduce_kind)

    def _check_input(self, x: np.ndarray) -> None:
        allowed = "f" if self.float_only else "fiu"
        if x.dtype.kind not in allowed:
            what = "a float array" if self.float_only else "a float or integer array"
            raise TypeError(f"{self.name}: input must be {what}, got dtype {x.dtype}")
        axes = self.reduced_axes(x.ndim)
        if self.empty_error and any(x.shape[a] == 0 for a in axes):
            raise ValueError(f"{self.name}: cannot take the {self.empty_error} over an empty "
                             f"dimension; input shape {x.shape}, axis {self.axis}")

    # -- sharding
    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        (x,) = shapes
        axes = self.reduced_axes(len(x))
        space = self.iter_space(*shapes)
        cuts = dict(zip(space.order, strat[0]))
        squeezed = tuple(n for d, n in enumerate(x) if d not in axes)
        sh = _build_sharding(self, shapes, strat, out_strategy, device_num, space, cuts,
                             out_shape=squeezed)
        if self.keep_dims:
            raw = _keep_dims(sh.raw_out, axes, self.infer_shape(x))
            out = raw.with_partial(())
            sh = dataclasses.replace(sh, raw_out=raw, out=out, out_plan=plan(raw, out))
        split = sh.device_axes_cutting([it for it in space.order if it not in space.output])
        if self.reduce_kind == "max" and split:
            n = sh.raw_out.local_size()
            sh = dataclasses.replace(
                sh,
                internal_forward=(CommSpec(StepKind.ALL_REDUCE, sh.device_matrix, split, n,
                                           "max over the split reduced dims", on_output=True,
                                           how="max"),),
                internal_backward=(CommSpec(StepKind.ALL_REDUCE, sh.device_matrix, split, n,
                                            "sum of the max's cotangent over the split reduced "
                                            "dims", on_output=True),))
        return sh

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return math.prod(local_in[0])

    # -- single-device maths shared by the subclasses
    def _reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        raise NotImplementedError

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        (x,) = xs
        self._check_input(x)
        return self._reduce(x, self.reduced_axes(x.ndim))

    def _expand(self, dy: np.ndarray, x_shape: tuple[int, ...]) -> np.ndarray:
        """``dy`` reshaped so that it broadcasts against the input (reduced dims of size 1)."""
        axes = self.reduced_axes(len(x_shape))
        return dy.reshape(tuple(1 if d in axes else n for d, n in enumerate(x_shape)))


def _keep_dims(lay: TensorLayout, axes: tuple[int, ...], shape: tuple[int, ...]) -> TensorLayout:
    """``lay`` (the output without the reduced dims) with an unsplit size-1 dim at each axis."""
    tmap: list[object] = list(lay.tensor_map)
    for a in axes:
        tmap.insert(a, -1)
    return TensorLayout(lay.device_matrix, tmap, shape, lay.partial)


@register(mindspore_cost=CostClass.REDUCE_SUM, elementwise=False)
class ReduceSum(_Reduce):
    """Sum over ``axis`` (``()``/``None``: every axis); ``keep_dims`` keeps them with size 1.

    ``ReduceSum(axis=1).shard(((2, 4),))`` on 8 devices with x of shape (8, 16): device matrix
    [2, 4]; rank 5, at coordinate (1, 1), sums x[4:8, 4:8] over columns into a partial (4,)
    vector, and one AllReduce over ranks [4, 5, 6, 7] completes output rows 4..7.
    """

    def _reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        return np.asarray(np.sum(x, axis=axes, dtype=x.dtype, keepdims=self.keep_dims))

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x = xs[0]
        if x.dtype.kind != "f":
            return (None,)
        return (np.broadcast_to(self._expand(dy, x.shape), x.shape).astype(x.dtype),)


@register(mindspore_cost=CostClass.REDUCE_MEAN, elementwise=False)
class ReduceMean(_Reduce):
    """Mean over ``axis`` (float inputs). With a reduced dim cut, every rank sums its slice
    and divides by the *global* count, so the AllReduce(sum) of the output plan completes it.

    ``ReduceMean(axis=0).shard(((4, 2),))`` on 8 devices, x of shape (8, 6): rank 3 at
    coordinate (1, 1) holds x[2:4, 3:6] and yields ``x[2:4, 3:6].sum(0) / 8``, a partial
    (3,) vector summed over ranks [1, 3, 5, 7].
    """

    tape = Tape.NOTHING

    float_only = True
    empty_error = "mean"

    def _count(self, x_shape: tuple[int, ...]) -> int:
        return math.prod(x_shape[a] for a in self.reduced_axes(len(x_shape)))

    def _reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        return self._partial_mean(x, self._count(x.shape))

    def _partial_mean(self, x: np.ndarray, count: int) -> np.ndarray:
        s = np.sum(x, axis=self.reduced_axes(x.ndim), dtype=x.dtype, keepdims=self.keep_dims)
        return np.asarray(s / x.dtype.type(count), dtype=x.dtype)

    def _grad(self, x_shape: tuple[int, ...], dtype: np.dtype, dy: np.ndarray,
              count: int) -> np.ndarray:
        # A broadcast view, read-only like every cotangent (kernels never write into theirs).
        g = self._expand(dy, x_shape) / dtype.type(count)
        return np.broadcast_to(g.astype(dtype, copy=False), x_shape)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x = xs[0]
        return (self._grad(x.shape, x.dtype, dy, self._count(x.shape)),)

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        (x,) = xs
        self._check_input(x)
        count = self._count(sh.input_shapes[0])
        return self._partial_mean(x, count), (x.shape, x.dtype, count)

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        shape, dtype, count = saved
        return (self._grad(shape, dtype, dy, count),)

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return math.prod(local_in[0]) + math.prod(local_out)


@register(mindspore_cost=CostClass.REDUCE_MAX, elementwise=False)
class ReduceMax(_Reduce):
    """Maximum over ``axis``. With a reduced dim cut, each rank takes the max of its slice and
    one AllReduce(max) inside the op gives every rank of the group the global max.

    ``ReduceMax(axis=-1).shard(((1, 8),))`` on 8 devices, x of shape (4, 16): rank r holds
    columns 2r..2r+1, computes their row max, and the AllReduce(max) over ranks 0..7 leaves
    the (4,) result on every rank. Backward: one AllReduce(sum) of the cotangent over the same
    ranks, then each rank routes it to its positions equal to the max (all ties, undivided;
    see the module docstring).
    """

    reduce_kind = "max"
    empty_error = "max"

    def _reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        return np.asarray(np.max(x, axis=axes, keepdims=self.keep_dims))

    def _route(self, x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> np.ndarray:
        """dy to every position of x equal to its max y (ties all get it)."""
        hit = x == self._expand(y, x.shape)
        return np.where(hit, self._expand(dy, x.shape), 0).astype(x.dtype)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x = xs[0]
        if x.dtype.kind != "f":
            return (None,)
        return (self._route(x, y, dy),)

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        (x,) = xs
        y = self.kernel(x)
        for spec in sh.internal_forward:
            y = collectives.all_reduce(spec, y, "max")
        return y, (x, y)

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        x, y = saved
        dy = np.asarray(dy)  # run_op's cotangent of a 0-d output is a numpy scalar
        for spec in sh.internal_backward:
            dy = collectives.all_reduce(spec, dy, "max-adjoint")
        return self.vjp((x,), y, dy)
