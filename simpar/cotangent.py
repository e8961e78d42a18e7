"""Planning the backward pass with layouts: where each cotangent is pending, and so which
reductions the backward really needs (pure: no MPI).

A value's cotangent is a tensor with a layout, like the value. Where the value is split, the
cotangent is split alike. Over a device axis where the value is replicated, the cotangent is
either *whole* (every replica holds the same, complete cotangent) or *pending* (each replica
holds a contribution, and the contributions sum to the cotangent), as a partial layout is.
Over an axis where the value itself is a pending sum, its cotangent is whole: each piece of a
sum has the whole sum's cotangent.

Keeping cotangents whole where the replicas compute the same thing is what Megatron's f/g
operators and DTensor's placements do, and it is what makes the backward of a forward
AllReduce free: the cotangent of its (replicated) result is already whole on every rank. A
reduction is then needed only where a pending cotangent must become whole over exactly the
axes where it is pending: before an op whose local gradient needs it whole (a forward
AllReduce's adjoint over pending axes, an AllGather's adjoint), and for a parameter's gradient
(its Mirror, over the parameter's pending axes only).

The rules, for a cotangent with pending axes ``P`` moving back through each forward step:

* AllReduce over ``A`` (partial -> replicated): an AllReduce over ``A & P`` only (none if the
  cotangent is whole there); the result is whole over ``A``.
* AllGather over ``A`` (split -> replicated): if the cotangent is whole over ``A``, each rank
  keeps its own slice (local); if pending, a ReduceScatter (the rest of ``A`` zeroed first).
* Slice (replicated -> split): zero-padding, pending over the axes the slice split.
* Zero (replicated -> partial): nothing (the cotangent of a partial value is whole).
* ReduceScatter, AllToAll: their usual adjoints (AllGather, AllToAll).
* The direct exchange: every replica axis pending first (local), then its adjoint.

Through an op: the local gradient is linear in the cotangent, so where every rank of a group
runs the op on the same data (a *repeat* axis: replicated in every input and output), a whole
cotangent gives whole input gradients and a pending one pending gradients; over an axis that
cuts an iteration dimension an input lacks, the input's gradient is pending (each rank sums
only its part). An op whose layouts say neither is run on contributions, as before.

Every pending set is turned into another by zeroing (:class:`Action` with a ZERO step: the
value stays on the replica at coordinate 0 and is zero elsewhere), never by communicating.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from simpar.layout import TensorLayout
from simpar.redistribution import (
    RedistributionPlan,
    Step,
    StepKind,
    common_refinement,
    refine,
)

__all__ = ["Action", "Frame", "OpBackward", "Pending", "Sharded", "SoloBackward",
           "cotangent_actions", "op_backward", "solo_backward"]

Pending = frozenset[int]


@dataclass(frozen=True, slots=True)
class Action:
    """One step of the backward on a cotangent: ``step`` run forward, or (``adjoint``) its
    adjoint as :func:`simpar.redistribution.execute_adjoint` runs it."""

    step: Step
    adjoint: bool

    @property
    def local(self) -> bool:
        return self.step.kind.local

    @property
    def kind(self) -> StepKind:
        """The collective (or local step) this action runs."""
        return self.step.kind.adjoint if self.adjoint else self.step.kind

    def __str__(self) -> str:
        axes = f"{list(self.step.device_axes)}" if self.step.device_axes else ""
        return f"{'adjoint of ' if self.adjoint else ''}{self.step.kind}{axes}"


@dataclass(frozen=True)
class Frame:
    """How pending axes are written. On ``p**k`` devices every layout is written over the
    finest device matrix ``(p,) * k`` (``fine``), so the pending axes of any two layouts
    compare directly, however the ops wrote their device matrices (a repeat axis merged
    with a model-parallel one stays apart); otherwise each layout over its own."""

    fine: tuple[int, ...] | None

    @classmethod
    def for_devices(cls, device_num: int) -> Frame:
        p = next((f for f in range(2, device_num + 1) if device_num % f == 0), 1)
        k, rest = 0, device_num
        while rest > 1 and rest % p == 0:
            rest //= p
            k += 1
        return cls((p,) * k if rest == 1 and k > 0 else None)

    def of(self, layout: TensorLayout) -> TensorLayout:
        """``layout`` as pending axes are written for it."""
        return refine(layout, self.fine) if self.fine is not None else layout

    def replicas(self, layout: TensorLayout) -> Pending:
        """The axes (size > 1) over which ``layout`` is replicated: where its cotangent may
        be pending."""
        return _replicas(self.of(layout))

    def zero(self, layout: TensorLayout, axes: Sequence[int]) -> Action:
        """Make a cotangent in ``layout`` pending over ``axes`` too (local: zero off
        coordinate 0)."""
        lay = self.of(layout)
        return Action(Step(StepKind.ZERO, lay, lay, tuple(sorted(axes))), False)

    def summed(self, layout: TensorLayout, axes: Sequence[int]) -> Action:
        """Sum a cotangent in ``layout`` over its pending ``axes``: one AllReduce."""
        lay = self.of(layout)
        return Action(Step(StepKind.ALL_REDUCE, lay, lay, tuple(sorted(axes))), False)


@lru_cache(maxsize=1 << 16)
def _roles(lay: TensorLayout) -> tuple[frozenset[int], Pending]:
    """The axes ``lay`` splits or is a pending sum over, and those (size > 1) over which it
    is replicated: where its cotangent may be pending. One pass, once per layout: the
    backward of every op, and of every candidate a cost model prices, asks for them."""
    dm = lay.device_matrix
    used = {a for axes in lay.dim_axes for a in axes}
    used.update(lay.partial_axes)
    return frozenset(used), frozenset(a for a in range(len(dm)) if dm[a] > 1 and a not in used)


def _replicas(lay: TensorLayout) -> Pending:
    return _roles(lay)[1]


def _runs(device_matrix: tuple[int, ...], fine: tuple[int, ...]) -> list[tuple[int, ...]]:
    """For each axis of ``device_matrix``, the axes of its refinement ``fine`` it spans."""
    out, j = [], 0
    for size in device_matrix:
        run: list[int] = []
        prod = 1
        while prod < size:
            prod *= fine[j]
            run.append(j)
            j += 1
        out.append(tuple(run))
    return out


def _to(axes: set[int] | Pending, coarse: tuple[int, ...], fine: tuple[int, ...]) -> set[int]:
    """Axes of ``coarse`` as axes of its refinement ``fine``."""
    runs = _runs(coarse, fine)
    return {f for a in axes for f in runs[a]}


@lru_cache(maxsize=1 << 14)
def cotangent_actions(p: RedistributionPlan, pending: Pending, frame: Frame
                      ) -> tuple[tuple[Action, ...], Pending]:
    """The backward of plan ``p`` on a cotangent held in ``p.dst`` with ``pending`` axes
    (written as ``frame`` writes ``p.dst``): the actions to run, in order, and the pending
    axes of the result in ``p.src``."""
    src, dst = frame.of(p.src), frame.of(p.dst)
    if not p.steps and src.device_matrix == dst.device_matrix:
        # src is dst: the pending axes stay (those of size 1 are none)
        return (), frozenset(a for a in pending if src.device_matrix[a] > 1)
    if p.steps:
        fine = common_refinement(dst.device_matrix, p.steps[0].src.device_matrix)
        if fine is not None:
            fine = common_refinement(fine, src.device_matrix)
    else:   # the same blocks over other device matrices (no frame writes both alike)
        fine = common_refinement(dst.device_matrix, src.device_matrix)
    if fine is None:   # writings with no common refinement: contributions, as before
        missing = frame.replicas(p.dst) - pending
        actions = (frame.zero(p.dst, sorted(missing)),) if missing else ()
        return actions + tuple(Action(s, True) for s in reversed(p.steps)), \
            frame.replicas(p.src)
    cur = _to(pending, dst.device_matrix, fine)
    out: list[Action] = []
    for step in reversed(p.steps):
        axes = _to(set(step.device_axes), step.src.device_matrix, fine)
        kind = step.kind
        if kind == StepKind.SLICE:
            out.append(Action(step, True))  # zero-padding: pending where the slice split
            split = refine(step.dst, fine).split_axes - refine(step.src, fine).split_axes
            cur |= {a for a in split if fine[a] > 1}
        elif kind == StepKind.ZERO:
            assert not axes & cur, "a partial value's cotangent is whole over its sums"
        elif kind == StepKind.ALL_REDUCE:
            summed = axes & cur
            if summed == axes:
                out.append(Action(step, True))
            elif summed:
                lay = refine(step.dst, fine)
                out.append(Action(Step(StepKind.ALL_REDUCE, lay, lay, tuple(sorted(summed))),
                                  False))
            cur -= axes
        elif kind == StepKind.ALL_GATHER:
            if not axes & cur:   # whole on every replica: keep this rank's slice
                out.append(Action(Step(StepKind.SLICE, step.dst, step.src), False))
            else:
                if not axes <= cur:
                    lay = refine(step.dst, fine)
                    out.append(Action(Step(StepKind.ZERO, lay, lay, tuple(sorted(axes - cur))),
                                      False))
                out.append(Action(step, True))
                cur -= axes
        elif kind in (StepKind.REDUCE_SCATTER, StepKind.ALL_TO_ALL):
            assert not axes & cur, "split axes are never pending"
            out.append(Action(step, True))
        else:  # the direct exchange runs on contributions over every replica
            lay = refine(step.dst, fine)
            extra = {a for a in lay.replica_axes if fine[a] > 1} - cur
            if extra:
                out.append(Action(Step(StepKind.ZERO, lay, lay, tuple(sorted(extra))), False))
            out.append(Action(step, True))
            src_lay = refine(step.src, fine)
            cur = {a for a in src_lay.replica_axes if fine[a] > 1}
    # Back to how the frame writes p.src: pending over part of one of its axes becomes
    # pending over all of it (zeroing the rest).
    result: set[int] = set()
    rest: set[int] = set()
    for a, run in enumerate(_runs(src.device_matrix, fine)):
        touched = cur.intersection(run)
        if touched:
            result.add(a)
            rest.update(set(run) - touched)
    if rest:
        lay = refine(p.src, fine)
        out.append(Action(Step(StepKind.ZERO, lay, lay, tuple(sorted(rest))), False))
    return tuple(out), frozenset(result)


class Sharded(Protocol):
    """What planning an op's backward reads of its sharding
    (:class:`simpar.ops.OpSharding`): its input layouts, the redistribution of input 0 it
    runs before its kernel, and per output ``(raw layout, final layout, plan between)``."""

    @property
    def in_layouts(self) -> tuple[TensorLayout, ...]: ...

    @property
    def inner_plan(self) -> RedistributionPlan | None: ...

    @property
    def outputs(self) -> list[tuple[TensorLayout, TensorLayout, RedistributionPlan]]: ...


@dataclass(frozen=True)
class OpBackward:
    """The backward of one op, planned: per output the actions from its cotangent to the
    local kernel's (and the zeroing that aligns them), whether the local gradient runs on
    whole cotangents where the op repeats (``aware``) or on contributions, and each input's
    pending axes (in its ``in_layouts`` layout) after the inner plan's actions."""

    out_actions: tuple[tuple[Action, ...], ...]
    aware: bool
    in_pending: tuple[Pending, ...]
    inner_actions: tuple[Action, ...]


def op_backward(sh: Sharded, out_pending: Sequence[Pending | None], frame: Frame
                ) -> OpBackward:
    """Plan ``sh``'s backward for output cotangents pending over ``out_pending`` (None: the
    output gets no cotangent, zeros), axes written as ``frame`` writes the outputs."""
    raws = [raw for raw, _, _ in sh.outputs]
    kernel_ins = [sh.inner_plan.dst if k == 0 and sh.inner_plan is not None else lay
                  for k, lay in enumerate(sh.in_layouts)]
    per_out: list[tuple[list[Action], Pending | None]] = []
    for (_, _, p), pend in zip(sh.outputs, out_pending):
        if pend is None:
            per_out.append(([], None))
            continue
        acts, raw_pending = cotangent_actions(p, pend, frame)
        per_out.append((list(acts), raw_pending))
    written = ([*kernel_ins, *raws] if frame.fine is None
               else [frame.of(lay) for lay in (*kernel_ins, *raws)])
    dm = written[0].device_matrix
    aware = all(lay.device_matrix == dm for lay in written)
    union: Pending = frozenset().union(*(pend for _, pend in per_out if pend is not None))
    repeat: Pending = frozenset()
    if aware:
        used: set[int] = set()
        for lay in written:
            used |= _roles(lay)[0]
        repeat = frozenset(a for a in range(len(dm)) if dm[a] > 1 and a not in used)
        aware = union <= repeat
    out_actions = []
    for raw, (steps, pend) in zip(raws, per_out):
        if pend is not None:
            want = union if aware else frame.replicas(raw)
            if want - pend:
                steps.append(frame.zero(raw, sorted(want - pend)))
        out_actions.append(tuple(steps))
    in_pending = [(frame.replicas(lay) - repeat) | union if aware else frame.replicas(lay)
                  for lay in kernel_ins]
    inner: tuple[Action, ...] = ()
    if sh.inner_plan is not None:
        inner, in_pending[0] = cotangent_actions(sh.inner_plan, in_pending[0], frame)
    return OpBackward(tuple(out_actions), aware, tuple(in_pending), inner)


@dataclass(frozen=True)
class SoloBackward:
    """The backward of one op run by itself on contributions (``run_op``; a cost model
    pricing one op): output k's cotangent is held pending over ``seeds[k]`` (each rank its
    share), the op's own backward is ``op``, and input k's gradient comes out pending over
    ``sums[k]``, which one AllReduce completes. Axes are the op's device axes."""

    seeds: tuple[Pending, ...]
    op: OpBackward
    sums: tuple[Pending, ...]


def solo_backward(sh: Sharded, whole: Sequence[Sequence[int]]) -> SoloBackward:
    """Plan ``sh``'s backward as :func:`op_backward` plans it in a program, each output's
    cotangent seeded as contributions: pending over the output's replicas but
    ``whole[k]`` (the axes where the op computed output k alike from different input
    pieces, its local VJP then taking the whole cotangent). On a MatMul ``((2, 4), (4, 1))``
    on 8 devices, the output is replicated over the 4-way axis after its AllReduce: the
    cotangent is pending there, the AllReduce's adjoint sums it, and input 1's gradient is
    pending over the 2-way axis (its replicas)."""
    frame = Frame(None)
    seeds = tuple(_replicas(out) - frozenset(whole[k]) if whole[k] else _replicas(out)
                  for k, (_, out, _) in enumerate(sh.outputs))
    planned = op_backward(sh, seeds, frame)
    return SoloBackward(seeds, planned, planned.in_pending)
