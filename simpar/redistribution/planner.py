"""The redistribution planner: the cheapest list of steps from one layout to another (pure).

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from simpar.layout import TensorLayout, block_key
from simpar.redistribution.refine import common_refinement, refine
from simpar.redistribution.step import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    ALL_TO_ALL_V,
    REDUCE_SCATTER,
    SLICE,
    ZERO,
    RedistributionPlan,
    Step,
)

__all__ = ["min_bytes", "plan"]


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

