"""The cost tables of :mod:`~simpar.search.dynamic_programming`'s eliminations.

A table gives each index (a node's candidate, or an edge's pair of candidates) a list of
(cost, memory) entries, Pareto-minimal and ascending in memory; :func:`pareto` reduces the
entries an elimination combines to such lists, and :func:`stack` joins tables built a block of
rows at a time.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

__all__ = ["Table", "pareto", "stack"]

#: Keys of tables that equal no other.
_FRESH = itertools.count()


class Table:
    """A cost table: per index (a node's candidate, or an edge's pair) a Pareto list of
    (cost, memory) entries, as arrays of shape ``index shape + (entries,)`` padded with
    infinite cost. ``parts``, ``prov`` and ``axes`` say how it was made, for the replay."""

    __slots__ = ("_flip", "axes", "cost", "extra", "key", "kind", "mem", "node", "parts",
                 "prov")

    def __init__(self, cost: np.ndarray, mem: np.ndarray, kind: str,
                 parts: tuple[Table, ...] = (), prov: np.ndarray | None = None,
                 axes: tuple[int, ...] = (), node: int = -1, extra: Any = None,
                 key: Any = None) -> None:
        self.cost, self.mem, self.kind = cost, mem, kind
        self.parts, self.prov, self.axes, self.node, self.extra = parts, prov, axes, node, extra
        #: Equal keys, equal contents (cost, mem, prov): what the eliminations memoise on.
        self.key = key if key is not None else ("unique", next(_FRESH))
        self._flip: Table | None = None

    def rebind(self, cost: np.ndarray, mem: np.ndarray, prov: np.ndarray | None = None
               ) -> None:
        """New contents for the same place in the elimination graph (and its flips')."""
        t = self
        t.cost, t.mem = cost, mem
        if prov is not None:
            t.prov = prov
        while t._flip is not None:
            t._flip.cost, t._flip.mem = t.cost.transpose(1, 0, 2), t.mem.transpose(1, 0, 2)
            t = t._flip

    def flipped(self) -> Table:
        """An edge table seen from its other end (made once)."""
        if self._flip is None:
            self._flip = Table(self.cost.transpose(1, 0, 2), self.mem.transpose(1, 0, 2),
                                "flip", (self,), key=("flip", self.key))
        return self._flip


def pareto(cost: np.ndarray, mem: np.ndarray, width: int, cap: float
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Per row of ``cost``/``mem`` (rows x M), the Pareto-minimal entries within ``cap``,
    ascending in memory, at most ``width`` of them (thinned evenly by memory rank, keeping the
    first and the last), with their column in the input. Returns (cost, mem, column,
    thinned)."""
    cost = np.where(mem > cap, np.inf, cost)
    if width == 1:  # the cheapest entry, the least memory among equals, the first of those
        best = cost.min(axis=1, keepdims=True)
        col = np.argmin(np.where(cost == best, mem, np.inf), axis=1)[:, None]
        col = np.where(np.isfinite(best), col, -1)
        return best, np.take_along_axis(mem, np.maximum(col, 0), axis=1), col, False
    by_cost = np.argsort(cost, axis=1, kind="stable")
    order = np.take_along_axis(by_cost, np.argsort(np.take_along_axis(mem, by_cost, axis=1),
                                                   axis=1, kind="stable"), axis=1)
    cs = np.take_along_axis(cost, order, axis=1)
    ms = np.take_along_axis(mem, order, axis=1)
    best = np.minimum.accumulate(cs, axis=1)
    before = np.concatenate([np.full((cs.shape[0], 1), np.inf), best[:, :-1]], axis=1)
    keep = cs < before
    count = keep.sum(axis=1, keepdims=True)
    thinned = bool((count > width).any())
    if thinned:
        rank = np.cumsum(keep, axis=1) - 1
        span = np.maximum(count - 1, 1)
        q = np.rint(rank * (width - 1) / span)
        keep &= (count <= width) | (np.rint(q * span / (width - 1)) == rank)
    count = keep.sum(axis=1)
    f = max(int(count.max(initial=0)), 1)
    slot = np.cumsum(keep, axis=1) - 1
    rows, cols = np.nonzero(keep)
    out_c = np.full((cs.shape[0], f), np.inf)
    out_m = np.zeros((cs.shape[0], f))
    out_i = np.full((cs.shape[0], f), -1, dtype=np.int64)
    out_c[rows, slot[rows, cols]] = cs[rows, cols]
    out_m[rows, slot[rows, cols]] = ms[rows, cols]
    out_i[rows, slot[rows, cols]] = order[rows, cols]
    return out_c, out_m, out_i, thinned


def stack(cs: list[np.ndarray], ms: list[np.ndarray], idx: list[np.ndarray]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row blocks of tables whose lists may differ in length: pad on the left (lists are
    ascending in memory and end with the cheapest entry)."""
    if len(cs) == 1:
        return cs[0], ms[0], idx[0]
    f = max(c.shape[-1] for c in cs)

    def pad(x: np.ndarray, value: float) -> np.ndarray:
        return np.concatenate([np.full((*x.shape[:-1], f - x.shape[-1]), value, x.dtype), x],
                              axis=-1)

    return (np.concatenate([pad(c, np.inf) for c in cs]),
            np.concatenate([pad(m, 0.0) for m in ms]),
            np.concatenate([pad(i, -1) for i in idx]))
