"""The global seed (MindSpore's ``set_seed``): parameter initial values and dropout masks are
functions of it, identical on every rank and for every rank count.

The training step that counter-based random ops (Dropout) draw for is execution state, not op
state: the runtime runs each step inside ``training_step(k)``, so executing a program never
writes into the ops of its graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["current_step", "get_seed", "set_seed", "training_step"]

_STEP: ContextVar[int | None] = ContextVar("simpar_training_step", default=None)

_SEED = 0


def set_seed(seed: int) -> None:
    """Set the global seed (a non-negative int)."""
    global _SEED
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"set_seed: seed must be a non-negative int, got {seed!r}")
    _SEED = seed


def get_seed() -> int:
    return _SEED


@contextmanager
def training_step(step: int) -> Iterator[None]:
    """Within the block, Dropout masks are drawn for training step ``step``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"training_step: step must be a non-negative int, got {step!r}")
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def current_step() -> int | None:
    """The step of the enclosing :func:`training_step`, or None outside one."""
    return _STEP.get()
