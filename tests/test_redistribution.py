"""simpar.redistribution, planning only (one process): which collectives a transition takes,
that every non-partial plan receives exactly the lower bound, refinement of device matrices,
planning for 4096 devices, and bad input. Plans are also run on simulated ranks (threads
exchanging numpy arrays) and checked against numpy, including meshes MPI runs don't cover."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise, product
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simpar.layout import TensorLayout, assemble
from simpar.redistribution import (
    RedistributionPlan,
    common_refinement,
    execute,
    min_bytes,
    refine,
)
from simpar.redistribution import plan as _plan
from tests.layout_strategies import factorizations, layout_pairs, layout_structure

L = TensorLayout
COLLECTIVE_KINDS = {"AllGather", "AllToAll", "AllToAllV", "ReduceScatter", "AllReduce"}


def plan(src: TensorLayout, dst: TensorLayout, enable_alltoall: bool = True
         ) -> RedistributionPlan:
    """The planner with all-to-all on, as these tests were written for (MindSpore's default,
    and simpar's, is off: test_the_default_is_mindspores_no_alltoall)."""
    return _plan(src, dst, enable_alltoall)


def test_the_default_is_mindspores_no_alltoall() -> None:
    s0, s1 = L((8,), (0, -1), (16, 16)), L((8,), (-1, 0), (16, 16))
    assert _plan(s0, s1).kinds() == ["AllGather", "Slice"]
    assert _plan(s0, s1) is _plan(s0, s1, False) and not _plan(s0, s1).enable_alltoall
    assert _plan(s0, s1, True).kinds() == ["AllToAll"]


# ------------------------------------------------------------------ simulated ranks
class _SimComm:
    """The part of simpar.comm that execute uses, for ``size`` threads in one process.

    Every rank calls every collective of a plan in the same order (possibly in different
    groups), so one world-wide barrier per call is enough to exchange the buffers. Bytes are
    counted with the convention of simpar/comm/trace.py.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=30)
        self._board: dict[int, Any] = {}
        self._local = threading.local()
        self.recv_bytes = [0] * size
        self.calls: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(size)]

    # --- world
    def get_rank(self) -> int:
        return int(self._local.rank)

    def get_group_size(self) -> int:
        return self.size

    @contextmanager
    def label(self, text: str) -> Iterator[None]:
        yield

    # --- agreement checks: the threads run one plan object, so there is nothing to agree on
    def validation(self) -> bool:
        return False

    @contextmanager
    def validation_disabled(self) -> Iterator[None]:
        yield

    def _exchange(self, value: Any) -> dict[int, Any]:
        me = self.get_rank()
        self._board[me] = value
        self._barrier.wait()
        seen = dict(self._board)
        self._barrier.wait()
        return seen

    def _note(self, kind: str, group: tuple[int, ...], nbytes: int) -> None:
        me = self.get_rank()
        self.calls[me].append((kind, group))
        self.recv_bytes[me] += nbytes

    # --- collectives (group = world ranks in group order)
    def all_reduce(self, x: np.ndarray, group: Sequence[int]) -> np.ndarray:
        g = tuple(group)
        seen = self._exchange(np.array(x))
        p, n = len(g), x.nbytes
        self._note("AllReduce", g, 2 * (p - 1) * n // p)
        return sum((seen[r] for r in g[1:]), seen[g[0]].copy())

    def all_gather(self, x: np.ndarray, axis: int, group: Sequence[int]) -> np.ndarray:
        g = tuple(group)
        seen = self._exchange(np.array(x))
        self._note("AllGather", g, (len(g) - 1) * x.nbytes)
        return np.concatenate([seen[r] for r in g], axis=axis)

    def reduce_scatter(self, x: np.ndarray, axis: int, group: Sequence[int]) -> np.ndarray:
        g = tuple(group)
        seen = self._exchange(np.array(x))
        total = sum((seen[r] for r in g[1:]), seen[g[0]].copy())
        out = np.split(total, len(g), axis=axis)[g.index(self.get_rank())]
        self._note("ReduceScatter", g, (len(g) - 1) * out.nbytes)
        return np.ascontiguousarray(out)

    def all_to_all(self, x: np.ndarray, split_axis: int, concat_axis: int,
                   group: Sequence[int]) -> np.ndarray:
        g = tuple(group)
        seen = self._exchange(np.array(x))
        me = g.index(self.get_rank())
        pieces = [np.split(seen[r], len(g), axis=split_axis)[me] for r in g]
        self._note("AllToAll", g, (len(g) - 1) * pieces[0].nbytes)
        return np.concatenate(pieces, axis=concat_axis)

    def all_to_all_v(self, pieces: Sequence[np.ndarray | None],
                     recv_shapes: Sequence[Sequence[int] | None], dtype: object = None
                     ) -> list[np.ndarray | None]:
        me = self.get_rank()
        seen = self._exchange([None if a is None else np.array(a) for a in pieces])
        out: list[np.ndarray | None] = []
        got = 0
        for r, shape in enumerate(recv_shapes):
            piece = seen[r][me]
            if shape is None:
                assert piece is None or r == me, (r, me)
                out.append(None)
                continue
            assert piece is not None and piece.shape == tuple(shape), (r, me, shape)
            out.append(piece)
            if r != me:
                got += piece.nbytes
        self._note("AllToAllV", tuple(range(self.size)), got)
        return out

    # --- driver
    def run(self, fn: Any) -> list[Any]:
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        if real or errors:
            raise (real or errors)[0]
        return results


def _pending_parts(g: np.ndarray, lay: TensorLayout, seed: int) -> list[np.ndarray]:
    """Per rank, integer pending parts whose sum over each partial group is g's piece (the
    same on replicas); plain shards for a non-partial layout."""
    rng = np.random.default_rng(seed)
    coords = [lay.mesh.coordinate(r) for r in range(lay.device_num)]
    parts: dict[tuple[object, ...], np.ndarray] = {}
    out = []
    for r in range(lay.device_num):
        pc = tuple(coords[r][a] for a in lay.partial_axes)
        key = (lay.chunk_index(r), pc)
        if any(pc) and key not in parts:
            parts[key] = rng.integers(-9, 9, size=lay.local_shape())
    for r in range(lay.device_num):
        pc = tuple(coords[r][a] for a in lay.partial_axes)
        if any(pc):
            out.append(parts[(lay.chunk_index(r), pc)].copy())
            continue
        piece = np.array(g[lay.slices(r)])
        for other in product(*(range(lay.device_matrix[a]) for a in lay.partial_axes)):
            if any(other):
                piece -= parts[(lay.chunk_index(r), other)]
        out.append(piece)
    return out


def _simulate(p: RedistributionPlan, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray],
                                                            _SimComm]:
    src = p.src
    g = np.random.default_rng(seed).integers(-99, 99, size=src.shape)
    shards = _pending_parts(g, src, seed + 1)
    sim = _SimComm(src.device_num)
    out = sim.run(lambda r: execute(p, shards[r], comm=sim))
    return g, out, sim


def _check_result(g: np.ndarray, out: list[np.ndarray], dst: TensorLayout) -> None:
    for r, x in enumerate(out):
        assert x.shape == dst.local_shape() and x.dtype == g.dtype
        if not dst.partial:
            np.testing.assert_array_equal(x, g[dst.slices(r)], err_msg=f"rank {r}")
    np.testing.assert_array_equal(assemble(out, dst), g)
    held: dict[tuple[object, ...], np.ndarray] = {}
    for r, x in enumerate(out):  # replicas agree
        coord = dst.mesh.coordinate(r)
        key = (dst.chunk_index(r), tuple(coord[a] for a in dst.partial_axes))
        np.testing.assert_array_equal(held.setdefault(key, x), x, err_msg=f"rank {r}")


# ------------------------------------------------------------------ plan structure
def _kinds(src: TensorLayout, dst: TensorLayout, **kw: bool) -> list[str]:
    return plan(src, dst, **kw).kinds()


S0, S1, R = (0, -1), (-1, 0), (-1, -1)


def test_1d_mesh_transitions_are_one_step_each() -> None:
    shape = (16, 16)
    assert _kinds(L((8,), S0, shape), L((8,), S1, shape)) == ["AllToAll"]
    assert _kinds(L((8,), S0, shape), L((8,), R, shape)) == ["AllGather"]
    assert _kinds(L((8,), R, shape), L((8,), S1, shape)) == ["Slice"]
    assert _kinds(L((8,), R, shape, (0,)), L((8,), S0, shape)) == ["ReduceScatter"]
    assert _kinds(L((8,), R, shape, (0,)), L((8,), R, shape)) == ["AllReduce"]
    assert _kinds(L((8,), R, shape), L((8,), R, shape, (0,))) == ["Zero"]


def test_s0_to_s1_step_details_and_bytes() -> None:
    src, dst = L((8,), S0, (16, 16)), L((8,), S1, (16, 16))
    p = plan(src, dst)
    (step,) = p.steps
    assert (step.device_axes, step.tensor_dim, step.concat_dim) == ((0,), 1, 0)
    assert step.group_size == 8
    # Each rank keeps its own 2x2 block of its 2x16 row block and receives 7 blocks.
    assert [p.recv_bytes(r, 8) for r in range(8)] == [7 * 4 * 8] * 8 == list(min_bytes(src, dst, 8))
    assert p.send_bytes(3, 4) == 7 * 4 * 4
    assert p.seconds(4) > 0
    assert p.collectives() == [step]


def test_partial_steps_bytes() -> None:
    shape = (16, 16)
    rs = plan(L((8,), R, shape, (0,)), L((8,), S0, shape))
    assert rs.recv_bytes(0, 4) == 7 * 32 * 4  # (p-1)/p of the 256-element buffer
    ar = plan(L((8,), R, shape, (0,)), L((8,), R, shape))
    assert ar.recv_bytes(5, 4) == 2 * 7 * 256 * 4 // 8
    # CommTrace rounds an AllReduce's 2 (p-1)/p n in bytes: one int64 over 8 ranks is 14 bytes
    # (rounding in elements first would say 8).
    tiny = plan(L((8,), (-1,), (1,), (0,)), L((8,), (-1,), (1,)))
    assert tiny.recv_bytes(0, 8) == 14 and tiny.send_bytes(0, 8) == 14


def test_identical_layouts_give_an_empty_plan() -> None:
    lay = L((2, 4), (1, 0), (4, 8))
    p = plan(lay, lay)
    assert p.steps == () and len(p) == 0 and p.kinds() == []
    assert p.recv_bytes(0, 4) == 0 and p.seconds(4) == 0
    assert "nothing to do" in str(p)
    # The same placement over another device matrix is also nothing to do.
    assert plan(L((8,), S0, (16, 4)), L((2, 4), ((1, 0), -1), (16, 4))).steps == ()
    assert plan(L((2, 1, 4), (2, 0), (4, 8)), L((2, 4), (1, 0), (4, 8))).steps == ()


def test_device_matrix_changes() -> None:
    shape = (8, 8)
    # (2, 4) -> (8,): rows over 2 and columns over 4 become rows over 8: the 4-axis moves.
    a = plan(L((2, 4), (1, 0), shape), L((8,), S0, shape))
    assert a.kinds() == ["AllToAll"]
    assert a.steps[0].device_axes == (1,) and a.steps[0].src.device_matrix == (2, 4)
    # (8,) -> (4, 2) with the 2-axis replicated: gather over the inner axis of 2.
    b = plan(L((8,), S0, shape), L((4, 2), (1, -1), shape))
    assert b.kinds() == ["AllGather"] and b.steps[0].group_size == 2
    # (4, 2) -> (2, 4): refined to (2, 2, 2).
    c = plan(L((4, 2), (1, 0), shape), L((2, 4), (1, 0), shape))
    assert c.steps[0].src.device_matrix == (2, 2, 2)
    for p in (a, b, c):
        src, dst = p.src, p.dst
        assert [p.recv_bytes(r, 4) for r in range(8)] == list(min_bytes(src, dst, 4))


def test_dimension_over_several_axes_in_either_order() -> None:
    shape = (16, 4)
    outer = L((2, 2, 2), ((2, 1), -1), shape)
    inner = L((2, 2, 2), ((1, 2), -1), shape)
    rows2 = L((2, 2, 2), (2, -1), shape)
    rows8 = L((2, 2, 2), ((2, 1, 0), -1), shape)
    assert _kinds(outer, rows2) == ["AllGather"]
    assert _kinds(rows2, outer) == ["Slice"]
    assert _kinds(outer, rows8) == ["Slice"]
    assert _kinds(rows8, outer) == ["AllGather"]
    for src, dst in ((outer, inner), (inner, outer), (inner, rows2), (rows8, inner)):
        p = plan(src, dst)
        assert len(p.collectives()) == 1, str(p)
        assert [p.recv_bytes(r, 4) for r in range(8)] == list(min_bytes(src, dst, 4)), str(p)


def test_replicated_axes_on_either_side() -> None:
    shape = (8, 8)
    rep_right = L((2, 4), (1, -1), shape)     # rows over 2, replicated over the 4-axis
    rep_left = L((2, 4), (-1, 0), shape)      # columns over 4, replicated over the 2-axis
    split = L((2, 4), (1, 0), shape)
    assert _kinds(rep_right, split) == ["Slice"]
    assert _kinds(rep_left, split) == ["Slice"]
    assert _kinds(split, rep_right) == ["AllGather"]
    assert _kinds(split, rep_left) == ["AllGather"]
    for src, dst in ((rep_right, rep_left), (rep_left, rep_right),
                     (rep_right, L((2, 4), (0, -1), shape))):
        p = plan(src, dst)
        assert len(p.collectives()) <= 1, str(p)
        assert [p.recv_bytes(r, 4) for r in range(8)] == list(min_bytes(src, dst, 4)), str(p)


def test_partial_sources_resolve_with_one_reduce() -> None:
    shape = (8, 8)
    p = plan(L((2, 4), (-1, 0), shape, (1,)), L((2, 4), (1, 0), shape))
    assert p.kinds() == ["ReduceScatter"] and p.steps[0].tensor_dim == 0
    q = plan(L((2, 4), (-1, 0), shape, (1,)), L((2, 4), (-1, 0), shape))
    assert q.kinds() == ["AllReduce"] and q.steps[0].device_axes == (0,)
    # Partial over both axes, scattered onto two dims: one ReduceScatter per dim.
    r = plan(L((2, 4), R, shape, (0, 1)), L((2, 4), (1, 0), shape))
    assert r.kinds() == ["ReduceScatter", "ReduceScatter"]
    # Partial axes common to both sides are carried without communication on them.
    s = plan(L((2, 4), (-1, -1), shape, (1,)), L((2, 4), (-1, 0), shape, (1,)))
    assert s.kinds() == ["Slice"]


def test_without_alltoall_only_gathers_and_slices() -> None:
    shape = (16, 16)
    p = plan(L((8,), S0, shape), L((8,), S1, shape), enable_alltoall=False)
    assert p.kinds() == ["AllGather", "Slice"] and not p.enable_alltoall
    q = plan(L((2, 4), (1, 0), shape), L((2, 4), (0, 1), shape), enable_alltoall=False)
    assert set(q.kinds()) <= {"AllGather", "Slice"}
    assert plan(L((8,), R, shape, (0,)), L((8,), S0, shape),
                enable_alltoall=False).kinds() == ["ReduceScatter"]
    # It costs more than the bound.
    assert p.recv_bytes(0, 4) > min_bytes(p.src, p.dst, 4)[0]


@given(layout_pairs(src_partial=True, dst_partial=True))
def test_without_alltoall_property(pair: tuple[TensorLayout, TensorLayout]) -> None:
    p = plan(*pair, enable_alltoall=False)
    assert set(p.kinds()) <= {"AllGather", "Slice", "Zero", "ReduceScatter", "AllReduce"}, str(p)


def test_plans_are_cached_and_printable() -> None:
    a = plan(L((8,), S0, (16, 16)), L((8,), S1, (16, 16)))
    b = plan(L([8], [0, -1], [16, 16]), L((8,), (-1, (0,)), (16, 16)))
    assert a is b
    assert plan(a.src, a.dst, enable_alltoall=False) is not a
    text = str(a)
    assert text.splitlines()[0] == "[8]:[0,-1] [16, 16] -> [8]:[-1,0] [16, 16]"
    assert "AllToAll" in text and "split=1 concat=0" in text
    two = str(plan(L((2, 4), R, (8, 8), (0, 1)), L((2, 4), (1, 0), (8, 8))))
    assert two.count("ReduceScatter") == 2 and len(two.splitlines()) == 3
    assert all(str(s) for s in a.steps) and hash(a) == hash(b)


def test_plan_steps_chain() -> None:
    p = plan(L((2, 4), R, (8, 8), (0, 1)), L((4, 2), (0, 1), (8, 8)))
    for before, after in pairwise(p.steps):
        assert before.dst == after.src
    assert refine(p.dst, p.steps[-1].dst.device_matrix) == p.steps[-1].dst


# ------------------------------------------------------------------ refinement
@pytest.mark.parametrize("a, b, want", [
    ((2, 4), (8,), (2, 4)),
    ((8,), (2, 4), (2, 4)),
    ((4, 2), (2, 4), (2, 2, 2)),
    ((2, 1, 4), (8,), (2, 4)),
    ((1, 8), (8, 1), (8,)),
    ((2, 3), (3, 2), None),
    ((4, 3), (2, 6), (2, 2, 3)),
    ((8,), (4,), None),
    ((1,), (1, 1), (1,)),
])
def test_common_refinement(a: tuple[int, ...], b: tuple[int, ...],
                           want: tuple[int, ...] | None) -> None:
    assert common_refinement(a, b) == want


def test_refine_example_and_errors() -> None:
    assert refine(L((8,), (0,), (16,)), (2, 4)).tensor_map == ((1, 0),)
    # Partial over the size-4 axis (map value 0), which refines into mesh axes 1 and 2.
    fine = refine(L((2, 4), (-1, -1), (4, 4), (0,)), (2, 2, 2))
    assert fine.partial_axes == (1, 2) and fine.partial == (0, 1)
    lay = L((2, 4), (1, 0), (4, 8))
    assert refine(lay, (2, 4)) is lay
    for bad in ((4, 2), (2, 2), (2, 4, 2), (16,)):
        with pytest.raises(ValueError, match="does not refine"):
            refine(lay, bad)


@st.composite
def _layout_and_other_matrix(draw: st.DrawFn) -> tuple[TensorLayout, tuple[int, ...]]:
    p = draw(st.sampled_from([4, 6, 8, 12]))
    ndim = draw(st.integers(1, 3))
    dm, dims, partial, cuts = draw(layout_structure(p, ndim, True))
    shape = [c * draw(st.integers(1, 2)) for c in cuts]
    other = draw(st.sampled_from([f for k in (1, 2, 3) for f in factorizations(p, k)]))
    return L.from_dim_axes(dm, dims, shape, partial), other


@given(_layout_and_other_matrix())
def test_refined_layouts_hold_the_same_slices(case: tuple[TensorLayout, tuple[int, ...]]
                                              ) -> None:
    lay, other = case
    fine = common_refinement(lay.device_matrix, other)
    if fine is None:
        return
    assert math.prod(fine) == lay.device_num and 1 not in fine or fine == (1,)
    ref = refine(lay, fine)
    assert ref.device_matrix == fine and ref.shape == lay.shape
    for r in range(lay.device_num):
        assert ref.slice_of(r) == lay.slice_of(r)
        assert set(ref.partial_group(r)) == set(lay.partial_group(r))
        assert set(ref.replica_group(r)) == set(lay.replica_group(r))
    assert common_refinement(fine, lay.device_matrix) == fine


# ------------------------------------------------------------------ bytes == lower bound
@given(layout_pairs(dst_partial=True))
def test_non_partial_plans_receive_exactly_the_lower_bound(
        pair: tuple[TensorLayout, TensorLayout]) -> None:
    src, dst = pair
    p = plan(src, dst)
    bound = min_bytes(src, dst, 4)
    assert [p.recv_bytes(r, 4) for r in range(src.device_num)] == list(bound), str(p)
    assert len(p.collectives()) <= 1, str(p)
    assert sum(p.send_bytes(r, 4) for r in range(src.device_num)) == sum(bound)


@given(layout_pairs(src_partial=True, dst_partial=True))
def test_plans_reach_dst_and_never_send_more_than_gathering(
        pair: tuple[TensorLayout, TensorLayout]) -> None:
    src, dst = pair
    for enable in (True, False):
        p = plan(src, dst, enable_alltoall=enable)
        assert p.src == src and p.dst == dst
        if p.steps:
            assert p.steps[-1].dst == refine(dst, p.steps[-1].dst.device_matrix)
        for before, after in pairwise(p.steps):
            assert before.dst == after.src
        # Never more than an AllReduce of everything plus a gather of everything.
        worst = 2 * math.prod(src.shape)
        assert all(p.recv_bytes(r, 1) <= worst for r in range(src.device_num))


# ------------------------------------------------------------------ simulated execution
@given(layout_pairs(device_nums=(8, 4, 6), src_partial=True, dst_partial=True, max_ndim=3),
       st.booleans(), st.integers(0, 1000))
def test_simulated_execution_matches_numpy(pair: tuple[TensorLayout, TensorLayout],
                                           enable: bool, seed: int) -> None:
    src, dst = pair
    p = plan(src, dst, enable_alltoall=enable)
    g, out, sim = _simulate(p, seed)
    _check_result(g, out, dst)
    assert sim.recv_bytes == [p.recv_bytes(r, 8) for r in range(src.device_num)], str(p)
    if not src.partial and enable:
        assert sim.recv_bytes == list(min_bytes(src, dst, 8))
    kinds = [k for k in p.kinds() if k in COLLECTIVE_KINDS]
    assert all([k for k, _ in calls] == kinds for calls in sim.calls)


@pytest.mark.parametrize("src, dst", [
    (L((2, 3), (1, 0), (6, 6)), L((3, 2), (0, 1), (6, 6))),
    (L((2, 3), (1, -1), (6, 6), (0,)), L((3, 2), (-1, 0), (6, 6))),
    (L((2, 3), (1, 0), (6, 6)), L((3, 2), (1, -1), (6, 6), (0,))),
    (L((3, 2), (-1, -1), (6, 6)), L((2, 3), ((1, 0), -1), (6, 6))),
])
@pytest.mark.parametrize("enable", [True, False])
def test_unrelated_device_matrices(src: TensorLayout, dst: TensorLayout, enable: bool) -> None:
    assert common_refinement(src.device_matrix, dst.device_matrix) is None
    p = plan(src, dst, enable_alltoall=enable)
    if not enable:
        assert not {"AllToAll", "AllToAllV"} & set(p.kinds())
    g, out, sim = _simulate(p)
    _check_result(g, out, dst)
    assert sim.recv_bytes == [p.recv_bytes(r, 8) for r in range(6)]
    if enable and not src.partial:
        assert sim.recv_bytes == list(min_bytes(src, dst, 8))


def test_scalar_partial_to_replicated() -> None:
    p = plan(L((4,), (), (), (0,)), L((4,), (), ()))
    assert p.kinds() == ["AllReduce"]
    g, out, _ = _simulate(p)
    assert all(x.shape == () and x == g for x in out)


# ------------------------------------------------------------------ planning at scale
@pytest.mark.parametrize("src, dst", [
    (L((16, 256), (1, 0), (4096, 4096)), L((16, 256), (0, 1), (4096, 4096))),
    (L((4096,), S0, (4096, 4096)), L((4096,), S1, (4096, 4096))),
    (L((16, 256), (1, 0), (4096, 4096)), L((4096,), S0, (4096, 4096))),
    (L((16, 256), (-1, (1, 0)), (4096, 4096)), L((16, 256), (-1, (0, 1)), (4096, 4096))),
    (L((16, 256), (1, -1), (4096, 4096)), L((256, 16), (0, 1), (4096, 4096))),
    (L((16, 256), (1, 0), (4096, 4096)), L((16, 256), R, (4096, 4096))),
])
def test_planning_for_4096_devices(src: TensorLayout, dst: TensorLayout) -> None:
    p = plan(src, dst)
    assert 1 <= len(p.collectives()) <= 1, str(p)
    bound = min_bytes(src, dst, 4)
    for r in (0, 1, 255, 256, 2049, 4095):
        assert p.recv_bytes(r, 4) == bound[r]
    assert p.seconds(4) > 0 and str(p)


def test_planning_partial_for_4096_devices() -> None:
    src = L((16, 256), (1, -1), (4096, 4096), partial=(0,))
    p = plan(src, L((16, 256), (1, 0), (4096, 4096)))
    assert p.kinds() == ["ReduceScatter"] and p.steps[0].group_size == 256
    # The local (256, 4096) block is reduced over 256 ranks: each receives 255/256 of it.
    assert p.recv_bytes(4095, 4) == 255 * 4096 * 4


# ------------------------------------------------------------------ bad input
def test_plan_errors() -> None:
    a = L((8,), S0, (16, 16))
    with pytest.raises(ValueError, match=r"src shape \(16, 16\) and dst shape \(16, 8\) differ"):
        plan(a, L((8,), S0, (16, 8)))
    with pytest.raises(ValueError, match="lives on 8 devices .* and dst on 4"):
        plan(a, L((4,), S0, (16, 16)))
    with pytest.raises(TypeError, match="must be TensorLayout, got str and TensorLayout"):
        plan("S0", a)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be TensorLayout"):
        plan(a, {"device_matrix": [8]})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enable_alltoall must be a bool, got 1"):
        plan(a, a, enable_alltoall=1)  # type: ignore[arg-type]


def test_min_bytes_errors() -> None:
    a = L((8,), S0, (16, 16))
    with pytest.raises(ValueError, match="is partial"):
        min_bytes(L((8,), R, (16, 16), (0,)), a)
    with pytest.raises(ValueError, match="must share shape and device count"):
        min_bytes(a, L((8,), S0, (8, 16)))
    with pytest.raises(ValueError, match="must share shape and device count"):
        min_bytes(a, L((4,), S0, (16, 16)))


def test_execute_errors_before_any_communication() -> None:
    sim = _SimComm(4)
    p = plan(L((4,), S0, (8, 8)), L((4,), S1, (8, 8)))
    with pytest.raises(ValueError, match="cover 4 devices but the MPI world has 2 ranks"):
        two = _SimComm(2)
        two.run(lambda r: execute(p, np.zeros((2, 8)), comm=two))
    with pytest.raises(ValueError, match=r"shard has shape \(8, 8\)"):
        sim.run(lambda r: execute(p, np.zeros((8, 8)), comm=sim))


def test_partial_source_is_sliced_before_it_is_reduced():
    # dst splits rows over axis 0, which the partial source replicates: slice first (free),
    # then AllReduce only the kept half, never the whole tensor.
    src = TensorLayout((2, 4), (-1, -1), (8, 8), partial=(0,))
    dst = TensorLayout((2, 4), (1, -1), (8, 8))
    p = plan(src, dst)
    assert p.kinds() == ["Slice", "AllReduce"]
    assert p.recv_bytes(0, 8) == 2 * 3 * (4 * 8 * 8) // 4       # AllReduce of a (4, 8) piece
    src3 = TensorLayout((2, 2, 2), (-1, -1), (8, 8), partial=(2,))
    p3 = plan(src3, TensorLayout((4, 2), (-1, 0), (8, 8)))
    assert p3.kinds() == ["Slice", "AllReduce"] and p3.recv_bytes(0, 8) == 256


def test_a_pending_cotangent_keeps_its_axes_between_two_writings_of_one_layout() -> None:
    """Nothing moves between two writings of the same blocks over 48 devices (no frame
    writes every layout alike there): the cotangent's pending replica axis, written for the
    destination's device matrix, is the same ranks' axis written for the source's."""
    from simpar.cotangent import Frame, cotangent_actions
    src = TensorLayout((6, 2, 1, 4), (3, 2, -1, -1), (6, 4, 2, 2))
    dst = TensorLayout((6, 2, 1, 1, 4), (4, 3, 2, 1), (6, 4, 2, 2))
    p = plan(src, dst)
    assert not p.steps and Frame.for_devices(48).fine is None
    assert all(src.slice_of(r) == dst.slice_of(r) for r in range(48))
    assert cotangent_actions(p, frozenset({4}), Frame.for_devices(48)) == ((), frozenset({3}))
    assert cotangent_actions(p, frozenset(), Frame.for_devices(48)) == ((), frozenset())
