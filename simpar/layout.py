"""Where every piece of a tensor lives: MindSpore's device matrix + tensor map.

``TensorLayout(device_matrix, tensor_map, shape, partial=())``:

* ``device_matrix`` lays the ranks out row-major (last axis fastest, see :mod:`simpar.mesh`).
* ``tensor_map`` has one entry per tensor dimension. ``k >= 0`` splits that dimension along
  device axis ``n-1-k`` (MindSpore counts from the right); ``-1`` leaves it whole; a tuple
  splits it over several device axes, the outer one first.
* ``partial`` lists the device axes over which the local values are pending sums (the true
  tensor is the sum over that axis's group), counted like the tensor map: ``k`` is device axis
  ``n-1-k``. On device matrix ``(2, 4)``, ``partial=(1,)`` sums over the axis of size 2, the
  same axis that tensor map value 1 splits.
* A device axis used by neither is a *replica* axis: the ranks along it hold the same piece
  (MindSpore's repeated calculation).

Example (DESIGN.md): device matrix ``(2, 1, 4)``, tensor map ``(2, 0)``, shape ``(8, 16)``.
Dimension 0 is cut in 2 along device axis 0, dimension 1 in 4 along device axis 2, and rank 5,
at coordinate (1, 0, 1), holds rows 4..7 and columns 4..7.

Code that works on the mesh (groups, coordinates, :class:`DeviceMesh`) counts device axes from
the left instead: :attr:`TensorLayout.dim_axes` and :attr:`TensorLayout.partial_axes` give the
tensor map and ``partial`` in that count, and :meth:`TensorLayout.from_dim_axes` and
:meth:`TensorLayout.with_partial_axes` take it.

Shards are even: every cut must divide its dimension. Uneven shards are out of scope.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Union

import numpy as np

from simpar._checks import integer, ints
from simpar.mesh import DeviceMesh

__all__ = ["IndivisibleError", "Layout", "MapEntry", "TensorLayout", "assemble", "block_key",
           "distribute", "shard_index", "take_shard"]

MapEntry = Union[int, tuple[int, ...]]  # noqa: UP007 (a runtime alias, Python 3.10 too)


class IndivisibleError(ValueError):
    """A tensor dimension does not split evenly into the requested number of parts."""


def _norm_entry(entry: object, ndev: int, where: str) -> MapEntry:
    if isinstance(entry, (tuple, list)):
        vals = tuple(integer(v, f"{where} entries") for v in entry)
        if not vals:
            return -1
        if any(not 0 <= v < ndev for v in vals):
            raise ValueError(f"{where} {tuple(entry)} has a value outside 0..{ndev - 1} "
                             f"(tuple entries may not be -1)")
        return vals[0] if len(vals) == 1 else vals
    v = integer(entry, where)
    if not -1 <= v < ndev:
        raise ValueError(f"{where} value {v} is out of range; allowed -1 (not split) or "
                         f"0..{ndev - 1} for a {ndev}-axis device matrix")
    return v


def _mesh_axes_as_map_values(axes: Sequence[object], n: int, what: str,
                              device_matrix: Sequence[int], split: Sequence[int] = ()
                              ) -> tuple[int, ...]:
    """Device axes counted from the left (mesh axes) as values counted from the right (the
    tensor map's count): on 3 axes, ``(0, 2)`` becomes ``(2, 0)``. Errors speak the caller's
    count; ``split`` lists the (left-counted) axes the tensor map already uses."""
    vals = tuple(integer(a, f"{what} entries") for a in axes)
    bad = [a for a in vals if not 0 <= a < n]
    if bad:
        raise ValueError(f"{what} {vals} names device axis {bad[0]}; allowed 0..{n - 1} (counted "
                         f"from the left) for device matrix {list(device_matrix)}")
    twice = sorted({a for a in vals if vals.count(a) > 1})
    if twice:
        raise ValueError(f"{what} {vals} names device axis {twice[0]} twice")
    clash = sorted(set(vals) & set(split))
    if clash:
        raise ValueError(f"{what} {vals}: device axes {clash} (counted from the left) also split "
                         "a tensor dimension; a device axis can do only one of the two")
    return tuple(n - 1 - a for a in vals)


def _listed(tensor_map: Sequence[MapEntry]) -> list[int | list[int]]:
    """A tensor map as MindSpore's layout dictionaries write it: ``(2, (1, 0))`` is
    ``[2, [1, 0]]``."""
    return [list(e) if isinstance(e, tuple) else e for e in tensor_map]


#: Layouts built by :meth:`TensorLayout.from_dim_axes` of plain ints, by their arguments (the
#: oldest let go past :data:`_BUILT_KEPT`): a lookup before the arguments' types are checked.
_BUILT: dict[tuple[Any, ...], TensorLayout] = {}
_BUILT_KEPT = 1 << 17


def _from_dim_axes(device_matrix: tuple[int, ...], dim_axes: tuple[tuple[int, ...], ...],
                   shape: tuple[int, ...], partial_axes: tuple[int, ...]) -> TensorLayout:
    """``TensorLayout.from_dim_axes`` of plain ints: checked here in one pass and built
    without the general constructor's normalisation (planners build many layouts); anything
    invalid goes through the constructor, which raises the precise error."""
    n = len(device_matrix)
    used = [a for axes in dim_axes for a in axes]
    used += partial_axes
    if (not n or min(device_matrix) < 1 or len(dim_axes) != len(shape)
            or (shape and min(shape) < 0) or len(set(used)) != len(used)
            or (used and (min(used) < 0 or max(used) >= n))):
        return TensorLayout._from_dim_axes(device_matrix, dim_axes, shape, partial_axes)
    cuts = tuple(1 if not axes else device_matrix[axes[0]] if len(axes) == 1 else
                 math.prod([device_matrix[a] for a in axes]) for axes in dim_axes)
    local = []
    for x, c in zip(shape, cuts):
        if x % c:
            return TensorLayout._from_dim_axes(device_matrix, dim_axes, shape, partial_axes)
        local.append(x // c)
    tmap = tuple(-1 if not axes else n - 1 - axes[0] if len(axes) == 1 else
                 tuple(n - 1 - a for a in axes) for axes in dim_axes)
    paxes = tuple(sorted(partial_axes))
    lay = object.__new__(TensorLayout)
    setattr_ = object.__setattr__
    setattr_(lay, "device_matrix", device_matrix)
    setattr_(lay, "tensor_map", tmap)
    setattr_(lay, "shape", shape)
    setattr_(lay, "partial", tuple(n - 1 - a for a in reversed(paxes)))
    setattr_(lay, "_axes", dim_axes)
    setattr_(lay, "_cuts", cuts)
    setattr_(lay, "_local", tuple(local))
    setattr_(lay, "_paxes", paxes)
    return lay


@lru_cache(maxsize=4096)
def _dim_axes(ndev: int, tensor_map: tuple[MapEntry, ...]) -> tuple[tuple[int, ...], ...]:
    out = []
    for e in tensor_map:
        vals = e if isinstance(e, tuple) else ((e,) if e >= 0 else ())
        out.append(tuple(ndev - 1 - v for v in vals))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """How a tensor of ``shape`` is cut over ``device_matrix``; see the module docstring.

    >>> lay = TensorLayout((2, 1, 4), (2, 0), (8, 16))
    >>> lay.local_shape(), lay.slice_of(5)
    ((4, 4), ((4, 8), (4, 8)))
    """

    device_matrix: tuple[int, ...]
    tensor_map: tuple[MapEntry, ...]
    shape: tuple[int, ...]
    partial: tuple[int, ...] = ()
    _axes: tuple[tuple[int, ...], ...] = field(default=(), init=False, repr=False,
                                               compare=False)
    _cuts: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _local: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _paxes: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __init__(self, device_matrix: Sequence[int], tensor_map: Sequence[object],
                 shape: Sequence[int], partial: Sequence[int] = ()) -> None:
        mesh = DeviceMesh(tuple(device_matrix))
        dm, n = mesh.device_matrix, mesh.ndim
        shp = tuple(integer(s, "shape entries") for s in shape)
        if any(s < 0 for s in shp):
            raise ValueError(f"shape entries must be >= 0, got {shp}")
        if len(tensor_map) != len(shp):
            raise ValueError(f"tensor_map {tuple(tensor_map)} has {len(tensor_map)} entries but "
                             f"shape {shp} has {len(shp)} dimensions; give one entry per dimension")
        tmap = tuple(_norm_entry(e, n, "tensor_map") for e in tensor_map)
        used: list[int] = []
        for e in tmap:
            used.extend(e if isinstance(e, tuple) else ([e] if e >= 0 else []))
        dup = sorted({v for v in used if used.count(v) > 1})
        if dup:
            raise ValueError(f"tensor_map {tmap} uses map value(s) {dup} more than once; each "
                             "device axis may split at most one tensor dimension")
        part = tuple(sorted(integer(k, "partial entries") for k in partial))
        bad = [k for k in part if not 0 <= k < n]
        twice = sorted({k for k in part if part.count(k) > 1})
        if bad or twice:
            what = f"value {bad[0]} is out of range" if bad else f"value {twice[0]} is repeated"
            raise ValueError(f"partial {tuple(partial)}: {what}; partial must list distinct "
                             f"device axes in 0..{n - 1}, counted from the right like the "
                             f"tensor map, for device matrix {list(dm)}")
        clash = sorted(set(part) & set(used))
        if clash:
            raise ValueError(f"map value(s) {clash} are both partial and splitting a dimension "
                             f"in tensor_map {tmap} (partial {part}); a device axis can do only "
                             "one of the two")
        object.__setattr__(self, "device_matrix", dm)
        object.__setattr__(self, "tensor_map", tmap)
        object.__setattr__(self, "shape", shp)
        object.__setattr__(self, "partial", part)
        axes = _dim_axes(n, tmap)
        cuts = tuple(math.prod(dm[a] for a in x) for x in axes)
        object.__setattr__(self, "_axes", axes)  # read by every planner step
        object.__setattr__(self, "_cuts", cuts)
        object.__setattr__(self, "_local", tuple(s // c for s, c in zip(shp, cuts)))
        object.__setattr__(self, "_paxes", tuple(sorted(n - 1 - k for k in part)))
        for tensor_dim, (size, cut) in enumerate(zip(shp, cuts)):
            if size % cut:
                raise IndivisibleError(
                    f"dimension {tensor_dim} of shape {shp} cannot be split into {cut} parts "
                    f"(tensor_map {tmap} on device matrix {list(dm)}); {size} is not a multiple "
                    f"of {cut}")

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_dim_axes(cls, device_matrix: Sequence[int], dim_axes: Sequence[Sequence[int]],
                      shape: Sequence[int], partial_axes: Sequence[int] = ()) -> TensorLayout:
        """The layout whose tensor dimension ``i`` is split over device axes ``dim_axes[i]`` and
        that is partial over device axes ``partial_axes``.

        Device axes are counted from the left (mesh axes, as in :class:`DeviceMesh`), the outer
        one first; ``()`` leaves a dimension whole. This is the inverse of :attr:`dim_axes` and
        :attr:`partial_axes`.

        >>> lay = TensorLayout.from_dim_axes((2, 1, 4), [(0,), (2,)], (8, 16))
        >>> lay.tensor_map, lay.slice_of(5)   # rank 5, at (1, 0, 1): rows 4..7, columns 4..7
        ((2, 0), ((4, 8), (4, 8)))
        >>> lay = TensorLayout.from_dim_axes((2, 1, 4), [(0, 2), ()], (8, 16))
        >>> lay.tensor_map, lay.slice_of(5)   # rank 5: row 5 (chunk 1 * 4 + 1), every column
        (((2, 0), -1), ((5, 6), (0, 16)))
        >>> lay = TensorLayout.from_dim_axes((2, 4), [(), (1,)], (8, 8), partial_axes=(0,))
        >>> lay.partial, lay.partial_group(5)   # pending sums over the size-2 axis: ranks 1, 5
        ((1,), (1, 5))
        """
        try:  # layouts are immutable: planners build the same ones millions of times
            key = (tuple(device_matrix), tuple(map(tuple, dim_axes)), tuple(shape),
                   tuple(partial_axes))
            found = _BUILT.get(key) if cls is TensorLayout else None
        except TypeError:  # unhashable arguments: build it uncached (and let it complain)
            return cls._from_dim_axes(device_matrix, dim_axes, shape, partial_axes)
        if found is not None:   # a key equal to a built one's (ints or their equals)
            return found
        if cls is not TensorLayout or any(
                type(x) is not int for part in (key[0], key[2], key[3], *key[1]) for x in part):
            return cls._from_dim_axes(device_matrix, dim_axes, shape, partial_axes)
        if len(_BUILT) >= _BUILT_KEPT:
            del _BUILT[next(iter(_BUILT))]   # the oldest
        found = _BUILT[key] = _from_dim_axes(*key)
        return found

    @classmethod
    def _from_dim_axes(cls, device_matrix: Sequence[int], dim_axes: Sequence[Sequence[int]],
                       shape: Sequence[int], partial_axes: Sequence[int] = ()) -> TensorLayout:
        n = len(device_matrix)
        tmap: list[tuple[int, ...]] = []
        for tensor_dim, axes in enumerate(dim_axes):
            vals = tuple(integer(a, "dim_axes entries") for a in axes)
            bad = [a for a in vals if not 0 <= a < n]
            if bad:
                raise ValueError(f"dim_axes {[tuple(x) for x in dim_axes]} splits tensor "
                                 f"dimension {tensor_dim} over device axis {bad[0]}; allowed "
                                 f"0..{n - 1} for device matrix {list(device_matrix)}")
            # The constructor canonicalises: () becomes -1 and (k,) becomes k.
            tmap.append(tuple(n - 1 - a for a in vals))
        split = [n - 1 - v for entry in tmap for v in entry]
        part = _mesh_axes_as_map_values(partial_axes, n, "partial_axes", device_matrix, split)
        return cls(device_matrix, tmap, shape, part)

    @classmethod
    def from_strategy(cls, device_matrix: Sequence[int], cuts: Sequence[int],
                      shape: Sequence[int]) -> TensorLayout:
        """The layout that cuts dimension ``i`` of ``shape`` into ``cuts[i]`` parts.

        Cut dimensions take device axes left to right; an axis whose size no cut uses is a
        replica axis. ``from_strategy((2, 1, 4), (2, 4), (8, 16))`` gives tensor map (2, 0).
        A cut equal to the product of consecutive axes takes them all (outer first).
        """
        dm = DeviceMesh(tuple(device_matrix)).device_matrix
        n = len(dm)
        cuts_t = tuple(integer(c, "cuts entries") for c in cuts)
        if any(c < 1 for c in cuts_t):
            raise ValueError(f"cuts must be >= 1, got {cuts_t}")
        dim_axes: list[tuple[int, ...]] = []
        axis = 0
        for c in cuts_t:
            if c == 1:
                dim_axes.append(())
                continue
            found = None
            for start in range(axis, n):
                prod, end = 1, start
                while end < n and prod < c:
                    prod *= dm[end]
                    end += 1
                if prod == c and dm[start] > 1:
                    found = (start, end)
                    break
            if found is None:
                raise ValueError(f"cuts {cuts_t} do not fit device matrix {list(dm)}: no device "
                                 f"axes after axis {axis} multiply to {c}")
            dim_axes.append(tuple(a for a in range(*found) if dm[a] > 1) or (found[0],))
            axis = found[1]
        return cls.from_dim_axes(dm, dim_axes, shape)

    # ---------------------------------------------------------------- structure
    @property
    def mesh(self) -> DeviceMesh:
        return DeviceMesh(self.device_matrix)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dim_axes(self) -> tuple[tuple[int, ...], ...]:
        """Per tensor dimension, the device axes (from the left) that split it, outer first."""
        return self._axes

    @property
    def partial_axes(self) -> tuple[int, ...]:
        """The device axes (from the left) over which values are pending sums, in increasing
        order: ``partial`` in the mesh's count. On device matrix (2, 4), ``partial=(1,)`` has
        ``partial_axes == (0,)``."""
        return self._paxes

    @property
    def cuts(self) -> tuple[int, ...]:
        """How many parts each tensor dimension is cut into."""
        return self._cuts

    @property
    def split_axes(self) -> frozenset[int]:
        return frozenset(a for axes in self.dim_axes for a in axes)

    @property
    def replica_axes(self) -> tuple[int, ...]:
        """Device axes along which ranks hold identical values."""
        idle = self.split_axes | set(self.partial_axes)
        return tuple(a for a in range(len(self.device_matrix)) if a not in idle)

    @property
    def is_partial(self) -> bool:
        return bool(self.partial)

    @property
    def device_num(self) -> int:
        return math.prod(self.device_matrix)

    def local_shape(self) -> tuple[int, ...]:
        """Shape of the shard every rank holds."""
        return self._local

    def local_size(self) -> int:
        return math.prod(self.local_shape())

    # ---------------------------------------------------------------- per-rank queries
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.device_num:
            raise ValueError(f"rank {rank} is out of range for device matrix "
                             f"{list(self.device_matrix)} of {self.device_num} devices")

    def chunk_index(self, rank: int) -> tuple[int, ...]:
        """Which piece of each tensor dimension ``rank`` holds (0-based)."""
        self._check_rank(rank)
        coord = np.unravel_index(rank, self.device_matrix)
        out = []
        for axes in self.dim_axes:
            idx = 0
            for a in axes:
                idx = idx * self.device_matrix[a] + int(coord[a])
            out.append(idx)
        return tuple(out)

    def slice_of(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Per tensor dimension, the ``(start, stop)`` that ``rank`` holds.

        On device matrix (2, 1, 4), tensor map (2, 0), shape (8, 16), rank 5 holds
        ``((4, 8), (4, 8))``.
        """
        local = self.local_shape()
        return tuple((i * n, (i + 1) * n) for i, n in zip(self.chunk_index(rank), local))

    def slices(self, rank: int) -> tuple[slice, ...]:
        """``slice_of`` as numpy slices: ``global_array[layout.slices(r)]`` is rank r's shard."""
        return tuple(slice(a, b) for a, b in self.slice_of(rank))

    def ranks_holding(self, index: Sequence[int]) -> tuple[int, ...]:
        """The ranks whose shard contains global element ``index`` (with partial axes, each
        holds a pending part of it)."""
        if len(index) != self.ndim or any(not 0 <= i < s for i, s in zip(index, self.shape)):
            raise ValueError(f"index {tuple(index)} is outside shape {self.shape}")
        local = self.local_shape()
        want = tuple(i // n if n else 0 for i, n in zip(index, local))
        return tuple(r for r in range(self.device_num) if self.chunk_index(r) == want)

    def replica_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that hold exactly what ``rank`` holds (the group along the replica axes)."""
        self._check_rank(rank)
        return self.mesh.group_of(rank, self.replica_axes)

    def partial_group(self, rank: int) -> tuple[int, ...]:
        """The ranks whose values sum to the true values of ``rank``'s piece.

        On device matrix (2, 4) with ``partial=(1,)`` (the size-2 axis), rank 5 sums with
        rank 1: ``(1, 5)``.
        """
        self._check_rank(rank)
        return self.mesh.group_of(rank, self.partial_axes)

    # ---------------------------------------------------------------- conversions
    def with_shape(self, shape: Sequence[int]) -> TensorLayout:
        return TensorLayout(self.device_matrix, self.tensor_map, shape, self.partial)

    def replicated(self) -> TensorLayout:
        """The same tensor held whole by every rank of the same device matrix."""
        return TensorLayout(self.device_matrix, [-1] * self.ndim, self.shape)

    def with_partial(self, partial: Sequence[int]) -> TensorLayout:
        """The same cut, pending sums over ``partial`` (counted from the right, like the tensor
        map); ``with_partial(())`` is the layout with the sums done."""
        n = len(self.device_matrix)
        split = self.split_axes
        axes = [n - 1 - k for k in partial if type(k) is int and 0 <= k < n]
        if len(axes) == len(partial) == len(set(axes)) and not split.intersection(axes):
            return TensorLayout.from_dim_axes(self.device_matrix, self._axes, self.shape,
                                              sorted(axes))
        return TensorLayout(self.device_matrix, self.tensor_map, self.shape, partial)

    def with_partial_axes(self, partial_axes: Sequence[int]) -> TensorLayout:
        """:meth:`with_partial` with device axes counted from the left (mesh axes): on
        device matrix (2, 4), ``with_partial_axes((0,)) == with_partial((1,))``."""
        n = len(self.device_matrix)
        part = _mesh_axes_as_map_values(partial_axes, n, "partial_axes", self.device_matrix,
                                        sorted(self.split_axes))
        return self.with_partial(part)

    def to_dict(self) -> dict[str, Any]:
        """MindSpore's layout dictionary (plus ``shape`` and ``partial`` of simpar's own;
        ``partial`` counts device axes from the right, like ``tensor_map``)."""
        return {
            "device_matrix": list(self.device_matrix),
            "tensor_map": _listed(self.tensor_map),
            "shape": list(self.shape),
            "partial": list(self.partial),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], shape: Sequence[int] | None = None) -> TensorLayout:
        """Inverse of :meth:`to_dict`; ``shape`` is needed when the dict has none."""
        for key in ("device_matrix", "tensor_map"):
            if key not in d:
                raise ValueError(f"layout dict needs key {key!r}, got keys {sorted(d)}")
        shp = shape if shape is not None else d.get("shape")
        if shp is None:
            raise ValueError("layout dict has no 'shape'; pass shape=")
        tmap = [tuple(e) if isinstance(e, list) else e for e in d["tensor_map"]]
        return cls(d["device_matrix"], tmap, shp, d.get("partial", ()))

    def __str__(self) -> str:
        def entry(e: MapEntry) -> str:
            return "(" + ",".join(map(str, e)) + ")" if isinstance(e, tuple) else str(e)
        part = f" P{list(self.partial)}" if self.partial else ""
        return (f"{list(self.device_matrix)}:[{','.join(entry(e) for e in self.tensor_map)}]"
                f"{part} {list(self.shape)}")


@lru_cache(maxsize=1 << 16)
def block_key(layout: TensorLayout) -> tuple[Any, ...]:
    """A key equal for layouts that give every rank the same block and the same pending sums,
    however their device matrices are written: axes of size 1 dropped, and neighbouring axes
    merged when both are replicas, both pending sums, or successive splits of one dimension.
    (Pure arithmetic on the device matrix, checked against every rank's block in the tests.)"""
    dm = layout.device_matrix
    roles: list[Any] = [("rep",)] * len(dm)
    for d, axes in enumerate(layout.dim_axes):
        for k, a in enumerate(x for x in axes if dm[x] > 1):  # outer first, size-1 dropped
            roles[a] = ("dim", d, k)
    for a in layout.partial_axes:
        roles[a] = ("partial",)
    merged: list[list[Any]] = []
    for size, role in zip(layout.device_matrix, roles):
        if size == 1:
            continue
        if merged:
            last = merged[-1]
            same = role[0] == last[1][0] and role[0] in ("rep", "partial")
            follows = (role[0] == "dim" == last[1][0] and role[1] == last[1][1]
                       and role[2] == last[1][2] + 1)
            if same or follows:
                last[0] *= size
                last[1] = role
                continue
        merged.append([size, role])
    # Positions within a dimension only order its axes (outer first): after merging, each
    # merged axis takes its rank among its dimension's.
    ks: dict[int, list[int]] = {}
    for _, role in merged:
        if role[0] == "dim":
            ks.setdefault(role[1], []).append(role[2])
    out = []
    for size, role in merged:
        if role[0] == "dim":
            role = ("dim", role[1], sorted(ks[role[1]]).index(role[2]))
        out.append((size, role))
    return (layout.shape, tuple(out))


@dataclass(frozen=True, slots=True)
class Layout:
    """MindSpore's alias API: name the device axes, then map tensor dimensions to names.

    >>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    >>> layout("dp", ("sp", "mp")).to_dict()["tensor_map"]
    [2, [1, 0]]

    ``"None"`` leaves a dimension unsplit. Bind a shape with :meth:`layout_for`, which also
    names the pending-sum axes by alias: ``layout("dp", "None").layout_for((8, 8),
    partial=("mp",))``.
    """

    device_matrix: tuple[int, ...]
    alias_name: tuple[str, ...]
    tensor_map: tuple[MapEntry, ...] | None = None

    def __init__(self, device_matrix: tuple[int, ...], alias_name: tuple[str, ...],
                 tensor_map: tuple[MapEntry, ...] | None = None) -> None:
        if not isinstance(device_matrix, tuple):
            raise TypeError(f"Layout: device_matrix must be a tuple, got "
                            f"{type(device_matrix).__name__}")
        if not isinstance(alias_name, tuple):
            raise TypeError(f"Layout: alias_name must be a tuple, got {type(alias_name).__name__}")
        if len(device_matrix) != len(alias_name):
            raise ValueError(f"Layout: device_matrix {device_matrix} has {len(device_matrix)} "
                             f"axes but alias_name {alias_name} has {len(alias_name)} names")
        ints(device_matrix, "Layout: device_matrix", 1)
        for name in alias_name:
            if not isinstance(name, str):
                raise TypeError(f"Layout: alias_name entries must be str, got {name!r}")
            if not name:
                raise ValueError("Layout: alias_name entries must not be empty strings")
            if name == "None":
                raise ValueError("Layout: 'None' is reserved for an unsplit dimension and cannot "
                                 "be an alias_name")
        if len(set(alias_name)) != len(alias_name):
            raise ValueError(f"Layout: alias_name {alias_name} has duplicate names")
        DeviceMesh(device_matrix)
        object.__setattr__(self, "device_matrix", device_matrix)
        object.__setattr__(self, "alias_name", alias_name)
        object.__setattr__(self, "tensor_map", tensor_map)

    def _map_value(self, name: object, expected: str) -> int:
        """The tensor-map value (counted from the right) of alias ``name``."""
        if not isinstance(name, str):
            raise TypeError(f"Layout: {expected}, got {name!r}")
        if name not in self.alias_name:
            raise ValueError(f"Layout: alias {name!r} is not one of {self.alias_name}")
        return len(self.alias_name) - 1 - self.alias_name.index(name)

    def __call__(self, *tensor_map: str | tuple[str, ...]) -> Layout:
        used: set[str] = set()
        out: list[MapEntry] = []
        for entry in tensor_map:
            names = entry if isinstance(entry, tuple) else (entry,)
            vals = []
            for name in names:
                if name == "None":
                    if len(names) > 1:
                        raise ValueError(f"Layout: 'None' cannot be combined with other aliases "
                                         f"in {entry}")
                    continue
                value = self._map_value(
                    name, "tensor map entries must be alias names (str) or tuples of them")
                if name in used:
                    raise ValueError(f"Layout: alias {name!r} is used more than once in "
                                     f"{tensor_map}; each alias may split one dimension only")
                used.add(name)
                vals.append(value)
            out.append(-1 if not vals else vals[0] if len(vals) == 1 else tuple(vals))
        return Layout(self.device_matrix, self.alias_name, tuple(out))

    def to_dict(self) -> dict[str, Any]:
        """``{"device_matrix", "tensor_map", "interleaved_parallel", "alias_name"}``."""
        if self.tensor_map is None:
            raise ValueError("Layout: call the layout with a tensor map first, e.g. "
                             "layout('dp', 'None')")
        return {
            "device_matrix": self.device_matrix,
            "tensor_map": _listed(self.tensor_map),
            "interleaved_parallel": False,
            "alias_name": self.alias_name,
        }

    def layout_for(self, shape: Sequence[int], partial: Sequence[str] = ()) -> TensorLayout:
        """The TensorLayout of a tensor of ``shape`` under this alias layout, holding pending
        sums over the device axes named in ``partial``.

        >>> layout = Layout((2, 4), ("dp", "mp"))
        >>> lay = layout("None", "mp").layout_for((8, 8), partial=("dp",))
        >>> lay.partial, lay.partial_group(5)   # rank 5 sums with rank 1 along "dp"
        ((1,), (1, 5))
        """
        if self.tensor_map is None:
            raise ValueError("Layout: call the layout with a tensor map before binding a shape")
        if isinstance(partial, str):
            raise TypeError(f"Layout: partial must be a tuple of alias names, got the string "
                            f"{partial!r}; write ({partial!r},)")
        part = [self._map_value(name, "partial entries must be alias names (str)")
                for name in partial]
        split = {v for e in self.tensor_map for v in (e if isinstance(e, tuple) else (e,))}
        for name, value in zip(partial, part):
            if list(partial).count(name) > 1:
                raise ValueError(f"Layout: alias {name!r} is listed more than once in partial "
                                 f"{tuple(partial)}")
            if value in split:
                raise ValueError(f"Layout: alias {name!r} both splits a dimension (tensor map "
                                 f"{self.tensor_map}) and is partial; an axis can do only one")
        return TensorLayout(self.device_matrix, self.tensor_map, shape, part)


def distribute(global_array: np.ndarray, layout: TensorLayout, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard of ``global_array`` (a copy).

    For a partial layout, the full value sits on coordinate 0 of every partial axis and the
    other ranks of the partial group hold zeros, so the shards still sum to the global array.
    """
    if tuple(global_array.shape) != layout.shape:
        raise ValueError(f"distribute: global array has shape {global_array.shape}, layout "
                         f"{layout} expects {layout.shape}")
    return take_shard(global_array, *shard_index(layout, rank))


def take_shard(global_array: np.ndarray, where: tuple[slice, ...], zero: bool) -> np.ndarray:
    """``global_array[where]``, copied, and zeroed when ``zero``: :func:`distribute` from a
    :func:`shard_index` found once (a training cell takes its batch's shard on every step)."""
    shard = np.array(global_array[where], copy=True)
    if zero:
        shard[...] = 0
    return shard


@lru_cache(maxsize=4096)   # a training cell distributes its batch on every step
def shard_index(layout: TensorLayout, rank: int) -> tuple[tuple[slice, ...], bool]:
    """Where ``rank``'s shard sits in the global array, and whether it holds zeros (off
    coordinate 0 of a partial axis): what :func:`take_shard` takes."""
    coord = layout.mesh.coordinate(rank) if layout.partial else ()
    return layout.slices(rank), any(coord[a] for a in layout.partial_axes) if coord else False


def assemble(shards_by_rank: Mapping[int, np.ndarray] | Sequence[np.ndarray],
             layout: TensorLayout) -> np.ndarray:
    """The global array from every rank's shard (partial axes summed, replicas checked equal)."""
    shards = dict(enumerate(shards_by_rank)) if not isinstance(shards_by_rank, Mapping) \
        else dict(shards_by_rank)
    missing = [r for r in range(layout.device_num) if r not in shards]
    if missing:
        raise ValueError(f"assemble: no shard for ranks {missing} of layout {layout}")
    first = shards[0]
    out = np.zeros(layout.shape, dtype=first.dtype)
    local = layout.local_shape()
    for r in range(layout.device_num):
        if tuple(shards[r].shape) != local:
            raise ValueError(f"assemble: rank {r}'s shard has shape {shards[r].shape}, layout "
                             f"{layout} gives {local}")
        coord = layout.mesh.coordinate(r)
        if any(coord[a] for a in layout.replica_axes):
            continue
        out[layout.slices(r)] += shards[r]
    return out
