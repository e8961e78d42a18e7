"""simpar.comm on real MPI ranks: every collective against numpy, byte counts, bad input.

Each rank can build every rank's input (``_local``: seeded by the rank), so each rank checks its
own result against a numpy reference made from the global data. The values are small integers,
exact in every dtype, so sums and means compare bit for bit. Tests marked ``mpi`` without
``min_size`` work at any world size, 1 included:

    python -m pytest tests/test_comm.py -q --with-mpi
    mpirun -n 8 python -m pytest tests/test_comm.py -q --with-mpi -m mpi

Inside a test, every rank runs all its collectives before it asserts anything, so a failed
check on one rank cannot leave the others waiting in a collective.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import simpar.comm as comm
from simpar import _env
from simpar.comm import CommEvent, CommMismatchError, CommTrace, Group
from simpar.mesh import DeviceMesh

DTYPES = [np.dtype(d) for d in (np.float32, np.float64, np.int32, np.int64)]
LAYOUTS = ["contiguous", "transposed", "strided", "reversed"]
OPS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "sum": lambda s: s.sum(axis=0),
    "mean": lambda s: s.sum(axis=0) / s.shape[0],
    "max": lambda s: s.max(axis=0),
    "min": lambda s: s.min(axis=0),
}
DTYPE_OPS = [(d, op) for d in DTYPES for op in OPS if not (op == "mean" and d.kind == "i")]


def _local(rank: int, shape: Sequence[int], dtype: np.dtype, layout: str = "contiguous",
           seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s input of this shape, as a view with the given memory layout."""
    shape = tuple(shape)
    rng = np.random.default_rng([seed, rank])

    def ints(s: tuple[int, ...]) -> np.ndarray:
        return rng.integers(-20, 21, size=s).astype(dtype)

    if layout == "contiguous":
        return ints(shape)
    if layout == "transposed":
        return ints(shape[::-1]).T
    if layout == "strided":
        return ints(shape[:-1] + (2 * shape[-1] + 1,))[..., 1::2]
    if layout == "reversed":
        return ints(shape)[::-1]
    raise AssertionError(layout)


def _members(group: Sequence[int] | Group | None) -> tuple[int, ...]:
    if group is None:
        return tuple(range(comm.get_group_size()))
    return group.ranks if isinstance(group, Group) else tuple(group)


def _event(ev: CommEvent, kind: str, group: Sequence[int], sent: int, recv: int,
           x: np.ndarray, op: str | None = None) -> None:
    got = (ev.kind, ev.group, ev.bytes_sent, ev.bytes_recv, ev.dtype, ev.shape, ev.op)
    assert got == (kind, tuple(group), sent, recv, str(x.dtype), x.shape, op)
    assert ev.seconds >= 0


def _exact(a: int, b: int) -> int:
    assert a % b == 0, "choose shapes whose byte counts divide exactly"
    return a // b


# ---------------------------------------------------------------- all_reduce


@pytest.mark.mpi
@pytest.mark.parametrize(("dtype", "op"), DTYPE_OPS, ids=[f"{d}-{o}" for d, o in DTYPE_OPS])
def test_all_reduce(world: tuple[int, int], dtype: np.dtype, op: str) -> None:
    rank, p = world
    shape = (4, 6)
    inputs = [_local(rank, shape, dtype, layout) for layout in LAYOUTS]
    before = [x.copy() for x in inputs]
    with CommTrace() as trace:
        outs = [comm.all_reduce(x, op) for x in inputs]
    assert trace.count() == len(LAYOUTS)
    for layout, x, x0, out, ev in zip(LAYOUTS, inputs, before, outs, trace.events, strict=True):
        stack = np.stack([_local(r, shape, dtype, layout) for r in range(p)])
        want = OPS[op](stack)
        assert out.dtype == dtype and out.shape == shape and out.flags.c_contiguous
        np.testing.assert_array_equal(out, want.astype(dtype), strict=True)
        np.testing.assert_array_equal(x, x0)
        assert not np.shares_memory(out, x)
        n = x.nbytes
        _event(ev, "AllReduce", range(p), _exact(2 * (p - 1) * n, p),
               _exact(2 * (p - 1) * n, p), x, op)


def test_layouts_are_really_non_contiguous() -> None:
    for layout in LAYOUTS[1:]:
        assert not _local(0, (4, 6), DTYPES[0], layout).flags.c_contiguous


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.kind == "i"], ids=str)
def test_mean_on_integers_is_a_type_error(dtype: np.dtype) -> None:
    x = np.ones((2, 8), dtype=dtype)
    with pytest.raises(TypeError, match=r"all_reduce: op 'mean' needs a floating dtype, got int"):
        comm.all_reduce(x, "mean")
    with pytest.raises(TypeError, match=r"reduce_scatter: op 'mean' needs a floating dtype"):
        comm.reduce_scatter(x, axis=1, op="mean")


# ---------------------------------------------------------------- all_gather


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_gather_every_axis(world: tuple[int, int], dtype: np.dtype, layout: str) -> None:
    rank, p = world
    shape = (2, 3, 4)
    x = _local(rank, shape, dtype, layout)
    axes = list(range(-3, 3))
    with CommTrace() as trace:
        outs = [comm.all_gather(x, axis=a) for a in axes]
    everyone = [_local(r, shape, dtype, layout) for r in range(p)]
    for a, out, ev in zip(axes, outs, trace.events, strict=True):
        np.testing.assert_array_equal(out, np.concatenate(everyone, axis=a), strict=True)
        _event(ev, "AllGather", range(p), (p - 1) * x.nbytes, (p - 1) * x.nbytes, x)


@pytest.mark.mpi
def test_all_gather_of_a_vector_and_of_empty_blocks(world: tuple[int, int]) -> None:
    rank, p = world
    vec = np.arange(3, dtype=np.int64) + 10 * rank
    empty = np.zeros((0, 2), dtype=np.float32)
    with CommTrace() as trace:
        v = comm.all_gather(vec)
        e = comm.all_gather(empty, axis=1)
        e0 = comm.all_gather(empty, axis=0)
    np.testing.assert_array_equal(v, np.concatenate([np.arange(3) + 10 * r for r in range(p)]))
    assert e.shape == (0, 2 * p) and e0.shape == (0, 2)
    assert [ev.bytes_recv for ev in trace.events] == [(p - 1) * 24, 0, 0]


# ---------------------------------------------------------------- reduce_scatter


@pytest.mark.mpi
@pytest.mark.parametrize(("dtype", "op"), DTYPE_OPS, ids=[f"{d}-{o}" for d, o in DTYPE_OPS])
def test_reduce_scatter_every_axis(world: tuple[int, int], dtype: np.dtype, op: str) -> None:
    rank, p = world
    cases = []
    for i, axis in enumerate((0, 1, 2, -1, -2, -3)):
        shape = [2, 3, 2]
        shape[axis] *= p
        cases.append((axis, tuple(shape), LAYOUTS[i % len(LAYOUTS)]))
    inputs = [_local(rank, s, dtype, lay) for _, s, lay in cases]
    with CommTrace() as trace:
        outs = [comm.reduce_scatter(x, axis=a, op=op)
                for (a, _, _), x in zip(cases, inputs, strict=True)]
    for (axis, shape, layout), x, out, ev in zip(cases, inputs, outs, trace.events, strict=True):
        full = OPS[op](np.stack([_local(r, shape, dtype, layout) for r in range(p)]))
        want = np.split(full.astype(dtype), p, axis=axis)[rank]
        np.testing.assert_array_equal(out, want, strict=True)
        n = x.nbytes
        _event(ev, "ReduceScatter", range(p), _exact((p - 1) * n, p), _exact((p - 1) * n, p),
               x, op)


# ---------------------------------------------------------------- all_to_all


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_to_all_every_axis_pair(world: tuple[int, int], dtype: np.dtype) -> None:
    rank, p = world
    cases = []
    for split in (0, 1, -1):
        for concat in (0, -2, 2):
            shape = [2, 3, 2]
            shape[split] *= p
            layout = LAYOUTS[(split + concat) % len(LAYOUTS)]
            cases.append((split, concat, tuple(shape), layout))
    inputs = [_local(rank, s, dtype, lay) for _, _, s, lay in cases]
    with CommTrace() as trace:
        outs = [comm.all_to_all(x, split_axis=s, concat_axis=c)
                for (s, c, _, _), x in zip(cases, inputs, strict=True)]
    for (split, concat, shape, layout), x, out, ev in zip(cases, inputs, outs, trace.events,
                                                          strict=True):
        pieces = [np.split(_local(j, shape, dtype, layout), p, axis=split)[rank]
                  for j in range(p)]
        np.testing.assert_array_equal(out, np.concatenate(pieces, axis=concat), strict=True)
        n = x.nbytes
        _event(ev, "AllToAll", range(p), _exact((p - 1) * n, p), _exact((p - 1) * n, p), x)


@pytest.mark.mpi
def test_all_to_all_row_block_to_column_block(world: tuple[int, int]) -> None:
    """The docstring's example, scaled: a (2, 4p) row block becomes a (2p, 4) column block."""
    rank, p = world
    full = np.arange(2 * p * 4 * p, dtype=np.float64).reshape(2 * p, 4 * p)
    out = comm.all_to_all(full[2 * rank:2 * rank + 2], split_axis=1, concat_axis=0)
    np.testing.assert_array_equal(out, full[:, 4 * rank:4 * rank + 4])


# ---------------------------------------------------------------- prepared collectives
# (name, the general call, prepare's keyword arguments, a local shape whose split axes hold p)
PREPARED: list[tuple[str, Callable[..., np.ndarray], dict[str, Any], Callable[[int], tuple]]] = [
    ("all_reduce", comm.all_reduce, {"op": "sum"}, lambda p: (3, 4)),
    ("all_reduce", comm.all_reduce, {"op": "max"}, lambda p: (5,)),
    ("all_reduce", comm.all_reduce, {"op": "mean"}, lambda p: ()),
    ("all_gather", comm.all_gather, {"axis": 0}, lambda p: (2, 3)),
    ("all_gather", comm.all_gather, {"axis": -1}, lambda p: (2, 3)),
    ("reduce_scatter", comm.reduce_scatter, {"axis": 1, "op": "sum"}, lambda p: (2, 2 * p)),
    ("all_to_all", comm.all_to_all, {"split_axis": 1, "concat_axis": 0}, lambda p: (2, 3 * p)),
    ("all_to_all", comm.all_to_all, {"split_axis": 0, "concat_axis": 1}, lambda p: (p, 3)),
    ("broadcast", comm.broadcast, {"root": 0}, lambda p: (2, 3)),
]


@pytest.mark.mpi
@pytest.mark.parametrize("case", range(len(PREPARED)))
def test_a_prepared_collective_is_the_call_it_prepares(world: tuple[int, int], case: int
                                                       ) -> None:
    """Bit for bit the general call's result and CommTrace event, on contiguous and
    non-contiguous inputs; ``at`` becomes the event's program step and label."""
    rank, p = world
    name, general, args, shape_of = PREPARED[case]
    shape = shape_of(p)
    dtype = np.dtype(np.float64 if args.get("op") == "mean" else np.int32)
    run = comm.prepare(name, shape, dtype, **args)
    layouts = LAYOUTS if shape else ["contiguous"]
    inputs = [_local(rank, shape, dtype, layout, seed=case) for layout in layouts]
    with CommTrace() as want_trace:
        want = [general(x, **args) for x in inputs]
    with CommTrace() as trace:
        got = [run(x) for x in inputs] + [run(inputs[0], (7, "a program step"))]
    for w, g in zip(want + want[:1], got, strict=True):
        np.testing.assert_array_equal(g, w.reshape(g.shape), strict=True)
        assert g.flags.c_contiguous and not any(np.shares_memory(g, x) for x in inputs)
    fields = [(e.kind, e.group, e.bytes_sent, e.bytes_recv, e.dtype, e.shape, e.op, e.label,
               e.step) for e in trace.events]
    expected = [(e.kind, e.group, e.bytes_sent, e.bytes_recv, e.dtype, e.shape, e.op, e.label,
                 e.step) for e in want_trace.events]
    assert fields[:-1] == expected
    assert fields[-1][:-2] == expected[0][:-2] and fields[-1][-2:] == ("a program step", 7)


@pytest.mark.mpi
def test_a_prepared_collective_takes_the_general_path_for_another_array(
        world: tuple[int, int]) -> None:
    """Another shape or dtype than prepared gets the general call's result and checks."""
    rank, p = world
    run = comm.prepare("all_reduce", (2, 3), np.float32, op="sum")
    x = _local(rank, (4,), np.dtype(np.float64))
    want = sum(_local(r, (4,), np.dtype(np.float64)) for r in range(p))
    np.testing.assert_array_equal(run(x), want, strict=True)
    y = _local(rank, (2, 3), np.dtype(np.int64))
    np.testing.assert_array_equal(run(y), sum(_local(r, (2, 3), np.dtype(np.int64))
                                              for r in range(p)), strict=True)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_a_consuming_prepared_all_reduce_sums_into_its_input(world: tuple[int, int],
                                                            op: str) -> None:
    """``consume=True``: the general call's result and event, written into ``x`` itself
    (MPI_IN_PLACE) when ``x`` is writeable and C-contiguous, else into a new array with
    ``x`` left as it was."""
    rank, p = world
    dtype = np.dtype(np.float64)
    run = comm.prepare("all_reduce", (3, 4), dtype, op=op, consume=True)
    for layout in LAYOUTS:
        x = _local(rank, (3, 4), dtype, layout, seed=5)
        before = x.copy()
        with CommTrace() as want_trace:
            want = comm.all_reduce(x, op=op)
        with CommTrace() as trace:
            got = run(x)
        np.testing.assert_array_equal(got, want, strict=True)
        into = layout == "contiguous"
        assert (got is x) == into and x.flags.c_contiguous == into, layout
        if not into:
            np.testing.assert_array_equal(x, before, strict=True)
        assert [(e.kind, e.group, e.bytes_sent, e.bytes_recv, e.shape, e.op)
                for e in trace.events] == [(e.kind, e.group, e.bytes_sent, e.bytes_recv,
                                            e.shape, e.op) for e in want_trace.events]


@pytest.mark.mpi
@pytest.mark.parametrize(("name", "args", "error", "words"), [
    ("all_reduce", {"op": "avg"}, ValueError, "op must be one of"),
    ("all_reduce", {"op": "mean"}, TypeError, "needs a floating dtype"),
    ("all_gather", {"axis": 2}, ValueError, "axis=2 is out of range"),
    ("scatter", {}, ValueError, "prepare: name must be one of"),
    ("all_gather", {"consume": True}, ValueError, "True only for 'all_reduce'"),
    ("all_reduce", {"consume": 1}, ValueError, "consume must be a bool"),
])
def test_prepare_refuses_what_the_call_would(world: tuple[int, int], name: str,
                                             args: dict[str, Any], error: type,
                                             words: str) -> None:
    with pytest.raises(error, match=words):
        comm.prepare(name, (2, 2), np.int32, **args)


@pytest.mark.mpi(min_size=3)
def test_a_prepared_indivisible_scatter_fails_on_every_rank(world: tuple[int, int]) -> None:
    """Refused after the ranks agree, as the general call is: every rank raises alike."""
    rank, p = world
    run = comm.prepare("reduce_scatter", (p + 1, 2), np.float64, axis=0)
    with pytest.raises(ValueError, match="does not split into"):
        run(_local(rank, (p + 1, 2), np.dtype(np.float64)))


# ---------------------------------------------------------------- broadcast


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast_from_every_root(world: tuple[int, int], dtype: np.dtype) -> None:
    rank, p = world
    roots = [p - 1, p // 2, 0]          # a non-zero root first whenever p > 1
    inputs = [_local(rank, (3, 4), dtype, LAYOUTS[i % len(LAYOUTS)], seed=root)
              for i, root in enumerate(roots)]
    before = [x.copy() for x in inputs]
    with CommTrace() as trace:
        outs = [comm.broadcast(x, root=root) for x, root in zip(inputs, roots, strict=True)]
    for i, (root, x, out, ev) in enumerate(zip(roots, inputs, outs, trace.events, strict=True)):
        want = _local(root, (3, 4), dtype, LAYOUTS[i % len(LAYOUTS)], seed=root)
        np.testing.assert_array_equal(out, want, strict=True)
        np.testing.assert_array_equal(x, before[i])
        sent, got = ((p - 1) * x.nbytes, 0) if rank == root else (0, x.nbytes)
        _event(ev, "Broadcast", range(p), sent, got, x)


# ---------------------------------------------------------------- all_to_all_v


def _v_shape(src: int, dst: int) -> tuple[int, int] | None:
    """Shape of the piece world rank ``src`` sends ``dst``: None, empty or (1|2, 3)."""
    k = (src + 2 * dst + 1) % 4
    return None if k == 3 else (k, 3)


def _v_piece(src: int, dst: int, dtype: np.dtype) -> np.ndarray | None:
    shape = _v_shape(src, dst)
    if shape is None:
        return None
    return _local(1000 * src + dst, shape, dtype, LAYOUTS[(src + dst) % len(LAYOUTS)])


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_to_all_v_arbitrary_pieces(world: tuple[int, int], dtype: np.dtype) -> None:
    rank, p = world
    pieces = [_v_piece(rank, j, dtype) for j in range(p)]
    shapes = [_v_shape(j, rank) for j in range(p)]
    with CommTrace() as trace:
        outs = comm.all_to_all_v(pieces, shapes, dtype=dtype)
    assert len(outs) == p
    for j, out in enumerate(outs):
        want = _v_piece(j, rank, dtype)
        if want is None:
            assert out is None
        else:
            assert out is not None
            np.testing.assert_array_equal(out, want, strict=True)
    item = dtype.itemsize
    sent = sum(a.size for j, a in enumerate(pieces) if a is not None and j != rank) * item
    got = sum(int(np.prod(s)) for j, s in enumerate(shapes) if s is not None and j != rank) * item
    own = pieces[rank]
    (ev,) = trace.events
    assert (ev.kind, ev.group, ev.bytes_sent, ev.bytes_recv, ev.dtype, ev.shape) == (
        "AllToAllV", tuple(range(p)), sent, got, str(dtype), own.shape if own is not None else (0,))


@pytest.mark.mpi
def test_all_to_all_v_without_any_piece_and_in_a_reversed_group(world: tuple[int, int]) -> None:
    rank, p = world
    group = list(range(p))[::-1]
    me = group.index(rank)
    nothing = comm.all_to_all_v([None] * p, [None] * p, dtype=np.int32)
    # Group rank i sends group rank j a (i+1, j+1) block filled with 10 i + j.
    pieces = [np.full((me + 1, j + 1), 10 * me + j, dtype=np.int64) for j in range(p)]
    outs = comm.all_to_all_v(pieces, [(i + 1, me + 1) for i in range(p)], group=group)
    assert nothing == [None] * p
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out, np.full((i + 1, me + 1), 10 * i + me))


@pytest.mark.mpi
@pytest.mark.parametrize("source", ["split-1d", "row-blocks", "same-view-everywhere",
                                    "column-blocks", "two-buffers", "with-gaps-and-empty",
                                    "strided-1d", "transposed-2d"])
def test_all_to_all_v_pieces_that_are_views(world: tuple[int, int], source: str) -> None:
    """Pieces cut from one contiguous array go out without packing; any other pieces are
    packed. Either way every rank receives exactly its pieces."""
    rank, p = world
    dt = np.dtype(np.float64)
    base = _local(rank, (4 * p, 3), dt)
    other = _local(rank, (4 * p, 3), dt, seed=1)
    if source == "split-1d":
        pieces = np.split(base.reshape(-1)[: 6 * p], p)
    elif source == "row-blocks":
        pieces = [base[4 * j:4 * j + 4] for j in range(p)]
    elif source == "same-view-everywhere":
        pieces = [base[1:3]] * p
    elif source == "column-blocks":
        wide = _local(rank, (3, 2 * p), dt)
        pieces = [wide[:, 2 * j:2 * j + 2] for j in range(p)]
    elif source == "two-buffers":
        pieces = [(base if j % 2 else other)[4 * j:4 * j + 4] for j in range(p)]
    elif source == "strided-1d":  # inside one buffer, but not contiguous: packed
        pieces = [base.reshape(-1)[6 * j:6 * j + 6:2] for j in range(p)]
    elif source == "transposed-2d":  # contiguous in Fortran order only: packed
        pieces = [base[4 * j:4 * j + 4].T for j in range(p)]
    else:
        pieces = [base[4 * j + 1:4 * j + 1 + j % 3] for j in range(p)]
    before = base.copy()
    shapes = [pieces[rank].shape] * p      # every rank cuts its pieces the same way
    outs = comm.all_to_all_v(list(pieces), shapes)

    def piece_of(j: int) -> np.ndarray:     # the piece rank j built for this rank, from scratch
        b, o = _local(j, (4 * p, 3), dt), _local(j, (4 * p, 3), dt, seed=1)
        return {"split-1d": lambda: np.split(b.reshape(-1)[: 6 * p], p)[rank],
                "row-blocks": lambda: b[4 * rank:4 * rank + 4],
                "same-view-everywhere": lambda: b[1:3],
                "column-blocks": lambda: _local(j, (3, 2 * p), dt)[:, 2 * rank:2 * rank + 2],
                "two-buffers": lambda: (b if rank % 2 else o)[4 * rank:4 * rank + 4],
                "strided-1d": lambda: b.reshape(-1)[6 * rank:6 * rank + 6:2],
                "transposed-2d": lambda: b[4 * rank:4 * rank + 4].T,
                "with-gaps-and-empty": lambda: b[4 * rank + 1:4 * rank + 1 + rank % 3]}[source]()

    for j, out in enumerate(outs):
        assert out is not None
        np.testing.assert_array_equal(out, piece_of(j), strict=True)
    np.testing.assert_array_equal(base, before)
    assert not any(np.shares_memory(out, base) for out in outs if out is not None)


@pytest.mark.mpi(min_size=2)
def test_all_to_all_v_disagreeing_sizes_fail_on_every_rank(world: tuple[int, int]) -> None:
    rank, p = world
    pieces = [np.zeros((2,), np.float32) for _ in range(p)]
    shapes: list[tuple[int, ...]] = [(2,)] * p
    if rank == 0:
        shapes = [(2,), (3,)] + shapes[2:]       # rank 1 sends 2 elements, not 3
    with pytest.raises(CommMismatchError, match=r"disagree on the piece sizes") as info:
        comm.all_to_all_v(pieces, shapes)
    # Every rank raises the same message, naming the pair that disagrees.
    assert "rank 1 sends 2 elements to rank 0, which expects 3" in str(info.value)
    assert isinstance(info.value, ValueError)


def _row_counts(p: int, seed: int) -> np.ndarray:
    """counts[i, j]: rows rank i sends rank j (the same table on every rank; zeros included)."""
    return np.random.default_rng(seed).integers(0, 4, size=(p, p))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_all_to_all_single_against_numpy(world: tuple[int, int], dtype: np.dtype,
                                         layout: str) -> None:
    rank, p = world
    counts = _row_counts(p, seed=3)
    rows = [_local(r, (int(counts[r].sum()), 3), dtype, layout) for r in range(p)]
    with CommTrace() as tr:
        got = comm.all_to_all_single(rows[rank], counts[rank].tolist(), counts[:, rank].tolist())
        again = comm.all_to_all_single(rows[rank], counts[rank].tolist(),
                                       counts[:, rank].tolist())
    starts = [np.concatenate(([0], np.cumsum(counts[r]))) for r in range(p)]
    expect = np.concatenate([rows[j][starts[j][rank]:starts[j][rank + 1]] for j in range(p)])
    np.testing.assert_array_equal(got, expect, strict=True)
    np.testing.assert_array_equal(again, expect, strict=True)
    item = 3 * dtype.itemsize
    sent = (int(counts[rank].sum()) - int(counts[rank, rank])) * item
    recv = (int(counts[:, rank].sum()) - int(counts[rank, rank])) * item
    for ev in tr.events:
        assert (ev.kind, ev.bytes_sent, ev.bytes_recv) == ("AllToAllV", sent, recv)


@pytest.mark.mpi(min_size=2)
def test_all_to_all_single_disagreeing_counts_fail_on_every_rank(world: tuple[int, int]) -> None:
    rank, p = world
    counts = np.ones((p, p), dtype=int)
    recv = counts[:, rank].tolist()
    if rank == 0:
        recv[1] = 2  # rank 1 sends 1 row, rank 0 expects 2
    x = np.zeros((p, 2), np.float32)
    with pytest.raises(CommMismatchError, match="disagree on the piece sizes") as info:
        comm.all_to_all_single(x, counts[rank].tolist(), recv, out=np.empty((sum(recv), 2),
                                                                          np.float32))
    assert "rank 1 sends 1 rows to rank 0, which expects 2" in str(info.value)


@pytest.mark.mpi
def test_all_to_all_single_float_counts_fail_even_after_int_counts(world: tuple[int, int]) -> None:
    _, p = world
    x = np.zeros((p, 2), np.float64)
    assert comm.all_to_all_single(x, [1] * p, [1] * p).shape == (p, 2)  # cached now
    with pytest.raises(ValueError, match="send_counts must be non-negative ints"):
        comm.all_to_all_single(x, [1.0] * p, [1] * p)  # 1.0 == 1, but not an int


@pytest.mark.mpi(min_size=2)
def test_all_to_all_single_rows_of_size_zero_must_agree_too(world: tuple[int, int]) -> None:
    rank, p = world
    recv = [1] * p
    if rank == 0:
        recv[1] = 2
    with pytest.raises(CommMismatchError, match="rank 1 sends 1 rows to rank 0, which expects 2"):
        comm.all_to_all_single(np.zeros((p, 0), np.float32), [1] * p, recv)


@pytest.mark.mpi
@pytest.mark.parametrize(("sends", "recvs", "words"), [
    (lambda p: [1] * (p + 1), lambda p: [1] * p, "one send count and one receive count per"),
    (lambda p: [2] * p, lambda p: [2] * p, "add up to"),
    (lambda p: [-1] + [1] * (p - 1), lambda p: [1] * p, "must be non-negative ints"),
    (lambda p: [1] * p, lambda p: [1.5] * p, "must be non-negative ints"),
])
def test_all_to_all_single_bad_counts(world: tuple[int, int], sends: Callable[[int], list],
                                      recvs: Callable[[int], list], words: str) -> None:
    _, p = world
    with pytest.raises(ValueError, match=words):
        comm.all_to_all_single(np.zeros((p, 2), np.float64), sends(p), recvs(p))


@pytest.mark.mpi(min_size=2)
def test_piece_size_mismatch_in_a_group_too_large_to_list(world: tuple[int, int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from simpar.comm import agreement

    rank, p = world
    monkeypatch.setattr(agreement, "_COUNT_TABLE_MAX", 1)  # as if the group were huge
    recv = [1] * p
    if rank == 0:
        recv[1] = 2
    with pytest.raises(CommMismatchError, match=rf"\({p} ranks\) disagree on the piece sizes"):
        comm.all_to_all_single(np.zeros((p, 1), np.float32), [1] * p, recv)


# ---------------------------------------------------------------- send / recv, barrier


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_send_recv_between_pairs(world: tuple[int, int], dtype: np.dtype) -> None:
    rank, p = world
    if rank == p - 1 and p % 2:
        return
    partner = rank ^ 1
    x = _local(rank, (3, 4), dtype, "transposed")
    with CommTrace() as trace:
        if rank % 2 == 0:
            comm.send(x, dest=partner, tag=7)
            y = comm.recv(partner, (3, 4), dtype, tag=7)
        else:
            y = comm.recv(partner, (3, 4), dtype, tag=7)
            comm.send(x, dest=partner, tag=7)
    np.testing.assert_array_equal(y, _local(partner, (3, 4), dtype, "transposed"), strict=True)
    sent = ("Send", (rank, partner), x.nbytes, 0, str(dtype), (3, 4))
    got = ("Receive", (partner, rank), 0, x.nbytes, str(dtype), (3, 4))
    assert [(e.kind, e.group, e.bytes_sent, e.bytes_recv, e.dtype, e.shape)
            for e in trace.events] == ([sent, got] if rank % 2 == 0 else [got, sent])


@pytest.mark.mpi(min_size=2)
def test_recv_of_the_wrong_size_is_a_mismatch(world: tuple[int, int]) -> None:
    rank, p = world
    if rank >= 2:
        return
    if rank == 0:
        comm.send(np.arange(3, dtype=np.int32), dest=1, tag=3)
        return
    with pytest.raises(CommMismatchError, match=r"recv: expected 16 bytes \(int32\[4\]\) from "
                                                r"rank 0, got 12"):
        comm.recv(0, (4,), np.int32, tag=3)


@pytest.mark.mpi
def test_barrier_is_traced_with_no_bytes(world: tuple[int, int]) -> None:
    _, p = world
    with CommTrace() as trace:
        comm.barrier()
        comm.barrier(list(range(p)))
    assert [(e.kind, e.group, e.bytes_sent, e.bytes_recv) for e in trace.events] == [
        ("Barrier", tuple(range(p)), 0, 0)] * 2


# ---------------------------------------------------------------- groups


def _run_all(x: np.ndarray, group: Any, root: int) -> list[np.ndarray]:
    return [comm.all_reduce(x, "sum", group=group), comm.all_reduce(x, "max", group=group),
            comm.all_gather(x, axis=1, group=group),
            comm.reduce_scatter(x, axis=0, op="sum", group=group),
            comm.all_to_all(x, split_axis=0, concat_axis=1, group=group),
            comm.broadcast(x, root=root, group=group)]


def _check_all(outs: list[np.ndarray], events: list[CommEvent], members: tuple[int, ...],
               rank: int, shape: tuple[int, ...], root: int) -> None:
    p, me, dt = len(members), members.index(rank), np.dtype(np.float64)
    xs = [_local(r, shape, dt, "strided") for r in members]
    x = xs[me]
    stack = np.stack(xs)
    wants = [stack.sum(0), stack.max(0), np.concatenate(xs, axis=1),
             np.split(stack.sum(0), p, axis=0)[me],
             np.concatenate([np.split(a, p, axis=0)[me] for a in xs], axis=1),
             xs[members.index(root)]]
    for out, want in zip(outs, wants, strict=True):
        np.testing.assert_array_equal(out, want, strict=True)
    n = x.nbytes
    ar, part = _exact(2 * (p - 1) * n, p), _exact((p - 1) * n, p)
    bsent, brecv = ((p - 1) * n, 0) if rank == root else (0, n)
    expected = [("AllReduce", ar, ar, "sum"), ("AllReduce", ar, ar, "max"),
                ("AllGather", (p - 1) * n, (p - 1) * n, None),
                ("ReduceScatter", part, part, "sum"), ("AllToAll", part, part, None),
                ("Broadcast", bsent, brecv, None)]
    assert len(events) == len(expected)
    for ev, (kind, sent, got, op) in zip(events, expected, strict=True):
        _event(ev, kind, members, sent, got, x, op)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("axes", [(0,), (1,), (0, 1), (1, 0)], ids=str)
def test_every_collective_on_subgroups_of_a_2x4_mesh(world: tuple[int, int],
                                                     axes: tuple[int, ...]) -> None:
    rank, _ = world
    if rank >= 8:
        return
    members = DeviceMesh((2, 4)).group_of(rank, axes)
    shape = (8, 2)
    root = members[-1]
    with CommTrace() as trace:
        group = comm.create_group(members)
        outs = _run_all(_local(rank, shape, np.dtype(np.float64), "strided"), group, root)
    _check_all(outs, trace.events, members, rank, shape, root)
    assert group == Group(members) and group.index(rank) == members.index(rank)


@pytest.mark.mpi
@pytest.mark.parametrize("form", ["none", "list", "tuple", "Group", "reversed", "even-reversed"])
def test_every_collective_on_groups_in_any_form_and_order(world: tuple[int, int],
                                                          form: str) -> None:
    rank, p = world
    ranks = list(range(p))
    group: Any = {"none": None, "list": ranks, "tuple": tuple(ranks), "Group": Group(tuple(ranks)),
                  "reversed": ranks[::-1], "even-reversed": ranks[::2][::-1]}[form]
    members = _members(group)
    if rank not in members:
        return                          # non-members must not call
    shape = (2 * len(members), 2)
    root = members[0]                   # world rank p-1 (or the top even rank) when reversed
    with CommTrace() as trace:
        outs = _run_all(_local(rank, shape, np.dtype(np.float64), "strided"), group, root)
    _check_all(outs, trace.events, members, rank, shape, root)


@pytest.mark.mpi
def test_create_group_caches_and_resolves(world: tuple[int, int]) -> None:
    rank, p = world
    from simpar.comm import _world

    g = comm.create_group([rank])
    again = comm.create_group((rank,))
    assert g == again == Group((rank,)) and g.size == 1 and str(g) == f"Group[{rank}]"
    assert _world.resolve(g)[1] is _world.resolve([rank])[1]
    assert _world.resolve(None)[1] is comm.world() is _world.resolve(list(range(p)))[1]
    assert comm.get_group_size() == p and comm.get_group_size(g) == 1
    assert comm.get_group_size([0, 1, 2]) == 3
    np.testing.assert_array_equal(comm.all_reduce(np.full(3, rank, np.int64), group=g),
                                  np.full(3, rank))


# ---------------------------------------------------------------- validation and mismatches


def _mismatched_call(kind: str, x: np.ndarray) -> Callable[[], object]:
    return {
        "all_reduce": lambda: comm.all_reduce(x),
        "all_gather": lambda: comm.all_gather(x, axis=0),
        "reduce_scatter-axis0": lambda: comm.reduce_scatter(x, axis=0),
        "reduce_scatter-axis1": lambda: comm.reduce_scatter(x, axis=1),
        "all_to_all": lambda: comm.all_to_all(x, split_axis=1, concat_axis=0),
        "broadcast": lambda: comm.broadcast(x, root=0),
    }[kind]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter-axis0",
                                  "reduce_scatter-axis1", "all_to_all", "broadcast"])
def test_shape_mismatch_raises_on_every_rank(world: tuple[int, int], kind: str) -> None:
    rank, p = world
    x = np.zeros((4, 3) if rank == 0 else (4, 2), dtype=np.float32)
    with pytest.raises(CommMismatchError) as info:
        _mismatched_call(kind, x)()
    # The world is still usable afterwards: every rank took part in the same checks.
    total = comm.all_reduce(np.ones(2, np.int64))
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith(kind.split("-")[0] + ": ")
    assert "rank 0: float32[4, 3]" in message
    others = ",".join(str(r) for r in range(1, p))
    assert f"rank{'s' if p > 2 else ''} {others}: float32[4, 2]" in message
    np.testing.assert_array_equal(total, [p, p])


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("axes", [(0,), (1,)], ids=str)
def test_shape_mismatch_inside_subgroups_of_a_2x4_mesh(world: tuple[int, int],
                                                       axes: tuple[int, ...]) -> None:
    rank, _ = world
    if rank >= 8:
        return
    members = DeviceMesh((2, 4)).group_of(rank, axes)
    x = np.zeros((4, 3) if rank == members[0] else (4, 2), dtype=np.float64)
    with pytest.raises(CommMismatchError) as info:
        comm.all_gather(x, axis=1, group=members)
    rest = ",".join(map(str, members[1:]))
    assert str(info.value).startswith(f"all_gather: the ranks of group {list(members)} passed")
    assert f"rank {members[0]}: float64[4, 3] axis=1" in str(info.value)
    assert f"rank{'s' if len(members) > 2 else ''} {rest}: float64[4, 2] axis=1" in str(info.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["dtype", "op", "axis", "root", "reversed-group"])
def test_argument_mismatch_raises_on_every_rank(world: tuple[int, int], what: str) -> None:
    rank, p = world
    first = rank == 0
    x = np.zeros((2 * p, 2), dtype=np.float32)
    with pytest.raises(CommMismatchError, match="every rank must pass the same") as info:
        if what == "dtype":
            comm.all_reduce(x.astype(np.float64) if first else x)
        elif what == "op":
            comm.all_reduce(x, "max" if first else "sum")
        elif what == "axis":
            comm.reduce_scatter(x, axis=1 if first else 0)
        elif what == "root":
            comm.broadcast(x, root=1 if first else 0)
        else:
            comm.all_gather(x[:, :1] if first else x, group=list(range(p))[::-1])
    words = {"dtype": ["float64[", "float32["], "op": [" max", " sum"],
             "axis": ["axis=1", "axis=0"], "root": ["root=1", "root=0"],
             "reversed-group": [f"[{2 * p}, 1]", f"[{2 * p}, 2]"]}[what]
    for w in words:
        assert w in str(info.value)


def _gather_into_itself(x: np.ndarray) -> object:
    """MPI's in-place all-gather idiom (own block inside the output), which simpar refuses."""
    out = np.zeros((x.shape[0] * comm.get_group_size(), x.shape[1]), x.dtype)
    return comm.all_gather(out[:x.shape[0]], out=out)


@pytest.mark.mpi
def test_all_reduce_in_place_through_a_view_and_overlap_refused(world: tuple[int, int]) -> None:
    rank, p = world
    y = np.full(6, rank + 1, dtype=np.float64)
    got = comm.all_reduce(y, out=y[...])  # another view of y's memory: in place
    np.testing.assert_array_equal(y, np.full(6, p * (p + 1) / 2))
    assert np.shares_memory(got, y)
    with pytest.raises(ValueError, match="out overlaps the input's memory without being"):
        comm.all_reduce(y[:3], out=y[1:4])


# A bad argument on one rank only: without the shared check the others would wait forever in
# the collective. Every case names (call on the bad rank, error it raises, words of it).
ONE_RANK_BAD: dict[str, tuple[Callable[[np.ndarray], object], type[Exception], str]] = {
    "non-array": (lambda x: comm.all_reduce(x.tolist()), TypeError, "expected a numpy.ndarray"),
    "dtype": (lambda x: comm.all_gather(x.astype(np.float16)), TypeError, "dtype float16 is not"),
    "axis": (lambda x: comm.all_gather(x, axis=5), ValueError, "axis=5 is out of range"),
    "op": (lambda x: comm.reduce_scatter(x, op="prod"), ValueError, "op must be one of"),
    "out": (lambda x: comm.all_to_all(x, 0, 1, out=np.empty(3, x.dtype)), ValueError,
            "out must be a writeable C-contiguous"),
    "root": (lambda x: comm.broadcast(x, root=-1), ValueError, "root -1 is not in group"),
    "read-only-out": (lambda x: comm.all_reduce(x, out=np.broadcast_to(x, x.shape)), ValueError,
                      "(read-only)"),
    "byte-order": (lambda x: comm.all_reduce(x.astype(">f4")), TypeError, "native byte order"),
    "overlap": (_gather_into_itself, ValueError, "cannot run in place"),
    "recv-shape": (lambda x: comm.all_to_all_v([x[:1]] * comm.get_group_size(),
                                               [(-1, -2)] * comm.get_group_size()),
                   ValueError, "non-negative ints"),
    "a2av-dtype": (lambda x: comm.all_to_all_v([x[:1]] * comm.get_group_size(),
                                               [(1, 2)] * comm.get_group_size(), dtype=np.int32),
                   TypeError, "share one supported dtype"),
}
GOOD_CALL: dict[str, Callable[[np.ndarray], object]] = {
    "non-array": lambda x: comm.all_reduce(x),
    "dtype": lambda x: comm.all_gather(x),
    "axis": lambda x: comm.all_gather(x, axis=1),
    "op": lambda x: comm.reduce_scatter(x),
    "out": lambda x: comm.all_to_all(x, 0, 1),
    "root": lambda x: comm.broadcast(x, root=0),
    "read-only-out": lambda x: comm.all_reduce(x),
    "byte-order": lambda x: comm.all_reduce(x),
    "overlap": lambda x: comm.all_gather(x),
    "recv-shape": lambda x: comm.all_to_all_v([x[:1]] * comm.get_group_size(),
                                              [(1, 2)] * comm.get_group_size()),
    "a2av-dtype": lambda x: comm.all_to_all_v([x[:1]] * comm.get_group_size(),
                                              [(1, 2)] * comm.get_group_size()),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", list(ONE_RANK_BAD))
def test_a_bad_argument_on_one_rank_raises_on_every_rank(world: tuple[int, int],
                                                         case: str) -> None:
    rank, p = world
    bad = p - 1
    x = np.zeros((2 * p, 2), dtype=np.float32)
    call, error, words = ONE_RANK_BAD[case]
    with pytest.raises(ValueError if rank != bad else error) as info:
        (call if rank == bad else GOOD_CALL[case])(x)
    message = str(info.value)
    assert words in message
    if rank != bad:  # the others quote what the bad rank raised
        assert isinstance(info.value, CommMismatchError)
        assert f"rank {bad} of group {list(range(p))} refused its own arguments" in message
        assert f"rank {bad}: raised {error.__name__}: " in message
    # Every rank took part in the same check: the world is still usable.
    np.testing.assert_array_equal(comm.all_reduce(np.ones(2, np.int64)), [p, p])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("other", ["all_gather", "all_to_all_v", "check_agreement"])
def test_different_collectives_on_different_ranks_raise_on_every_rank(
        world: tuple[int, int], other: str) -> None:
    rank, p = world
    x = np.zeros((p, 2), dtype=np.float64)
    with pytest.raises(CommMismatchError) as info:
        if rank == 0:
            comm.all_reduce(x)
        elif other == "all_gather":
            comm.all_gather(x)
        elif other == "all_to_all_v":
            comm.all_to_all_v([x[:1]] * p, [(1, 2)] * p)
        else:
            comm.check_agreement("plan", "a description")
    message = str(info.value)
    assert "rank 0: all_reduce: float64[" in message
    assert {"all_gather": "all_gather: float64[", "all_to_all_v": "all_to_all_v: float64",
            "check_agreement": "plan: a description"}[other] in message
    np.testing.assert_array_equal(comm.all_reduce(np.ones(1, np.int64)), [p])


@pytest.mark.mpi(min_size=2)
def test_check_agreement_passes_and_fails_on_every_rank(world: tuple[int, int]) -> None:
    rank, p = world
    comm.check_agreement("plan", "S0 -> S1 float32")
    with pytest.raises(CommMismatchError, match=r"plan: the ranks of group .* passed different"
                                                r" arrays or arguments") as info:
        comm.check_agreement("plan", "S0 -> S1" if rank else "S0 -> R")
    assert "rank 0: S0 -> R" in str(info.value)


@pytest.mark.mpi(min_size=2)
def test_all_to_all_v_reuses_its_exchange_only_for_the_same_call(world: tuple[int, int]) -> None:
    rank, p = world
    a = np.arange(2 * p, dtype=np.float64)
    b = np.arange(3 * p, dtype=np.int64)
    for _ in range(2):  # the second round runs from the cached exchanges
        got_a = comm.all_to_all_v([a[2 * j:2 * j + 2] for j in range(p)], [(2,)] * p)
        got_b = comm.all_to_all_v([b[3 * j:3 * j + 3].reshape(3, 1) for j in range(p)],
                                   [(3, 1)] * p)
        got_c = comm.all_to_all_v([b[2 * j:2 * j + 2] for j in range(p)], [(2,)] * p)
        for j in range(p):
            np.testing.assert_array_equal(got_a[j], [2 * rank, 2 * rank + 1], strict=False)
            assert got_a[j].dtype == np.float64 and got_b[j].dtype == np.int64
            np.testing.assert_array_equal(got_b[j].reshape(-1), np.arange(3) + 3 * rank)
            assert got_b[j].shape == (3, 1) and got_c[j].dtype == np.int64


@pytest.mark.mpi
def test_a_cached_call_still_checks_what_varies_per_call(world: tuple[int, int]) -> None:
    """Repeated calls reuse what their signature determines; the types of the arguments and
    the out= buffer are still checked on every call."""
    _, p = world
    x = np.ones((2 * p, 2), dtype=np.float32)
    for _ in range(2):
        np.testing.assert_array_equal(comm.all_gather(x, axis=1), np.ones((2 * p, 2 * p)))
        np.testing.assert_array_equal(comm.reduce_scatter(x, axis=0), np.full((2, 2), p))
    with pytest.raises(TypeError, match="axis must be an int, got True"):
        comm.all_gather(x, axis=True)  # True == 1 and hashes like it
    with pytest.raises(TypeError, match="axis must be an int, got 0.0"):
        comm.reduce_scatter(x, axis=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out must be a writeable C-contiguous float32 array"):
        comm.reduce_scatter(x, axis=0, out=np.empty((3, 2), np.float32))
    got = comm.reduce_scatter(x.astype(np.int64), axis=0)  # same shape, another dtype
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.full((2, 2), p))
    pieces = [np.ones(2, np.float32) for _ in range(p)]
    for _ in range(2):
        comm.all_to_all_v(pieces, [(2,)] * p)
    for bad in ((2.0,), (True, 2)):  # equal to (2,) and (1, 2), and hashing like them
        with pytest.raises(ValueError, match="a receive shape must be a sequence of non-neg"):
            comm.all_to_all_v(pieces, [bad] * p)


def test_claims_cancel_exactly_when_all_ranks_agree() -> None:
    """The XOR of every rank's claims is 0 iff the ranks agree (pure: no MPI needed)."""
    from simpar.comm.agreement import piece_claims, ring_claims

    rng = np.random.default_rng(7)
    for p in (2, 3, 8, 64):
        for trial in range(200):
            keys = [int(k) for k in rng.integers(0, 5, size=p)] if trial % 2 else [3] * p
            total = 0
            for me, key in enumerate(keys):
                total ^= ring_claims(key, me, p)
            assert (total == 0) == (len(set(keys)) == 1), (p, keys)
            # all_to_all_v counts: a consistent matrix, then one entry changed on one side.
            sends = rng.integers(0, 4, size=(p, p))
            expects = sends.T.copy()
            if trial % 3:
                i, j = rng.choice(p, size=2, replace=False)
                expects[j, i] += 1
            total = 0
            for me in range(p):
                total ^= piece_claims(me, [int(v) for v in sends[me]],
                                      [int(v) for v in expects[me]])
            off = ~np.eye(p, dtype=bool)
            agree = bool(np.all((sends == expects.T)[off]))
            assert (total == 0) == agree, (p, trial)


@pytest.mark.mpi
def test_int64_of_every_type_number_is_accepted(world: tuple[int, int]) -> None:
    rank, p = world
    x = np.ones(3, dtype=np.longlong)  # numpy's "longlong": int64, another type number
    assert x.dtype == np.int64
    np.testing.assert_array_equal(comm.all_reduce(x), np.full(3, p))
    out = np.empty(3, dtype=np.int64)  # "long" out for a "longlong" input
    comm.all_reduce(x, out=out)
    np.testing.assert_array_equal(out, np.full(3, p))
    # all_to_all_v: "longlong" pieces, with and without dtype=, into a "long" receive buffer
    base = np.arange(2 * p, dtype=np.longlong) + 10 * rank
    for dtype in (None, np.longlong, np.int64):
        got = comm.all_to_all_v([base[2 * j:2 * j + 2] for j in range(p)], [(2,)] * p,
                                dtype=dtype, out=np.empty(2 * p, dtype=np.int64))
        for j in range(p):
            np.testing.assert_array_equal(got[j], [10 * j + 2 * rank, 10 * j + 2 * rank + 1])


@pytest.mark.mpi
def test_validation_switch(world: tuple[int, int]) -> None:
    rank, p = world
    assert comm.validation() is True
    x = _local(rank, (2 * p, 3), np.dtype(np.float32), "transposed")
    with CommTrace() as on:
        checked = [comm.all_reduce(x), comm.reduce_scatter(x), comm.all_to_all(x, 0, 1)]
    comm.set_validation(False)
    try:
        assert comm.validation() is False
        with CommTrace() as off:
            unchecked = [comm.all_reduce(x), comm.reduce_scatter(x), comm.all_to_all(x, 0, 1)]
    finally:
        comm.set_validation(True)
    for a, b in zip(checked, unchecked, strict=True):
        np.testing.assert_array_equal(a, b, strict=True)
    # The agreement check itself is never traced.
    assert on.signature() == off.signature() and on.count() == 3
    with pytest.raises(TypeError, match=r"set_validation\(on\) takes a bool, got 1"):
        comm.set_validation(1)  # type: ignore[arg-type]
    assert comm.validation() is True


# ---------------------------------------------------------------- bad input


COLLECTIVES: dict[str, Callable[[Any], object]] = {
    "all_reduce": lambda x: comm.all_reduce(x),
    "all_gather": lambda x: comm.all_gather(x),
    "reduce_scatter": lambda x: comm.reduce_scatter(x),
    "all_to_all": lambda x: comm.all_to_all(x, 0, 0),
    "broadcast": lambda x: comm.broadcast(x, root=0),
    "send": lambda x: comm.send(x, dest=0),
    "all_to_all_v": lambda x: comm.all_to_all_v([x] * comm.get_group_size(),
                                                [(1,)] * comm.get_group_size()),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(COLLECTIVES))
@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, None, "x"], ids=["list", "float", "None", "str"])
def test_non_arrays_are_type_errors(name: str, bad: object) -> None:
    if name == "all_to_all_v" and bad is None:      # None is a legal piece: "send nothing"
        with pytest.raises(ValueError, match="pass dtype= when this rank sends no piece"):
            COLLECTIVES[name](bad)
        return
    with pytest.raises(TypeError, match=rf"{name}: expected a numpy.ndarray, got "
                                        rf"{type(bad).__name__}"):
        COLLECTIVES[name](bad)


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(COLLECTIVES))
@pytest.mark.parametrize("dtype", ["float16", "complex64", "bool", "uint8", "int8", "object"])
def test_unsupported_dtypes_are_type_errors(name: str, dtype: str) -> None:
    x = np.zeros((8, 8), dtype=dtype)
    with pytest.raises(TypeError, match=rf"dtype {dtype} is not supported; use one of "
                                        r"\['float32', 'float64', 'int32', 'int64'\]"):
        COLLECTIVES[name](x)


@pytest.mark.mpi
def test_recv_of_an_unsupported_dtype_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"recv: dtype float16 is not supported"):
        comm.recv(0, (2,), np.float16)


@pytest.mark.mpi
@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda x: comm.all_gather(x, axis=2), ValueError, "all_gather: axis=2 is out of range for "
                                                       "an array of rank 2"),
    (lambda x: comm.all_gather(x, axis=-3), ValueError, "axis=-3 is out of range"),
    (lambda x: comm.all_gather(x, axis=1.0), TypeError, "all_gather: axis must be an int, got 1.0"),
    (lambda x: comm.all_gather(x, axis=True), TypeError, "axis must be an int, got True"),
    (lambda x: comm.reduce_scatter(x, axis=5), ValueError, "reduce_scatter: axis=5 is out of"),
    (lambda x: comm.reduce_scatter(x, axis="0"), TypeError, "axis must be an int, got '0'"),
    (lambda x: comm.all_to_all(x, 2, 0), ValueError, "all_to_all: split_axis=2 is out of range"),
    (lambda x: comm.all_to_all(x, 0, -3), ValueError, "concat_axis=-3 is out of range"),
    (lambda x: comm.all_to_all(x, None, 0), TypeError, "split_axis must be an int, got None"),
    (lambda x: comm.all_gather(x[0, 0, ...]), ValueError,
     "all_gather: needs an array of rank >= 1, got a 0-d array"),
    (lambda x: comm.reduce_scatter(x[0, 0, ...]), ValueError, "reduce_scatter: needs an array"),
    (lambda x: comm.all_to_all(x[0, 0, ...], 0, 0), ValueError, "all_to_all: needs an array"),
    (lambda x: comm.all_reduce(x, "prod"), ValueError, "all_reduce: op must be one of ['sum', "
                                                       "'mean', 'max', 'min'], got 'prod'"),
    (lambda x: comm.reduce_scatter(x, op="avg"), ValueError, "op must be one of"),
    (lambda x: comm.broadcast(x, root=comm.get_group_size()), ValueError, "broadcast: root"),
    (lambda x: comm.broadcast(x, root=True), TypeError, "root must be an int (a world rank)"),
    (lambda x: comm.all_to_all_v([x], [(8, 8)] * 9), ValueError, "one piece and one receive "
                                                                 "shape per rank"),
    (lambda x: comm.all_to_all_v([None] * comm.get_group_size(),
                                 [None] * comm.get_group_size()), ValueError, "pass dtype="),
    (lambda x: comm.all_to_all_v([x] * comm.get_group_size(), [(8, 8)] * comm.get_group_size(),
                                 dtype=np.int32), TypeError, "share one supported dtype"),
    (lambda x: comm.all_to_all_v([x] * comm.get_group_size(), [(4, 4)] * comm.get_group_size()),
     ValueError, "keeps for itself must match its own receive shape, got (8, 8) and (4, 4)"),
    (lambda x: comm.all_to_all_v([None] * comm.get_group_size(), [(8, 8)] * comm.get_group_size(),
                                 dtype=np.float32), ValueError, "keeps for itself"),
])
def test_bad_arguments(call: Callable[[np.ndarray], object], error: type[Exception],
                       words: str) -> None:
    x = np.zeros((8, 8), dtype=np.float32)
    with pytest.raises(error) as info:
        call(x)
    assert words in str(info.value)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["reduce_scatter", "all_to_all"])
def test_indivisible_axis(world: tuple[int, int], name: str) -> None:
    _, p = world
    x = np.zeros((3, p + 1), dtype=np.float64)
    with pytest.raises(ValueError) as info:
        if name == "reduce_scatter":
            comm.reduce_scatter(x, axis=-1)
        else:
            comm.all_to_all(x, split_axis=1, concat_axis=0)
    assert str(info.value) == (f"{name}: axis 1 of shape (3, {p + 1}) has length {p + 1}, which "
                               f"does not split into {p} equal parts for a group of {p} ranks")


@pytest.mark.mpi
@pytest.mark.parametrize("name", [n for n in COLLECTIVES if n not in ("send", "all_to_all_v")]
                         + ["barrier"])
def test_group_with_a_rank_outside_the_world(world: tuple[int, int], name: str) -> None:
    _, p = world
    x = np.zeros((2, 2), np.float32)
    call: Callable[[list[int]], object] = {
        "all_reduce": lambda g: comm.all_reduce(x, group=g),
        "all_gather": lambda g: comm.all_gather(x, group=g),
        "reduce_scatter": lambda g: comm.reduce_scatter(x, group=g),
        "all_to_all": lambda g: comm.all_to_all(x, 0, 1, group=g),
        "broadcast": lambda g: comm.broadcast(x, 0, group=g),
        "barrier": lambda g: comm.barrier(g),
    }[name]
    with pytest.raises(ValueError, match=rf"group \[0, {p}\] names ranks \[{p}\] outside the "
                                         rf"world of {p}"):
        call([0, p])
    with pytest.raises(ValueError, match=r"names ranks \[-1\] outside"):
        call([-1])
    with pytest.raises(ValueError, match=rf"outside the world of {p}"):
        comm.create_group([0, p + 3])


@pytest.mark.mpi(min_size=2)
def test_caller_not_in_group(world: tuple[int, int]) -> None:
    rank, p = world
    other = (rank + 1) % p
    with pytest.raises(ValueError, match=rf"rank {rank} is not a member of group \[{other}\]; "
                                         "only members may use or create a group"):
        comm.all_reduce(np.zeros(2, np.float32), group=[other])
    with pytest.raises(ValueError, match=rf"rank {rank} is not a member"):
        comm.create_group([other])
    with pytest.raises(ValueError, match=rf"broadcast: root {other} is not in group \[{rank}\]"):
        comm.broadcast(np.zeros(2, np.float32), root=other, group=[rank])


def test_group_values() -> None:
    assert Group((4, 5, 6, 7)).index(6) == 2 and Group((3, 1)).size == 2
    assert str(Group((3, 1))) == "Group[3, 1]" and Group((1, 3)) != Group((3, 1))
    with pytest.raises(ValueError, match=r"non-empty and distinct, got \[\]"):
        Group(())
    with pytest.raises(ValueError, match=r"non-empty and distinct, got \[1, 1\]"):
        Group((1, 1))


# ---------------------------------------------------------------- CommTrace


@pytest.mark.mpi
def test_trace_nests_labels_and_totals(world: tuple[int, int]) -> None:
    rank, p = world
    x = np.ones((p, 2), np.float64)
    with CommTrace() as outer:
        comm.all_reduce(x)
        with CommTrace() as inner, comm.label("step1"):
            comm.all_gather(x)
            with comm.label("inner"):
                comm.reduce_scatter(x)
    comm.all_reduce(x)                  # after both traces: recorded by neither
    n = x.nbytes
    ar, ag, rs = 2 * (p - 1) * n // p, (p - 1) * n, (p - 1) * n // p
    assert outer.kinds() == ["AllReduce", "AllGather", "ReduceScatter"]
    assert inner.events == outer.events[1:]
    assert [e.label for e in outer.events] == ["", "step1", "step1/inner"]
    assert outer.signature() == [("AllReduce", tuple(range(p)), ar),
                                 ("AllGather", tuple(range(p)), ag),
                                 ("ReduceScatter", tuple(range(p)), rs)]
    assert outer.bytes_sent() == outer.bytes_recv() == ar + ag + rs
    assert outer.count() == 3 and outer.count("AllGather") == 1 and inner.count("AllReduce") == 0
    assert outer.by_kind()["AllGather"]["bytes_recv"] == ag
    assert outer.seconds() == pytest.approx(sum(e.seconds for e in outer.events))
    assert str(inner) == "CommTrace(AllGather×1, ReduceScatter×1)"
    assert "AllReduce" in outer.summary() and CommTrace().summary() == "no collectives"
    assert str(outer.events[0]).startswith(f"AllReduce(sum) group={list(range(p))} "
                                           f"float64[{p}, 2] sent={ar} recv={ar} ")


# ------------------------------------------------------------ properties (same draws on all ranks)


@pytest.mark.mpi
@settings(max_examples=8)
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       dtype=st.sampled_from(DTYPES), layout=st.sampled_from(LAYOUTS), data=st.data())
def test_property_gather_scatter_alltoall(shape: list[int], dtype: np.dtype, layout: str,
                                          data: st.DataObject) -> None:
    rank, p = comm.get_rank(), comm.get_group_size()
    nd = len(shape)
    axis = data.draw(st.integers(-nd, nd - 1), label="axis")
    concat = data.draw(st.integers(-nd, nd - 1), label="concat_axis")
    split_shape = list(shape)
    split_shape[axis] *= p
    x = _local(rank, shape, dtype, layout)
    y = _local(rank, split_shape, dtype, layout)
    gathered = comm.all_gather(x, axis=axis)
    scattered = comm.reduce_scatter(y, axis=axis, op="max")
    exchanged = comm.all_to_all(y, split_axis=axis, concat_axis=concat)
    xs = [_local(r, shape, dtype, layout) for r in range(p)]
    ys = [_local(r, split_shape, dtype, layout) for r in range(p)]
    np.testing.assert_array_equal(gathered, np.concatenate(xs, axis=axis), strict=True)
    np.testing.assert_array_equal(scattered, np.split(np.max(ys, axis=0), p, axis)[rank],
                                  strict=True)
    np.testing.assert_array_equal(
        exchanged, np.concatenate([np.split(a, p, axis)[rank] for a in ys], axis=concat),
        strict=True)


# ---------------------------------------------------------------- process settings (_env)


def _env_overridden() -> list[str]:
    s = _env.SETTINGS
    out = []
    if "local ranks" not in str(s["threads_from"]):
        out.append(f"threads from {s['threads_from']}")
    if s["wait_policy"] == "user" or s["wait_policy_from"] == "SIMPAR_WAIT_POLICY":
        out.append(f"wait policy from {s['wait_policy_from']}")
    if s["malloc"] == "system":
        out.append(f"malloc from {s['malloc_from']}")
    return out


def _page_faults_per_allocation(nbytes: int, count: int = 8) -> float:
    import resource

    np.ones(nbytes // 8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(count):
        np.ones(nbytes // 8)            # allocated, written, freed
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / count


@pytest.mark.mpi
def test_env_settings_follow_the_launcher(world: tuple[int, int]) -> None:
    from threadpoolctl import threadpool_info

    _, p = world
    s = _env.SETTINGS
    launched = os.environ.get("MPI_LOCALNRANKS")
    assert s["local_ranks"] == (int(launched) if launched else 1)
    if launched:
        assert s["local_ranks"] == p             # one host: Hydra's count is the world size
    assert s["cores"] == _env.usable_cores()
    blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    assert blas and all(n == s["blas_threads"] for n in blas)
    if _env_overridden():
        pytest.skip("the environment chose: " + "; ".join(_env_overridden()))
    ranks, cores = int(s["local_ranks"]), int(s["cores"])  # type: ignore[call-overload]
    assert s["blas_threads"] == max(1, cores // ranks)
    assert s["wait_policy"] == ("yield" if ranks > cores else "spin")
    if s["wait_policy"] == "yield":
        assert os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"
        assert os.environ["MPIR_CVAR_POLLS_BEFORE_YIELD"] == "1"
    # glibc reuses freed arrays instead of mapping (and page-faulting) fresh memory every time.
    assert s["malloc"] == "mmap_threshold=256MiB trim_threshold=512MiB"
    assert _page_faults_per_allocation(16 * 2**20) < 4


@pytest.mark.mpi(min_size=8)
def test_env_settings_with_8_ranks_on_2_cores() -> None:
    if _env.usable_cores() >= 8:
        pytest.skip(f"this host has {_env.usable_cores()} cores, enough for 8 spinning ranks")
    if _env_overridden():
        pytest.skip("the environment chose: " + "; ".join(_env_overridden()))
    s = _env.SETTINGS
    assert (s["local_ranks"], s["blas_threads"], s["wait_policy"]) == (8, 1, "yield")
    assert s["threads_from"] == f"{s['cores']} cores / 8 local ranks"
    assert s["wait_policy_from"] == f"8 ranks > {s['cores']} cores"


_ENV_PROBE = """
import importlib.util, json, os, sys
cases, out = json.loads(sys.argv[2]), []
base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
for env, cores in cases:
    os.environ.clear(); os.environ.update(base); os.environ.update(env)
    spec = importlib.util.spec_from_file_location("_env_probe", sys.argv[1])
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    mod.usable_cores = lambda: cores
    try:
        s = mod.apply()
        out.append([s["blas_threads"], s["wait_policy"], os.environ.get("OMP_NUM_THREADS"),
                    os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD"), s["malloc"]])
    except ValueError as e:
        out.append(["ValueError", str(e)])
print(json.dumps(out))
"""


def test_env_decision_table() -> None:
    """_env.apply() in a fresh interpreter (no numpy, no MPI) for each environment."""
    tuned = "mmap_threshold=256MiB trim_threshold=512MiB"
    cases: list[tuple[dict[str, str], int, list[Any]]] = [
        ({"MPI_LOCALNRANKS": "8"}, 2, [1, "yield", "1", "1", tuned]),
        ({"MPI_LOCALNRANKS": "4"}, 2, [1, "yield", "1", "1", tuned]),
        ({"MPI_LOCALNRANKS": "2"}, 2, [1, "spin", "1", None, tuned]),
        ({}, 2, [2, "spin", "2", None, tuned]),
        ({"PMI_SIZE": "8"}, 16, [2, "spin", "2", None, tuned]),
        ({"MPI_LOCALNRANKS": "8", "SIMPAR_WAIT_POLICY": "spin"}, 2, [1, "spin", "1", None, tuned]),
        ({"SIMPAR_WAIT_POLICY": "yield"}, 2, [2, "yield", "2", "1", tuned]),
        ({"MPI_LOCALNRANKS": "8", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"}, 2,
         [1, "user", "1", "0", tuned]),
        ({"MPI_LOCALNRANKS": "8", "OMP_NUM_THREADS": "2"}, 2, [2, "yield", "2", "1", tuned]),
        ({"MPI_LOCALNRANKS": "8", "SIMPAR_NUM_THREADS": "3"}, 2, [3, "yield", "3", "1", tuned]),
        ({"SIMPAR_MALLOC": "system"}, 2, [2, "spin", "2", None, "system"]),
        ({"MALLOC_TRIM_THRESHOLD_": "4096"}, 2, [2, "spin", "2", None, "system"]),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}, 2,
         [2, "spin", "2", None, "system"]),
        ({"SIMPAR_MALLOC": "tuned", "MALLOC_TOP_PAD_": "0"}, 2, [2, "spin", "2", None, tuned]),
        ({"SIMPAR_WAIT_POLICY": "sleep"}, 2,
         ["ValueError", "SIMPAR_WAIT_POLICY must be 'spin' or 'yield', got 'sleep'"]),
        ({"SIMPAR_NUM_THREADS": "0"}, 2,
         ["ValueError", "SIMPAR_NUM_THREADS must be a positive integer, got '0'"]),
        ({"SIMPAR_MALLOC": "jemalloc"}, 2,
         ["ValueError", "SIMPAR_MALLOC must be 'tuned' or 'system', got 'jemalloc'"]),
    ]
    path = Path(_env.__file__)
    probe = json.dumps([[env, cores] for env, cores, _ in cases])
    result = subprocess.run([sys.executable, "-c", _ENV_PROBE, str(path), probe],
                            capture_output=True, text=True, check=True, timeout=60)
    got = json.loads(result.stdout)
    for (env, cores, want), row in zip(cases, got, strict=True):
        assert row == want, (env, cores)


# ---------------------------------------------------------------- out= buffers
@pytest.mark.mpi
def test_out_buffers_receive_the_result(world: tuple[int, int]) -> None:
    rank, p = world
    x = np.arange(4 * p, dtype=np.float64).reshape(2 * p, 2) + rank
    total = sum(np.arange(4 * p, dtype=np.float64).reshape(2 * p, 2) + r for r in range(p))
    out = np.empty_like(x)
    assert comm.all_reduce(x, out=out) is out
    np.testing.assert_array_equal(out, total)
    inplace = x.copy()
    comm.all_reduce(inplace, out=inplace)
    np.testing.assert_array_equal(inplace, total)
    gathered = np.empty((p * 2 * p, 2))
    assert comm.all_gather(x, out=gathered) is gathered
    np.testing.assert_array_equal(gathered, np.concatenate(
        [np.arange(4 * p, dtype=np.float64).reshape(2 * p, 2) + r for r in range(p)]))
    side = np.empty((2 * p, 2 * p))
    comm.all_gather(x, axis=1, out=side)
    np.testing.assert_array_equal(side, np.concatenate(
        [np.arange(4 * p, dtype=np.float64).reshape(2 * p, 2) + r for r in range(p)], axis=1))
    piece = np.empty((2, 2))
    comm.reduce_scatter(x, out=piece)
    np.testing.assert_array_equal(piece, total[2 * rank:2 * rank + 2])
    moved = np.empty_like(x)
    np.testing.assert_array_equal(comm.all_to_all(x, 0, 0, out=moved), comm.all_to_all(x, 0, 0))
    b = x.copy()
    comm.broadcast(b, root=p - 1, out=b)
    np.testing.assert_array_equal(b, np.arange(4 * p, dtype=np.float64).reshape(2 * p, 2) + p - 1)
    with pytest.raises(ValueError, match="out must be a writeable C-contiguous float64 array"):
        comm.all_reduce(x, out=np.empty((3,)))
    with pytest.raises(TypeError, match="out must be a numpy.ndarray"):
        comm.all_reduce(x, out=[0.0])  # type: ignore[arg-type]


def test_nested_traces_with_equal_events_close_in_order() -> None:
    """Each trace is its own recording: closing the inner of two traces that hold the same
    events closes that one, and the outer goes on recording."""
    from simpar.comm import trace as trace_module

    with CommTrace() as outer:
        with CommTrace() as inner:
            trace_module.record("AllReduce", (0,), 8, 8, 0.0, np.float32, (2,), "sum")
        assert inner.events == outer.events
        trace_module.record("AllGather", (0,), 4, 4, 0.0, np.float32, (1,))
    assert inner.kinds() == ["AllReduce"] and outer.kinds() == ["AllReduce", "AllGather"]
    assert trace_module._open == 0 and not trace_module.tracing()


def test_trace_belongs_to_its_thread() -> None:
    """A trace open on one thread records that thread's collectives only, and closing it
    leaves no trace recording anywhere (record() skips all work while none is open)."""
    import threading

    from simpar.comm import trace as trace_module

    started, release = threading.Event(), threading.Event()
    seen: dict[str, list[str]] = {}

    def other() -> None:
        with CommTrace() as t:
            started.set()
            release.wait(timeout=30)
            trace_module.record("AllGather", (0,), 4, 4, 0.0, np.float32, (1,))
        seen["other"] = t.kinds()

    thread = threading.Thread(target=other)
    thread.start()
    assert started.wait(timeout=30)
    with CommTrace() as mine:
        trace_module.record("AllReduce", (0,), 8, 8, 0.0, np.float32, (2,), "sum")
    release.set()
    thread.join(timeout=30)
    assert mine.kinds() == ["AllReduce"] and seen["other"] == ["AllGather"]
    assert trace_module._open == 0 and not trace_module.tracing()
    with CommTrace() as late:
        pass
    trace_module.record("AllReduce", (0,), 8, 8, 0.0, np.float32, (2,), "sum")
    assert late.events == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sleep", [False, True])
def test_a_ring_of_nonblocking_sends_arrives_whether_the_receive_sleeps_or_not(
        world: tuple[int, int], sleep: bool) -> None:
    """Each rank sends the next one its rank's array: waited in MPI, or tested with sleeps
    between (the pipeline runner's receives where ranks outnumber the cores)."""
    rank, size = world
    before, after = (rank - 1) % size, (rank + 1) % size
    mine = np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * rank
    with CommTrace() as trace:
        request = comm.irecv(before, (2, 3), np.float64, tag=5)
        sent = comm.isend(mine, after, tag=5)
        got = request.wait(sleep=sleep)
        sent.wait()
    np.testing.assert_array_equal(got, np.arange(6).reshape(2, 3) + 10 * before)
    assert sorted((e.kind, e.group, e.bytes_sent, e.bytes_recv) for e in trace.events) == [
        ("Receive", (before, rank), 0, 48), ("Send", (rank, after), 48, 0)]
    # A shorter message than posted raises on the rank that receives it (here: every rank).
    request = comm.irecv(before, (2, 4), np.float64, tag=6)
    sent = comm.isend(mine, after, tag=6)
    with pytest.raises(CommMismatchError, match=rf"expected 64 bytes \(float64\[2, 4\]\) "
                                                f"from rank {before}, got 48"):
        request.wait(sleep=sleep)
    sent.wait()
