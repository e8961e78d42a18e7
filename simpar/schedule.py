"""The schedule guard: a per-rank program runs exactly the collectives it lists, in order.

A lowered :class:`~simpar.runtime.ParallelProgram` lists every collective its forward and
backward run on a rank (``program.schedule(rank)``): the steps of every redistribution, the
statistics AllReduces inside Softmax, LayerNorm and the losses, and the Mirrors. While
:func:`following` is active, the code about to run a collective announces it with
:func:`issue`, naming the object it runs (a redistribution step or an op's ``CommSpec``). It
must be the schedule's next collective, the same object in the same direction, or
:class:`ScheduleError` is raised; the collective's CommTrace event then carries the step's
index and label. A collective that nothing announced raises too (``simpar.comm`` checks, as
it records each call, that a guarded region is inside an announced step). So the list a cost
model reads is the list that runs, and nothing runs beside it. (Announcements are compared by
identity; a cached redistribution plan reused by two ops shares its step objects, so there the
order of the list tells them apart.)

Outside :func:`following` (``run_op``, direct use of ``simpar.redistribution``) :func:`issue`
does nothing. This module sits just above ``simpar.comm``, with meshes and layouts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

from simpar.comm import trace
from simpar.comm.trace import ScheduleError

__all__ = ["Scheduled", "ScheduleError", "announce", "following", "issue"]


class Scheduled(Protocol):
    """What the guard needs of a scheduled collective."""

    @property
    def index(self) -> int: ...

    @property
    def label(self) -> str: ...

    @property
    def runs(self) -> object: ...

    @property
    def adjoint(self) -> bool: ...


class _Cursor:
    def __init__(self, steps: Sequence[Scheduled], what: str) -> None:
        self.steps, self.what, self.pos = steps, what, 0

    def advance(self, runs: object, adjoint: bool) -> Scheduled:
        if self.pos == len(self.steps):
            raise ScheduleError(f"{self.what}: a collective was about to run after the last of "
                                f"the {len(self.steps)} the schedule lists "
                                f"({_name(runs, adjoint)})")
        step = self.steps[self.pos]
        # Steps and specs by identity; a Mirror announces a tuple (group, parameters), by value.
        same = step.runs is runs or (isinstance(runs, tuple) and step.runs == runs)
        if not same or step.adjoint != adjoint:
            raise ScheduleError(f"{self.what}: step {step.index} of the schedule is "
                                f"{step.label!r}, but {_name(runs, adjoint)} was about to run")
        self.pos += 1
        return step


def _name(runs: object, adjoint: bool) -> str:
    return ("the adjoint of " if adjoint else "") + str(runs)


_CURSOR: ContextVar[_Cursor | None] = ContextVar("simpar_schedule", default=None)


@contextmanager
def following(steps: Sequence[Scheduled], what: str = "program") -> Iterator[None]:
    """Check every collective announced in the block against ``steps``, in order; on leaving
    the block normally, every step must have run."""
    cursor = _Cursor(steps, what)
    token = _CURSOR.set(cursor)
    try:
        with trace.guarded(what):
            yield
    finally:
        _CURSOR.reset(token)
    if cursor.pos != len(steps):
        missing = steps[cursor.pos]
        raise ScheduleError(f"{what}: {len(steps) - cursor.pos} scheduled collectives never "
                            f"ran, from step {missing.index} ({missing.label!r})")


class issue:  # noqa: N801  (used as a function: ``with schedule.issue(step):``)
    """Announce that the block runs ``runs`` (forwards, or its adjoint): under
    :func:`following` it must be the next scheduled collective. (A class rather than a
    generator: every collective of a program enters one.)"""

    __slots__ = ("_runs", "_adjoint", "_step")

    def __init__(self, runs: object, adjoint: bool = False) -> None:
        self._runs, self._adjoint = runs, adjoint
        self._step: trace.program_step | None = None

    def __enter__(self) -> None:
        at = announce(self._runs, self._adjoint)
        if at is not None:
            self._step = trace.program_step(*at)
            self._step.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._step is not None:
            self._step.__exit__(*exc)


def announce(runs: object, adjoint: bool = False) -> tuple[int, str] | None:
    """The check :class:`issue` makes on entering, also for a caller that hands the step to
    the collective itself (a prepared collective, ``simpar.comm.prepare``) rather than
    entering a block: under :func:`following`, ``runs`` must be the next scheduled
    collective, and its (index, label) is returned for the CommTrace event; None outside
    :func:`following`."""
    cursor = _CURSOR.get()
    if cursor is None:
        return None
    step = cursor.advance(runs, adjoint)
    return step.index, step.label
