"""Every redistribution between two lists of layouts at once: which pairs plan alike (pure).

Dynamic programming and the ILP need every edge's full matrix: on 1024 devices one GPT layer
has a million distinct pairs of layouts, too many to plan one by one. On ``p**k`` devices
(a prime power) every layout can be written over the finest device matrix ``(p,) * k``, where
it is a list of fine axes per tensor dimension and a set of pending-sum axes. Over that form
:func:`plan_signatures` replays :func:`simpar.redistribution.plan` (``enable_alltoall=False``,
MindSpore's default) for all pairs together, in numpy, and returns each pair's *signature*:
for every step, in order, its kind, the fine device axes its group spans, and how many fine
axes split each tensor dimension before and after it. The signature determines the plan's
collectives, groups and buffer sizes, hence every cost model's price, so a caller plans and
prices one representative pair per distinct signature with the real planner, and checks that
the planner's steps have exactly that signature (:func:`signature_of`).

The replay is cheap per pair because most of it is not per pair: up to the move without
pending sums, what the planner does to tensor dimension ``i`` depends only on the source and
on the fine axes the destination splits dimension ``i`` with, so it is worked out once per
source and distinct list of axes; a pair combines its dimensions' entries, and only the last
free slice (which may be blocked by an axis another dimension holds) and the AllGather are
its own. :func:`plan_moves` gives the plans a block of sources at a time, as the collective
steps a cost model prices in bulk (:class:`MoveSteps`). The searches' pricers of one cost
model share what they price (:func:`move_memo`).

>>> from simpar.layout import TensorLayout
>>> s0 = TensorLayout((8,), (0, -1), (64, 64))       # rows over 8 ranks
>>> s1 = TensorLayout((8,), (-1, 0), (64, 64))       # columns over 8 ranks
>>> rows = plan_signatures([s0, s1], [s1], 2, 3)
>>> decode(rows[0], 2)                                # AllGather rows, then slice columns
(('AllGather', 7, (3, 0), (0, 0)), ('Slice', 0, (0, 0), (0, 3)))
>>> decode(rows[1], 2)                                # already there
()
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from simpar.collective_kinds import StepKind
from simpar.layout import TensorLayout
from simpar.redistribution.refine import refine
from simpar.redistribution.step import RedistributionPlan

__all__ = ["COLUMNS", "MoveBlock", "MoveMemo", "MoveSteps", "decode", "fine_form", "move_memo",
           "move_steps", "plan_moves", "plan_signatures", "signature_of"]

#: The steps a plan without AllToAll can hold, in the order the planner emits them; the
#: ReduceScatters (one per tensor dimension, ascending) sit between the first Slice and the
#: AllReduce.
_BEFORE = (StepKind.SLICE,)
_AFTER = (StepKind.ALL_REDUCE, StepKind.SLICE, StepKind.ALL_GATHER, StepKind.SLICE,
          StepKind.ZERO)
#: Columns per step: the fine-axes mask of its group (-1: the step is absent), then the split
#: counts per tensor dimension before and after it, packed ``_BITS`` bits each.
COLUMNS = 3
_BITS = 6


def _slots(ndim: int) -> tuple[StepKind, ...]:
    return (*_BEFORE, *([StepKind.REDUCE_SCATTER] * ndim), *_AFTER)


@dataclass(frozen=True, eq=False)
class MoveSteps:
    """One step of many plans at once (the same place in each): which plans have it
    (``present``), the fine device axes of its group (``axes``: a mask, bit ``a`` for axis
    ``a`` of ``(p,) * k`` counted from the left) and each rank's elements before and after."""

    kind: StepKind
    present: np.ndarray
    axes: np.ndarray
    src_elements: np.ndarray
    dst_elements: np.ndarray


def move_steps(rows: np.ndarray, shape: Sequence[int], p: int) -> list[MoveSteps]:
    """:func:`plan_signatures`' rows as steps, in plan order, for a model to price in bulk."""
    ndim = len(shape)
    shape_arr = np.array(shape, dtype=np.int64)

    def elements(packed: np.ndarray) -> np.ndarray:
        out = np.ones(len(packed), dtype=np.int64)
        for i in range(ndim):
            splits = (packed >> (_BITS * i)) & ((1 << _BITS) - 1)
            out *= shape_arr[i] // np.int64(p) ** splits
        return out

    out = []
    for s, kind in enumerate(_slots(ndim)):
        mask = rows[:, COLUMNS * s]
        out.append(MoveSteps(kind, mask >= 0, np.maximum(mask, 0),
                             elements(rows[:, COLUMNS * s + 1]),
                             elements(rows[:, COLUMNS * s + 2])))
    return out


@lru_cache(maxsize=1 << 16)
def fine_form(layout: TensorLayout, p: int, k: int) -> tuple[tuple[tuple[int, ...], ...], int]:
    """``layout`` over the finest device matrix ``(p,) * k``: the fine axes splitting each
    tensor dimension (outer first) and the mask of its pending-sum axes.

    >>> fine_form(TensorLayout((2, 4), (1, 0), (8, 8)), 2, 3)   # dim 0 over 2, dim 1 over 4
    (((0,), (1, 2)), 0)
    """
    fine = refine(layout, (p,) * k)
    return (tuple(tuple(a) for a in fine.dim_axes),
            sum(1 << a for a in fine.partial_axes))


def _unpack(packed: int, ndim: int) -> tuple[int, ...]:
    return tuple((int(packed) >> (_BITS * i)) & ((1 << _BITS) - 1) for i in range(ndim))


def decode(row: np.ndarray, ndim: int) -> tuple[tuple[str, int, tuple[int, ...],
                                                       tuple[int, ...]], ...]:
    """One signature row as ``(kind, group mask, splits before, splits after)`` per step."""
    out = []
    for s, kind in enumerate(_slots(ndim)):
        mask, before, after = (int(x) for x in row[COLUMNS * s:COLUMNS * (s + 1)])
        if mask >= 0:
            out.append((str(kind), mask, _unpack(before, ndim), _unpack(after, ndim)))
    return tuple(out)


def signature_of(plan: RedistributionPlan, p: int, k: int
                 ) -> tuple[tuple[str, int, tuple[int, ...], tuple[int, ...]], ...]:
    """The signature of a plan the real planner made, in :func:`decode`'s form."""
    out = []
    for step in plan.steps:
        dm = step.src.device_matrix
        start = [0]
        for size in dm:
            start.append(start[-1] + _log(size, p))
        mask = 0
        for a in step.device_axes:
            for b in range(start[a], start[a + 1]):
                mask |= 1 << b
        before = tuple(sum(_log(dm[a], p) for a in axes) for axes in step.src.dim_axes)
        after = tuple(sum(_log(step.dst.device_matrix[a], p) for a in axes)
                      for axes in step.dst.dim_axes)
        out.append((str(step.kind), mask, before, after))
    return tuple(out)


def _log(size: int, p: int) -> int:
    n = 0
    while size > 1:
        size //= p
        n += 1
    return n


#: Pairs planned at once: a block of sources against every destination.
_BLOCK_PAIRS = 1 << 18


class _Forms:
    """Layouts over ``(p,) * k`` as arrays: the fine axes of each tensor dimension (-1
    padded), their counts and masks, and the pending-sum mask."""

    def __init__(self, layouts: Sequence[TensorLayout], p: int, k: int) -> None:
        width = max(k, 1)
        forms = [fine_form(lay, p, k) for lay in layouts]
        ndim = len(layouts[0].shape)
        self.axes = np.full((len(forms), ndim, width), -1, dtype=np.int8)
        for n, (dims, _) in enumerate(forms):
            for i, axes in enumerate(dims):
                self.axes[n, i, :len(axes)] = axes
        self.lens = (self.axes >= 0).sum(axis=2).astype(np.int8)
        self.masks = _bits(self.axes)
        self.part = np.array([m for _, m in forms], dtype=np.int64)


def _bits(axes: np.ndarray) -> np.ndarray:
    """Fine-axis lists (last dimension, -1 = none) -> the int64 mask of their axes."""
    return np.where(axes >= 0, np.left_shift(1, np.maximum(axes, 0).astype(np.int64)),
                    0).sum(axis=-1)


def _leading(ok: np.ndarray) -> np.ndarray:
    """How many leading entries of the last dimension are true."""
    return np.cumprod(ok, axis=-1, dtype=np.int8).sum(axis=-1, dtype=np.int8)


class _DimTables:
    """Tensor dimension ``i`` of every source against every distinct list of fine axes that
    some destination splits dimension ``i`` with: what the planner does to that dimension up
    to the move without pending sums, which depends on nothing else. Arrays are indexed
    [source, list]."""

    def __init__(self, src: _Forms, lists: np.ndarray, i: int, size: int, p: int,
                 k: int) -> None:
        width = max(k, 1)
        pos = np.arange(width)
        s = src.axes[:, None, i, :]                          # (S, 1, K)
        d = lists[None, :, :]                                # (1, B, K)
        ls = src.lens[:, i].astype(np.int64)[:, None]        # (S, 1)
        ld = (lists >= 0).sum(axis=1)[None, :]               # (1, B)
        part = src.part[:, None]
        # 1. A pending sum is sliced first (free): dst's next axes that the source replicates.
        replica = ((1 << k) - 1) & ~src.masks.sum(axis=1) & ~src.part
        prefix = ((s == d) | (pos >= ls[..., None])).all(axis=2) & (ls <= ld)
        spare = ((replica[:, None, None] >> np.maximum(d, 0)) & 1).astype(bool) & (d >= 0)
        grown = _leading((pos < ls[..., None]) | ((pos < ld[..., None]) & spare))
        c1 = np.where(prefix & (part != 0), grown, ls)
        cur = np.where(pos < ls[..., None], s, np.where(pos < c1[..., None], d, -1))
        # 2. Pending axes dst splits this dimension with: one ReduceScatter when they divide.
        chosen = ((part[..., None] >> np.maximum(d, 0)) & 1).astype(bool) & (d >= 0)
        count = chosen.sum(axis=2)
        local = size // np.int64(p) ** c1
        scatter = (count > 0) & (local % np.int64(p) ** count == 0)
        at = np.nonzero(chosen & scatter[..., None])
        cur[at[0], at[1], c1[at[0], at[1]] + np.cumsum(chosen, axis=2)[at] - 1] = \
            lists[at[1], at[2]]
        c2 = c1 + np.where(scatter, count, 0)
        # 3. Where the move without pending sums starts.
        same = _leading((cur == d) & (pos < c2[..., None]) & (pos < ld[..., None]))
        self.prefix = same == c2                             # cur is a prefix of dst's list
        self.c1, self.c2 = c1.astype(np.int8), c2.astype(np.int8)
        self.common = same.astype(np.int8)
        self.grew = c1 > ls
        self.scatter = np.where(scatter, _bits(np.where(chosen, d, -1)), 0).astype(_MASK)
        self.used = _bits(cur).astype(_MASK)
        self.rest = np.where(self.prefix, _bits(np.where(pos >= c2[..., None], d, -1)),
                             0).astype(_MASK)
        self.gathered = _bits(np.where(pos >= same[..., None], cur, -1)).astype(_MASK)
        self.done = self.prefix & (c2 == ld)
        # [list, mask]: the first position of the list holding an axis of the mask (the
        # list's length if none), flat.
        masks = np.arange(1 << k, dtype=np.int64)[None, :]
        first = np.broadcast_to(ld[0][:, None], (len(lists), 1 << k)).astype(np.int8)
        for j in reversed(range(width)):
            axis = lists[:, j, None]
            first = np.where((axis >= 0) & ((masks >> np.maximum(axis, 0)) & 1 == 1), j, first)
        self.first = first.astype(np.int8).ravel()


#: Masks of fine axes: ``k <= 15`` (4096 devices are ``2**12``).
_MASK = np.uint16
_Slot = tuple[np.ndarray, np.ndarray, Sequence[np.ndarray], Sequence[np.ndarray]]


@dataclass(frozen=True, eq=False)
class MoveBlock:
    """The plans from the sources ``sources`` (indices into the source list) to every
    destination, pair ``n`` being source ``sources[n // D]`` to destination ``n % D``:
    their collective steps in plan order (``steps``, local steps left out: they move
    nothing), which steps each plan has (``kinds``: bit ``s`` for step slot ``s``), and
    :meth:`rows`, the signature rows of chosen pairs."""

    sources: np.ndarray
    steps: tuple[MoveSteps, ...]
    kinds: np.ndarray
    #: Per step slot, arrays [source of the block, destination]: whether the plan has the
    #: step, its group's mask, and each tensor dimension's split count before and after it.
    slots: tuple[_Slot, ...]

    def rows(self, pairs: np.ndarray) -> np.ndarray:
        """:func:`plan_signatures`' rows of the pairs ``pairs`` of this block."""
        at = np.unravel_index(pairs, self.slots[0][0].shape)
        out = np.zeros((len(pairs), COLUMNS * len(self.slots)), dtype=np.int64)
        for s, (present, mask, before, after) in enumerate(self.slots):
            on = present[at]
            out[:, COLUMNS * s] = np.where(on, mask[at].astype(np.int64), -1)
            for i, (b, a) in enumerate(zip(before, after)):
                out[:, COLUMNS * s + 1] |= np.where(on, b[at], 0).astype(np.int64) << (
                    _BITS * i)
                out[:, COLUMNS * s + 2] |= np.where(on, a[at], 0).astype(np.int64) << (
                    _BITS * i)
        return out


def plan_moves(srcs: Sequence[TensorLayout], dsts: Sequence[TensorLayout], p: int, k: int,
               block_pairs: int = _BLOCK_PAIRS) -> Iterator[MoveBlock]:
    """The moves from every ``srcs[i]`` to every ``dsts[j]`` on ``p**k`` devices without
    AllToAll, a block of sources at a time (about ``block_pairs`` pairs each).

    What the planner does to one tensor dimension before the move without pending sums
    depends only on the source and on the destination's fine axes for that dimension, so it
    is worked out once per source and distinct list (:class:`_DimTables`); each pair then
    combines its dimensions' entries."""
    if not srcs or not dsts:
        return
    shape = srcs[0].shape
    if any(lay.shape != shape for lay in (*srcs, *dsts)):
        raise ValueError(f"plan_signatures: every layout must have shape {shape}")
    if k > 15:
        raise ValueError(f"plan_moves: at most 2**15 fine axes, got k={k}")
    ndim = len(shape)
    src, dst = _Forms(srcs, p, k), _Forms(dsts, p, k)
    lists, which = [], []
    for i in range(ndim):
        found, inverse = np.unique(dst.axes[:, i, :], axis=0, return_inverse=True)
        lists.append(found)
        which.append(inverse.ravel())
    tables = [_DimTables(src, lists[i], i, shape[i], p, k) for i in range(ndim)]
    width = max(k, 1)
    factor = [np.array([shape[i] // p ** c for c in range(width + 1)], dtype=np.int64)
              for i in range(ndim)]
    order = np.argsort(src.part != 0, kind="stable")   # sources with pending sums last
    step = max(1, block_pairs // len(dsts))
    for lo in range(0, len(srcs), step):
        yield _block(order[lo:lo + step], src, dst, tables, which, factor, k)


def _block(sources: np.ndarray, src: _Forms, dst: _Forms, tables: list[_DimTables],
           which: list[np.ndarray], factor: list[np.ndarray], k: int) -> MoveBlock:
    """One block of :func:`plan_moves`: arrays [source of the block, destination]."""
    ndim = len(tables)

    def take(table: np.ndarray, i: int) -> np.ndarray:
        return table[sources][:, which[i]]

    def elements(counts: Sequence[np.ndarray]) -> np.ndarray:
        out = factor[0][counts[0]]
        for i in range(1, ndim):
            out = out * factor[i][counts[i]]
        return out

    shape = (len(sources), len(which[0]))
    ld = [np.broadcast_to(dst.lens[:, i], shape) for i in range(ndim)]
    c0 = [np.broadcast_to(src.lens[sources, i][:, None], shape) for i in range(ndim)]
    c1 = [take(t.c1, i) for i, t in enumerate(tables)]
    c2 = [take(t.c2, i) for i, t in enumerate(tables)]
    prefix = [take(t.prefix, i) for i, t in enumerate(tables)]
    used = take(tables[0].used, 0)
    done = take(tables[0].done, 0)
    for i in range(1, ndim):
        used = used | take(tables[i].used, i)
        done = done & take(tables[i].done, i)
    moving = ~done
    # The free slice of the move: dst's next axes that no dimension holds.
    c3, final, ends = [], [], np.ones(shape, dtype=bool)
    for i, t in enumerate(tables):
        blocked = take(t.rest, i) & used
        first = t.first[which[i][None, :] << k | blocked]
        grown = np.where(prefix[i] & moving, first - c2[i], 0).astype(np.int8)
        c3.append(c2[i] + grown)
        ends &= prefix[i] & (c3[i] == ld[i])
        final.append(np.where(prefix[i], c3[i], take(t.common, i)))
    gathering = moving & ~ends
    gathered = take(tables[0].gathered, 0)
    for i in range(1, ndim):
        gathered = gathered | take(tables[i].gathered, i)
    ps = src.part[sources][:, None].astype(_MASK)
    pd = dst.part[None, :].astype(_MASK)
    slots: list[_Slot] = []
    steps: list[MoveSteps] = []
    none = np.zeros(shape, dtype=_MASK)
    sliced = take(tables[0].grew, 0)
    for i in range(1, ndim):
        sliced = sliced | take(tables[i].grew, i)
    slots.append((sliced, none, c0, c1))
    scattered = np.zeros(shape, dtype=_MASK)
    pending = bool(ps.any())
    for i, t in enumerate(tables):
        mask = take(t.scatter, i) if pending else none
        scattered |= mask
        before = [*c2[:i], *c1[i:]]
        after = [*c2[:i + 1], *c1[i + 1:]]
        slots.append((mask != 0, mask, before, after))
        if pending and mask.any():
            steps.append(MoveSteps(StepKind.REDUCE_SCATTER, (mask != 0).ravel(),
                                   mask.ravel(), elements(before).ravel(),
                                   elements(after).ravel()))
    summed = (ps & ~pd & ~scattered).astype(_MASK)
    slots.append((summed != 0, summed, c2, c2))
    if pending and summed.any():
        both = elements(c2).ravel()
        steps.append(MoveSteps(StepKind.ALL_REDUCE, (summed != 0).ravel(), summed.ravel(),
                               both, both))
    grew = np.zeros(shape, dtype=bool)
    for i in range(ndim):
        grew |= c3[i] > c2[i]
    slots.append((grew, none, c2, c3))
    gathered = np.where(gathering, gathered, 0).astype(_MASK)
    slots.append((gathering, gathered, c3, final))
    if gathering.any():
        steps.append(MoveSteps(StepKind.ALL_GATHER, gathering.ravel(), gathered.ravel(),
                               elements(c3).ravel(), elements(final).ravel()))
    reslice = np.zeros(shape, dtype=bool)
    for i in range(ndim):
        reslice |= final[i] != ld[i]
    slots.append((gathering & reslice, none, final, ld))
    zero = (pd & ~ps).astype(_MASK)
    slots.append((zero != 0, zero, ld, ld))
    kinds = np.zeros(shape, dtype=np.int64)
    for s, slot in enumerate(slots):
        kinds |= slot[0].astype(np.int64) << s
    return MoveBlock(sources, tuple(steps), kinds.ravel(),
                     tuple((np.broadcast_to(a, shape), np.broadcast_to(m, shape), b, c)
                           for a, m, b, c in slots))


def plan_signatures(srcs: Sequence[TensorLayout], dsts: Sequence[TensorLayout], p: int,
                    k: int) -> np.ndarray:
    """Signature rows of the moves from every ``srcs[i]`` to every ``dsts[j]`` (row
    ``i * len(dsts) + j``) on ``p**k`` devices without AllToAll; :func:`decode` reads one.

    Equal rows plan the same collectives over the same groups with the same buffers."""
    if not srcs or not dsts:
        return np.zeros((0, 0), dtype=np.int64)
    out = np.zeros((len(srcs) * len(dsts), COLUMNS * len(_slots(len(srcs[0].shape)))),
                   dtype=np.int64)
    for block in plan_moves(srcs, dsts, p, k):
        n = len(block.sources) * len(dsts)
        at = (block.sources[:, None] * len(dsts) + np.arange(len(dsts))[None, :]).ravel()
        out[at] = block.rows(np.arange(n))
    return out


#: A pricer's memo of moves: their prices, their transients, and the matrices of both.
MoveMemo = tuple[dict[tuple[Any, Any, int], float], dict[tuple[Any, Any, int], float],
                  dict[tuple[Any, ...], np.ndarray], dict[tuple[Any, ...], np.ndarray]]
#: Per cost model (by identity, while it lives) whose edge prices are fixed
#: (``fixed_edge_prices``), per device count and AllToAll setting: the prices of moves,
#: their transients and the matrices of both.
_MOVE_MEMOS: dict[int, dict[tuple[int, bool], MoveMemo]] = {}


def move_memo(model: Any, device_num: int, enable_alltoall: bool) -> MoveMemo:
    """The moves' memo of the pricers of ``model`` on ``device_num`` devices: shared when
    the model's edge prices depend on nothing but itself, else a new one."""
    fresh: MoveMemo = ({}, {}, {}, {})
    if not getattr(model, "fixed_edge_prices", False):
        return fresh
    key = id(model)
    if key not in _MOVE_MEMOS:
        try:
            weakref.finalize(model, _MOVE_MEMOS.pop, key, None)
        except TypeError:   # not weakly referable: its pricers keep their own
            return fresh
        _MOVE_MEMOS[key] = {}
    return _MOVE_MEMOS[key].setdefault((device_num, enable_alltoall), fresh)
