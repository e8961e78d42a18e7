"""Watching the memory a rank's executor holds: :func:`watching_memory` (for the cost
model's fidelity benchmark, not for training)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

__all__ = ["MemoryWatch", "current_watch", "watching_memory"]

class MemoryWatch:
    """The peak bytes of the arrays the executor holds (parameters passed in, every value of
    the forward, the tapes, the backward's cotangents), sampled after every op; arrays that
    share memory (views) count once. Use :func:`watching_memory`."""

    def __init__(self) -> None:
        self.peak = 0
        self.params: Any = {}  # the parameter shards of the last forward, held throughout

    def sample(self, *holders: Any) -> None:
        seen: dict[int, int] = {}
        for holder in (self.params, *holders):
            _arrays(holder, seen)
        self.peak = max(self.peak, sum(seen.values()))


_WATCH: ContextVar[MemoryWatch | None] = ContextVar("simpar_memory_watch", default=None)


def current_watch() -> MemoryWatch | None:
    """The watch of the innermost :func:`watching_memory` block, None outside one."""
    return _WATCH.get()


@contextmanager
def watching_memory() -> Iterator[MemoryWatch]:
    """Inside the block, the executor records the peak bytes it holds (costly: for the cost
    model's fidelity benchmark, not for training).

    >>> with watching_memory() as watch:        # doctest: +SKIP
    ...     train(data, label)
    >>> watch.peak                              # doctest: +SKIP
    """
    watch = MemoryWatch()
    token = _WATCH.set(watch)
    try:
        yield watch
    finally:
        _WATCH.reset(token)


def _arrays(x: Any, seen: dict[int, int]) -> None:
    """Every array inside ``x`` (dicts, tuples, lists), by the memory block it lives in."""
    if isinstance(x, np.ndarray):
        base = x
        while isinstance(base.base, np.ndarray):
            base = base.base
        seen[id(base)] = base.nbytes
    elif isinstance(x, dict):
        for item in x.values():
            _arrays(item, seen)
    elif isinstance(x, (tuple, list)):
        for item in x:
            _arrays(item, seen)
