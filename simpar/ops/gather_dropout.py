"""Gather (embedding lookup, vocabulary parallel when the table's rows are split) and Dropout
(a counter-based mask, so that every shard computes exactly its part of the one-device mask).

``Gather(axis=0)(params, indices)``: MindSpore passes ``axis`` as a third call input; here it is
an attribute. The output is ``params.shape[:axis] + indices.shape + params.shape[axis+1:]``.
Iteration dims, in device-matrix order: the index dims ``i0, i1, …``, then the table dims, with
``v`` for the gathered one (MindSpore's GatherInfo: index strategy, then param strategy).
``v`` never reaches the output, so cutting it leaves the lookup partial: each rank looks up the
ids whose rows it holds and writes zeros elsewhere, and the output plan completes the result
with one AllReduce(sum) (a ReduceScatter with ``out_strategy``). The backward scatters the
cotangent into the local rows only. Column and index cuts need no communication.

``Dropout(keep_prob, seed0, seed1)``: element ``k`` (flat C-order index in the *global*
tensor) is kept when ``splitmix64(key + (k + 1) * golden) >> 11 < keep_prob * 2**53``, with
``key`` mixed from ``(seed0, seed1, step)``. The mask is a pure function of the seeds, the step
and the global index, never of a generator's state, so every strategy gives the same mask bit
for bit and needs no communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from simpar.counter_rng import bits, mix_int
from simpar.ops._base import OpSharding, Primitive, register
from simpar.ops.comm_spec import ONE_DEVICE, Collectives
from simpar.ops.facts import CostClass
from simpar.ops.kernels import Tape
from simpar.ops.strategy import IterSpace
from simpar.seed import current_step

__all__ = ["Dropout", "Gather"]

_INDEX_DTYPES = ("int32", "int64")


# ------------------------------------------------------------------ Gather
@register(mindspore_cost=CostClass.GATHER, elementwise=False)
class Gather(Primitive):
    """Rows (slices along ``axis``) of ``params`` picked by integer ``indices``.

    ``Gather().shard(((4, 1), (2, 1)))`` on 8 devices, table (16, 8), ids (4, 6): device matrix
    [2, 1, 4, 1] (i0, i1, v, h). Rank 5, at coordinate (1, 0, 1, 0), holds table rows 4..7 and
    id rows 2..3; it writes ``table[id]`` where ``4 <= id < 8`` and zeros elsewhere, and one
    AllReduce over ranks [4, 5, 6, 7] completes output rows 2..3. The table's gradient on
    rank 5 is the cotangent of those ids scattered into rows 4..7, then summed over [1, 5]
    (the table's replicas along the id axis).
    """

    tape = Tape.INDICES

    n_inputs = 2
    nondiff_inputs = (1,)
    supports_out_strategy = True

    def __init__(self, axis: int = 0) -> None:
        super().__init__()
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"Gather: axis must be an int, got {type(axis).__name__} {axis!r}")
        self.axis = int(axis)

    def attrs(self) -> dict[str, Any]:
        return {"axis": self.axis}

    def _axis(self, params_ndim: int) -> int:
        if params_ndim == 0:
            raise ValueError("Gather: input_params must have at least 1 dimension, got a 0-d "
                             "array")
        if not -params_ndim <= self.axis < params_ndim:
            raise ValueError(f"Gather: axis {self.axis} is out of range for input_params with "
                             f"{params_ndim} dimensions; allowed {-params_ndim}..{params_ndim - 1}")
        return self.axis % params_ndim

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        p, i = shapes
        a = self._axis(len(p))
        return p[:a] + i + p[a + 1:]

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        p, i = shapes
        a = self._axis(len(p))
        pdims = tuple("v" if d == a else f"p{d}" for d in range(len(p)))
        idims = tuple(f"i{d}" for d in range(len(i)))
        return IterSpace((pdims, idims), pdims[:a] + idims + pdims[a + 1:], idims + pdims)

    def index_limit(self, i: int, shapes: tuple[tuple[int, ...], ...]) -> int | None:
        return shapes[0][self._axis(len(shapes[0]))] if i == 1 else None

    def index_error(self, i: int, value: int, limit: int) -> str:
        return (f"Gather: index {value} is out of range for input_params with {limit} "
                f"entries along axis {self.axis}; allowed 0..{limit - 1}")

    def check_values(self, *global_inputs: np.ndarray) -> None:
        params, indices = global_inputs
        self._check(params, indices, params.shape[self._axis(params.ndim)])

    # -- checks shared by the single-device and the per-rank kernels
    def _check(self, params: np.ndarray, indices: np.ndarray, rows: int) -> None:
        if params.dtype.kind not in "fiu":
            raise TypeError(f"Gather: input_params must be a float or integer array, got dtype "
                            f"{params.dtype}")
        if indices.dtype.name not in _INDEX_DTYPES:
            raise TypeError(f"Gather: input_indices must be int32 or int64, got dtype "
                            f"{indices.dtype}")
        if indices.size:
            lo, hi = int(indices.min()), int(indices.max())
            bad = lo if lo < 0 else hi if hi >= rows else None
            if bad is not None:
                raise ValueError(f"Gather: index {bad} is out of range for input_params with "
                                 f"{rows} entries along axis {self.axis}; allowed 0..{rows - 1}")

    def _lookup(self, params: np.ndarray, ids: np.ndarray, start: int, whole: bool
                ) -> np.ndarray:
        """``params`` holds entries ``start..start+n-1`` along the axis: ids outside give 0.
        ``whole``: it holds every entry, and the ids were checked to lie among them."""
        a = self._axis(params.ndim)
        if whole:
            return np.take(params, ids, axis=a)
        n = params.shape[a]
        local = ids.astype(np.int64) - start
        mine = (local >= 0) & (local < n)
        out = np.take(params, np.where(mine, local, 0), axis=a)
        if not mine.all():
            mask = mine.reshape((1,) * a + ids.shape + (1,) * (params.ndim - a - 1))
            out = np.where(mask, out, np.zeros((), dtype=out.dtype))
        return out

    def _scatter(self, params_shape: tuple[int, ...], dtype: np.dtype, ids: np.ndarray,
                 dy: np.ndarray, start: int, whole: bool) -> np.ndarray:
        """The adjoint of :meth:`_lookup`: ``dy`` summed into the rows its ids pick."""
        a = self._axis(len(params_shape))
        n = params_shape[a]
        g = np.zeros(params_shape, dtype=dtype)
        k = ids.ndim
        # dy: (pre..., ids..., post...) -> (ids..., pre..., post...) -> (m, pre..., post...)
        d = np.moveaxis(dy, tuple(range(a, a + k)), tuple(range(k))) if k and a else dy
        d = d.reshape((-1,) + params_shape[:a] + params_shape[a + 1:])
        if whole:   # every id is this rank's: the same sums, in the same order, unmasked
            np.add.at(np.moveaxis(g, a, 0), ids.reshape(-1), d)
            return g
        local = ids.astype(np.int64).reshape(-1) - start
        mine = (local >= 0) & (local < n)
        np.add.at(np.moveaxis(g, a, 0), local[mine], d[mine])
        return g

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        params, indices = xs
        self._check(params, indices, params.shape[self._axis(params.ndim)])
        return self._lookup(params, indices, 0, True)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        params, indices = xs
        if params.dtype.kind != "f":
            return None, None
        self._check(params, indices, params.shape[self._axis(params.ndim)])
        return self._scatter(params.shape, params.dtype, indices, dy, 0, True), None

    def _start(self, sh: OpSharding, rank: int) -> int:
        """The first table entry (along the axis) that ``rank`` holds."""
        a = self._axis(len(sh.input_shapes[0]))
        return sh.in_slices_on(rank)[0][a][0]

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        params, indices = xs
        a = self._axis(params.ndim)
        self._check(params, indices, sh.input_shapes[0][a])
        start = self._start(sh, collectives.rank)
        whole = params.shape[a] == sh.input_shapes[0][a]   # the table is not split on the axis
        return (self._lookup(params, indices, start, whole),
                (params.shape, params.dtype, indices, start, whole))

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        shape, dtype, indices, start, whole = saved
        if dtype.kind != "f":
            return None, None
        return self._scatter(shape, dtype, indices, dy, start, whole), None


# ------------------------------------------------------------------ Dropout
def _check_seed(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"Dropout: {what} must be an int, got {type(v).__name__} {v!r}")
    if v < 0:
        raise ValueError(f"Dropout: {what} must be >= 0, got {v}")
    return int(v)


@register(mindspore_cost=CostClass.DROPOUT, elementwise=False)
class Dropout(Primitive):
    """Zero each element with probability ``1 - keep_prob`` and scale the kept ones by
    ``1 / keep_prob``.

    The mask depends on ``(seed0, seed1, step, global element index)`` only. ``step`` is the
    enclosing ``simpar.seed.training_step`` (the training runtime runs each step in one), else
    this op's ``step`` attribute; the kernel and the VJP read it when they run, and the
    per-rank backward reuses the mask its forward saved. MindSpore's Dropout returns
    ``(output, mask)``; this one returns the output only.
    MindSpore draws a random seed when seed0 = seed1 = 0; here (0, 0) is a seed like any other,
    so runs are reproducible.

    ``Dropout(0.9).shard(((2, 4),))`` on 8 devices, x of shape (8, 16): rank 5 holds
    x[4:8, 4:8] and hashes the global flat indices 16 * r + c for r in 4..7, c in 4..7, so its
    mask is exactly ``mask[4:8, 4:8]`` of the one-device mask.
    """

    tape = Tape.MASK

    n_inputs = 1

    def __init__(self, keep_prob: float = 0.5, seed0: int = 0, seed1: int = 0) -> None:
        super().__init__()
        if isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float, np.floating,
                                                                     np.integer)):
            raise TypeError(f"Dropout: keep_prob must be a float, got "
                            f"{type(keep_prob).__name__} {keep_prob!r}")
        if not 0.0 < float(keep_prob) <= 1.0:
            raise ValueError(f"Dropout: keep_prob must be in (0, 1], got {keep_prob}")
        self.keep_prob = float(keep_prob)
        self.seed0 = _check_seed(seed0, "seed0")
        self.seed1 = _check_seed(seed1, "seed1")
        self._step = 0

    @property
    def step(self) -> int:
        """The training step the mask is drawn for (advance it once per step)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = _check_seed(value, "step")

    def attrs(self) -> dict[str, Any]:
        return {"keep_prob": self.keep_prob, "seed0": self.seed0, "seed1": self.seed1}

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        return shapes[0]

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        return IterSpace.pointwise(len(shapes[0]))

    def keep_mask(self, shape: Sequence[int], box: Sequence[tuple[int, int]] | None = None
                  ) -> np.ndarray:
        """The boolean keep mask of the elements ``box`` (per dim ``(start, stop)``, default:
        all) of a tensor of global ``shape``, at the current step.

        ``keep_mask((8, 16), ((4, 8), (4, 8)))`` equals ``keep_mask((8, 16))[4:8, 4:8]``.
        """
        shp = tuple(int(n) for n in shape)
        full = tuple((0, n) for n in shp)
        running = current_step()
        step = self._step if running is None else running
        key = mix_int(mix_int(mix_int(self.seed0) ^ self.seed1) ^ step)
        h = bits(key, shp, full if box is None else tuple(box))
        return (h >> np.uint64(11)) < np.uint64(int(self.keep_prob * 2.0 ** 53))

    def _check(self, x: np.ndarray) -> None:
        if x.dtype.kind != "f":
            raise TypeError(f"Dropout: input must be a float array, got dtype {x.dtype}")

    def _apply(self, x: np.ndarray, keep: np.ndarray) -> np.ndarray:
        scale = x.dtype.type(1.0 / self.keep_prob)
        out = np.zeros_like(x)      # one array: the kept elements scaled into it
        np.multiply(x, scale, out=out, where=keep)
        return out

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        (x,) = xs
        self._check(x)
        return self._apply(x, self.keep_mask(x.shape))

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x = xs[0]
        return (self._apply(np.asarray(dy, dtype=x.dtype), self.keep_mask(x.shape)),)

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        (x,) = xs
        self._check(x)
        keep = self.keep_mask(sh.input_shapes[0], sh.in_slices_on(collectives.rank)[0])
        return self._apply(x, keep), keep

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        return (self._apply(dy, saved),)

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return math.prod(local_out)
