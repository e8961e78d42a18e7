"""Data-movement operators: Transpose, Reshape (and its kinds Flatten, Squeeze, ExpandDims),
Concat, Split and Assign.

Transpose permutes the tensor map and is always local. Reshape keeps the input's layout when
the split dimensions survive whole (a split dim's block stays one contiguous block of the
output); otherwise it first redistributes the input to the cheapest layout that does
(MindSpore's InferReshape does the same), then reshapes locally. Concat and Split work along
an unsplit dimension. Assign moves its value to its output, where both are laid out alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from simpar import _checks as checks
from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding, Primitive, build_sharding, register
from simpar.ops.comm_spec import ONE_DEVICE, Collectives
from simpar.ops.facts import CostClass
from simpar.ops.kernels import Tape
from simpar.ops.strategy import IterSpace, Strategy, dim_names
from simpar.redistribution import RedistributionPlan, plan

__all__ = ["Assign", "Concat", "ExpandDims", "Flatten", "Reshape", "Split", "Squeeze",
           "Transpose", "reshape_layout"]


# ------------------------------------------------------------------ the two views
@functools.lru_cache(maxsize=1024)  # a program's views, made once, not per call
def _transposes(perm: tuple[int, ...]) -> tuple[Callable[[np.ndarray], np.ndarray],
                                                Callable[[np.ndarray], np.ndarray]]:
    inverse = tuple(int(p) for p in np.argsort(perm))
    return operator.methodcaller("transpose", perm), operator.methodcaller("transpose", inverse)


@functools.lru_cache(maxsize=1024)
def _reshapes(out: tuple[int, ...], back: tuple[int, ...]
              ) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]:
    return operator.methodcaller("reshape", out), operator.methodcaller("reshape", back)


class _View(Primitive):
    """An op whose per-rank forward and backward are its :meth:`local_view` pair."""

    def local_view(self, sh: OpSharding) -> tuple[Callable[[np.ndarray], np.ndarray],
                                                  Callable[[np.ndarray], np.ndarray]]:
        raise NotImplementedError

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        return self.local_view(sh)[0](xs[0]), None

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        return (self.local_view(sh)[1](dy),)


# ------------------------------------------------------------------ Transpose
@register(mindspore_cost=CostClass.TRANSPOSE, elementwise=False)
class Transpose(_View):
    """Permute dimensions: output dim ``d`` is input dim ``perm[d]``. Always local: the tensor
    map is permuted with the dims (``Transpose((1, 0))`` of map [1, 0] gives [0, 1])."""

    tape = Tape.NOTHING
    moves_values = True

    n_inputs = 1

    def __init__(self, perm: Sequence[int] | None = None) -> None:
        super().__init__()
        self.perm = None if perm is None else tuple(int(p) for p in perm)

    def attrs(self) -> dict[str, Any]:
        return {"perm": self.perm}

    def _perm(self, ndim: int) -> tuple[int, ...]:
        perm = self.perm if self.perm is not None else tuple(reversed(range(ndim)))
        if sorted(perm) != list(range(ndim)):
            raise ValueError(f"Transpose: perm {perm} is not a permutation of 0..{ndim - 1} "
                             f"for an input of rank {ndim}")
        return perm

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x = shapes[0]
        return tuple(x[p] for p in self._perm(len(x)))

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        names = dim_names(len(shapes[0]))
        return IterSpace((names,), tuple(names[p] for p in self._perm(len(names))), names)

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return np.transpose(xs[0], self._perm(xs[0].ndim))

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (np.transpose(dy, np.argsort(self._perm(dy.ndim))),)

    def local_view(self, sh: OpSharding) -> tuple[Callable[[np.ndarray], np.ndarray],
                                                  Callable[[np.ndarray], np.ndarray]]:
        # Views both ways: a collective or a kernel that needs contiguous memory makes the copy
        # (the Reshape after attention's Transpose does; the BatchMatMuls read strided views).
        # The cost models still count a Transpose's output as an array of its own: where a
        # Reshape copies after it, that is where the array is; where a view goes straight
        # into a BatchMatMul, it is one array too many (an upper bound, which a memory cap
        # can trust). On the GPT at batch 1 the views take a tenth off the step.
        return _transposes(self._perm(len(sh.input_shapes[0])))

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 0


# ------------------------------------------------------------------ Reshape
def _groups(src: tuple[int, ...], dst: tuple[int, ...]
            ) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of non-1 dims of ``src`` and ``dst`` with equal products (minimal runs)."""
    si = [d for d, n in enumerate(src) if n != 1]
    di = [d for d, n in enumerate(dst) if n != 1]
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(si) or j < len(di):
        gi, gj, pi, pj = [], [], 1, 1
        while True:
            if pi <= pj and i < len(si):
                pi *= src[si[i]]
                gi.append(si[i])
                i += 1
            elif j < len(di):
                pj *= dst[di[j]]
                gj.append(di[j])
                j += 1
            else:
                return None
            if pi == pj:
                break
        out.append((gi, gj))
    return out


def _block_axes(layout: TensorLayout, dims: list[int]) -> list[int] | None:
    """The group's split axes (outer first) if its local block is contiguous, else None.

    Contiguous means: leading dims fully split (local size 1), then at most one dim split
    partially, then unsplit dims.
    """
    dm = layout.device_matrix
    axes: list[int] = []
    whole_before = True  # every earlier dim of the group is cut down to local size 1
    for d in dims:
        own = [a for a in layout.dim_axes[d] if dm[a] > 1]
        cut = math.prod(dm[a] for a in own)
        if cut > 1 and not whole_before:
            return None
        axes += own
        if cut != layout.shape[d]:
            whole_before = False
    return axes


def _place_axes(dm: tuple[int, ...], axes: list[int], dims: list[int],
                shape: tuple[int, ...]) -> dict[int, list[int]] | None:
    """Split ``axes`` (outer first) over output ``dims``: leading dims fully, then one dim
    partially. None when the axis sizes do not line up with the dims."""
    out: dict[int, list[int]] = {d: [] for d in dims}
    k = 0
    for d in dims:
        prod = 1
        while k < len(axes) and prod * dm[axes[k]] <= shape[d] and shape[d] % (
                prod * dm[axes[k]]) == 0:
            prod *= dm[axes[k]]
            out[d].append(axes[k])
            k += 1
        if prod != shape[d]:
            break  # this dim is only partly split: every later dim must stay whole
    return out if k == len(axes) else None


def reshape_layout(layout: TensorLayout, shape: Sequence[int]) -> TensorLayout | None:
    """The layout of ``reshape(x, shape)`` when a local reshape of ``x``'s shards gives it,
    else None. ``(8, 16)`` cut (2, 4) reshaped to ``(8, 4, 4)`` keeps both cuts: (2, 4, 1)."""
    dst = tuple(int(n) for n in shape)
    groups = _groups(layout.shape, dst)
    if groups is None:
        return None
    dm = layout.device_matrix
    dim_axes: dict[int, list[int]] = {d: [] for d in range(len(dst))}
    for gi, gj in groups:
        axes = _block_axes(layout, gi)
        if axes is None:
            return None
        placed = _place_axes(dm, axes, gj, dst)
        if placed is None:
            return None
        dim_axes.update(placed)
    return TensorLayout.from_dim_axes(dm, [dim_axes[d] for d in range(len(dst))], dst,
                                      layout.partial_axes)


def _reshape_candidates(layout: TensorLayout) -> Iterator[TensorLayout]:
    """Layouts to try before a reshape, in order: the input itself; every dim's axes moved
    onto one other dim (an AllToAll); and every suffix of each dim's axes dropped (an
    AllGather). Made one at a time: the search stops at the first that moves nothing,
    most often the input itself."""
    yield layout
    dm = layout.device_matrix

    def split_over(dim_axes: Sequence[Sequence[int]]) -> TensorLayout:
        return TensorLayout.from_dim_axes(dm, dim_axes, layout.shape, layout.partial_axes)

    split = [(d, list(ax)) for d, ax in enumerate(layout.dim_axes) if ax]
    for d, axes in split:
        for target in range(layout.ndim):
            if target == d:
                continue
            moved = [list(a) for a in layout.dim_axes]
            moved[d] = []
            moved[target] = moved[target] + axes
            if layout.shape[target] % math.prod(dm[a] for a in moved[target]) == 0:
                yield split_over(moved)
        for keep in range(len(axes)):
            dropped = [list(a) for a in layout.dim_axes]
            dropped[d] = axes[:keep]
            yield split_over(dropped)
    yield split_over([[] for _ in range(layout.ndim)])


@register(mindspore_cost=CostClass.RESHAPE, elementwise=False)
class Reshape(_View):
    """Reshape to ``shape`` (``-1`` infers one dim). MindSpore passes the shape as a second
    input: ``Reshape()(x, (4, 8))``; simpar also takes it at construction, ``Reshape((4, 8))``.

    On device matrix (2, 4) with x (8, 16) cut (2, 4), ``Reshape((8, 4, 4))`` is local: rank 5
    reshapes its (4, 4) block to (4, 1, 4). ``Reshape((128,))`` is not (a column cut does not
    stay contiguous): the input is first redistributed to the cheapest layout that works.
    """

    tape = Tape.NOTHING
    moves_values = True
    output_aliases_input = True

    n_inputs = 1

    def __init__(self, shape: Sequence[int] | None = None) -> None:
        super().__init__()
        self.shape = None if shape is None else tuple(int(n) for n in shape)

    def __call__(self, *xs: Any) -> Any:
        if len(xs) == 2 and isinstance(xs[1], (tuple, list)):
            self.shape = tuple(int(n) for n in xs[1])
            xs = xs[:1]
        return super().__call__(*xs)

    def attrs(self) -> dict[str, Any]:
        return {"shape": self.shape}

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x = shapes[0]
        if self.shape is None:
            raise ValueError("Reshape: no target shape; use Reshape(shape) or op(x, shape)")
        total = math.prod(x)
        if self.shape.count(-1) > 1 or any(n < -1 or n == 0 and total for n in self.shape):
            raise ValueError(f"Reshape: target shape {self.shape} may hold at most one -1 and "
                             "otherwise positive sizes")
        known = math.prod(n for n in self.shape if n != -1)
        out = tuple(total // known if n == -1 else n for n in self.shape)
        if math.prod(out) != total:
            raise ValueError(f"Reshape: cannot reshape {x} ({total} elements) into "
                             f"{self.shape}")
        return out

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        return IterSpace.pointwise(len(shapes[0]))

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return xs[0].reshape(self.infer_shape(xs[0].shape))

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (dy.reshape(xs[0].shape),)

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 0

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        out_shape = self.infer_shape(*shapes)
        base = build_sharding(self, shapes, strat, None, device_num, self.iter_space(*shapes),
                              dict(zip(dim_names(len(strat[0])), strat[0])),
                              out_shape=shapes[0])
        src = base.in_layouts[0]
        best: tuple[int, TensorLayout, TensorLayout, RedistributionPlan] | None = None
        for mid in _reshape_candidates(src):
            out = reshape_layout(mid, out_shape)
            if out is None:
                continue
            p = plan(src, mid, enable_alltoall)
            cost = p.busiest_bytes(1)
            if best is None or cost < best[0]:
                best = (cost, mid, out, p)
            if cost == 0:  # nothing is cheaper, and the first of equals is kept
                break
        assert best is not None  # the fully replicated candidate always reshapes
        _, mid, out, pre = best
        empty = plan(out, out)
        # The op redistributes its input to ``mid`` itself (the runtime runs
        # ``inner_plan`` before the kernel), so ``in_layouts`` stays what the strategy says.
        return dataclasses.replace(base, raw_out=out, out=out, out_plan=empty,
                                   inner_plan=None if not pre.steps else pre)

    def local_view(self, sh: OpSharding) -> tuple[Callable[[np.ndarray], np.ndarray],
                                                  Callable[[np.ndarray], np.ndarray]]:
        # After inner_plan when there is one: the view is between its layout and the output's.
        mid = sh.in_layouts[0] if sh.inner_plan is None else sh.inner_plan.dst
        return _reshapes(sh.out.local_shape(), mid.local_shape())


@register(mindspore_cost=CostClass.RESHAPE, elementwise=False)
class Flatten(Reshape):
    """MindSpore's ``Flatten()``: (N, d1, d2, ...) to (N, d1 * d2 * ...), a Reshape. Cuts of
    N and d1 stay (each rank's block is a contiguous block of the flat rows); a cut of a
    later dim is first redistributed away, as Reshape does. ``Flatten().shard(((2, 4, 1,
    1),))`` on 8 devices, x (4, 8, 3, 3): rank 5 flattens its (2, 2, 3, 3) block into the
    (2, 18) block of rows 2..3, columns 18..35, with nothing communicated."""

    def __init__(self) -> None:
        super().__init__()

    def __call__(self, *xs: Any) -> Any:
        return Primitive.__call__(self, *xs)

    def attrs(self) -> dict[str, Any]:
        return {}

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x = tuple(shapes[0])
        if not x:
            raise ValueError("Flatten: x must have rank >= 1 (dim 0 is the batch), got a 0-d "
                             "input")
        return (x[0], math.prod(x[1:]))


@register(mindspore_cost=CostClass.CAST, elementwise=False)
class Squeeze(Reshape):
    """MindSpore's ``Squeeze(axis=())``: drop the dims of size 1 named by ``axis`` (an int
    or a tuple of ints), or every dim of size 1 when ``axis`` is empty. Local on every
    strategy (a size-1 dim is never cut)."""

    def __init__(self, axis: int | Sequence[int] = ()) -> None:
        super().__init__()
        raw = (axis,) if not isinstance(axis, (tuple, list)) else tuple(axis)
        for a in raw:
            if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
                raise TypeError(f"Squeeze: axis must be an int or a tuple of ints, got "
                                f"{axis!r}")
        self.axis = tuple(int(a) for a in raw)

    def __call__(self, *xs: Any) -> Any:
        return Primitive.__call__(self, *xs)

    def attrs(self) -> dict[str, Any]:
        return {"axis": self.axis}

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x = tuple(shapes[0])
        if not self.axis:
            return tuple(n for n in x if n != 1)
        axes = {checks.axis(a, len(x), "Squeeze: axis") for a in self.axis}
        for a in sorted(axes):
            if x[a] != 1:
                raise ValueError(f"Squeeze: axis {a} of shape {x} has size {x[a]}; only dims "
                                 "of size 1 can be squeezed")
        return tuple(n for d, n in enumerate(x) if d not in axes)


@register(mindspore_cost=CostClass.CAST, elementwise=False)
class ExpandDims(Reshape):
    """MindSpore's ``ExpandDims()(x, axis)``: insert a dim of size 1 at ``axis`` (in
    ``[-x.ndim - 1, x.ndim]``); simpar also takes it at construction, ``ExpandDims(0)``.
    Local on every strategy."""

    def __init__(self, axis: int | None = None) -> None:
        super().__init__()
        self.axis = None if axis is None else self._check_axis(axis)

    @staticmethod
    def _check_axis(axis: object) -> int:
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"ExpandDims: axis must be an int, got {type(axis).__name__} "
                            f"{axis!r}")
        return int(axis)

    def __call__(self, *xs: Any) -> Any:
        if len(xs) == 2:
            self.axis = self._check_axis(xs[1])
            xs = xs[:1]
        return Primitive.__call__(self, *xs)

    def attrs(self) -> dict[str, Any]:
        return {"axis": self.axis}

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x = tuple(shapes[0])
        if self.axis is None:
            raise ValueError("ExpandDims: no axis; use ExpandDims(axis) or op(x, axis)")
        if not -len(x) - 1 <= self.axis <= len(x):
            raise ValueError(f"ExpandDims: axis {self.axis} is outside [{-len(x) - 1}, "
                             f"{len(x)}] for an input of rank {len(x)}")
        a = self.axis % (len(x) + 1)
        return x[:a] + (1,) + x[a:]


# ------------------------------------------------------------------ Concat and Split
@register(mindspore_cost=CostClass.CONCAT, elementwise=False)
class Concat(Primitive):
    """Concatenate the inputs along ``axis``, which must be unsplit in every strategy; the
    other dims' cuts must agree across inputs. ``Concat(axis=1).shard(((2, 1), (2, 1)))``."""

    n_inputs = 2

    def __init__(self, axis: int = 0, n_inputs: int = 2) -> None:
        super().__init__()
        self.axis = axis
        self.n_inputs = checks.positive_int(n_inputs, "Concat: n_inputs")

    def attrs(self) -> dict[str, Any]:
        return {"axis": self.axis}

    def shard(self, in_strategy: Sequence[Sequence[int]],
              out_strategy: Sequence[Sequence[int]] | None = None) -> Primitive:
        if isinstance(in_strategy, (tuple, list)):
            self.n_inputs = len(in_strategy)
        return super().shard(in_strategy, out_strategy)

    def __call__(self, *xs: Any) -> Any:
        if len(xs) == 1 and isinstance(xs[0], (tuple, list)):
            xs = tuple(xs[0])
        self.n_inputs = len(xs)
        return super().__call__(*xs)

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        first = shapes[0]
        axis = checks.axis(self.axis, len(first), "Concat: axis")
        for i, s in enumerate(shapes):
            if len(s) != len(first) or any(a != b for d, (a, b) in enumerate(zip(s, first))
                                           if d != axis):
                raise ValueError(f"Concat: input {i} has shape {s}, which differs from input 0 "
                                 f"{first} outside axis {axis}")
        return first[:axis] + (sum(s[axis] for s in shapes),) + first[axis + 1:]

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        self.infer_shape(*shapes)
        axis = checks.axis(self.axis, len(shapes[0]), "Concat: axis")
        names = tuple("cat" if d == axis else f"d{d}" for d in range(len(shapes[0])))
        return IterSpace(tuple(names for _ in shapes), names, names,
                         unsplittable=frozenset({"cat"}))

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        self.infer_shape(*(x.shape for x in xs))
        return np.concatenate(xs, axis=self.axis)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        axis = checks.axis(self.axis, dy.ndim, "Concat: axis")
        cuts = np.cumsum([x.shape[axis] for x in xs])[:-1]
        return tuple(np.split(dy, cuts, axis=axis))

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 0


@register(mindspore_cost=CostClass.SPLIT, elementwise=False)
class Split(Primitive):
    """Split along ``axis`` into ``output_num`` equal outputs; ``axis`` must be unsplit.
    Every output keeps the input's tensor map: on (2, 4) with x (8, 16) cut (2, 4) and
    ``Split(axis=0, output_num=2)``, rank 5 returns two (2, 4) blocks of its (4, 4) shard."""

    tape = Tape.NOTHING
    moves_values = True

    n_inputs = 1

    def __init__(self, axis: int = 0, output_num: int = 1) -> None:
        super().__init__()
        self.axis = axis
        self.output_num = self.n_outputs = checks.positive_int(output_num, "Split: output_num")

    def attrs(self) -> dict[str, Any]:
        return {"axis": self.axis, "output_num": self.output_num}

    def _out_shape(self, x: tuple[int, ...]) -> tuple[int, ...]:
        axis = checks.axis(self.axis, len(x), "Split: axis")
        if x[axis] % self.output_num:
            raise ValueError(f"Split: dimension {axis} of shape {x} does not split into "
                             f"{self.output_num} equal outputs")
        return x[:axis] + (x[axis] // self.output_num,) + x[axis + 1:]

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        return self._out_shape(shapes[0])

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        axis = checks.axis(self.axis, len(shapes[0]), "Split: axis")
        names = tuple("split" if d == axis else f"d{d}" for d in range(len(shapes[0])))
        return IterSpace((names,), names, names, unsplittable=frozenset({"split"}))

    def kernel(self, *xs: np.ndarray) -> Any:
        self._out_shape(xs[0].shape)
        parts = tuple(np.split(xs[0], self.output_num, axis=self.axis))
        return parts if self.output_num > 1 else parts[0]

    def vjp(self, xs: Sequence[np.ndarray], y: Any, dy: Any) -> tuple[np.ndarray | None, ...]:
        parts = dy if self.output_num > 1 else (dy,)
        return (np.concatenate(parts, axis=self.axis),)

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 0

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        sh = super()._sharding(shapes, strat, out_strategy, device_num, enable_alltoall)
        extra = tuple((sh.raw_out, sh.out, sh.out_plan) for _ in range(self.output_num - 1))
        return dataclasses.replace(sh, more_outs=extra)

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[Any, Any]:
        parts = tuple(np.ascontiguousarray(p) for p in
                      np.split(xs[0], self.output_num, axis=self.axis))
        return (parts if self.output_num > 1 else parts[0]), None

    def local_backward(self, sh: OpSharding, saved: Any, dy: Any,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        return self.vjp((), None, dy)



# ------------------------------------------------------------------ Assign
@register(mindspore_cost=CostClass.ASSIGN, elementwise=False)
class Assign(Primitive):
    """MindSpore's ``Assign(variable, value)``, as the value-returning op: the output is
    ``value`` (in the variable's dtype), with the variable's shape.

    What it omits: MindSpore writes ``value`` into the Parameter ``variable`` and returns the
    updated Parameter. simpar's traced graphs have no way to write a Parameter, so the variable
    keeps its value; only the returned tensor equals what MindSpore returns.

    Sharding (MindSpore's AssignInfo, an ArithmeticBase): ``variable`` and ``value`` have one
    shape and must be cut alike; the output has their layout and nothing is communicated.
    ``Assign().shard(((2, 4), (2, 4)))`` on 8 devices: rank 5 returns its own (rows 4..7,
    columns 4..7 of an (8, 16)) block of ``value``.

    Gradient, MindSpore's bprop for Assign, ``(dout, zeros_like(value))``: the output's
    cotangent goes to ``variable`` unchanged (the output *is* the variable in MindSpore) and
    ``value`` gets none (``gives_gradient`` is False for it), so nothing upstream of ``value``
    is trained through an Assign.
    """

    tape = Tape.NOTHING

    n_inputs = 2
    nondiff_inputs = (1,)

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        variable, value = (tuple(s) for s in shapes)
        if variable != value:
            raise ValueError(f"Assign: value has shape {value} but must have the variable's "
                             f"shape {variable}")
        return variable

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        names = dim_names(len(self.infer_shape(*shapes)))
        return IterSpace((names, names), names, names)

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        variable, value = xs
        self.infer_shape(variable.shape, value.shape)
        return np.array(value, dtype=variable.dtype)  # a new tensor: the variable is not written

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        variable = xs[0]
        if variable.dtype.kind != "f":
            return None, None
        return np.asarray(dy, dtype=variable.dtype), None

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 0

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        return self.kernel(*xs), xs[0].dtype

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        if np.dtype(saved).kind != "f":
            return None, None
        return np.asarray(dy, dtype=saved), None
