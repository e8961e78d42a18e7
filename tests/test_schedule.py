"""The schedule guard (simpar.schedule): a program's collectives run in the order it lists."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from simpar import comm, schedule
from simpar.comm import CommTrace
from simpar.schedule import ScheduleError


@dataclass(frozen=True)
class _Step:
    index: int
    label: str
    runs: object
    adjoint: bool = False


A, B = object(), object()
STEPS = [_Step(0, "first", A), _Step(1, "second", B, adjoint=True)]


def test_the_listed_collectives_in_order_pass_and_carry_their_step() -> None:
    with CommTrace() as trace, schedule.following(STEPS):
        with schedule.issue(A):
            comm.all_reduce(np.ones(2), group=[comm.get_rank()])
        with schedule.issue(B, adjoint=True):
            comm.all_reduce(np.ones(2), group=[comm.get_rank()])
    assert [(e.step, e.label) for e in trace.events] == [(0, "first"), (1, "second")]


def test_a_collective_out_of_order_or_in_the_wrong_direction_raises() -> None:
    with pytest.raises(ScheduleError, match="step 0 of the schedule is 'first'"), \
            schedule.following(STEPS), schedule.issue(B, adjoint=True):
        pass
    with pytest.raises(ScheduleError, match="step 1 of the schedule is 'second'"), \
            schedule.following(STEPS):
        with schedule.issue(A):
            pass
        with schedule.issue(B):  # forwards, but the schedule lists its adjoint
            pass


def test_a_missing_or_an_extra_collective_raises() -> None:
    with pytest.raises(ScheduleError, match="1 scheduled collectives never ran, from step 1"), \
            schedule.following(STEPS), schedule.issue(A):
        pass
    with pytest.raises(ScheduleError, match="after the last of the 2"), \
            schedule.following(STEPS):
        for runs, adjoint in ((A, False), (B, True), (A, False)):
            with schedule.issue(runs, adjoint):
                pass


def test_outside_a_program_nothing_is_checked_and_labels_nest() -> None:
    with CommTrace() as trace, comm.label("outer"), schedule.issue(A):
        comm.all_reduce(np.ones(1), group=[comm.get_rank()])
    assert [(e.step, e.label) for e in trace.events] == [(None, "outer")]


def test_a_collective_nothing_announced_raises_inside_a_program() -> None:
    with pytest.raises(ScheduleError, match="forward: AllReduce over ranks .* ran, but the "
                       "program's schedule does not list it"), \
            schedule.following([], "forward"):
        comm.all_reduce(np.ones(1), group=[comm.get_rank()])
    comm.all_reduce(np.ones(1), group=[comm.get_rank()])  # outside a program: fine


def test_a_prepared_collective_is_announced_and_checked_like_any_other() -> None:
    """``announce`` hands the step to a prepared collective (simpar.comm.prepare): the same
    checks as ``issue``, the step in the event; outside a program it returns None."""
    run = comm.prepare("all_reduce", (2,), np.float64, group=[comm.get_rank()])
    with CommTrace() as trace, schedule.following(STEPS):
        run(np.ones(2), schedule.announce(A))
        run(np.ones(2), schedule.announce(B, adjoint=True))
    assert [(e.step, e.label) for e in trace.events] == [(0, "first"), (1, "second")]
    with pytest.raises(ScheduleError, match="step 0 of the schedule is 'first'"), \
            schedule.following(STEPS):
        schedule.announce(B, adjoint=True)
    with CommTrace() as trace, comm.label("outer"):
        run(np.ones(2), schedule.announce(A))
    assert [(e.step, e.label) for e in trace.events] == [(None, "outer")]
