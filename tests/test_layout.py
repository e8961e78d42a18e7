"""simpar.layout: MindSpore's slicing rules pinned by worked examples, properties over random
layouts checked against an independent reference slicer, and every error a caller can hit."""

from __future__ import annotations

import math
import random
from itertools import product

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simpar.layout import (
    IndivisibleError,
    Layout,
    TensorLayout,
    _from_dim_axes,
    assemble,
    distribute,
)
from tests.layout_strategies import layouts

# ------------------------------------------------------------------ reference slicer
# Written from MindSpore's rule, independently of simpar: coordinates by repeated divmod
# (last device axis fastest), map value k names device axis n-1-k, a tuple is outer first.


def _ref_coordinate(rank: int, device_matrix: tuple[int, ...]) -> list[int]:
    coord = []
    for size in reversed(device_matrix):
        rank, c = divmod(rank, size)
        coord.append(c)
    return coord[::-1]


def _ref_slice(device_matrix: tuple[int, ...], tensor_map: tuple[object, ...],
               shape: tuple[int, ...], rank: int) -> tuple[tuple[int, int], ...]:
    n = len(device_matrix)
    coord = _ref_coordinate(rank, device_matrix)
    out = []
    for entry, size in zip(tensor_map, shape, strict=True):
        values = entry if isinstance(entry, tuple) else (() if entry == -1 else (entry,))
        index, parts = 0, 1
        for v in values:
            axis = n - 1 - v
            index = index * device_matrix[axis] + coord[axis]
            parts *= device_matrix[axis]
        step = size // parts
        out.append((index * step, (index + 1) * step))
    return tuple(out)


def _ranks_along(layout: TensorLayout, rank: int, axes: tuple[int, ...]) -> set[int]:
    me = _ref_coordinate(rank, layout.device_matrix)
    return {r for r in range(layout.device_num)
            if all(c == m or a in axes for a, (c, m) in
                   enumerate(zip(_ref_coordinate(r, layout.device_matrix), me, strict=True)))}


# ------------------------------------------------------------------ worked examples
def test_design_example_rank5_holds_rows_4_to_7_and_cols_4_to_7() -> None:
    lay = TensorLayout((2, 1, 4), (2, 0), (8, 16))
    assert lay.local_shape() == (4, 4)
    assert lay.cuts == (2, 4)
    assert lay.slice_of(5) == ((4, 8), (4, 8))
    assert lay.slices(5) == (slice(4, 8), slice(4, 8))
    assert lay.chunk_index(5) == (1, 1)
    assert lay.mesh.coordinate(5) == (1, 0, 1)
    for r in range(8):
        row, col = r // 4, r % 4
        assert lay.slice_of(r) == ((4 * row, 4 * row + 4), (4 * col, 4 * col + 4))
    g = np.arange(8 * 16).reshape(8, 16)
    np.testing.assert_array_equal(distribute(g, lay, 5), g[4:8, 4:8])


def test_matmul_strategy_2_1_by_1_4_maps_and_repeated_calculation() -> None:
    # MatMul().shard(((2, 1), (1, 4))): device matrix [2, 1, 4], A [2, 1], B [1, 0], out [2, 0].
    a = TensorLayout((2, 1, 4), (2, 1), (8, 6))
    b = TensorLayout((2, 1, 4), (1, 0), (6, 16))
    out = TensorLayout((2, 1, 4), (2, 0), (8, 16))
    assert (a.cuts, b.cuts, out.cuts) == ((2, 1), (1, 4), (2, 4))
    assert (a.local_shape(), b.local_shape(), out.local_shape()) == ((4, 6), (6, 4), (4, 4))
    # A ignores device axis 2 (size 4): ranks 4..7 compute with the same A rows.
    assert a.replica_axes == (2,)
    assert a.replica_group(5) == (4, 5, 6, 7)
    assert {a.slice_of(r) for r in (4, 5, 6, 7)} == {((4, 8), (0, 6))}
    # B ignores device axis 0 (size 2): ranks 1 and 5 hold the same B columns.
    assert b.replica_axes == (0,)
    assert b.replica_group(5) == (1, 5)
    assert b.slice_of(5) == ((0, 6), (4, 8)) == b.slice_of(1)
    # A map value naming a size-1 axis cuts like -1.
    assert a.slices(3) == TensorLayout((2, 1, 4), (2, -1), (8, 6)).slices(3)
    assert TensorLayout.from_strategy((2, 1, 4), (2, 4), (8, 16)) == out


def test_matmul_strategy_splitting_k_gives_a_partial_output() -> None:
    # MatMul().shard(((2, 4), (4, 1))): device matrix [2, 4, 1]; the output is partial over the
    # k axis (map value 1: device axis 1 of 3, counted from the right like the tensor map), so
    # ranks {0,1,2,3} and {4,5,6,7} each sum one output block.
    a = TensorLayout((2, 4, 1), (2, 1), (8, 8))
    b = TensorLayout((2, 4, 1), (1, 0), (8, 4))
    out = TensorLayout((2, 4, 1), (2, 0), (8, 4), partial=(1,))
    assert a.cuts == (2, 4) and b.cuts == (4, 1)
    assert out.is_partial and out.partial == (1,) and out.partial_axes == (1,)
    assert out.partial_group(2) == (0, 1, 2, 3)
    assert out.partial_group(5) == (4, 5, 6, 7)
    assert out.replica_axes == ()  # map value 0 names the size-1 axis 2
    assert out.local_shape() == (4, 4)


def test_cake_cutting() -> None:
    # A (4, 8) cake cut 2 ways on dim 0 gives (2, 8) pieces; 4 ways on dim 1, (4, 2) pieces.
    rows = TensorLayout.from_strategy((2,), (2, 1), (4, 8))
    cols = TensorLayout.from_strategy((4,), (1, 4), (4, 8))
    assert rows.tensor_map == (0, -1) and rows.local_shape() == (2, 8)
    assert cols.tensor_map == (-1, 0) and cols.local_shape() == (4, 2)
    cake = np.arange(32).reshape(4, 8)
    np.testing.assert_array_equal(distribute(cake, rows, 1), cake[2:4])
    np.testing.assert_array_equal(distribute(cake, cols, 3), cake[:, 6:8])


def test_tuple_map_splits_one_dimension_over_two_axes_outer_first() -> None:
    # Device matrix (2, 2, 2); dim 0 over device axes 0 then 1 (map values 2, 1): 4 row blocks.
    outer_first = TensorLayout((2, 2, 2), ((2, 1), 0), (8, 4))
    assert outer_first.cuts == (4, 2) and outer_first.local_shape() == (2, 2)
    # Rank 2 is at (0, 1, 0): row block 0*2 + 1 = 1.  Rank 6 at (1, 1, 0): block 3.
    assert outer_first.slice_of(2) == ((2, 4), (0, 2))
    assert outer_first.slice_of(6) == ((6, 8), (0, 2))
    assert outer_first.dim_axes == ((0, 1), (2,))
    # The other order: device axis 1 outer. Rank 2 now holds row block 1*2 + 0 = 2.
    inner_first = TensorLayout((2, 2, 2), ((1, 2), 0), (8, 4))
    assert inner_first.slice_of(2) == ((4, 6), (0, 2))
    assert inner_first.slice_of(6) == ((6, 8), (0, 2))
    assert inner_first.slice_of(4) == ((2, 4), (0, 2))
    # A one-element tuple is the plain value; an empty tuple is -1.
    assert TensorLayout((2, 4), ((1,), ()), (4, 4)).tensor_map == (1, -1)


def test_fully_replicated_and_fully_split() -> None:
    rep = TensorLayout((2, 4), (-1, -1), (4, 4))
    assert rep.replica_axes == (0, 1) and rep.local_shape() == (4, 4)
    assert rep.replica_group(3) == tuple(range(8))
    assert all(rep.slice_of(r) == ((0, 4), (0, 4)) for r in range(8))
    split = TensorLayout((2, 4), ((1, 0), -1), (16, 4))
    assert split.replica_axes == () and split.replica_group(3) == (3,)
    assert [split.slice_of(r)[0] for r in range(8)] == [(2 * r, 2 * r + 2) for r in range(8)]


def test_partial_layout_distribute_puts_the_value_on_coordinate_zero() -> None:
    lay = TensorLayout((2, 4), (-1, 0), (4, 8), partial=(1,))
    g = np.arange(32.0).reshape(4, 8)
    assert lay.partial_group(5) == (1, 5)
    np.testing.assert_array_equal(distribute(g, lay, 1), g[:, 2:4])
    np.testing.assert_array_equal(distribute(g, lay, 5), np.zeros((4, 2)))
    np.testing.assert_array_equal(assemble([distribute(g, lay, r) for r in range(8)], lay), g)
    # Any split of the value over the partial group assembles to the sum.
    shards = {r: np.full((4, 2), float(r)) for r in range(8)}
    total = assemble(shards, lay)
    np.testing.assert_array_equal(total[:, 0:2], np.full((4, 2), 0.0 + 4.0))
    np.testing.assert_array_equal(total[:, 6:8], np.full((4, 2), 3.0 + 7.0))


def test_partial_counts_device_axes_like_the_tensor_map() -> None:
    # On (2, 4), map value 1 is the size-2 axis (mesh axis 0), for tensor_map and partial alike.
    rows = TensorLayout((2, 4), (1, -1), (8, 8))
    assert rows.cuts == (2, 1) and rows.dim_axes == ((0,), ())
    summed = TensorLayout((2, 4), (-1, -1), (8, 8), partial=(1,))
    assert summed.partial == (1,) and summed.partial_axes == (0,)
    # Rank 5 is at (1, 1): it sums with rank 1 along the size-2 axis, the axis rows splits.
    assert summed.partial_group(5) == (1, 5)
    assert summed.partial_group(5) == rows.mesh.group_of(5, rows.dim_axes[0])
    assert summed.replica_axes == (1,) and summed.replica_group(5) == (4, 5, 6, 7)
    # Map value 0 is the size-4 axis: ranks 4..7 hold pending parts of one value.
    assert TensorLayout((2, 4), (-1, -1), (8, 8), partial=(0,)).partial_group(5) == (4, 5, 6, 7)
    # The same value cannot both split and be partial.
    with pytest.raises(ValueError, match=r"map value\(s\) \[1\] are both partial and splitting"):
        TensorLayout((2, 4), (1, -1), (8, 8), partial=(1,))
    assert str(summed) == "[2, 4]:[-1,-1] P[1] [8, 8]"
    assert summed.to_dict()["partial"] == [1]


def test_with_partial_counts_from_the_right_and_with_partial_axes_from_the_left() -> None:
    lay = TensorLayout((2, 1, 4), (-1, 0), (8, 8))
    assert lay.with_partial((2,)) == lay.with_partial_axes((0,))
    assert lay.with_partial((2,)).partial == (2,) and lay.with_partial((2,)).partial_axes == (0,)
    assert lay.with_partial_axes((1, 0)).partial == (1, 2)
    assert lay.with_partial_axes((0,)).with_partial(()) == lay
    assert TensorLayout.from_dim_axes((2, 1, 4), [(), (2,)], (8, 8), partial_axes=(0,)) \
        == lay.with_partial((2,))
    with pytest.raises(ValueError, match=r"partial_axes \(3,\) names device axis 3; allowed "
                                         r"0\.\.2 \(counted from the left\)"):
        lay.with_partial_axes((3,))
    with pytest.raises(ValueError, match="partial_axes .* names device axis -1"):
        TensorLayout.from_dim_axes((2, 4), [(), ()], (8, 8), partial_axes=(-1,))
    with pytest.raises(TypeError, match="partial_axes entries must be an int"):
        lay.with_partial_axes(("0",))  # type: ignore[arg-type]


@pytest.mark.parametrize("partial, value", [((2,), "value 2 is out of range"),
                                            ((0, -1), "value -1 is out of range"),
                                            ((1, 1), "value 1 is repeated")])
def test_bad_partial_entry_is_named(partial: tuple[int, ...], value: str) -> None:
    with pytest.raises(ValueError) as info:
        TensorLayout((2, 4), (-1, -1), (8, 8), partial=partial)
    msg = str(info.value)
    assert f"partial {partial}: {value}" in msg, msg
    assert "in 0..1, counted from the right like the tensor map, for device matrix [2, 4]" in msg


def test_ranks_holding_and_chunk_index() -> None:
    lay = TensorLayout((2, 1, 4), (2, 0), (8, 16))
    assert lay.ranks_holding((5, 6)) == (5,)
    assert lay.ranks_holding((0, 15)) == (3,)
    a = TensorLayout((2, 1, 4), (2, 1), (8, 6))
    assert a.ranks_holding((5, 0)) == (4, 5, 6, 7)
    assert a.chunk_index(6) == (1, 0)
    p = TensorLayout((2, 4), (-1, 0), (4, 8), partial=(1,))
    assert p.ranks_holding((0, 3)) == (1, 5)


def test_from_strategy_picks_axes_left_to_right() -> None:
    assert TensorLayout.from_strategy((2, 4), (2, 4), (4, 8)).tensor_map == (1, 0)
    assert TensorLayout.from_strategy((2, 4), (8,), (16,)).tensor_map == ((1, 0),)
    # A cut of 4 over (2, 2, 2) takes the first two axes, outer first.
    lay = TensorLayout.from_strategy((2, 2, 2), (4, 2), (8, 4))
    assert lay.tensor_map == ((2, 1), 0)
    # Repeated calculation: an axis no cut uses stays a replica axis, wherever it sits.
    left = TensorLayout.from_strategy((4, 2), (2, 1), (8, 8))
    assert left.tensor_map == (0, -1) and left.replica_axes == (0,)
    right = TensorLayout.from_strategy((2, 4), (2, 1), (8, 8))
    assert right.tensor_map == (1, -1) and right.replica_axes == (1,)
    # Size-1 axes are skipped.
    assert TensorLayout.from_strategy((2, 1, 4), (1, 8), (4, 16)).tensor_map == (-1, (2, 0))
    assert TensorLayout.from_strategy((8,), (1, 1), (4, 4)).replica_axes == (0,)


def test_to_dict_is_mindspore_shaped_and_round_trips() -> None:
    lay = TensorLayout((2, 2, 2), ((2, 1), -1), (8, 4), partial=(0,))
    d = lay.to_dict()
    assert d == {"device_matrix": [2, 2, 2], "tensor_map": [[2, 1], -1], "shape": [8, 4],
                 "partial": [0]}
    assert lay.partial_axes == (2,)
    assert TensorLayout.from_dict(d) == lay
    # A MindSpore layout item has no shape or partial: pass the shape.
    ms = {"dev_matrix_unused": 0, "device_matrix": [2, 4], "tensor_map": [1, -1]}
    assert TensorLayout.from_dict(ms, shape=(4, 4)) == TensorLayout((2, 4), (1, -1), (4, 4))


def test_layouts_are_hashable_values_printed_on_one_line() -> None:
    a = TensorLayout([2, 4], [1, (0,)], [4, 8])
    b = TensorLayout((2, 4), (1, 0), (4, 8))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.tensor_map == (1, 0) and a.shape == (4, 8) and a.device_matrix == (2, 4)
    text = str(TensorLayout((2, 2, 2), ((2, 1), -1), (8, 4), partial=(0,)))
    assert "\n" not in text and "(2,1)" in text and "P[0]" in text
    with pytest.raises(AttributeError):
        a.shape = (8, 8)  # type: ignore[misc]
    assert a.with_shape((8, 8)).shape == (8, 8)
    assert a.with_partial(()) == a


def test_numpy_integers_are_accepted() -> None:
    lay = TensorLayout(np.array([2, 4]), [np.int64(1), -1], np.array([4, 8]))  # type: ignore[arg-type]
    assert lay == TensorLayout((2, 4), (1, -1), (4, 8))
    assert all(type(v) is int for v in lay.shape + lay.device_matrix)


# ------------------------------------------------------------------ alias API
def test_layout_alias_api() -> None:
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    assert layout("dp", "mp").to_dict()["tensor_map"] == [2, 0]
    d = layout("dp", ("sp", "mp")).to_dict()
    assert d == {"device_matrix": (2, 2, 2), "tensor_map": [2, [1, 0]],
                 "interleaved_parallel": False, "alias_name": ("dp", "sp", "mp")}
    assert layout("None", "sp").tensor_map == (-1, 1)
    assert layout(("mp",), "None").tensor_map == (0, -1)
    lay = layout("dp", ("sp", "mp")).layout_for((4, 8))
    assert lay == TensorLayout((2, 2, 2), (2, (1, 0)), (4, 8))
    assert lay.slice_of(3) == ((0, 2), (6, 8))


def test_layout_alias_partial() -> None:
    layout = Layout((2, 4), ("dp", "mp"))
    lay = layout("None", "mp").layout_for((8, 8), partial=("dp",))
    assert lay == TensorLayout((2, 4), (-1, 0), (8, 8), partial=(1,))
    assert lay.partial_axes == (0,) and lay.partial_group(5) == (1, 5)
    both = Layout((2, 2, 2), ("dp", "sp", "mp"))("sp", "None").layout_for((4, 4), ("mp", "dp"))
    assert both.partial == (0, 2) and both.partial_axes == (0, 2)
    assert layout("dp", "mp").layout_for((8, 8)) == layout("dp", "mp").layout_for((8, 8), ())


@pytest.mark.parametrize("partial, exc, words", [
    (("tp",), ValueError, r"'tp' is not one of \('dp', 'mp'\)"),
    (("dp", "dp"), ValueError, "'dp' is listed more than once in partial"),
    (("mp",), ValueError, "'mp' both splits a dimension"),
    ((1,), TypeError, "partial entries must be alias names"),
    ("dp", TypeError, "partial must be a tuple of alias names, got the string 'dp'"),
])
def test_layout_alias_partial_errors(partial: object, exc: type[Exception], words: str) -> None:
    with pytest.raises(exc, match=words):
        Layout((2, 4), ("dp", "mp"))("None", "mp").layout_for((8, 8), partial)  # type: ignore[arg-type]


@pytest.mark.parametrize("args, exc, words", [
    (([2, 2], ("a", "b")), TypeError, "device_matrix must be a tuple"),
    (((2, 2), ["a", "b"]), TypeError, "alias_name must be a tuple"),
    (((2, 2), ("a",)), ValueError, "has 2 axes but alias_name"),
    (((2, "2"), ("a", "b")), TypeError, "device_matrix entries must be int"),
    (((2, True), ("a", "b")), TypeError, "device_matrix entries must be int"),
    (((2, 2), ("a", 1)), TypeError, "alias_name entries must be str"),
    (((2, 2), ("a", "")), ValueError, "empty"),
    (((2, 2), ("a", "None")), ValueError, "'None' is reserved"),
    (((2, 2), ("a", "a")), ValueError, "duplicate"),
    (((2, 0), ("a", "b")), ValueError, ">= 1"),
])
def test_layout_constructor_errors(args: tuple[object, object], exc: type[Exception],
                                   words: str) -> None:
    with pytest.raises(exc, match=words):
        Layout(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("entries, exc, words", [
    (("dp", "dp"), ValueError, "'dp' is used more than once"),
    (("dp", ("sp", "dp")), ValueError, "'dp' is used more than once"),
    (("tp",), ValueError, r"'tp' is not one of \('dp', 'sp', 'mp'\)"),
    ((("None", "dp"),), ValueError, "'None' cannot be combined"),
    ((None,), TypeError, "alias names"),
    ((0,), TypeError, "alias names"),
    ((("dp", 1),), TypeError, "alias names"),
])
def test_layout_call_errors(entries: tuple[object, ...], exc: type[Exception], words: str) -> None:
    with pytest.raises(exc, match=words):
        Layout((2, 2, 2), ("dp", "sp", "mp"))(*entries)  # type: ignore[arg-type]


def test_layout_needs_a_tensor_map_before_use() -> None:
    layout = Layout((2, 4), ("dp", "mp"))
    with pytest.raises(ValueError, match="call the layout with a tensor map"):
        layout.to_dict()
    with pytest.raises(ValueError, match="call the layout with a tensor map"):
        layout.layout_for((4, 4))
    with pytest.raises(IndivisibleError, match="cannot be split into 4 parts"):
        layout("None", "mp").layout_for((4, 6))


# ------------------------------------------------------------------ TensorLayout errors
def test_indivisible_dimension_message() -> None:
    with pytest.raises(IndivisibleError) as info:
        TensorLayout((4,), (-1, 0), (8, 6))
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "dimension 1 of shape (8, 6) cannot be split into 4 parts" in msg
    assert "6 is not a multiple of 4" in msg
    with pytest.raises(IndivisibleError, match="dimension 0 of shape \\(6,\\) cannot be split "
                                               "into 4 parts"):
        TensorLayout((2, 2), ((1, 0),), (6,))


@pytest.mark.parametrize("dm, tmap, shape, partial, exc, words", [
    ((2, 4), (2, -1), (8, 8), (), ValueError, "value 2 is out of range"),
    ((2, 4), (-2, -1), (8, 8), (), ValueError, "value -2 is out of range"),
    ((2, 4), ((0, -1), -1), (8, 8), (), ValueError, "outside 0..1"),
    ((2, 4), ((0, 2), -1), (8, 8), (), ValueError, "outside 0..1"),
    ((2, 4), (0, 0), (8, 8), (), ValueError, "uses map value(s) [0] more than once"),
    ((2, 4), ((1, 0), 1), (8, 8), (), ValueError, "more than once"),
    ((2, 4), (1, -1), (8, 8), (1,), ValueError, "both partial and splitting"),
    ((2, 4), ((1, 0), -1), (8, 8), (0,), ValueError, "both partial and splitting"),
    ((2, 4), (-1, -1), (8, 8), (2,), ValueError, "distinct device axes in 0..1"),
    ((2, 4), (-1, -1), (8, 8), (0, 0), ValueError, "distinct device axes"),
    ((8,), (0,), (8, 8), (), ValueError, "has 1 entries but shape (8, 8) has 2"),
    ((8,), (0, -1, -1), (8, 8), (), ValueError, "has 3 entries"),
    ((8,), ("0", -1), (8, 8), (), TypeError, "must be an int"),
    ((8,), (True, -1), (8, 8), (), TypeError, "must be an int"),
    ((8,), (0.0, -1), (8, 8), (), TypeError, "must be an int"),
    ((8,), (0, -1), (8.0, 8), (), TypeError, "shape entries must be an int"),
    ((8,), (0, -1), (8, -8), (), ValueError, "must be >= 0"),
    ((8,), (-1, -1), (8, 8), ("0",), TypeError, "partial entries must be an int"),
    ((0, 8), (0, -1), (8, 8), (), ValueError, ">= 1"),
    ((), (), (), (), ValueError, "at least one axis"),
    ((2, "4"), (0, -1), (8, 8), (), TypeError, "ints"),
])
def test_tensor_layout_errors(dm: object, tmap: object, shape: object, partial: object,
                              exc: type[Exception], words: str) -> None:
    with pytest.raises(exc) as info:
        TensorLayout(dm, tmap, shape, partial)  # type: ignore[arg-type]
    assert words in str(info.value), str(info.value)


def test_per_rank_query_errors() -> None:
    lay = TensorLayout((2, 4), (1, 0), (4, 8))
    for bad in (-1, 8):
        with pytest.raises(ValueError, match=f"rank {bad} is out of range"):
            lay.slice_of(bad)
        with pytest.raises(ValueError, match="out of range"):
            lay.replica_group(bad)
        with pytest.raises(ValueError, match="out of range"):
            lay.partial_group(bad)
    with pytest.raises(ValueError, match="outside shape"):
        lay.ranks_holding((4, 0))
    with pytest.raises(ValueError, match="outside shape"):
        lay.ranks_holding((0,))


def test_constructor_helper_errors() -> None:
    with pytest.raises(ValueError, match="do not fit device matrix"):
        TensorLayout.from_strategy((2, 4), (3, 1), (6, 4))
    with pytest.raises(ValueError, match="cuts must be >= 1"):
        TensorLayout.from_strategy((2, 4), (0, 1), (6, 4))
    with pytest.raises(TypeError, match="cuts entries must be an int"):
        TensorLayout.from_strategy((2, 4), (2.0, 1), (6, 4))  # type: ignore[arg-type]
    with pytest.raises(IndivisibleError):
        TensorLayout.from_strategy((2, 4), (2, 4), (6, 6))
    with pytest.raises(ValueError, match="needs key 'tensor_map'"):
        TensorLayout.from_dict({"device_matrix": [8]})
    with pytest.raises(ValueError, match="pass shape="):
        TensorLayout.from_dict({"device_matrix": [8], "tensor_map": [0]})


def test_distribute_and_assemble_errors() -> None:
    lay = TensorLayout((2, 4), (1, 0), (4, 8))
    with pytest.raises(ValueError, match="global array has shape"):
        distribute(np.zeros((4, 4)), lay, 0)
    shards = [np.zeros((2, 2)) for _ in range(8)]
    with pytest.raises(ValueError, match=r"no shard for ranks \[7\]"):
        assemble(shards[:7], lay)
    shards[3] = np.zeros((2, 3))
    with pytest.raises(ValueError, match="rank 3's shard has shape"):
        assemble(shards, lay)


# ------------------------------------------------------------------ properties
@given(layouts())
def test_slices_match_the_reference_slicer(lay: TensorLayout) -> None:
    for r in range(lay.device_num):
        assert lay.slice_of(r) == _ref_slice(lay.device_matrix, lay.tensor_map, lay.shape, r)
        assert tuple(b - a for a, b in lay.slice_of(r)) == lay.local_shape()
        assert all(0 <= i < c for i, c in zip(lay.chunk_index(r), lay.cuts, strict=True))
    assert math.prod(lay.cuts) * math.prod(lay.device_matrix[a] for a in lay.replica_axes) \
        * math.prod(lay.device_matrix[a] for a in lay.partial_axes) == lay.device_num


@given(layouts())
def test_every_element_is_held_by_exactly_one_piece(lay: TensorLayout) -> None:
    """The distinct slices tile the tensor; ranks sharing a slice are the replica x partial
    group."""
    owners: dict[tuple[tuple[int, int], ...], set[int]] = {}
    for r in range(lay.device_num):
        owners.setdefault(lay.slice_of(r), set()).add(r)
    assert len(owners) == math.prod(lay.cuts)
    count = np.zeros(lay.shape, dtype=np.int64)
    for sl in owners:
        count[tuple(slice(a, b) for a, b in sl)] += 1
    assert (count == 1).all()
    for r in range(lay.device_num):
        same = owners[lay.slice_of(r)]
        assert same == _ranks_along(lay, r, lay.replica_axes + lay.partial_axes)
        assert set(lay.replica_group(r)) == _ranks_along(lay, r, lay.replica_axes)
        assert set(lay.partial_group(r)) == _ranks_along(lay, r, lay.partial_axes)
        assert r in lay.replica_group(r) and r in lay.partial_group(r)


@given(layouts(), st.data())
def test_ranks_holding_matches_slices(lay: TensorLayout, data: st.DataObject) -> None:
    index = tuple(data.draw(st.integers(0, s - 1)) for s in lay.shape)
    want = tuple(r for r in range(lay.device_num)
                 if all(a <= i < b for i, (a, b) in zip(index, lay.slice_of(r), strict=True)))
    assert lay.ranks_holding(index) == want


@given(layouts(), st.sampled_from([np.float64, np.float32, np.int64]))
def test_distribute_then_assemble_is_the_identity(lay: TensorLayout, dtype: type) -> None:
    g: np.ndarray = np.arange(math.prod(lay.shape)).reshape(lay.shape).astype(dtype)
    shards = [distribute(g, lay, r) for r in range(lay.device_num)]
    for r, s in enumerate(shards):
        assert s.shape == lay.local_shape() and s.dtype == g.dtype
        if not lay.partial:
            np.testing.assert_array_equal(s, g[lay.slices(r)])
    out = assemble(shards, lay)
    assert out.dtype == g.dtype
    np.testing.assert_array_equal(out, g)
    # Shards are copies: writing to one leaves the global array alone.
    shards[0][...] = 0
    np.testing.assert_array_equal(assemble(
        {r: distribute(g, lay, r) for r in range(lay.device_num)}, lay), g)


@given(layouts(), st.integers(0, 2**31 - 1))
def test_partial_shards_that_sum_to_the_value_assemble_to_it(lay: TensorLayout,
                                                             seed: int) -> None:
    """Random pending parts (the same on replicas) whose sum over each partial group is G."""
    rng = np.random.default_rng(seed)
    g = rng.integers(-50, 50, size=lay.shape)
    coords = [_ref_coordinate(r, lay.device_matrix) for r in range(lay.device_num)]
    parts: dict[tuple[object, ...], np.ndarray] = {}
    for r in range(lay.device_num):
        key = (lay.chunk_index(r), tuple(coords[r][a] for a in lay.partial_axes))
        if key not in parts:
            parts[key] = rng.integers(-50, 50, size=lay.local_shape())
    shards = {}
    for r in range(lay.device_num):
        pcoord = tuple(coords[r][a] for a in lay.partial_axes)
        if any(pcoord):
            shards[r] = parts[(lay.chunk_index(r), pcoord)]
        else:
            others = [parts[(lay.chunk_index(r), pc)] for pc in
                      product(*(range(lay.device_matrix[a]) for a in lay.partial_axes))
                      if any(pc)]
            shards[r] = g[lay.slices(r)] - sum(others, np.zeros(lay.local_shape(), np.int64))
    np.testing.assert_array_equal(assemble(shards, lay), g)


@given(layouts())
def test_dict_round_trip_and_value_semantics(lay: TensorLayout) -> None:
    assert TensorLayout.from_dict(lay.to_dict()) == lay
    rebuilt = TensorLayout(list(lay.device_matrix), list(lay.tensor_map), list(lay.shape),
                           list(lay.partial))
    assert rebuilt == lay and hash(rebuilt) == hash(lay)
    assert "\n" not in str(lay)


def test_from_dim_axes_counts_device_axes_from_the_left() -> None:
    lay = TensorLayout.from_dim_axes((2, 1, 4), [(0,), (2,)], (8, 16))
    assert lay == TensorLayout((2, 1, 4), (2, 0), (8, 16))
    assert lay.slice_of(5) == ((4, 8), (4, 8))
    both = TensorLayout.from_dim_axes((2, 1, 4), [(0, 2), ()], (8, 16), partial_axes=(1,))
    assert both.tensor_map == ((2, 0), -1) and both.partial_axes == (1,) and both.partial == (1,)
    assert both.slice_of(5) == ((5, 6), (0, 16))
    with pytest.raises(ValueError, match=r"dimension 1 over device axis 3; allowed 0\.\.2"):
        TensorLayout.from_dim_axes((2, 1, 4), [(0,), (3,)], (8, 16))
    with pytest.raises(TypeError, match="dim_axes entries must be an int"):
        TensorLayout.from_dim_axes((2, 4), [("a",), ()], (8, 16))


@given(layouts())
def test_from_dim_axes_inverts_dim_axes(lay: TensorLayout) -> None:
    again = TensorLayout.from_dim_axes(lay.device_matrix, lay.dim_axes, lay.shape,
                                       lay.partial_axes)
    assert again == lay and again.tensor_map == lay.tensor_map


@given(layouts(allow_partial=False))
def test_from_strategy_reproduces_the_cuts(lay: TensorLayout) -> None:
    """from_strategy of a layout's cuts gives the same cuts (maybe on other axes), when they fit
    left to right."""
    try:
        again = TensorLayout.from_strategy(lay.device_matrix, lay.cuts, lay.shape)
    except ValueError:
        return
    assert again.cuts == lay.cuts and again.local_shape() == lay.local_shape()


def test_mesh_axes_errors_speak_the_callers_count() -> None:
    """from_dim_axes and with_partial_axes take left-counted axes and say so in their errors,
    never echoing the right-counted values the caller did not write."""
    with pytest.raises(ValueError, match=r"partial_axes \(0, 0\) names device axis 0 twice"):
        TensorLayout.from_dim_axes((2, 4), [(), ()], (8, 8), partial_axes=(0, 0))
    with pytest.raises(ValueError, match=r"partial_axes \(0,\): device axes \[0\] \(counted from "
                       "the left\\) also split a tensor dimension"):
        TensorLayout.from_dim_axes((2, 4), [(0,), ()], (8, 8), partial_axes=(0,))
    lay = TensorLayout.from_dim_axes((2, 4), [(), (1,)], (8, 8))
    with pytest.raises(ValueError, match=r"partial_axes \(1,\): device axes \[1\]"):
        lay.with_partial_axes((1,))


def _random_dim_axes(rng: random.Random, extra_axis: bool, most: int
                     ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """A device matrix, a shape and per-dimension device axes drawn at random (``extra_axis``
    lets an axis one past the matrix appear, ``most`` bounds the axes per dimension)."""
    nd = rng.randint(1, 4)
    dm = tuple(rng.choice([1, 2, 3, 4]) for _ in range(nd))
    ndim = rng.randint(0, 3)
    shape = tuple(rng.choice([0, 1, 2, 4, 6, 8, 12, 16, 24]) for _ in range(ndim))
    axes = list(range(nd + extra_axis))
    rng.shuffle(axes)
    dim_axes = tuple(tuple(axes[:rng.randint(0, most)]) if rng.random() < .5 else ()
                     for _ in range(ndim))
    return dm, shape, dim_axes


def _same_layout(a: TensorLayout, b: TensorLayout) -> None:
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    for name in ("device_matrix", "tensor_map", "shape", "partial", "_axes", "_cuts", "_local"):
        assert getattr(a, name) == getattr(b, name), name


def test_from_dim_axes_fast_path_builds_what_the_constructor_builds():
    """Planners build layouts of plain ints through a cached one-pass path; it must give the
    very layout the checked constructor gives (every field, equality, hash), and send anything
    invalid to the constructor's error."""
    rng = random.Random(0)
    valid = 0
    for _ in range(4000):
        dm, shape, dim_axes = _random_dim_axes(rng, extra_axis=True, most=2)
        part = tuple(rng.sample(range(len(dm) + 1), rng.randint(0, 2)))
        try:
            slow, slow_error = TensorLayout._from_dim_axes(dm, dim_axes, shape, part), None
        except (TypeError, ValueError) as e:
            slow, slow_error = None, type(e)
        try:
            fast, fast_error = _from_dim_axes(dm, dim_axes, shape, part), None
        except (TypeError, ValueError) as e:
            fast, fast_error = None, type(e)
        assert slow_error == fast_error, (dm, dim_axes, shape, part)
        if slow is not None and fast is not None:
            valid += 1
            _same_layout(fast, slow)
    assert valid > 1000  # both branches are exercised


def test_from_dim_axes_gives_the_built_layout_for_arguments_equal_to_its_own() -> None:
    """A layout built once from plain ints is found again by equal arguments of other int
    types (numpy ints): the same value the constructor builds from them."""
    lay = TensorLayout.from_dim_axes((2, 1, 4), [(0,), (2,)], (8, 16))
    again = TensorLayout.from_dim_axes(np.array([2, 1, 4]), [(np.int64(0),), (np.int32(2),)],
                                       tuple(np.array([8, 16])))
    assert again is lay
    _same_layout(again, TensorLayout._from_dim_axes(np.array([2, 1, 4]), [(0,), (2,)],
                                                    (8, 16)))


def test_with_partial_builds_what_the_constructor_builds() -> None:
    """``with_partial`` takes the cached one-pass path for valid pending-sum axes; the result
    (and any error) is the constructor's."""
    rng = random.Random(1)
    valid = 0
    for _ in range(3000):
        dm, shape, dim_axes = _random_dim_axes(rng, extra_axis=False, most=1)
        try:
            lay = TensorLayout.from_dim_axes(dm, dim_axes, shape)
        except ValueError:
            continue
        part = tuple(rng.sample(range(-1, len(dm) + 1), rng.randint(0, 2)))
        try:
            want, want_error = TensorLayout(dm, lay.tensor_map, shape, part), None
        except (TypeError, ValueError) as e:
            want, want_error = None, type(e)
        try:
            got, got_error = lay.with_partial(part), None
        except (TypeError, ValueError) as e:
            got, got_error = None, type(e)
        assert got_error == want_error, (lay, part)
        if want is not None and got is not None:
            valid += 1
            _same_layout(got, want)
    assert valid > 500
