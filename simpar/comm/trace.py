"""CommTrace: a record of every collective a region of code ran.

Byte counts follow one convention, chosen so that they can be compared with lower bounds and
with the planner's predictions: they count the data that this rank must exchange with the
*other* ranks of the group in the bandwidth-optimal algorithm, never the part it keeps for
itself. For a local buffer of ``n`` bytes in a group of ``p`` ranks:

============== ====================== ======================
kind           bytes_sent             bytes_recv
============== ====================== ======================
AllReduce      ``2 (p-1)/p n``        ``2 (p-1)/p n``
AllGather      ``(p-1) n``            ``(p-1) n``
ReduceScatter  ``(p-1)/p n``          ``(p-1)/p n``
AllToAll       ``(p-1)/p n``          ``(p-1)/p n``
AllToAllV      sum of pieces to others sum of pieces from others
Broadcast      root: ``(p-1) n``      non-root: ``n``
Send / Receive ``n``                  ``n``
============== ====================== ======================

This module does not import MPI.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["CommEvent", "CommTrace", "ScheduleError", "guarded", "label", "program_step",
           "record"]


class ScheduleError(RuntimeError):
    """A collective ran that a per-rank program's schedule does not list at that point
    (raised through :mod:`simpar.schedule`, which re-exports it)."""


@dataclass(frozen=True, slots=True)
class CommEvent:
    """One collective call as this rank saw it.

    ``group`` lists world ranks in the group's own order; ``shape`` is the local input shape.
    """

    kind: str
    group: tuple[int, ...]
    bytes_sent: int
    bytes_recv: int
    seconds: float
    dtype: str
    shape: tuple[int, ...]
    op: str | None = None
    label: str = ""
    #: Index of the program step that ran it (``ParallelProgram.schedule``), None outside one.
    step: int | None = None
    #: ``time.perf_counter()`` when it finished, on this rank (it started ``seconds`` before).
    finished: float = 0.0

    def __str__(self) -> str:
        op = f"({self.op})" if self.op else ""
        tag = f" [{self.label}]" if self.label else ""
        return (f"{self.kind}{op} group={list(self.group)} {self.dtype}{list(self.shape)} "
                f"sent={self.bytes_sent} recv={self.bytes_recv} {self.seconds * 1e3:.3f}ms{tag}")


@dataclass(slots=True, eq=False)  # two traces are never "equal": each is its own recording
class CommTrace:
    """Records the collectives run while it is active.

    >>> with CommTrace() as trace:          # doctest: +SKIP
    ...     y = comm.all_reduce(x)
    >>> trace.kinds()                       # doctest: +SKIP
    ['AllReduce']

    Traces nest: every active trace records every event.
    """

    events: list[CommEvent] = field(default_factory=list)

    def __enter__(self) -> CommTrace:
        global _open
        _active().append(self)
        with _open_lock:
            _open += 1
        return self

    def __exit__(self, *exc: object) -> None:
        global _open
        _active().remove(self)  # by identity (eq=False): a trace equal to another is not it
        with _open_lock:
            _open -= 1

    def kinds(self) -> list[str]:
        """Kinds of the recorded events, in order."""
        return [e.kind for e in self.events]

    def count(self, kind: str | None = None) -> int:
        """Number of events, or of events of one kind."""
        return len(self.events) if kind is None else sum(e.kind == kind for e in self.events)

    def bytes_sent(self) -> int:
        return sum(e.bytes_sent for e in self.events)

    def bytes_recv(self) -> int:
        return sum(e.bytes_recv for e in self.events)

    def seconds(self) -> float:
        return sum(e.seconds for e in self.events)

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Totals per kind: ``{"AllReduce": {"count", "bytes_sent", "bytes_recv", "seconds"}}``."""
        out: dict[str, dict[str, float]] = {}
        for e in self.events:
            row = out.setdefault(e.kind, {"count": 0, "bytes_sent": 0, "bytes_recv": 0,
                                          "seconds": 0.0})
            row["count"] += 1
            row["bytes_sent"] += e.bytes_sent
            row["bytes_recv"] += e.bytes_recv
            row["seconds"] += e.seconds
        return out

    def signature(self) -> list[tuple[str, tuple[int, ...], int]]:
        """``(kind, group, bytes_recv)`` per event: what tests compare against a prediction."""
        return [(e.kind, e.group, e.bytes_recv) for e in self.events]

    def summary(self) -> str:
        """A short table of totals per kind."""
        if not self.events:
            return "no collectives"
        lines = [f"{'kind':<14}{'count':>6}{'sent MiB':>11}{'recv MiB':>11}{'ms':>9}"]
        for kind, row in self.by_kind().items():
            lines.append(f"{kind:<14}{int(row['count']):>6}{row['bytes_sent'] / 2**20:>11.3f}"
                         f"{row['bytes_recv'] / 2**20:>11.3f}{row['seconds'] * 1e3:>9.2f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        counts = Counter(self.kinds())
        return "CommTrace(" + ", ".join(f"{k}×{n}" for k, n in counts.items()) + ")"


class _ThreadState(threading.local):
    """Per thread: its active traces, the label stack, the guard and the program step."""

    def __init__(self) -> None:
        self.traces: list[CommTrace] = []
        self.labels: list[str] = []
        self.guard: str | None = None
        self.step: tuple[int, str] | None = None


_state = _ThreadState()
_open = 0  # active traces over all threads: record() returns at once while it is 0
_guards = 0  # guarded regions (simpar.schedule.following) over all threads
_open_lock = threading.Lock()


def _active() -> list[CommTrace]:
    return _state.traces


def _labels() -> list[str]:
    return _state.labels


def _step() -> tuple[int, str] | None:
    return _state.step


def tracing() -> bool:
    """True when at least one CommTrace is active on this thread."""
    return bool(_state.traces)


class label:  # noqa: N801  (used as a function: ``with comm.label("MatMul"):``)
    """Tag the events recorded inside the block, e.g. with the op or plan step that ran them.

    A class rather than a generator: the executor enters several per op and step, and this
    costs a tenth of contextlib's machinery."""

    __slots__ = ("_text",)

    def __init__(self, text: str) -> None:
        self._text = text

    def __enter__(self) -> None:
        _state.labels.append(self._text)

    def __exit__(self, *exc: object) -> None:
        _state.labels.pop()


@contextmanager
def guarded(what: str) -> Iterator[None]:
    """Inside the block every collective must run inside a :func:`program_step`: one that
    does not raises :class:`ScheduleError` on every rank that ran it."""
    global _guards
    outer = _state.guard
    _state.guard = what
    with _open_lock:
        _guards += 1
    try:
        yield
    finally:
        _state.guard = outer
        with _open_lock:
            _guards -= 1


class program_step:  # noqa: N801  (used as a function, like label)
    """Events recorded inside the block belong to step ``index`` of a per-rank program and
    carry exactly its label ``text`` (the labels around the block are not prefixed). A class,
    as :class:`label` is: every collective of a program enters one."""

    __slots__ = ("_step", "_outer")

    def __init__(self, index: int, text: str) -> None:
        self._step = (index, text)
        self._outer: tuple[int, str] | None = None

    def __enter__(self) -> None:
        self._outer = _state.step
        _state.step = self._step

    def __exit__(self, *exc: object) -> None:
        _state.step = self._outer


def record(kind: str, group: tuple[int, ...], bytes_sent: int, bytes_recv: int, seconds: float,
           dtype: object, shape: tuple[int, ...], op: str | None = None,
           at: tuple[int, str] | None = None) -> None:
    """Add one event to every active trace (called by simpar.comm only). Costs one lookup
    when no trace is active: naming the dtype is left until an event is really kept. ``at``:
    the program step that announced the call, passed by the caller (a prepared collective)
    instead of through :class:`program_step`."""
    if at is None and _guards and _state.guard is not None and _state.step is None:
        raise ScheduleError(f"{_state.guard}: {kind} over ranks {list(group)} ran, but the "
                            "program's schedule does not list it (nothing announced it with "
                            "simpar.schedule.issue)")
    if not _open:
        return
    traces = _active()
    if not traces:
        return
    step = at if at is not None else _step()
    index, text = step if step is not None else (None, "/".join(_labels()))
    event = CommEvent(kind, group, int(bytes_sent), int(bytes_recv), seconds, str(dtype), shape,
                      op, text, index, time.perf_counter())
    for t in traces:
        t.events.append(event)
