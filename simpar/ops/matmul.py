"""MatMul and BatchMatMul: A(i, k) @ B(k, j), with MindSpore's strategy conventions.

``MatMul().shard(((2, 1), (1, 4)))`` on 8 devices: device matrix [2, 1, 4] (i, k, j), A's map
[2, 1], B's [1, 0], output [2, 0]. ``((2, 4), (4, 1))`` cuts k: each rank's product is a
partial sum, completed by an AllReduce over ranks {0,1,2,3} (and {4,5,6,7}); with
``out_strategy=((8, 1),)`` a ReduceScatter onto the rows replaces it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from simpar import context
from simpar.ops._base import Primitive, register
from simpar.ops.facts import CostClass
from simpar.ops.kernels import Inline, Tape, gradient_needed
from simpar.ops.strategy import IterSpace, Strategy, StrategyError

__all__ = ["BatchMatMul", "MatMul"]


class _MatMulBase(Primitive):
    tape = Tape.INPUTS   # the VJP multiplies dy by the inputs; the product itself is not kept
    n_inputs = 2
    supports_out_strategy = True
    fully_used_keeps_unsplit = False  # MatMulBase::PrepareStrategy: product == device_num

    def __init__(self, transpose_a: bool = False, transpose_b: bool = False) -> None:
        super().__init__()
        for name, v in (("transpose_a", transpose_a), ("transpose_b", transpose_b)):
            if not isinstance(v, bool):
                raise TypeError(f"{self.name}: {name} must be a bool, got {v!r}")
        self.transpose_a = transpose_a
        self.transpose_b = transpose_b

    def attrs(self) -> dict[str, Any]:
        return {"transpose_a": self.transpose_a, "transpose_b": self.transpose_b}

    def _ikj(self, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, int, int]:
        if len(a) < 2 or len(b) < 2:
            raise ValueError(f"{self.name}: inputs must have rank >= 2, got shapes {a} and {b}")
        i, k = (a[-1], a[-2]) if self.transpose_a else (a[-2], a[-1])
        kb, j = (b[-1], b[-2]) if self.transpose_b else (b[-2], b[-1])
        if k != kb:
            raise ValueError(f"{self.name}: contraction sizes differ: A {a} gives k={k}, B {b} "
                             f"gives k={kb} (transpose_a={self.transpose_a}, "
                             f"transpose_b={self.transpose_b})")
        return i, k, j

    def _mat_dims(self) -> tuple[tuple[str, str], tuple[str, str]]:
        a = ("k", "i") if self.transpose_a else ("i", "k")
        b = ("j", "k") if self.transpose_b else ("k", "j")
        return a, b

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        # Shapes were checked where they came in (tracing, or ``op(a, b)``): a kernel runs
        # on every step, and its Python is the whole cost of a small shard's product.
        a, b = xs
        if self.transpose_b:
            b = b.swapaxes(-1, -2)
        if b.ndim == 2 and a.ndim > 2 and not self.transpose_a:
            # (..., k) @ (k, j) as one GEMM over every row
            out = np.matmul(a.reshape(-1, a.shape[-1]), b)
            return out.reshape(*a.shape[:-1], out.shape[-1])
        return np.matmul(a.swapaxes(-1, -2) if self.transpose_a else a, b)

    def inline(self, shapes: tuple[tuple[int, ...], ...]) -> Inline | None:
        """Shards of one rank each with equal batch dims: ``kernel`` and ``vjp``'s products
        as ``@`` expressions, transposes as views (``.T`` on 2-D shards)."""
        a, b = shapes
        if len(a) != len(b) or len(a) < 2 or a[:-2] != b[:-2]:
            return None   # broadcast batch dims, or (..., k) @ (k, j) as one GEMM: the kernel
        t = ".T" if len(a) == 2 else ".swapaxes(-1, -2)"
        ta, tb = self.transpose_a, self.transpose_b
        forward = "{x0}" + (t if ta else "") + " @ {x1}" + (t if tb else "")
        da = {(False, False): "{dy} @ {x1}" + t, (False, True): "{dy} @ {x1}",
              (True, False): "{x1} @ {dy}" + t, (True, True): "{x1}" + t + " @ {dy}" + t}
        db = {(False, False): "{x0}" + t + " @ {dy}", (False, True): "{dy}" + t + " @ {x0}",
              (True, False): "{x0} @ {dy}", (True, True): "{dy}" + t + " @ {x0}" + t}
        return Inline(forward, (da[ta, tb], db[ta, tb]))

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        # Each gradient is computed straight in its input's orientation (dB of B stored
        # (j, k) is dY^T A, not (A^T dY)^T): contiguous, with no copy, for the Mirror and the
        # optimizer's passes over it. A gradient the backward does not use is not computed.
        a, b = xs
        ta, tb = self.transpose_a, self.transpose_b
        da = db = None
        if b.ndim == 2 and a.ndim > 2 and not ta:   # a batch of rows times a matrix: 2-D GEMMs
            dy2 = dy.reshape(-1, dy.shape[-1])
            if gradient_needed(0):
                da = np.matmul(dy2, b if tb else b.T).reshape(a.shape)
            if gradient_needed(1):
                a2 = a.reshape(-1, a.shape[-1])
                db = np.matmul(dy2.T, a2) if tb else np.matmul(a2.T, dy2)
            return da, db
        dyt = dy.swapaxes(-1, -2)
        if gradient_needed(0):   # A (i, k): dY B^T; A stored (k, i): B dY^T
            bt = b.swapaxes(-1, -2) if tb else b
            da = np.matmul(bt, dyt) if ta else np.matmul(dy, bt.swapaxes(-1, -2))
            if da.shape != a.shape:
                da = _unbroadcast(da, a.shape)
            da = np.ascontiguousarray(da)
        if gradient_needed(1):   # B (k, j): A^T dY; B stored (j, k): dY^T A
            at = a.swapaxes(-1, -2) if ta else a
            db = np.matmul(dyt, at) if tb else np.matmul(at.swapaxes(-1, -2), dy)
            if db.shape != b.shape:
                db = _unbroadcast(db, b.shape)
            db = np.ascontiguousarray(db)
        return da, db

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        a = local_in[0]
        k = a[-2] if self.transpose_a else a[-1]
        return 2 * math.prod(local_out) * k

    def _strategy_allowed(self, strat: Strategy, shapes: tuple[tuple[int, ...], ...],
                          slice_align: int) -> bool:
        return _slice_aligned(strat, shapes, slice_align) is None

    def _check_settings(self, strat: Strategy, shapes: tuple[tuple[int, ...], ...]) -> None:
        bad = _slice_aligned(strat, shapes, context.algo_parameters().slice_align)
        if bad is not None:
            raise StrategyError(f"{self.name}: strategy {strat} gives slice shape {bad}, but "
                                "tensor_slice_align_enable is set and every slice dimension "
                                "must be a multiple of tensor_slice_align_size")


def _slice_aligned(strat: Strategy, shapes: tuple[tuple[int, ...], ...], size: int
                   ) -> tuple[int, ...] | None:
    """None when the slices' last two dimensions are multiples of ``size``, else the
    offending slice shape."""
    if size == 1:
        return None
    for s, shape in zip(strat, shapes):
        local = tuple(n // c for n, c in zip(shape, s))
        if any(d % size for d in local[-2:]):
            return local
    return None


def _unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``g`` down to ``shape`` (the adjoint of numpy broadcasting)."""
    if g.shape == shape and isinstance(g, np.ndarray):
        return g
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    axes = tuple(d for d, (n, m) in enumerate(zip(shape, g.shape)) if n == 1 and m != 1)
    # np.asarray: summing down to 0-d gives a numpy scalar, and collectives take arrays.
    return np.asarray(g.sum(axis=axes, keepdims=True) if axes else g)


@register(mindspore_cost=CostClass.MATMUL, elementwise=False)
class MatMul(_MatMulBase):
    """``C = A @ B`` on 2-D inputs (``transpose_a``/``transpose_b`` as in MindSpore)."""

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        a, b = shapes
        if len(a) != 2 or len(b) != 2:
            raise ValueError(f"MatMul: inputs must be 2-D, got shapes {a} and {b}; use "
                             "BatchMatMul for batched inputs")
        i, _, j = self._ikj(a, b)
        return (i, j)

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        self.infer_shape(*shapes)
        a, b = self._mat_dims()
        return IterSpace((a, b), ("i", "j"), ("i", "k", "j"))


@register(mindspore_cost=CostClass.MATMUL, elementwise=False)
class BatchMatMul(_MatMulBase):
    """``C[..., i, j] = A[..., i, k] @ B[..., k, j]`` with numpy broadcasting of batch dims."""

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        a, b = shapes
        i, _, j = self._ikj(a, b)
        try:
            batch = np.broadcast_shapes(a[:-2], b[:-2])
        except ValueError:
            raise ValueError(f"BatchMatMul: batch dimensions of {a} and {b} do not broadcast") \
                from None
        return tuple(batch) + (i, j)

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        out = self.infer_shape(*shapes)
        nb = len(out) - 2
        batch = tuple(f"b{d}" for d in range(nb))
        a_m, b_m = self._mat_dims()
        dims = []
        for shape, mat in zip(shapes, (a_m, b_m)):
            lead = len(shape) - 2
            bd: list[str | None] = []
            for d in range(lead):
                od = nb - lead + d
                bd.append(None if shape[d] == 1 and out[od] != 1 else batch[od])
            dims.append(tuple(bd) + mat)
        return IterSpace(tuple(dims), batch + ("i", "j"), batch + ("i", "k", "j"))
