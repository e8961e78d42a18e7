"""The global seed (MindSpore's ``set_seed``): parameter initial values and dropout masks are
functions of it, identical on every rank and for every rank count."""

from __future__ import annotations

__all__ = ["get_seed", "set_seed"]

_SEED = 0


def set_seed(seed: int) -> None:
    """Set the global seed (a non-negative int)."""
    global _SEED
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"set_seed: seed must be a non-negative int, got {seed!r}")
    _SEED = seed


def get_seed() -> int:
    return _SEED
