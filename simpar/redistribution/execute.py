"""Run a redistribution plan on this rank's shard, over real MPI: forwards (:func:`execute`),
backwards (:func:`execute_adjoint`), one step at a time (:func:`execute_step`), or one step
bound once for a compiled program (:func:`bind_step`).

How a step runs is one record per kind (:data:`_RUNNERS`): forwards, backwards and bound. A
collective kind without a record of its own runs as its row of
:data:`simpar.collective_kinds.KINDS` says: one call of its ``simpar.comm`` function with the
step's arguments, and backwards one call of its adjoint's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

import simpar.comm as simpar_comm
from simpar import schedule
from simpar.collective_kinds import KINDS, StepKind
from simpar.layout import TensorLayout
from simpar.mesh import DeviceMesh
from simpar.redistribution.exchange import route
from simpar.redistribution.step import (
    ALL_GATHER,
    ALL_TO_ALL_V,
    SLICE,
    ZERO,
    RedistributionPlan,
    Step,
)

__all__ = ["Comm", "bind_step", "execute", "execute_adjoint", "execute_step"]

#: The communication module: :mod:`simpar.comm`, or a stand-in with the same functions (the
#: planning tests run plans on threads).
Comm = Any
#: A function on an array, bound for one step, rank and dtype.
Bound = Callable[[np.ndarray], np.ndarray]


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
    runner = _runner(step.kind)
    run = runner.adjoint if adjoint else runner.forward
    if step.kind.local:
        return run(step, x, rank, comm)
    with _unchecked(comm), comm.label(_label(adjoint, step.kind)), \
            schedule.issue(step, adjoint):
        return run(step, x, rank, comm)


def bind_step(step: Step, adjoint: bool, dtype: Any, rank: int, consume: bool = False
              ) -> Bound:
    """``execute_step(step, x, adjoint)`` bound once for ``rank`` (this process's) and for
    arrays of ``dtype``, for a compiled program that runs the step on every training step:
    the group, the slice offsets and the collective (:func:`simpar.comm.prepare`) are worked
    out here, so a call is the numpy or MPI call and the schedule guard's check. A collective
    announces itself to the guard, as execute_step's does. An array of another shape or dtype
    takes the general path, checks and all; so do the steps with no prepared form (a gather
    of several dimensions at once, the direct exchange), through execute_step. ``consume``:
    the caller gives its array up, and an AllReduce sums into it
    (:func:`simpar.comm.prepare`'s ``consume``); other steps ignore it."""
    return _runner(step.kind).bind(step, adjoint, dtype, rank, consume)


def _default_comm(comm: Comm) -> Comm:
    return simpar_comm if comm is None else comm


def _run_steps(plan: RedistributionPlan, x: np.ndarray, rank: int, comm: Comm, adjoint: bool
               ) -> np.ndarray:
    """Every step of ``plan`` in order (or every step's adjoint in reverse order)."""
    _verify_once(plan, x.dtype, comm)
    steps = reversed(plan.steps) if adjoint else iter(plan.steps)
    with _unchecked(comm):
        for step in steps:
            runner = _runner(step.kind)
            run = runner.adjoint if adjoint else runner.forward
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


@lru_cache(maxsize=64)
def _label(adjoint: bool, kind: StepKind) -> str:
    """A step's CommTrace label (formatting an enum costs more than the lookup)."""
    return f"{'redistribute-adjoint' if adjoint else 'redistribute'}:{kind}"


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


# ------------------------------------------------------------------ how each kind runs
Run = Callable[[Step, np.ndarray, int, Comm], np.ndarray]
Bind = Callable[[Step, bool, Any, int, bool], Bound]


@dataclass(frozen=True, slots=True)
class _Runner:
    """How one kind of step runs on ``rank``: ``forward(step, x, rank, comm)``, its
    ``adjoint`` likewise, and ``bind(step, adjoint, dtype, rank, consume)``."""

    forward: Run
    adjoint: Run
    bind: Bind


def _runner(kind: StepKind) -> _Runner:
    return _RUNNERS.get(kind, _COLLECTIVE)


def _general(step: Step, adjoint: bool, dtype: Any, rank: int, consume: bool) -> Bound:
    """No prepared form: every call takes execute_step's path."""
    return lambda x: execute_step(step, x, adjoint)


# A collective: its simpar.comm function, as the kinds table says.
def _collective(step: Step, x: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    facts = KINDS[step.kind]
    group = _group(step.src.device_matrix, rank, step.device_axes)
    y = getattr(c, facts.function)(x, group=group, **facts.arguments(step))
    # reshape: comm.all_reduce returns a 0-d input as shape (1,) (np.ascontiguousarray).
    return y.reshape(x.shape) if facts.in_place else y


def _collective_adjoint(step: Step, g: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    facts = KINDS[step.kind]
    back = KINDS[facts.adjoint]
    group = _group(step.src.device_matrix, rank, step.device_axes)
    y = getattr(c, back.function)(g, group=group, **facts.adjoint_arguments(step))
    return y.reshape(g.shape) if back.in_place else y


def _bind_collective(step: Step, adjoint: bool, dtype: Any, rank: int, consume: bool
                     ) -> Bound:
    facts = KINDS[step.kind]
    call = KINDS[facts.adjoint] if adjoint else facts
    args = facts.adjoint_arguments(step) if adjoint else facts.arguments(step)
    group = _group(step.src.device_matrix, rank, step.device_axes)
    shape = (step.dst if adjoint else step.src).local_shape()
    prepared = simpar_comm.prepare(call.function, shape, dtype, group,
                                   consume=consume and call.in_place, **args)
    text = _label(adjoint, step.kind)
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


_COLLECTIVE = _Runner(_collective, _collective_adjoint, _bind_collective)


# Slice: keep a sub-block; backwards, zero-pad it back.
def _slice(step: Step, x: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    return np.ascontiguousarray(x[_offsets(step.src, step.dst, rank)])


def _pad(step: Step, g: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    out = np.zeros(step.src.local_shape(), dtype=g.dtype)
    out[_offsets(step.src, step.dst, rank)] = g
    return out


def _bind_slice(step: Step, adjoint: bool, dtype: Any, rank: int, consume: bool) -> Bound:
    offsets = _offsets(step.src, step.dst, rank)
    if not adjoint:
        return lambda x: np.ascontiguousarray(x[offsets])
    whole = step.src.local_shape()

    def pad(g: np.ndarray) -> np.ndarray:
        out = np.zeros(whole, dtype=g.dtype)
        out[offsets] = g
        return out
    return pad


# Zero (its own adjoint): zeros on every rank off coordinate 0 of its axes.
def _zero(step: Step, x: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    return np.zeros_like(x) if _zeroes(step.src.device_matrix, step.device_axes, rank) else x


def _bind_zero(step: Step, adjoint: bool, dtype: Any, rank: int, consume: bool) -> Bound:
    return (np.zeros_like if _zeroes(step.src.device_matrix, step.device_axes, rank)
            else _unchanged)


def _unchanged(x: np.ndarray) -> np.ndarray:
    return x


# AllGather: one dimension is the kinds table's call; several at once gather blocks and
# interleave them (backwards: split the cotangent into blocks and ReduceScatter them).
def _all_gather(step: Step, x: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    if len(step.gather_dims) == 1:
        return _collective(step, x, rank, c)
    group = _group(step.src.device_matrix, rank, step.device_axes)
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


def _all_gather_adjoint(step: Step, g: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    if len(step.gather_dims) == 1:
        return _collective_adjoint(step, g, rank, c)
    group = _group(step.src.device_matrix, rank, step.device_axes)
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


def _bind_all_gather(step: Step, adjoint: bool, dtype: Any, rank: int, consume: bool
                     ) -> Bound:
    bind = _bind_collective if len(step.gather_dims) == 1 else _general
    return bind(step, adjoint, dtype, rank, consume)


# The direct exchange: every rank sends and receives its route's pieces (backwards, the
# same route reversed, summing what comes back).
def _all_to_all_v(step: Step, x: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    way = route(step.src, step.dst, rank)
    p = step.src.device_num
    pieces: list[np.ndarray | None] = [None] * p
    for s, sl in way.sends:
        pieces[s] = x[sl]
    shapes: list[tuple[int, ...] | None] = [None] * p
    for r, _, shape in way.recvs:
        shapes[r] = shape
    got = c.all_to_all_v(pieces, shapes, dtype=x.dtype)
    # The part this rank keeps is copied after the exchange, so that no peer waits for it.
    out = np.empty(step.dst.local_shape(), dtype=x.dtype)
    if way.keep is not None:
        out[way.keep[0]] = x[way.keep[1]]
    for r, sl, _ in way.recvs:
        out[sl] = got[r]
    return out


def _all_to_all_v_adjoint(step: Step, g: np.ndarray, rank: int, c: Comm) -> np.ndarray:
    """The forward exchange's route run backwards: what this rank received it sends back, and
    what it sent comes back to be summed into its source shard."""
    way = route(step.src, step.dst, rank)
    p = step.src.device_num
    out = np.zeros(step.src.local_shape(), dtype=g.dtype)
    if way.keep is not None:
        out[way.keep[1]] += g[way.keep[0]]
    pieces: list[np.ndarray | None] = [None] * p
    for r, sl, _ in way.recvs:
        pieces[r] = g[sl]
    shapes: list[tuple[int, ...] | None] = [None] * p
    for s, sl in way.sends:
        shapes[s] = tuple(x.stop - x.start for x in sl)
    got = c.all_to_all_v(pieces, shapes, dtype=g.dtype)
    for s, sl in way.sends:
        out[sl] += got[s]
    return out


#: The kinds that do not run as one call of their simpar.comm function.
_RUNNERS: dict[StepKind, _Runner] = {
    SLICE: _Runner(_slice, _pad, _bind_slice),
    ZERO: _Runner(_zero, _zero, _bind_zero),
    ALL_GATHER: _Runner(_all_gather, _all_gather_adjoint, _bind_all_gather),
    ALL_TO_ALL_V: _Runner(_all_to_all_v, _all_to_all_v_adjoint, _general),
}
