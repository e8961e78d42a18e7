"""The one base of simpar's string enums: members are their values (``Source.USER ==
"annotated"``) and print as them (``str(StepKind.ALL_REDUCE) == "AllReduce"``), on every Python
simpar supports (``enum.StrEnum`` is 3.11+). A leaf module: it imports nothing from simpar.
"""

from __future__ import annotations

import enum

__all__ = ["StrEnum"]


class StrEnum(str, enum.Enum):
    """A string enum whose ``str()`` is its value."""

    def __str__(self) -> str:
        return self.value
