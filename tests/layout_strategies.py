"""Hypothesis strategies for random tensor layouts, shared by the layout and redistribution tests.

A layout is drawn as a device matrix plus, for every device axis, where it goes: onto one tensor
dimension (appended to that dimension's split, so the first axis drawn is the outer one), into
the partial axes, or nowhere (a replica axis). Axes are drawn as mesh axes (counted from the
left) for :meth:`TensorLayout.from_dim_axes`. Shapes are the smallest the cuts allow, times a
small factor. Every strategy draws in a fixed order, so a derandomized run draws the same layouts
on every MPI rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import strategies as st

from simpar.layout import TensorLayout

__all__ = ["device_matrices", "factorizations", "layout_pairs", "layout_structure", "layouts"]

DimAxes = list[list[int]]


def factorizations(total: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered way to write ``total`` as a product of ``k`` factors (1 allowed)."""
    if k == 1:
        return [(total,)]
    return [(d, *rest) for d in range(1, total + 1) if total % d == 0
            for rest in factorizations(total // d, k - 1)]


@st.composite
def device_matrices(draw: st.DrawFn, device_num: int | None = None) -> tuple[int, ...]:
    """A device matrix of 1 to 3 axes over ``device_num`` devices (default: a few counts)."""
    total = device_num if device_num is not None else draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    k = draw(st.integers(1, 3))
    return draw(st.sampled_from(factorizations(total, k)))


def _place_axes(draw: st.DrawFn, n: int, ndim: int, partial_ok: bool) -> tuple[DimAxes, list[int]]:
    """Per tensor dim the device axes that split it (outer first), and the partial axes."""
    dims: DimAxes = [[] for _ in range(ndim)]
    partial = []
    for axis in draw(st.permutations(range(n))):
        where = draw(st.integers(-2 if partial_ok else -1, ndim - 1))
        if where >= 0:
            dims[where].append(axis)
        elif where == -2:
            partial.append(axis)
    return dims, partial


def _cuts(dm: tuple[int, ...], dims: DimAxes) -> list[int]:
    return [math.prod(dm[a] for a in axes) for axes in dims]


@st.composite
def layouts(draw: st.DrawFn, allow_partial: bool = True) -> TensorLayout:
    """A layout of 1 to 4 dimensions on any of :func:`device_matrices`."""
    dm = draw(device_matrices())
    ndim = draw(st.integers(1, 4))
    dims, partial = _place_axes(draw, len(dm), ndim, allow_partial)
    shape = [c * draw(st.integers(1, 3)) for c in _cuts(dm, dims)]
    return TensorLayout.from_dim_axes(dm, dims, shape, partial)


@st.composite
def layout_structure(draw: st.DrawFn, device_num: int, ndim: int, partial_ok: bool
                     ) -> tuple[tuple[int, ...], DimAxes, list[int], list[int]]:
    """(device matrix, dim axes, partial axes, cuts) for a tensor of ``ndim`` dimensions on
    ``device_num`` devices; the caller picks a shape the cuts divide."""
    dm = draw(st.sampled_from([f for k in (1, 2, 3) for f in factorizations(device_num, k)]))
    dims, partial = _place_axes(draw, len(dm), ndim, partial_ok)
    return dm, dims, partial, _cuts(dm, dims)


@st.composite
def layout_pairs(draw: st.DrawFn, device_nums: Sequence[int] = (8, 4),
                 src_partial: bool = False, dst_partial: bool = False,
                 max_ndim: int = 4) -> tuple[TensorLayout, TensorLayout]:
    """(src, dst) of one shape on the same devices: the smallest shape that both layouts
    divide, times 1 or 2 on some dims."""
    p = draw(st.sampled_from(list(device_nums)))
    ndim = draw(st.integers(1, max_ndim))
    sdm, sdims, spart, scuts = draw(layout_structure(p, ndim, src_partial))
    ddm, ddims, dpart, dcuts = draw(layout_structure(p, ndim, dst_partial))
    shape = [math.lcm(a, b) * draw(st.integers(1, 2)) for a, b in zip(scuts, dcuts, strict=True)]
    return (TensorLayout.from_dim_axes(sdm, sdims, shape, spart),
            TensorLayout.from_dim_axes(ddm, ddims, shape, dpart))
