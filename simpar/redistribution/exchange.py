"""The direct exchange (an AllToAllV step): who sends which box of the tensor to whom.

Every rank receives exactly the elements of its destination shard it does not hold, each from
one holder; the holders of a source piece are dealt its requesters round-robin, so that every
holder sends about as much. Every rank computes the same routes from the two layouts alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache, lru_cache

import numpy as np

from simpar.layout import TensorLayout

__all__ = ["Exchange", "Route", "exchange", "held", "route"]


def held(src: TensorLayout, dst: TensorLayout, rank: int) -> int:
    """Elements of rank's dst shard that its src shard already holds."""
    return math.prod(max(0, min(b1, b2) - max(a1, a2)) for (a1, b1), (a2, b2)
                     in zip(src.slice_of(rank), dst.slice_of(rank)))


@dataclass(frozen=True, eq=False)
class Exchange:
    """Who sends which box to whom in an AllToAllV step (every rank computes the same)."""

    src: TensorLayout
    dst: TensorLayout
    s_lo: np.ndarray = field(repr=False)
    d_lo: np.ndarray = field(repr=False)
    s_box: np.ndarray = field(repr=False)   # id of the source piece each rank holds
    cls: np.ndarray = field(repr=False)     # coordinate on carried partial axes (class id)

    def overlap(self, r: int, s: int) -> np.ndarray:
        """(ndim, 2) global [lo, hi) of src shard of r ∩ dst shard of s (may be empty)."""
        s_len = np.array(self.src.local_shape())
        d_len = np.array(self.dst.local_shape())
        lo = np.maximum(self.s_lo[r], self.d_lo[s])
        hi = np.minimum(self.s_lo[r] + s_len, self.d_lo[s] + d_len)
        return np.stack([lo, hi], axis=1)

    def _sizes_from(self, r: int) -> np.ndarray:
        """Elements of rank r's source shard inside each rank's destination shard."""
        s_len = np.array(self.src.local_shape())
        d_len = np.array(self.dst.local_shape())
        lo = np.maximum(self.s_lo[r][None, :], self.d_lo)
        hi = np.minimum((self.s_lo[r] + s_len)[None, :], self.d_lo + d_len[None, :])
        return np.prod(np.clip(hi - lo, 0, None), axis=1)

    def _sizes_into(self, s: int) -> np.ndarray:
        """Elements of each rank's source shard inside rank s's destination shard."""
        s_len = np.array(self.src.local_shape())
        d_len = np.array(self.dst.local_shape())
        lo = np.maximum(self.s_lo, self.d_lo[s][None, :])
        hi = np.minimum(self.s_lo + s_len[None, :], (self.d_lo[s] + d_len)[None, :])
        return np.prod(np.clip(hi - lo, 0, None), axis=1)

    @cache  # noqa: B019 (one Exchange per cached layout pair)
    def holder(self, box: int, receiver: int) -> int:
        """The rank that sends source piece ``box`` to ``receiver``: requesters of the piece
        are dealt out round-robin over its holders, so every holder sends about as much."""
        same = self.cls == self.cls[receiver]
        holders = np.flatnonzero((self.s_box == box) & same)
        rep = int(holders[0])
        need = (self._sizes_from(rep) > 0) & same & (self.s_box != box)
        requesters = np.flatnonzero(need)
        k = int(np.searchsorted(requesters, receiver))
        return int(holders[k % len(holders)])

    def sends(self, r: int) -> list[tuple[int, np.ndarray]]:
        """(receiver, global box) pairs that rank r sends."""
        sizes = self._sizes_from(r)
        out = []
        for s in np.flatnonzero(sizes).tolist():
            if s == r or self.s_box[s] == self.s_box[r] or self.cls[s] != self.cls[r]:
                continue
            if self.holder(int(self.s_box[r]), s) == r:
                out.append((s, self.overlap(r, s)))
        return out

    def recvs(self, s: int) -> list[tuple[int, np.ndarray]]:
        """(sender, global box) pairs that rank s receives."""
        sizes = self._sizes_into(s)
        out = []
        seen: set[int] = set()
        for r in np.flatnonzero(sizes):
            box = int(self.s_box[r])
            if box in seen or box == self.s_box[s] or self.cls[r] != self.cls[s]:
                continue
            seen.add(box)
            h = self.holder(box, s)
            out.append((h, self.overlap(h, s)))
        return out

    def recv_elements(self, s: int) -> int:
        return sum(int(np.prod(b[:, 1] - b[:, 0])) for _, b in self.recvs(s))

    def send_elements(self, r: int) -> int:
        return sum(int(np.prod(b[:, 1] - b[:, 0])) for _, b in self.sends(r))


@lru_cache(maxsize=1024)
def exchange(src: TensorLayout, dst: TensorLayout) -> Exchange:
    """The exchange from ``src`` to ``dst`` (cached: layouts are immutable)."""
    p = src.device_num
    s_lo = np.array([[a for a, _ in src.slice_of(r)] for r in range(p)], dtype=np.int64)
    d_lo = np.array([[a for a, _ in dst.slice_of(r)] for r in range(p)], dtype=np.int64)
    s_lo = s_lo.reshape(p, src.ndim)
    d_lo = d_lo.reshape(p, dst.ndim)
    chunk = np.array([src.chunk_index(r) for r in range(p)], dtype=np.int64).reshape(p, src.ndim)
    s_box = np.ravel_multi_index(chunk.T, src.cuts) if src.ndim else np.zeros(p, dtype=np.int64)
    coords = np.array(np.unravel_index(np.arange(p), src.device_matrix)).T
    carried = [a for a in src.partial_axes if a in dst.partial_axes]
    cls: np.ndarray = np.zeros(p, dtype=np.int64)
    if carried:
        cls = np.asarray(np.ravel_multi_index(coords[:, carried].T,
                                              [src.device_matrix[a] for a in carried]))
    return Exchange(src, dst, s_lo, d_lo, np.asarray(s_box), cls)


Slices = tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class Route:
    """One rank's part of an AllToAllV step, in local coordinates of its own shards."""

    keep: tuple[Slices, Slices] | None                     # (into dst shard, from src shard)
    sends: tuple[tuple[int, Slices], ...]                  # (receiver, from src shard)
    recvs: tuple[tuple[int, Slices, tuple[int, ...]], ...]  # (sender, into dst shard, shape)


@lru_cache(maxsize=4096)
def route(src: TensorLayout, dst: TensorLayout, rank: int) -> Route:
    """``rank``'s part of the exchange from ``src`` to ``dst``, in its own shards' local
    coordinates: what it keeps, sends and receives."""
    ex = exchange(src, dst)
    s_lo, d_lo = ex.s_lo[rank], ex.d_lo[rank]

    def local(box: np.ndarray, lo: np.ndarray) -> Slices:
        return tuple(slice(int(a - o), int(b - o)) for (a, b), o in zip(box, lo, strict=True))

    mine = ex.overlap(rank, rank)
    keep = (local(mine, d_lo), local(mine, s_lo)) if np.all(mine[:, 1] > mine[:, 0]) else None
    sends = tuple((int(s), local(box, s_lo)) for s, box in ex.sends(rank))
    recvs = tuple((int(r), local(box, d_lo), tuple(int(b - a) for a, b in box))
                  for r, box in ex.recvs(rank))
    return Route(keep, sends, recvs)


