"""simpar.mesh.DeviceMesh: MindSpore's row-major device matrix, groups along axes, bad input.

Single process: no MPI is started here.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simpar.mesh import DeviceMesh

matrices = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


# ---------------------------------------------------------------- MindSpore's convention


@pytest.mark.parametrize(("dev_matrix", "rank", "coordinate"), [
    ((2, 1, 4), 5, (1, 0, 1)),          # the example in MindSpore's docs
    ((2, 1, 4), 0, (0, 0, 0)),
    ((2, 1, 4), 3, (0, 0, 3)),
    ((2, 1, 4), 4, (1, 0, 0)),
    ((2, 1, 4), 7, (1, 0, 3)),
    ((2, 4), 6, (1, 2)),
    ((4, 2), 6, (3, 0)),
    ((8,), 5, (5,)),
    ((2, 2, 2), 6, (1, 1, 0)),
    ((3, 5), 14, (2, 4)),
])
def test_coordinate_is_row_major_last_axis_fastest(
        dev_matrix: tuple[int, ...], rank: int, coordinate: tuple[int, ...]) -> None:
    mesh = DeviceMesh(dev_matrix)
    assert mesh.coordinate(rank) == coordinate
    assert mesh.rank_of(coordinate) == rank


def test_every_rank_of_2_1_4_in_order() -> None:
    mesh = DeviceMesh([2, 1, 4])
    assert [mesh.coordinate(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (1, 0, 0), (1, 0, 1), (1, 0, 2), (1, 0, 3)]


@given(matrices, st.data())
def test_coordinate_rank_of_round_trip(dev_matrix: tuple[int, ...], data: st.DataObject) -> None:
    mesh = DeviceMesh(dev_matrix)
    assert mesh.size == math.prod(dev_matrix)
    assert mesh.ndim == len(dev_matrix)
    coords = [mesh.coordinate(r) for r in range(mesh.size)]
    # Row-major order is exactly lexicographic order of the coordinates.
    assert coords == list(itertools.product(*(range(d) for d in dev_matrix)))
    assert [mesh.rank_of(c) for c in coords] == list(range(mesh.size))
    assert all(isinstance(c, int) for coord in coords for c in coord)
    rank = data.draw(st.integers(0, mesh.size - 1))
    assert mesh.rank_of(list(mesh.coordinate(rank))) == rank
    assert np.ravel_multi_index(mesh.coordinate(rank), dev_matrix) == rank


def test_constructor_forms_and_value_semantics() -> None:
    assert DeviceMesh(8).device_matrix == (8,)
    assert DeviceMesh(np.int64(4)).device_matrix == (4,)
    assert DeviceMesh([np.int32(2), 4]).device_matrix == (2, 4)
    assert all(type(d) is int for d in DeviceMesh([np.int32(2), 4]).device_matrix)
    assert DeviceMesh([2, 1, 4]) == DeviceMesh((2, 1, 4))
    assert hash(DeviceMesh([2, 1, 4])) == hash(DeviceMesh((2, 1, 4)))
    assert DeviceMesh((2, 4)) != DeviceMesh((4, 2))
    assert str(DeviceMesh((2, 1, 4))) == "DeviceMesh(2, 1, 4)"
    assert len({DeviceMesh((2, 4)), DeviceMesh([2, 4]), DeviceMesh((8,))}) == 2
    mesh = DeviceMesh((2, 4))
    with pytest.raises(AttributeError):
        mesh.device_matrix = (8,)  # type: ignore[misc]


def test_docstring_examples() -> None:
    import doctest

    import simpar.mesh

    result = doctest.testmod(simpar.mesh, verbose=False)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- groups along axes


def test_groups_of_2x4() -> None:
    mesh = DeviceMesh((2, 4))
    assert mesh.groups((1,)) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert mesh.groups((0,)) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.groups((0, 1)) == [tuple(range(8))]
    assert mesh.groups(()) == [(r,) for r in range(8)]
    assert mesh.groups([1]) == mesh.groups((1,))


def test_groups_of_2x1x4() -> None:
    mesh = DeviceMesh((2, 1, 4))
    assert mesh.groups((2,)) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert mesh.groups((1,)) == [(r,) for r in range(8)]
    assert mesh.groups((0,)) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.groups((0, 2)) == [tuple(range(8))]
    assert mesh.groups((0, 1)) == [(0, 4), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize(("rank", "axes", "group"), [
    (5, (1,), (4, 5, 6, 7)),
    (5, (0,), (1, 5)),
    (5, (0, 1), (0, 1, 2, 3, 4, 5, 6, 7)),
    # Order is row-major over the axes in the order given: the first axis given is outermost.
    (5, (1, 0), (0, 4, 1, 5, 2, 6, 3, 7)),
    (5, (), (5,)),
    (2, (0,), (2, 6)),
    (6, (1,), (4, 5, 6, 7)),
])
def test_group_of_2x4_and_its_order(rank: int, axes: tuple[int, ...],
                                    group: tuple[int, ...]) -> None:
    assert DeviceMesh((2, 4)).group_of(rank, axes) == group


def test_group_of_accepts_any_iterable_of_axes() -> None:
    mesh = DeviceMesh((2, 4))
    assert mesh.group_of(5, [1]) == mesh.group_of(5, iter([1])) == mesh.group_of(5, (np.int64(1),))


@given(matrices, st.data())
def test_groups_along_every_subset_of_axes(dev_matrix: tuple[int, ...],
                                           data: st.DataObject) -> None:
    mesh = DeviceMesh(dev_matrix)
    n = len(dev_matrix)
    subsets = [s for k in range(n + 1) for s in itertools.combinations(range(n), k)]
    axes = data.draw(st.sampled_from(subsets))
    axes = tuple(data.draw(st.permutations(axes)))
    groups = mesh.groups(axes)
    size = math.prod(dev_matrix[a] for a in axes)
    # A partition of all ranks into equal groups, sorted by first member.
    assert sorted(r for g in groups for r in g) == list(range(mesh.size))
    assert all(len(g) == size for g in groups)
    assert len(groups) == mesh.size // size
    assert [min(g) for g in groups] == sorted(min(g) for g in groups)
    fixed = [a for a in range(n) if a not in axes]
    for g in groups:
        coords = [mesh.coordinate(r) for r in g]
        # Members share every coordinate off the axes, and run row-major over the axes given.
        assert len({tuple(c[a] for a in fixed) for c in coords}) == 1
        assert [tuple(c[a] for a in axes) for c in coords] == list(
            itertools.product(*(range(dev_matrix[a]) for a in axes)))
        for r in g:
            assert mesh.group_of(r, axes) == g


# ---------------------------------------------------------------- tensor-map values <-> axes


def test_axis_of_map_counts_from_the_right() -> None:
    mesh = DeviceMesh((2, 1, 4))
    assert [mesh.axis_of_map(v) for v in (0, 1, 2)] == [2, 1, 0]
    assert [mesh.map_of_axis(a) for a in (0, 1, 2)] == [2, 1, 0]
    assert DeviceMesh((8,)).axis_of_map(0) == 0
    # MindSpore's example: dev_matrix [2,1,4], tensor_map [2,0] -> dims cut by axes 0 and 2,
    # so dim 0 is cut dev_matrix[0] = 2 ways and dim 1 dev_matrix[2] = 4 ways.
    assert [mesh.device_matrix[mesh.axis_of_map(v)] for v in (2, 0)] == [2, 4]


@given(matrices)
def test_axis_of_map_and_map_of_axis_are_inverse(dev_matrix: tuple[int, ...]) -> None:
    mesh = DeviceMesh(dev_matrix)
    for a in range(mesh.ndim):
        assert mesh.axis_of_map(mesh.map_of_axis(a)) == a
        assert mesh.map_of_axis(a) == mesh.ndim - 1 - a


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("value", "words"), [
    (None, ["device_matrix", "sequence of ints", "None"]),
    (2.0, ["device_matrix", "sequence of ints", "2.0"]),
    ({2: 4}, ["device_matrix", "sequence of ints"]),
    (iter([2, 4]), ["device_matrix", "sequence of ints"]),
    ("24", ["device_matrix", "ints", "'2'"]),
    ((2, 4.0), ["device_matrix", "ints", "4.0"]),
    ((2, True), ["device_matrix", "ints", "True"]),
    ((2, None), ["device_matrix", "ints", "None"]),
    (True, ["device_matrix", "ints", "True"]),
])
def test_device_matrix_type_errors(value: object, words: list[str]) -> None:
    with pytest.raises(TypeError) as info:
        DeviceMesh(value)  # type: ignore[arg-type]
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize(("value", "words"), [
    ((), ["device_matrix", "at least one axis"]),
    ([], ["device_matrix", "at least one axis"]),
    ((2, 0), ["device_matrix", ">= 1", "0", "[2, 0]"]),
    ((-2, 4), ["device_matrix", ">= 1", "-2"]),
    (0, ["device_matrix", ">= 1", "0"]),
])
def test_device_matrix_value_errors(value: object, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        DeviceMesh(value)  # type: ignore[arg-type]
    for w in words:
        assert w in str(info.value)


MESH = DeviceMesh((2, 1, 4))


@pytest.mark.parametrize(("call", "words"), [
    (lambda: MESH.coordinate(8), ["rank 8", "out of range", "[2, 1, 4]", "8 devices"]),
    (lambda: MESH.coordinate(-1), ["rank -1", "out of range"]),
    (lambda: MESH.rank_of((2, 0, 0)), ["coordinate (2, 0, 0)", "not on device matrix"]),
    (lambda: MESH.rank_of((1, 0)), ["coordinate (1, 0)", "[2, 1, 4]"]),
    (lambda: MESH.rank_of((0, 0, 0, 0)), ["coordinate (0, 0, 0, 0)"]),
    (lambda: MESH.rank_of((-1, 0, 0)), ["coordinate (-1, 0, 0)"]),
    (lambda: MESH.group_of(5, (3,)), ["device_axis 3", "out of range", "allowed 0..2"]),
    (lambda: MESH.group_of(5, (-1,)), ["device_axis -1", "out of range"]),
    (lambda: MESH.group_of(9, (0,)), ["rank 9", "out of range"]),
    (lambda: MESH.group_of(5, (0, 0)), ["distinct", "[0, 0]"]),
    (lambda: MESH.groups((2, 2)), ["distinct", "[2, 2]"]),
    (lambda: MESH.groups((5,)), ["device_axis 5"]),
    (lambda: MESH.axis_of_map(3), ["tensor map value 3", "out of range", "allowed 0..2"]),
    (lambda: MESH.axis_of_map(-1), ["tensor map value -1", "not split"]),
    (lambda: MESH.map_of_axis(3), ["device_axis 3", "out of range"]),
    (lambda: MESH.map_of_axis(-1), ["device_axis -1"]),
])
def test_value_errors(call: object, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        call()  # type: ignore[operator]
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize(("call", "words"), [
    (lambda: MESH.coordinate(1.0), ["rank", "int", "1.0"]),
    (lambda: MESH.coordinate("1"), ["rank", "int", "'1'"]),
    (lambda: MESH.coordinate(True), ["rank", "int", "True"]),
    (lambda: MESH.coordinate(None), ["rank", "int", "None"]),
    (lambda: MESH.rank_of(5), ["coordinate", "sequence of ints", "5"]),
    (lambda: MESH.rank_of("101"), ["coordinate", "sequence of ints"]),
    (lambda: MESH.rank_of((1.0, 0, 1)), ["coordinate", "int", "1.0"]),
    (lambda: MESH.rank_of((1, None, 1)), ["coordinate", "int", "None"]),
    (lambda: MESH.group_of(5, 1), ["device_axes", "iterable of ints", "1"]),
    (lambda: MESH.group_of(5, "1"), ["device_axes", "iterable of ints"]),
    (lambda: MESH.group_of(5, (1.7,)), ["device_axis", "int", "1.7"]),
    (lambda: MESH.group_of(5, ("2",)), ["device_axis", "int", "'2'"]),
    (lambda: MESH.group_of(5, (True,)), ["device_axis", "int", "True"]),
    (lambda: MESH.group_of(5.0, (1,)), ["rank", "int", "5.0"]),
    (lambda: MESH.groups(None), ["device_axes", "iterable of ints", "None"]),
    (lambda: MESH.axis_of_map(0.0), ["tensor map value", "int", "0.0"]),
    (lambda: MESH.axis_of_map("0"), ["tensor map value", "int", "'0'"]),
    (lambda: MESH.map_of_axis(1.5), ["device_axis", "int", "1.5"]),
    (lambda: MESH.map_of_axis(None), ["device_axis", "int", "None"]),
])
def test_type_errors(call: object, words: list[str]) -> None:
    with pytest.raises(TypeError) as info:
        call()  # type: ignore[operator]
    for w in words:
        assert w in str(info.value)
