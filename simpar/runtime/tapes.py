"""What a level3 tape holds in place of a weight optimizer parallel let go: a marker per
parameter, put in by :func:`unhold` after the forward and replaced by the weight gathered
again with :func:`rehold` before the backward needs it. Tapes are nested tuples; a weight is
found by identity, so an op's tape that keeps it in any position lets it go."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Dropped", "rehold", "unhold"]


class Dropped:
    """What a level3 tape holds in place of a weight the forward gathered (one per
    parameter): the backward gathers the weight again and puts it back (:func:`rehold`)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<dropped {self.name}>"


def unhold(tape: Any, x: np.ndarray, marker: Dropped) -> Any:
    """``tape`` with every entry that is ``x`` itself (in nested tuples) replaced by
    ``marker``: the tape no longer keeps the gathered weight alive."""
    if tape is x:
        return marker
    if isinstance(tape, tuple):
        return tuple(unhold(t, x, marker) for t in tape)
    return tape


def rehold(tape: Any, marker: Dropped, x: np.ndarray) -> Any:
    """:func:`unhold` undone with the weight gathered again."""
    if tape is marker:
        return x
    if isinstance(tape, tuple):
        return tuple(rehold(t, marker, x) for t in tape)
    return tape
