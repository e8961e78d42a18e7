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

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from simpar.collective_kinds import StepKind
from simpar.layout import TensorLayout
from simpar.redistribution.refine import refine
from simpar.redistribution.step import RedistributionPlan

__all__ = ["COLUMNS", "MoveSteps", "decode", "fine_form", "move_steps", "plan_signatures",
           "signature_of"]

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


def _pack(lengths: np.ndarray) -> np.ndarray:
    """(M, ndim) split counts -> one int64 per row."""
    out = np.zeros(lengths.shape[0], dtype=np.int64)
    for i in range(lengths.shape[1]):
        out |= lengths[:, i].astype(np.int64) << (_BITS * i)
    return out


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


class _Pairs:
    """Every (source, destination) pair's current layout, as arrays over the M pairs."""

    def __init__(self, src: Sequence[tuple[tuple[tuple[int, ...], ...], int]],
                 dst: Sequence[tuple[tuple[tuple[int, ...], ...], int]], ndim: int,
                 k: int) -> None:
        def lists(forms: Sequence[tuple[tuple[tuple[int, ...], ...], int]]) -> np.ndarray:
            out = np.full((len(forms), ndim, max(k, 1)), -1, dtype=np.int16)
            for n, (dims, _) in enumerate(forms):
                for i, axes in enumerate(dims):
                    out[n, i, :len(axes)] = axes
            return out

        n_src, n_dst = len(src), len(dst)
        si = np.repeat(np.arange(n_src), n_dst)
        di = np.tile(np.arange(n_dst), n_src)
        self.cur = lists(src)[si]                      # (M, ndim, k) fine axes, -1 padded
        self.to = lists(dst)[di]
        self.cur_len = (self.cur >= 0).sum(axis=2)     # (M, ndim)
        self.to_len = (self.to >= 0).sum(axis=2)
        self.cur_part = np.array([m for _, m in src], dtype=np.int64)[si]
        self.to_part = np.array([m for _, m in dst], dtype=np.int64)[di]
        self.pos = np.arange(max(k, 1))[None, :]
        self.all = (1 << k) - 1


def _has(axes: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(M, k) bool: each listed axis (-1 = none) is in its row's mask."""
    return ((mask[:, None] >> np.maximum(axes, 0)) & 1).astype(bool) & (axes >= 0)


def _bits(axes: np.ndarray) -> np.ndarray:
    """(M, k) fine axes (-1 = none) -> (M,) mask of them."""
    return np.where(axes >= 0, np.left_shift(1, np.maximum(axes, 0).astype(np.int64)),
                    0).sum(axis=-1)


def _used(pp: _Pairs) -> np.ndarray:
    return _bits(pp.cur.reshape(pp.cur.shape[0], -1))


def _free_slice(pp: _Pairs, active: np.ndarray) -> np.ndarray:
    """The planner's free slice on ``active`` rows: a dimension whose split is a prefix of the
    destination's takes the destination's next axes while the source replicates them.
    Returns the rows it changed."""
    replica = pp.all & ~_used(pp) & ~pp.cur_part
    changed = np.zeros(len(active), dtype=bool)
    for i in range(pp.cur.shape[1]):
        c, t = pp.cur[:, i], pp.to[:, i]
        cl, tl = pp.cur_len[:, i][:, None], pp.to_len[:, i][:, None]
        prefix = ((c == t) | (pp.pos >= cl)).all(axis=1) & (cl[:, 0] <= tl[:, 0])
        ok = (pp.pos < cl) | ((pp.pos < tl) & _has(t, replica))
        new = np.where(prefix & active, np.cumprod(ok, axis=1).sum(axis=1), cl[:, 0])
        grow = new > cl[:, 0]
        if grow.any():
            take = (pp.pos >= cl) & (pp.pos < new[:, None])
            c[take] = t[take]
            pp.cur_len[:, i] = new
            changed |= grow
    return changed


def _same_dims(pp: _Pairs) -> np.ndarray:
    return (pp.cur == pp.to).all(axis=(1, 2))


def plan_signatures(srcs: Sequence[TensorLayout], dsts: Sequence[TensorLayout], p: int,
                    k: int) -> np.ndarray:
    """Signature rows of the moves from every ``srcs[i]`` to every ``dsts[j]`` (row
    ``i * len(dsts) + j``) on ``p**k`` devices without AllToAll; :func:`decode` reads one.

    Equal rows plan the same collectives over the same groups with the same buffers."""
    if not srcs or not dsts:
        return np.zeros((0, 0), dtype=np.int64)
    shape = srcs[0].shape
    ndim = len(shape)
    if any(lay.shape != shape for lay in (*srcs, *dsts)):
        raise ValueError(f"plan_signatures: every layout must have shape {shape}")
    pp = _Pairs([fine_form(s, p, k) for s in srcs], [fine_form(d, p, k) for d in dsts], ndim, k)
    m = pp.cur.shape[0]
    slots = _slots(ndim)
    rows = np.zeros((m, COLUMNS * len(slots)), dtype=np.int64)
    rows[:, 0::COLUMNS] = -1
    shape_arr = np.array(shape, dtype=np.int64)[None, :]
    powers = np.int64(p) ** np.arange(max(k, 1) + 1, dtype=np.int64)

    def record(slot: int, rows_on: np.ndarray, mask: np.ndarray | int,
               before: np.ndarray) -> None:
        rows[rows_on, COLUMNS * slot] = (mask[rows_on] if isinstance(mask, np.ndarray)
                                          else mask)
        rows[rows_on, COLUMNS * slot + 1] = before[rows_on]
        rows[rows_on, COLUMNS * slot + 2] = _pack(pp.cur_len)[rows_on]

    active = ~(_same_dims(pp) & (pp.cur_part == pp.to_part))   # equal blocks: nothing moves
    # 1. A pending sum is sliced first, so that it is reduced only over what dst keeps.
    before = _pack(pp.cur_len)
    sliced = _free_slice(pp, active & (pp.cur_part != 0))
    record(0, sliced, 0, before)
    # 2. Pending sums dst does not keep: ReduceScatter onto the dimension dst splits with them
    #    (per dimension, ascending, when the shard divides), AllReduce the rest.
    resolve = pp.cur_part & ~pp.to_part & np.where(active, -1, 0)
    for i in range(ndim):
        t = pp.to[:, i]
        sel = _has(t, resolve)
        count = sel.sum(axis=1)
        local = shape_arr[0, i] // powers[pp.cur_len[:, i]]
        scatter = (count > 0) & (local % powers[count] == 0)
        if not scatter.any():
            continue
        before = _pack(pp.cur_len)
        mask = _bits(np.where(sel, t, -1))
        offset = np.cumsum(sel, axis=1) - 1
        r, j = np.nonzero(sel & scatter[:, None])
        pp.cur[r, i, pp.cur_len[r, i] + offset[r, j]] = t[r, j]
        pp.cur_len[:, i] += np.where(scatter, count, 0)
        pp.cur_part &= ~np.where(scatter, mask, 0)
        resolve &= ~np.where(scatter, mask, 0)
        record(1 + i, scatter, mask, before)
    reduce_all = resolve & pp.cur_part
    summed = reduce_all != 0
    record(1 + ndim, summed, reduce_all, _pack(pp.cur_len))
    pp.cur_part &= ~reduce_all
    # 3. The move without pending sums: free slice, then one AllGather (down to each
    #    dimension's common prefix with dst) and, if dst is not that prefix, a slice.
    moving = active & ~_same_dims(pp)
    before = _pack(pp.cur_len)
    sliced = _free_slice(pp, moving)
    record(2 + ndim, sliced, 0, before)
    moving &= ~_same_dims(pp)
    eq = (pp.cur == pp.to) & (pp.pos[None] < pp.cur_len[:, :, None]) & (
        pp.pos[None] < pp.to_len[:, :, None])
    prefix = np.cumprod(eq, axis=2).sum(axis=2)                   # (M, ndim)
    gathered = np.where(pp.pos[None] >= prefix[:, :, None], pp.cur, -1)
    mask = _bits(gathered.reshape(m, -1))
    before = _pack(pp.cur_len)
    pp.cur_len = np.where(moving[:, None], prefix, pp.cur_len)
    record(3 + ndim, moving, mask, before)
    reslice = moving & (prefix != pp.to_len).any(axis=1)
    before = _pack(pp.cur_len)
    pp.cur_len = np.where(moving[:, None], pp.to_len, pp.cur_len)
    record(4 + ndim, reslice, 0, before)
    # 4. Pending sums only dst has: zero all replicas but one (local).
    extra = pp.to_part & ~pp.cur_part
    record(5 + ndim, active & (extra != 0), extra, _pack(pp.cur_len))
    return rows
