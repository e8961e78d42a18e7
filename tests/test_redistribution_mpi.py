"""simpar.redistribution on real MPI ranks (mpirun -n 2, 4 or 8).

Every rank draws the same Hypothesis example (derandomized, no database, no shrinking), runs
the same plan, and only then checks its own shard against numpy and its CommTrace against the
plan. The verdict is agreed with one Allreduce, so all ranks fail the same example together and
keep calling the same collectives. An exception inside ``execute`` can leave other ranks inside
a collective, so it aborts the job at once (with this rank's traceback) instead of hanging.
"""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import simpar.comm as comm
from simpar.comm import CommTrace
from simpar.layout import TensorLayout
from simpar.mesh import DeviceMesh
from simpar.redistribution import (
    RedistributionPlan,
    bind_step,
    execute,
    execute_adjoint,
    min_bytes,
)
from simpar.redistribution import plan as _plan
from tests.layout_strategies import layout_pairs
from tests.mpi_guard import abort_job_on_error

L = TensorLayout
COLLECTIVE_KINDS = {"AllGather", "AllToAll", "AllToAllV", "ReduceScatter", "AllReduce"}
# derandomize is also in the conftest profile; repeated here because the ranks must agree.
# max_examples comes from that profile (40; SIMPAR_HYPOTHESIS_EXAMPLES overrides).
MPI_SETTINGS = settings(derandomize=True, database=None, phases=[Phase.explicit, Phase.generate])


def plan(src: TensorLayout, dst: TensorLayout, enable_alltoall: bool = True
         ) -> RedistributionPlan:
    """The planner with all-to-all on, as these tests were written for (the default is
    MindSpore's off; tests/test_redistribution.py checks it)."""
    return _plan(src, dst, enable_alltoall)


# ------------------------------------------------------------------ random layouts
def _pairs(device_num: int, src_partial: bool, dst_partial: bool
           ) -> st.SearchStrategy[tuple[TensorLayout, TensorLayout]]:
    """Layout pairs on exactly this world's ranks (tiny shapes)."""
    return layout_pairs((device_num,), src_partial, dst_partial)


# ------------------------------------------------------------------ per-rank data
def _global(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-1000, 1000, size=shape).astype(dtype)


def _my_input(g: np.ndarray, lay: TensorLayout, rank: int, seed: int) -> np.ndarray:
    """This rank's shard; for a partial layout a random pending part, the same on replicas,
    such that the parts of each partial group sum to g's piece (exactly for integers)."""
    piece = np.array(g[lay.slices(rank)])
    if not lay.partial:
        return piece
    coord = lay.mesh.coordinate(rank)
    chunk = lay.chunk_index(rank)

    def part(pc: tuple[int, ...]) -> np.ndarray:
        key = [seed, *chunk, *pc]
        return _global(lay.local_shape(), g.dtype, int(np.random.SeedSequence(key).
                                                       generate_state(1)[0]))

    mine = tuple(coord[a] for a in lay.partial_axes)
    if any(mine):
        return part(mine)
    for other in product(*(range(lay.device_matrix[a]) for a in lay.partial_axes)):
        if any(other):
            piece -= part(other)
    return piece


# ------------------------------------------------------------------ the check
def _run(p: RedistributionPlan, local: np.ndarray) -> tuple[np.ndarray, CommTrace]:
    with abort_job_on_error(f"execute on plan\n{p}\n"), CommTrace() as trace:
        out = execute(p, local)
    return out, trace


def _agree_or_fail(problems: list[str]) -> None:
    """Every rank raises if any rank found a problem (so all ranks stay in step)."""
    bad = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")
    if bad[0]:
        rank = comm.get_rank()
        raise AssertionError(f"rank {rank}: " + ("; ".join(problems) if problems else
                                                 "fine here, but another rank failed"))


def _check(p: RedistributionPlan, g: np.ndarray, seed: int) -> None:
    rank, size = comm.get_rank(), comm.get_group_size()
    src, dst = p.src, p.dst
    out, trace = _run(p, _my_input(g, src, rank, seed))
    # Everyone's result, for partial destinations (outside the trace).
    flat = comm.all_gather(np.ascontiguousarray(out).reshape(1, -1), axis=0)
    problems: list[str] = []
    exact = not src.partial or g.dtype.kind == "i"
    if out.shape != dst.local_shape() or out.dtype != g.dtype:
        problems.append(f"got {out.dtype}{out.shape}, want {g.dtype}{dst.local_shape()}")
    elif not dst.partial:
        want = g[dst.slices(rank)]
        same = np.array_equal(out, want) if exact else np.allclose(out, want, rtol=1e-5,
                                                                   atol=1e-5)
        if not same:
            problems.append(f"shard differs from global[{dst.slice_of(rank)}]")
    else:
        total = np.zeros(dst.local_shape(), dtype=np.float64 if not exact else g.dtype)
        for r in dst.partial_group(rank):
            total = total + flat[r].reshape(dst.local_shape())
        want = g[dst.slices(rank)]
        if not (np.array_equal(total, want) if exact else np.allclose(total, want, atol=1e-4)):
            problems.append("partial group does not sum to the global piece")
        for r in dst.replica_group(rank):
            if not np.array_equal(flat[r], flat[rank]):
                problems.append(f"replica rank {r} holds other values")
    measured = sum(e.bytes_recv for e in trace.events)
    predicted = p.recv_bytes(rank, g.dtype.itemsize)
    if measured != predicted:
        problems.append(f"received {measured} bytes, plan predicts {predicted}")
    if not src.partial and p.enable_alltoall:
        bound = min_bytes(src, dst, g.dtype.itemsize)[rank]
        if measured != bound:
            problems.append(f"received {measured} bytes, lower bound {bound}")
    kinds = [s.kind for s in p.steps if s.kind in COLLECTIVE_KINDS]
    if trace.kinds() != kinds:
        problems.append(f"ran {trace.kinds()}, plan has {kinds}")
    else:
        steps = [s for s in p.steps if s.kind in COLLECTIVE_KINDS]
        for s, e in zip(steps, trace.events, strict=True):
            group = tuple(range(size)) if s.kind == "AllToAllV" else \
                DeviceMesh(s.src.device_matrix).group_of(rank, s.device_axes)
            if e.group != group:
                problems.append(f"{s.kind} ran on group {e.group}, plan says {group}")
    if problems:
        problems.append(f"plan:\n{p}")
    _agree_or_fail(problems)


DTYPES = st.sampled_from([np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.float32),
                          np.dtype(np.int32)])


# ------------------------------------------------------------------ properties
@pytest.mark.mpi(min_size=2)
@MPI_SETTINGS
@given(st.data(), DTYPES, st.integers(0, 2**20))
def test_non_partial_sources(data: st.DataObject, dtype: np.dtype, seed: int) -> None:
    """Exact shards on every rank, bytes == plan == lower bound, collectives as planned."""
    src, dst = data.draw(_pairs(comm.get_group_size(), False, True), label="layouts")
    _check(plan(src, dst), _global(src.shape, dtype, seed), seed)


@pytest.mark.mpi(min_size=2)
@MPI_SETTINGS
@given(st.data(), st.sampled_from([np.dtype(np.int64), np.dtype(np.float64)]),
       st.integers(0, 2**20))
def test_partial_sources(data: st.DataObject, dtype: np.dtype, seed: int) -> None:
    """Random pending parts that sum to G: exact in int64, to rounding in float64."""
    src, dst = data.draw(_pairs(comm.get_group_size(), True, True), label="layouts")
    _check(plan(src, dst), _global(src.shape, dtype, seed), seed)


@pytest.mark.mpi(min_size=2)
@MPI_SETTINGS
@given(st.data(), st.integers(0, 2**20))
def test_without_alltoall(data: st.DataObject, seed: int) -> None:
    src, dst = data.draw(_pairs(comm.get_group_size(), True, True), label="layouts")
    p = plan(src, dst, enable_alltoall=False)
    assert not {"AllToAll", "AllToAllV"} & set(p.kinds())
    _check(p, _global(src.shape, np.dtype(np.int64), seed), seed)


@pytest.mark.mpi(min_size=2)
@settings(MPI_SETTINGS, max_examples=20)
@given(st.data(), st.sampled_from([np.dtype(np.float32), np.dtype(np.int64)]),
       st.integers(0, 2**20))
def test_bound_steps_are_execute_step_by_step(data: st.DataObject, dtype: np.dtype,
                                              seed: int) -> None:
    """A plan run as its bound steps (what a compiled program calls), forward and adjoint:
    bit for bit execute's and execute_adjoint's results, with the same CommTrace events; so
    is the forward whose first step consumes its input (an AllReduce sums into it)."""
    rank = comm.get_rank()
    src, dst = data.draw(_pairs(comm.get_group_size(), True, True), label="layouts")
    p = plan(src, dst)
    x = _my_input(_global(src.shape, dtype, seed), src, rank, seed)
    dy = _global(dst.local_shape(), dtype, seed + 1 + rank)
    with abort_job_on_error(f"bound steps of plan\n{p}\n"):
        with CommTrace() as want:
            y, dx = execute(p, x), execute_adjoint(p, dy)
        with CommTrace() as got:
            by = x
            for step in p.steps:
                by = bind_step(step, False, dtype, rank)(by)
            bdx = dy
            for step in reversed(p.steps):
                bdx = bind_step(step, True, dtype, rank)(bdx)
        cy = x.copy()
        for k, step in enumerate(p.steps):
            cy = bind_step(step, False, dtype, rank, consume=k == 0)(cy)
    problems = []
    for what, a, b in (("forward", y, by), ("adjoint", dx, bdx), ("consuming forward", y, cy)):
        if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b):
            problems.append(f"{what}: bound steps give {b.dtype}{b.shape}, execute "
                            f"{a.dtype}{a.shape}{'' if a.shape != b.shape else ', other values'}")
    fields = [[(e.kind, e.group, e.bytes_sent, e.bytes_recv, e.dtype, e.shape, e.op, e.label)
               for e in t.events] for t in (want, got)]
    if fields[0] != fields[1]:
        problems.append(f"events differ: {fields[0]} vs {fields[1]}")
    if problems:
        problems.append(f"plan:\n{p}")
    _agree_or_fail(problems)


# ------------------------------------------------------------------ named transitions
def _named(p: int) -> list[tuple[str, TensorLayout, TensorLayout, list[str]]]:
    shape = (4 * p, 4 * p)
    one = (p,)
    out = [
        ("S0->S1", L(one, (0, -1), shape), L(one, (-1, 0), shape), ["AllToAll"]),
        ("S0->R", L(one, (0, -1), shape), L(one, (-1, -1), shape), ["AllGather"]),
        ("R->S1", L(one, (-1, -1), shape), L(one, (-1, 0), shape), []),
        ("P->R", L(one, (-1, -1), shape, (0,)), L(one, (-1, -1), shape), ["AllReduce"]),
        ("P->S0", L(one, (-1, -1), shape, (0,)), L(one, (0, -1), shape), ["ReduceScatter"]),
    ]
    if p >= 4:
        two = (2, p // 2)
        out += [
            ("2D [1,0]->[0,1]", L(two, (1, 0), shape), L(two, (0, 1), shape), ["AllToAllV"]),
            ("2D [1,0]->R", L(two, (1, 0), shape), L(two, (-1, -1), shape), ["AllGather"]),
            ("2D->1D", L(two, (1, 0), shape), L(one, (0, -1), shape), ["AllToAll"]),
        ]
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("index", range(8))
def test_named_transitions(index: int) -> None:
    cases = _named(comm.get_group_size())
    if index >= len(cases):
        pytest.skip("needs 4 ranks")
    name, src, dst, kinds = cases[index]
    p = plan(src, dst)
    assert [k for k in p.kinds() if k in COLLECTIVE_KINDS] == kinds, f"{name}: {p}"
    for dtype in (np.dtype(np.float32), np.dtype(np.int64)):
        _check(p, _global(src.shape, dtype, index), index)


@pytest.mark.mpi(min_size=2)
def test_scalar_partial_sum() -> None:
    size = comm.get_group_size()
    p = plan(L((size,), (), (), (0,)), L((size,), (), ()))
    out, trace = _run(p, np.array(float(comm.get_rank() + 1)))
    assert trace.kinds() == ["AllReduce"]
    assert out.shape == () and out == size * (size + 1) / 2


@pytest.mark.mpi(min_size=2)
def test_execute_leaves_its_input_alone() -> None:
    size = comm.get_group_size()
    shape = (2 * size, 2 * size)
    g = _global(shape, np.dtype(np.float64), 7)
    problems = []
    for src, dst in ((L((size,), (0, -1), shape), L((size,), (-1, 0), shape)),
                     (L((size,), (-1, -1), shape, (0,)), L((size,), (0, -1), shape))):
        local = _my_input(g, src, comm.get_rank(), 7)
        keep = local.copy()
        _run(plan(src, dst), local)
        if not np.array_equal(local, keep):
            problems.append(f"execute changed its input ({src} -> {dst})")
    _agree_or_fail(problems)
