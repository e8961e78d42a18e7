"""DeviceMesh: MindSpore's device matrix, rank <-> coordinate, and rank groups along axes.

Ranks are laid out row-major, so the *last* device axis varies fastest: on device matrix
``(2, 1, 4)`` rank 5 sits at coordinate ``(1, 0, 1)``. In this module a ``device_axis`` is a
position in the device matrix counted from the left (0 is the outermost). MindSpore's tensor
maps count from the right; :meth:`DeviceMesh.axis_of_map` converts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from simpar._checks import integer, ints

__all__ = ["DeviceMesh"]


@dataclass(frozen=True, slots=True)
class DeviceMesh:
    """A device matrix over ranks ``0 .. prod(device_matrix) - 1``.

    >>> mesh = DeviceMesh((2, 4))
    >>> mesh.coordinate(6)
    (1, 2)
    >>> mesh.groups((1,))
    [(0, 1, 2, 3), (4, 5, 6, 7)]
    >>> mesh.groups((0,))
    [(0, 4), (1, 5), (2, 6), (3, 7)]
    """

    device_matrix: tuple[int, ...]

    def __init__(self, device_matrix: Sequence[int] | int) -> None:
        dm = (device_matrix,) if isinstance(device_matrix, (int, np.integer)) else device_matrix
        if not isinstance(dm, Sequence) and not isinstance(dm, tuple):
            raise TypeError(f"device_matrix must be a sequence of ints, got {device_matrix!r}")
        values = ints(list(dm), "device_matrix", 1)
        if not values:
            raise ValueError("device_matrix must have at least one axis, got ()")
        object.__setattr__(self, "device_matrix", values)

    def __str__(self) -> str:
        return f"DeviceMesh{self.device_matrix}"

    @property
    def size(self) -> int:
        """Number of devices (ranks)."""
        return math.prod(self.device_matrix)

    @property
    def ndim(self) -> int:
        return len(self.device_matrix)

    def axis_of_map(self, map_value: int) -> int:
        """The device axis that tensor-map value ``map_value`` names (MindSpore counts from the
        right): on a 3-axis mesh, map value 0 is device axis 2."""
        map_value = self._index(map_value, "tensor map value", self.ndim,
                                f"(allowed 0..{self.ndim - 1}; -1 means not split and names no "
                                "device axis)")
        return self.ndim - 1 - map_value

    def map_of_axis(self, device_axis: int) -> int:
        """Inverse of :meth:`axis_of_map`."""
        return self.ndim - 1 - self._check_axis(device_axis)

    def _index(self, value: object, what: str, stop: int, allowed: str) -> int:
        """``value`` as an int in ``0..stop-1``; the error ends with ``allowed``."""
        index = integer(value, what)
        if not 0 <= index < stop:
            raise ValueError(f"{what} {index} is out of range for device matrix "
                             f"{list(self.device_matrix)} {allowed}")
        return index

    def _check_axis(self, device_axis: int) -> int:
        return self._index(device_axis, "device_axis", self.ndim,
                           f"(allowed 0..{self.ndim - 1})")

    def _check_rank(self, rank: int) -> int:
        return self._index(rank, "rank", self.size, f"of {self.size} devices")

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinate of ``rank``: on (2, 1, 4), rank 5 is (1, 0, 1)."""
        rank = self._check_rank(rank)
        return tuple(int(c) for c in np.unravel_index(rank, self.device_matrix))

    def rank_of(self, coordinate: Sequence[int]) -> int:
        """Rank at ``coordinate``: on (2, 1, 4), (1, 0, 1) is rank 5."""
        if not isinstance(coordinate, Sequence) or isinstance(coordinate, str):
            raise TypeError(f"coordinate must be a sequence of ints, got {coordinate!r}")
        coordinate = tuple(integer(c, "coordinate entry") for c in coordinate)
        if len(coordinate) != self.ndim or any(
                not 0 <= c < d for c, d in zip(coordinate, self.device_matrix)):
            raise ValueError(f"coordinate {tuple(coordinate)} is not on device matrix "
                             f"{list(self.device_matrix)}")
        return int(np.ravel_multi_index(tuple(coordinate), self.device_matrix))

    def _axes(self, device_axes: Iterable[int]) -> tuple[int, ...]:
        if not isinstance(device_axes, Iterable) or isinstance(device_axes, str):
            raise TypeError(f"device_axes must be an iterable of ints, got {device_axes!r}")
        axes = tuple(self._check_axis(a) for a in device_axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"device axes must be distinct, got {list(axes)}")
        return axes

    def group_of(self, rank: int, device_axes: Iterable[int]) -> tuple[int, ...]:
        """The ranks that share ``rank``'s coordinate on every axis except ``device_axes``.

        The group is ordered row-major over ``device_axes`` in the order given, so on (2, 4)
        ``group_of(5, (1,))`` is (4, 5, 6, 7) and ``group_of(5, (0, 1))`` is (0, 1, …, 7).
        """
        axes = self._axes(device_axes)
        return _group_of(self.device_matrix, self._check_rank(rank), axes)

    def groups(self, device_axes: Iterable[int]) -> list[tuple[int, ...]]:
        """Every group along ``device_axes``, ordered by the first rank of each group."""
        axes = self._axes(device_axes)
        seen: dict[int, tuple[int, ...]] = {}
        for rank in range(self.size):
            g = self.group_of(rank, axes)
            seen.setdefault(min(g), g)
        return [seen[k] for k in sorted(seen)]


@lru_cache(maxsize=1 << 16)
def _group_of(device_matrix: tuple[int, ...], rank: int, axes: tuple[int, ...]
              ) -> tuple[int, ...]:
    """:meth:`DeviceMesh.group_of` by stride arithmetic (searches ask for millions)."""
    strides = [math.prod(device_matrix[a + 1:]) for a in range(len(device_matrix))]
    base = rank - sum((rank // strides[a]) % device_matrix[a] * strides[a] for a in axes)
    offsets = np.zeros(1, dtype=np.int64)
    for a in axes:
        offsets = (offsets[:, None] + np.arange(device_matrix[a]) * strides[a]).ravel()
    return tuple(int(base + o) for o in offsets)
