"""Device-matrix refinement: one layout written over a finer device matrix (same ranks, same
shards), so that two layouts over ``(2, 4)`` and ``(8,)`` can be compared axis by axis.

Rank numbering is row-major, so an axis of 8 is the pair of axes (2, 4), the outer one first.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from functools import lru_cache

from simpar.layout import TensorLayout

__all__ = ["common_refinement", "refine"]


def common_refinement(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """The coarsest device matrix that refines both ``a`` and ``b``, or None if there is none.

    Row-major numbering makes an axis of size ``x*y`` the same as two axes ``(x, y)``, so
    ``(2, 4)`` and ``(8,)`` refine to ``(2, 4)``; ``(2, 3)`` and ``(3, 2)`` have no refinement.
    """
    if math.prod(a) != math.prod(b):
        return None
    cuts = sorted(set(itertools.accumulate((d for d in a if d > 1), operator.mul))
                  | set(itertools.accumulate((d for d in b if d > 1), operator.mul)))
    out, prev = [], 1
    for c in cuts:
        if c % prev:
            return None
        out.append(c // prev)
        prev = c
    return tuple(out) or (1,)


def refine(layout: TensorLayout, device_matrix: Sequence[int]) -> TensorLayout:
    """``layout`` rewritten over a finer ``device_matrix`` (same ranks, same shards).

    Each original axis becomes the run of new axes whose sizes multiply to it; size-1 axes
    vanish. ``refine(TensorLayout((8,), (0,), (16,)), (2, 4))`` has tensor map ((1, 0),).
    """
    new = tuple(device_matrix)
    if tuple(layout.device_matrix) == new:
        return layout
    return _refine(layout, new)


@lru_cache(maxsize=1 << 16)
def _refine(layout: TensorLayout, new: tuple[int, ...]) -> TensorLayout:
    """:func:`refine` (layouts are immutable: planners refine the same ones many times)."""
    not_refining = f"device matrix {list(new)} does not refine {list(layout.device_matrix)}"
    groups: dict[int, tuple[int, ...]] = {}
    j, n_new = 0, len(new)
    for axis, size in enumerate(layout.device_matrix):
        run: list[int] = []
        prod = 1
        while prod < size:
            if j >= n_new:
                raise ValueError(not_refining)
            prod *= new[j]
            run.append(j)
            j += 1
        if prod != size:
            raise ValueError(not_refining)
        groups[axis] = tuple(run)
    if any(d != 1 for d in new[j:]):
        raise ValueError(not_refining)
    dim_axes = [[na for a in axes for na in groups[a]] for axes in layout.dim_axes]
    partial_axes = [na for a in layout.partial_axes for na in groups[a]]
    return TensorLayout.from_dim_axes(new, dim_axes, layout.shape, partial_axes)

