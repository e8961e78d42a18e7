"""Move a tensor from one layout to another with the fewest bytes, over real MPI.

:func:`plan` is pure (no MPI): it turns ``(src, dst)`` into a short list of :class:`Step` s, each
one collective or one local operation. :func:`execute` runs a plan on this rank's shard.

How a plan is built:

1. Both layouts are rewritten over their common refinement of the device matrix, so that
   ``(2, 4)`` and ``(8,)`` are both seen as ``(2, 4)``: rank numbering is row-major in both, so
   an axis of 8 is the pair of axes (2, 4) with the outer one first.
2. Pending sums are resolved at the destination's granularity: a partial axis that the
   destination uses to split dimension ``i`` becomes one ReduceScatter onto dimension ``i``;
   partial axes the destination replicates become one AllReduce.
3. What is left is a move between non-partial layouts. A free local slice takes whatever the
   destination cuts finer along axes the source replicates. Then exactly one of:
   an AllGather (the destination is the union of the source shards along some axes), an
   AllToAll (some axes move from the end of one dimension's split to the end of another's),
   or a direct exchange (``all_to_all_v``) in which every rank receives exactly the elements of
   its destination shard it does not hold, each from one holder, senders balanced round-robin.

Every non-partial plan therefore receives exactly :func:`min_bytes` on every rank. With
``enable_alltoall=False`` (MindSpore's default) steps 3's AllToAll and direct exchange are
replaced by AllGather + slice, as MindSpore does; that costs more bytes.

>>> src = TensorLayout((8,), (0, -1), (2048, 2048))   # S(0)
>>> dst = TensorLayout((8,), (-1, 0), (2048, 2048))   # S(1)
>>> print(plan(src, dst))                              # doctest: +SKIP
[8]:[0,-1] [2048, 2048] -> [8]:[-1,0] [2048, 2048]
  AllToAll axes=(0,) split=1 concat=0  recv/rank 1835008 el
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

import numpy as np

import simpar.comm as simpar_comm
from simpar import schedule
from simpar.cost.collective import (
    ALPHA_SECONDS,
    BANDWIDTH_BYTES_PER_S,
    sample_ranks,
    seconds,
    traffic,
)
from simpar.layout import TensorLayout, block_key
from simpar.mesh import DeviceMesh

__all__ = [
    "RedistributionPlan",
    "Step",
    "StepKind",
    "bind_step",
    "common_refinement",
    "execute",
    "execute_adjoint",
    "execute_step",
    "min_bytes",
    "plan",
    "refine",
]

class StepKind(str, enum.Enum):
    """What one step does: a collective (named as MindSpore and CommTrace name them) or a
    local operation. Members compare equal to their values (``StepKind.SLICE == "Slice"``)."""

    SLICE = "Slice"             # local: keep a sub-block of the shard
    ZERO = "Zero"               # local: zero all but one replica of a value becoming partial
    ALL_GATHER = "AllGather"
    ALL_TO_ALL = "AllToAll"
    ALL_TO_ALL_V = "AllToAllV"  # the direct exchange (simpar.comm.all_to_all_v)
    REDUCE_SCATTER = "ReduceScatter"
    ALL_REDUCE = "AllReduce"

    def __str__(self) -> str:
        return self.value

    @property
    def local(self) -> bool:
        """True for steps that move nothing between ranks."""
        return self in LOCAL_KINDS

    @property
    def adjoint(self) -> StepKind:
        """The step that runs this one backwards (AllGather's is a ReduceScatter)."""
        return _ADJOINT_KIND[self]


SLICE, ZERO = StepKind.SLICE, StepKind.ZERO
ALL_GATHER, ALL_TO_ALL, ALL_TO_ALL_V = (StepKind.ALL_GATHER, StepKind.ALL_TO_ALL,
                                        StepKind.ALL_TO_ALL_V)
REDUCE_SCATTER, ALL_REDUCE = StepKind.REDUCE_SCATTER, StepKind.ALL_REDUCE
#: Kinds that cost nothing on the network.
LOCAL_KINDS = (SLICE, ZERO)
_ADJOINT_KIND = {ALL_REDUCE: ALL_REDUCE, ALL_GATHER: REDUCE_SCATTER, REDUCE_SCATTER: ALL_GATHER,
                 ALL_TO_ALL: ALL_TO_ALL, ALL_TO_ALL_V: ALL_TO_ALL_V, SLICE: SLICE, ZERO: ZERO}



@dataclass(frozen=True, slots=True)
class Step:
    """One step of a plan: ``src`` becomes ``dst`` by one collective or one local operation.

    ``device_axes`` are the axes (of the refined device matrix, counted from the left) along
    which the collective's groups run; a rank's group is ``mesh.group_of(rank, device_axes)``.
    ``tensor_dim`` is the dimension scattered (ReduceScatter), split (AllToAll) or gathered
    (AllGather, several dims possible: ``gather_dims``); ``concat_dim`` is AllToAll's other side.
    """

    kind: StepKind
    src: TensorLayout
    dst: TensorLayout
    device_axes: tuple[int, ...] = ()
    tensor_dim: int = -1
    concat_dim: int = -1
    gather_dims: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StepKind(self.kind))  # "AllGather" is accepted too

    @property
    def group_size(self) -> int:
        return math.prod(self.src.device_matrix[a] for a in self.device_axes)

    def recv_elements(self, rank: int) -> int:
        """Elements this rank receives from other ranks in this step."""
        if self.kind in LOCAL_KINDS:
            return 0
        if self.kind == ALL_TO_ALL_V:
            # The direct exchange receives exactly the missing elements (min_bytes).
            return self.dst.local_size() - _held(self.src, self.dst, rank)
        return traffic(self.kind, self.group_size, self.src.local_size())

    def send_elements(self, rank: int) -> int:
        """Elements this rank sends to other ranks in this step."""
        if self.kind == ALL_TO_ALL_V:
            return _exchange(self.src, self.dst).send_elements(rank)
        return self.recv_elements(rank)

    def recv_bytes(self, rank: int, itemsize: int) -> int:
        """Bytes this rank receives, as CommTrace counts them: an AllReduce's ``2 (p-1)/p n``
        is rounded in bytes, not in elements (1 int64 over 8 ranks is 14 bytes)."""
        if self.kind == ALL_REDUCE:
            return traffic(ALL_REDUCE, self.group_size, self.src.local_size() * itemsize)
        return itemsize * self.recv_elements(rank)

    def send_bytes(self, rank: int, itemsize: int) -> int:
        if self.kind == ALL_REDUCE:
            return self.recv_bytes(rank, itemsize)
        return itemsize * self.send_elements(rank)

    def seconds(self, itemsize: int, alpha: float = ALPHA_SECONDS,
                bandwidth: float = BANDWIDTH_BYTES_PER_S) -> float:
        """Estimated time: latency per round plus the busiest rank's bytes over bandwidth."""
        if self.kind in LOCAL_KINDS:
            return 0.0
        busiest = max(max(self.recv_elements(r), self.send_elements(r))
                      for r in sample_ranks(self.src.device_num))
        return seconds(self.kind, self.group_size, busiest * itemsize, alpha, bandwidth)

    def __str__(self) -> str:
        extra = ""
        if self.kind == ALL_TO_ALL:
            extra = f" split={self.tensor_dim} concat={self.concat_dim}"
        elif self.kind == REDUCE_SCATTER:
            extra = f" dim={self.tensor_dim}"
        elif self.kind == ALL_GATHER:
            extra = " dims=" + ",".join(str(d) for d, _ in self.gather_dims)
        axes = f" axes={self.device_axes}" if self.device_axes else ""
        recv = "" if self.kind in LOCAL_KINDS else f"  recv/rank<= {self.max_recv_elements()} el"
        return f"{self.kind}{axes}{extra} -> {self.dst}{recv}"

    def max_recv_elements(self) -> int:
        return max(self.recv_elements(r) for r in sample_ranks(self.src.device_num))


@dataclass(frozen=True, slots=True)
class RedistributionPlan:
    """The steps that turn a shard in layout ``src`` into a shard in layout ``dst``."""

    src: TensorLayout
    dst: TensorLayout
    steps: tuple[Step, ...]
    enable_alltoall: bool = False

    def recv_bytes(self, rank: int, itemsize: int) -> int:
        """Bytes ``rank`` receives from others over the whole plan."""
        return sum(s.recv_bytes(rank, itemsize) for s in self.steps)

    def send_bytes(self, rank: int, itemsize: int) -> int:
        return sum(s.send_bytes(rank, itemsize) for s in self.steps)

    def seconds(self, itemsize: int, alpha: float = ALPHA_SECONDS,
                bandwidth: float = BANDWIDTH_BYTES_PER_S) -> float:
        return sum(s.seconds(itemsize, alpha, bandwidth) for s in self.steps)

    def collectives(self) -> list[Step]:
        """The steps that communicate."""
        return [s for s in self.steps if s.kind not in LOCAL_KINDS]

    def kinds(self) -> list[str]:
        return [str(s.kind) for s in self.steps]

    def __len__(self) -> int:
        return len(self.steps)

    def __str__(self) -> str:
        head = f"{self.src} -> {self.dst}"
        if not self.steps:
            return head + "\n  (nothing to do)"
        return head + "".join(f"\n  {s}" for s in self.steps)


# ------------------------------------------------------------------ device-matrix refinement
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


# ------------------------------------------------------------------ the planner
def plan(src: TensorLayout, dst: TensorLayout, enable_alltoall: bool = False
         ) -> RedistributionPlan:
    """The cheapest plan from ``src`` to ``dst`` (same shape, same number of devices).

    Pure and cached: no MPI, and the same arguments give the same plan object.
    """
    if not isinstance(src, TensorLayout) or not isinstance(dst, TensorLayout):
        raise TypeError(f"plan: src and dst must be TensorLayout, got {type(src).__name__} and "
                        f"{type(dst).__name__}")
    if not isinstance(enable_alltoall, bool):
        raise TypeError(f"plan: enable_alltoall must be a bool, got {enable_alltoall!r}")
    if src.shape != dst.shape:
        raise ValueError(f"plan: src shape {src.shape} and dst shape {dst.shape} differ; "
                         "redistribution keeps the global shape (reshape is an operator)")
    if src.device_num != dst.device_num:
        raise ValueError(f"plan: src lives on {src.device_num} devices {list(src.device_matrix)} "
                         f"and dst on {dst.device_num} {list(dst.device_matrix)}; both must "
                         "cover the same ranks")
    return _plan(src, dst, enable_alltoall)


@lru_cache(maxsize=8192)
def _plan(src: TensorLayout, dst: TensorLayout, enable_alltoall: bool) -> RedistributionPlan:
    if src == dst or src.device_num == 1 or block_key(src) == block_key(dst):
        # Nothing moves: one device holds the whole tensor in every layout, and two layouts
        # written over different device matrices can still give every rank the same block.
        return RedistributionPlan(src, dst, (), enable_alltoall)
    fine = common_refinement(src.device_matrix, dst.device_matrix)
    if fine is None:
        return _plan_unrelated(src, dst, enable_alltoall)
    s, d = refine(src, fine), refine(dst, fine)
    steps: list[Step] = []
    # Slice before reducing: a pending sum is then reduced only over the piece dst keeps.
    cur = _free_slice(s, d, steps) if s.partial else s
    cur = _resolve_partial(cur, d, steps)
    # Axes partial in dst but not in the source: reach dst without them, then zero replicas.
    extra_partial = [a for a in d.partial_axes if a not in cur.partial_axes]
    target = d.with_partial_axes([a for a in d.partial_axes if a in cur.partial_axes])
    cur = _move(cur, target, steps, enable_alltoall)
    if extra_partial:
        zeroed = cur.with_partial_axes(sorted(set(cur.partial_axes) | set(extra_partial)))
        steps.append(Step(ZERO, cur, zeroed, tuple(extra_partial)))
        cur = zeroed
    assert cur == d, (cur, d)
    return RedistributionPlan(src, dst, tuple(steps), enable_alltoall)


def _plan_unrelated(src: TensorLayout, dst: TensorLayout, enable_alltoall: bool
                    ) -> RedistributionPlan:
    """Device matrices with no common refinement, e.g. (2, 3) and (3, 2)."""
    steps: list[Step] = []
    cur = src
    if src.partial:
        cur = src.with_partial(())
        steps.append(Step(ALL_REDUCE, src, cur, src.partial_axes))
    target = dst.with_partial(())
    if not enable_alltoall:
        full = TensorLayout(cur.device_matrix, [-1] * cur.ndim, cur.shape)
        if cur != full:
            steps.append(_gather_step(cur, full))
        steps.append(Step(SLICE, full, target))
    else:
        steps.append(Step(ALL_TO_ALL_V, cur, target))
    if dst.partial:
        steps.append(Step(ZERO, target, dst, dst.partial_axes))
    return RedistributionPlan(src, dst, tuple(steps), enable_alltoall)


def _resolve_partial(s: TensorLayout, d: TensorLayout, steps: list[Step]) -> TensorLayout:
    """ReduceScatter partial axes onto the dimension dst splits with them; AllReduce the rest."""
    cur = s
    to_resolve = [a for a in s.partial_axes if a not in d.partial_axes]
    if not to_resolve:
        return cur
    dim_of = {a: i for i, axes in enumerate(d.dim_axes) for a in axes}
    by_dim: dict[int, list[int]] = {}
    reduce_all: list[int] = []
    for a in to_resolve:
        if a in dim_of:
            by_dim.setdefault(dim_of[a], []).append(a)
        else:
            reduce_all.append(a)
    for tensor_dim, axes in sorted(by_dim.items()):
        # Scatter in the order dst lists these axes, so that the chunk order matches dst.
        axes = sorted(axes, key=d.dim_axes[tensor_dim].index)
        local = cur.local_shape()[tensor_dim]
        p = math.prod(cur.device_matrix[a] for a in axes)
        if local % p:
            reduce_all.extend(axes)
            continue
        new_axes = [list(x) for x in cur.dim_axes]
        new_axes[tensor_dim] += axes
        nxt = TensorLayout.from_dim_axes(cur.device_matrix, new_axes, cur.shape,
                                         [a for a in cur.partial_axes if a not in axes])
        steps.append(Step(REDUCE_SCATTER, cur, nxt, tuple(axes), tensor_dim=tensor_dim))
        cur = nxt
    if reduce_all:
        summed = tuple(sorted(reduce_all))
        nxt = cur.with_partial_axes([a for a in cur.partial_axes if a not in summed])
        steps.append(Step(ALL_REDUCE, cur, nxt, summed))
        cur = nxt
    return cur


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


def _free_slice(cur: TensorLayout, d: TensorLayout, steps: list[Step]) -> TensorLayout:
    """Cut each dim further by dst's next axes that cur replicates: free, local, and done
    first, so that any collective after it moves (or reduces) only the smaller piece."""
    replica = set(cur.replica_axes)
    new_axes = [list(x) for x in cur.dim_axes]
    for i, (ca, da) in enumerate(zip(cur.dim_axes, d.dim_axes)):
        k = _common_prefix(ca, da)
        if k == len(ca):
            for a in da[k:]:
                if a not in replica:
                    break
                new_axes[i].append(a)
                replica.discard(a)
    if new_axes == [list(x) for x in cur.dim_axes]:
        return cur
    sliced = TensorLayout.from_dim_axes(cur.device_matrix, new_axes, cur.shape,
                                        cur.partial_axes)
    steps.append(Step(SLICE, cur, sliced))
    return sliced


def _move(cur: TensorLayout, d: TensorLayout, steps: list[Step], enable_alltoall: bool
          ) -> TensorLayout:
    """Non-partial move (partial axes common to both are carried along untouched)."""
    if cur == d:
        return cur
    # 1. Free slice: extend each dim's split by dst's next axes that cur replicates.
    cur = _free_slice(cur, d, steps)
    if cur == d:
        return cur
    # 2. AllGather: dst's split of every dim is a prefix of cur's.
    if all(_common_prefix(ca, da) == len(da) for ca, da in zip(cur.dim_axes, d.dim_axes)):
        steps.append(_gather_step(cur, d))
        return d
    if not enable_alltoall:
        keep = [list(ca[:_common_prefix(ca, da)]) for ca, da in zip(cur.dim_axes, d.dim_axes)]
        mid = TensorLayout.from_dim_axes(cur.device_matrix, keep, cur.shape, cur.partial_axes)
        steps.append(_gather_step(cur, mid))
        steps.append(Step(SLICE, mid, d))
        return d
    # 3. AllToAll: axes E leave the end of dim i's split and join the end of dim j's.
    for i in range(cur.ndim):
        for j in range(cur.ndim):
            if i == j:
                continue
            ci, cj, di, dj = cur.dim_axes[i], cur.dim_axes[j], d.dim_axes[i], d.dim_axes[j]
            if dj[:len(cj)] != cj or len(dj) == len(cj):
                continue
            moved = dj[len(cj):]
            others_equal = all(cur.dim_axes[k] == d.dim_axes[k] for k in range(cur.ndim)
                               if k not in (i, j))
            kept = len(ci) - len(moved)
            if (others_equal and ci[kept:] == moved and di == ci[:kept]
                    and cur.local_shape()[j] % math.prod(cur.device_matrix[a] for a in moved) == 0):
                steps.append(Step(ALL_TO_ALL, cur, d, tuple(moved), tensor_dim=j, concat_dim=i))
                return d
    # 4. Direct exchange of exactly the missing elements.
    steps.append(Step(ALL_TO_ALL_V, cur, d))
    return d


def _gather_step(cur: TensorLayout, d: TensorLayout) -> Step:
    """AllGather over every axis cur splits beyond dst's (dst must be a prefix per dim)."""
    gather_dims = tuple((i, tuple(ca[len(da):])) for i, (ca, da) in
                        enumerate(zip(cur.dim_axes, d.dim_axes)) if len(ca) > len(da))
    axes = tuple(a for _, ax in gather_dims for a in ax)
    return Step(ALL_GATHER, cur, d, axes, gather_dims=gather_dims)


# ------------------------------------------------------------------ lower bound
def min_bytes(src: TensorLayout, dst: TensorLayout, itemsize: int = 4) -> tuple[int, ...]:
    """Per rank, the fewest bytes it must receive: its destination shard minus what it holds.

    Computed from the two layouts' slices alone, independently of :func:`plan`. Defined for
    non-partial sources (a partial source holds no element outright).
    """
    if src.partial:
        raise ValueError(f"min_bytes: src {src} is partial; the bound is defined for "
                         "non-partial sources only")
    if src.shape != dst.shape or src.device_num != dst.device_num:
        raise ValueError(f"min_bytes: src {src} and dst {dst} must share shape and device count")
    out = []
    for r in range(src.device_num):
        have = math.prod(max(0, min(d1, s1) - max(d0, s0))
                         for (s0, s1), (d0, d1) in zip(src.slice_of(r), dst.slice_of(r)))
        out.append((math.prod(dst.local_shape()) - have) * itemsize)
    return tuple(out)


# ------------------------------------------------------------------ the direct exchange
def _held(src: TensorLayout, dst: TensorLayout, rank: int) -> int:
    """Elements of rank's dst shard that its src shard already holds."""
    return math.prod(max(0, min(b1, b2) - max(a1, a2)) for (a1, b1), (a2, b2)
                     in zip(src.slice_of(rank), dst.slice_of(rank)))


@dataclass(frozen=True, eq=False)
class _Exchange:
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

    @cache  # noqa: B019 (one _Exchange per cached layout pair)
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
def _exchange(src: TensorLayout, dst: TensorLayout) -> _Exchange:
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
    return _Exchange(src, dst, s_lo, d_lo, np.asarray(s_box), cls)


# ------------------------------------------------------------------ execution
#: The communication module: :mod:`simpar.comm`, or a stand-in with the same functions (the
#: planning tests run plans on threads).
Comm = Any


def execute(plan: RedistributionPlan, local_array: np.ndarray, comm: Comm = None
            ) -> np.ndarray:
    """Run ``plan`` on this rank's shard (in ``plan.src``) and return its shard in ``plan.dst``.

    ``comm`` is the communication module to use (default :mod:`simpar.comm`). Every rank of the
    layouts' devices must call this with the same plan.
    """
    if not plan.steps:
        return local_array
    comm = _default_comm(comm)
    rank, size = comm.get_rank(), comm.get_group_size()
    if plan.src.device_num != size:
        raise ValueError(f"execute: the plan's layouts cover {plan.src.device_num} devices "
                         f"but the MPI world has {size} ranks")
    if tuple(local_array.shape) != plan.src.local_shape():
        raise ValueError(f"execute: rank {rank}'s shard has shape {local_array.shape}, but "
                         f"layout {plan.src} gives shards of {plan.src.local_shape()}")
    return _run_steps(plan, local_array, rank, comm, adjoint=False)


def _default_comm(comm: Comm) -> Comm:
    return simpar_comm if comm is None else comm


def _run_steps(plan: RedistributionPlan, x: np.ndarray, rank: int, comm: Comm, adjoint: bool
               ) -> np.ndarray:
    """Every step of ``plan`` in order (or every step's adjoint in reverse order)."""
    _verify_once(plan, x.dtype, comm)
    steps = reversed(plan.steps) if adjoint else iter(plan.steps)
    run = _run_adjoint if adjoint else _run_step
    with _unchecked(comm):
        for step in steps:
            if step.kind.local:
                x = run(step, x, rank, comm)
                continue
            with comm.label(_label(adjoint, step.kind)), schedule.issue(step, adjoint):
                x = run(step, x, rank, comm)
    return x


def _unchecked(comm: Comm) -> contextlib.AbstractContextManager[None]:
    """Collectives without their per-call agreement check (a no-op when already so)."""
    return comm.validation_disabled() if comm.validation() else contextlib.nullcontext()


_VERIFIED: set[tuple[RedistributionPlan, np.dtype]] = set()
# The plans verified, by identity (a plan object is run over and over; hashing one walks its
# layouts and steps): id -> the plan, kept so that its id is not reused.
_VERIFIED_IDS: dict[tuple[int, np.dtype], RedistributionPlan] = {}


def _verify_once(plan: RedistributionPlan, dtype: np.dtype, comm: Comm) -> None:
    """The first time a (plan, dtype) runs, check that every rank runs the same one; its
    collectives then skip their own per-call agreement check (they agree by construction)."""
    if (id(plan), dtype) in _VERIFIED_IDS or not comm.validation():
        return
    key = (plan, dtype)
    if key not in _VERIFIED:
        comm.check_agreement("redistribution", f"{plan.src} -> {plan.dst} {dtype}")
        _VERIFIED.add(key)
    if len(_VERIFIED_IDS) < 65536:
        _VERIFIED_IDS[id(plan), dtype] = plan


# execute runs the same plans over and over: everything a step derives from (layouts, rank)
# alone is computed once per rank and cached (groups, slice offsets, AllToAllV routes).
@lru_cache(maxsize=65536)
def _group(device_matrix: tuple[int, ...], rank: int, device_axes: tuple[int, ...]
           ) -> tuple[int, ...]:
    """World ranks of ``rank``'s group along ``device_axes``, in group order."""
    if not device_axes:
        return (rank,)
    return DeviceMesh(device_matrix).group_of(rank, device_axes)


@lru_cache(maxsize=65536)
def _offsets(outer: TensorLayout, inner: TensorLayout, rank: int) -> tuple[slice, ...]:
    """Where ``inner``'s shard of ``rank`` sits inside ``outer``'s shard of ``rank``."""
    return tuple(slice(i0 - o0, i1 - o0) for (o0, _), (i0, i1) in
                 zip(outer.slice_of(rank), inner.slice_of(rank)))


@lru_cache(maxsize=65536)
def _zeroes(device_matrix: tuple[int, ...], device_axes: tuple[int, ...], rank: int) -> bool:
    """Whether a ZERO step over ``device_axes`` zeros ``rank``'s array (it is off coordinate 0
    of one of them)."""
    coord = DeviceMesh(device_matrix).coordinate(rank)
    return any(coord[a] for a in device_axes)


def _zero(step: Step, x: np.ndarray, rank: int) -> np.ndarray:
    """A ZERO step (its own adjoint): zeros on every rank off coordinate 0 of its axes."""
    return np.zeros_like(x) if _zeroes(step.src.device_matrix, step.device_axes, rank) else x


def _run_step(step: Step, x: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    if step.kind == SLICE:
        return np.ascontiguousarray(x[_offsets(step.src, step.dst, rank)])
    if step.kind == ZERO:
        return _zero(step, x, rank)
    group = _group(step.src.device_matrix, rank, step.device_axes)
    if step.kind == ALL_REDUCE:
        # reshape: comm.all_reduce returns a 0-d input as shape (1,) (np.ascontiguousarray).
        return c.all_reduce(x, group=group).reshape(x.shape)
    if step.kind == REDUCE_SCATTER:
        return c.reduce_scatter(x, axis=step.tensor_dim, group=group)
    if step.kind == ALL_TO_ALL:
        return c.all_to_all(x, split_axis=step.tensor_dim, concat_axis=step.concat_dim,
                            group=group)
    if step.kind == ALL_GATHER:
        return _all_gather(step, x, group, c)
    if step.kind == ALL_TO_ALL_V:
        return _all_to_all_v(step, x, rank, c)
    raise AssertionError(f"unknown step kind {step.kind}")


def _all_gather(step: Step, x: np.ndarray, group: tuple[int, ...], c: Comm) -> np.ndarray:
    if len(step.gather_dims) == 1:
        return c.all_gather(x, axis=step.gather_dims[0][0], group=group)
    # Several dims at once: one AllGather, then one copy that interleaves the blocks.
    blocks = c.all_gather(x[None], axis=0, group=group)
    dm = step.src.device_matrix
    sizes = [dm[a] for _, axes in step.gather_dims for a in axes]
    blocks = blocks.reshape(tuple(sizes) + x.shape)
    order: list[int] = []
    k = 0
    per_dim = dict(step.gather_dims)
    nb = len(sizes)
    for i in range(x.ndim):
        for _ in per_dim.get(i, ()):
            order.append(k)
            k += 1
        order.append(nb + i)
    out_shape = tuple(n * math.prod(dm[a] for a in per_dim.get(i, ()))
                      for i, n in enumerate(x.shape))
    return np.ascontiguousarray(blocks.transpose(order)).reshape(out_shape)


Slices = tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class _Route:
    """One rank's part of an AllToAllV step, in local coordinates of its own shards."""

    keep: tuple[Slices, Slices] | None                     # (into dst shard, from src shard)
    sends: tuple[tuple[int, Slices], ...]                  # (receiver, from src shard)
    recvs: tuple[tuple[int, Slices, tuple[int, ...]], ...]  # (sender, into dst shard, shape)


@lru_cache(maxsize=4096)
def _route(src: TensorLayout, dst: TensorLayout, rank: int) -> _Route:
    ex = _exchange(src, dst)
    s_lo, d_lo = ex.s_lo[rank], ex.d_lo[rank]

    def local(box: np.ndarray, lo: np.ndarray) -> Slices:
        return tuple(slice(int(a - o), int(b - o)) for (a, b), o in zip(box, lo, strict=True))

    mine = ex.overlap(rank, rank)
    keep = (local(mine, d_lo), local(mine, s_lo)) if np.all(mine[:, 1] > mine[:, 0]) else None
    sends = tuple((int(s), local(box, s_lo)) for s, box in ex.sends(rank))
    recvs = tuple((int(r), local(box, d_lo), tuple(int(b - a) for a, b in box))
                  for r, box in ex.recvs(rank))
    return _Route(keep, sends, recvs)


def _all_to_all_v(step: Step, x: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    route = _route(step.src, step.dst, rank)
    p = step.src.device_num
    pieces: list[np.ndarray | None] = [None] * p
    for s, sl in route.sends:
        pieces[s] = x[sl]
    shapes: list[tuple[int, ...] | None] = [None] * p
    for r, _, shape in route.recvs:
        shapes[r] = shape
    got = c.all_to_all_v(pieces, shapes, dtype=x.dtype)
    # The part this rank keeps is copied after the exchange, so that no peer waits for it.
    out = np.empty(step.dst.local_shape(), dtype=x.dtype)
    if route.keep is not None:
        out[route.keep[0]] = x[route.keep[1]]
    for r, sl, _ in route.recvs:
        out[sl] = got[r]
    return out


# ------------------------------------------------------------------ backward (adjoint)
def execute_adjoint(plan: RedistributionPlan, local_grad: np.ndarray, comm: Comm = None
                    ) -> np.ndarray:
    """The backward of :func:`execute`: map a gradient shard in ``plan.dst`` back to
    ``plan.src`` by running every step's adjoint in reverse order.

    Collectives are linear, so each adjoint is exact: AllGather ↔ ReduceScatter, AllReduce ↔
    AllReduce, AllToAll ↔ the inverse AllToAll, a direct exchange ↔ the reverse exchange, a
    slice ↔ zero-padding. The result is this rank's *contribution*: contributions of ranks
    that hold the same source piece sum to its gradient.
    """
    if not plan.steps:
        return local_grad
    comm = _default_comm(comm)
    rank = comm.get_rank()
    if tuple(local_grad.shape) != plan.dst.local_shape():
        raise ValueError(f"execute_adjoint: rank {rank}'s gradient has shape {local_grad.shape}, "
                         f"but layout {plan.dst} gives shards of {plan.dst.local_shape()}")
    return _run_steps(plan, local_grad, rank, comm, adjoint=True)


def execute_step(step: Step, x: np.ndarray, adjoint: bool = False, comm: Comm = None
                 ) -> np.ndarray:
    """Run one step of a plan (or its adjoint) on this rank's array: what a planned backward
    runs step by step. A collective announces itself to the schedule guard."""
    comm = _default_comm(comm)
    rank = comm.get_rank()
    run = _run_adjoint if adjoint else _run_step
    if step.kind.local:
        return run(step, x, rank, comm)
    with _unchecked(comm), comm.label(_label(adjoint, step.kind)), \
            schedule.issue(step, adjoint):
        return run(step, x, rank, comm)


def bind_step(step: Step, adjoint: bool, dtype: Any, rank: int, consume: bool = False
              ) -> Callable[[np.ndarray], np.ndarray]:
    """``execute_step(step, x, adjoint)`` bound once for ``rank`` (this process's) and for
    arrays of ``dtype``, for a compiled program that runs the step on every training step:
    the group, the slice offsets and the collective (:func:`simpar.comm.prepare`) are worked
    out here, so a call is the numpy or MPI call and the schedule guard's check. A collective
    announces itself to the guard, as execute_step's does. An array of another shape or dtype
    takes the general path, checks and all; so do the steps with no prepared form (a gather
    of several dimensions at once, the direct exchange), through execute_step. ``consume``:
    the caller gives its array up, and an AllReduce sums into it
    (:func:`simpar.comm.prepare`'s ``consume``); other steps ignore it."""
    kind = step.kind
    if kind == SLICE:
        offsets = _offsets(step.src, step.dst, rank)
        if not adjoint:
            return lambda x: np.ascontiguousarray(x[offsets])
        whole = step.src.local_shape()

        def pad(g: np.ndarray) -> np.ndarray:
            out = np.zeros(whole, dtype=g.dtype)
            out[offsets] = g
            return out
        return pad
    if kind == ZERO:
        return (np.zeros_like if _zeroes(step.src.device_matrix, step.device_axes, rank)
                else _unchanged)
    group = _group(step.src.device_matrix, rank, step.device_axes)
    shape = (step.dst if adjoint else step.src).local_shape()
    if kind == ALL_REDUCE:
        prepared = simpar_comm.prepare("all_reduce", shape, dtype, group, consume=consume)
    elif kind == REDUCE_SCATTER:
        prepared = simpar_comm.prepare("all_gather" if adjoint else "reduce_scatter", shape,
                                       dtype, group, axis=step.tensor_dim)
    elif kind == ALL_TO_ALL:
        split, concat = ((step.concat_dim, step.tensor_dim) if adjoint
                         else (step.tensor_dim, step.concat_dim))
        prepared = simpar_comm.prepare("all_to_all", shape, dtype, group, split_axis=split,
                                       concat_axis=concat)
    elif kind == ALL_GATHER and len(step.gather_dims) == 1:
        prepared = simpar_comm.prepare("reduce_scatter" if adjoint else "all_gather", shape,
                                       dtype, group, axis=step.gather_dims[0][0])
    else:
        return lambda x: execute_step(step, x, adjoint)
    text = _label(adjoint, kind)
    scalar = shape == ()   # the general path hands a 0-d array back as shape (1,)

    def run(x: np.ndarray) -> np.ndarray:
        at = schedule.announce(step, adjoint)
        if at is None:
            with simpar_comm.label(text):
                y = prepared(x)
        else:
            y = prepared(x, at)
        return y.reshape(()) if scalar else y
    return run


def _unchanged(x: np.ndarray) -> np.ndarray:
    return x


@lru_cache(maxsize=64)
def _label(adjoint: bool, kind: StepKind) -> str:
    """A step's CommTrace label (formatting an enum costs more than the lookup)."""
    return f"{'redistribute-adjoint' if adjoint else 'redistribute'}:{kind}"


def _run_adjoint(step: Step, g: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    if step.kind == SLICE:
        out = np.zeros(step.src.local_shape(), dtype=g.dtype)
        out[_offsets(step.src, step.dst, rank)] = g
        return out
    if step.kind == ZERO:
        return _zero(step, g, rank)
    group = _group(step.src.device_matrix, rank, step.device_axes)
    if step.kind == ALL_REDUCE:
        return c.all_reduce(g, group=group).reshape(g.shape)
    if step.kind == REDUCE_SCATTER:
        return c.all_gather(g, axis=step.tensor_dim, group=group)
    if step.kind == ALL_TO_ALL:
        return c.all_to_all(g, split_axis=step.concat_dim, concat_axis=step.tensor_dim,
                            group=group)
    if step.kind == ALL_GATHER:
        if len(step.gather_dims) == 1:
            return c.reduce_scatter(g, axis=step.gather_dims[0][0], group=group)
        local = step.src.local_shape()
        dm = step.src.device_matrix
        per_dim = dict(step.gather_dims)
        split_shape: list[int] = []
        block_pos: list[int] = []
        local_pos: list[int] = []
        for i, n in enumerate(local):
            for a in per_dim.get(i, ()):
                block_pos.append(len(split_shape))
                split_shape.append(dm[a])
            local_pos.append(len(split_shape))
            split_shape.append(n)
        blocks = np.ascontiguousarray(g.reshape(split_shape).transpose(block_pos + local_pos))
        blocks = blocks.reshape((-1,) + local)
        return c.reduce_scatter(blocks, axis=0, group=group)[0]
    if step.kind == ALL_TO_ALL_V:
        return _all_to_all_v_adjoint(step, g, rank, c)
    raise AssertionError(f"unknown step kind {step.kind}")


def _all_to_all_v_adjoint(step: Step, g: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    """The forward exchange's route run backwards: what this rank received it sends back, and
    what it sent comes back to be summed into its source shard."""
    route = _route(step.src, step.dst, rank)
    p = step.src.device_num
    out = np.zeros(step.src.local_shape(), dtype=g.dtype)
    if route.keep is not None:
        out[route.keep[1]] += g[route.keep[0]]
    pieces: list[np.ndarray | None] = [None] * p
    for r, sl, _ in route.recvs:
        pieces[r] = g[sl]
    shapes: list[tuple[int, ...] | None] = [None] * p
    for s, sl in route.sends:
        shapes[s] = tuple(x.stop - x.start for x in sl)
    got = c.all_to_all_v(pieces, shapes, dtype=g.dtype)
    for s, sl in route.sends:
        out[sl] += got[s]
    return out
