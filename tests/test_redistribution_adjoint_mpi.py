"""The backward of a redistribution is its adjoint: <execute(P, x), g> = <x, adjoint(P, g)>,
summed over ranks, for every kind of step (the dot-product test), on every rank; and each
plan runs exactly the collectives its layouts imply, forward and adjoint (written by hand
below, per case, as a function of the world size p)."""

from __future__ import annotations

import numpy as np
import pytest

import simpar.comm as comm
from simpar.comm import CommTrace
from simpar.layout import TensorLayout
from simpar.redistribution import execute, execute_adjoint, plan

SHAPE = (16, 8, 4)

#: (kind, group) of one collective, in the order it runs.
Calls = list[tuple[str, tuple[int, ...]]]
#: (src device matrix, src map, src partial (counted from the right, like the map), dst device
#:  matrix, dst map,
#:  forward collectives, adjoint collectives)
Spec = tuple[tuple[int, ...], tuple[object, ...], tuple[int, ...], tuple[int, ...],
             tuple[object, ...], Calls, Calls]


def _cases(p: int, rank: int) -> list[Spec]:
    world = tuple(range(p))
    # On (2, 4): rank's group along the inner axis (4 consecutive ranks), and along the outer
    # one (the 2 ranks 4 apart).
    inner = tuple(range(rank - rank % 4, rank - rank % 4 + 4))
    outer = (rank % 4, rank % 4 + 4)
    if p == 8:
        return [
            # Dim 0's cut moves to dim 1 over the same 8 ranks: one AllToAll, its own inverse.
            ((8,), (0, -1, -1), (), (8,), (-1, 0, -1),
             [("AllToAll", world)], [("AllToAll", world)]),
            # S(0) -> R: AllGather; adjoint ReduceScatter.
            ((8,), (0, -1, -1), (), (8,), (-1, -1, -1),
             [("AllGather", world)], [("ReduceScatter", world)]),
            # R -> S(1): a local slice; adjoint a zero-pad.
            ((8,), (-1, -1, -1), (), (8,), (-1, 0, -1), [], []),
            # The two axes swap dims (not a suffix move): the direct exchange, both ways.
            ((2, 4), (1, 0, -1), (), (2, 4), (0, 1, -1),
             [("AllToAllV", world)], [("AllToAllV", world)]),
            # Both dims gathered at once: one AllGather over all 8; adjoint one ReduceScatter.
            ((2, 4), (1, 0, -1), (), (2, 4), (-1, -1, -1),
             [("AllGather", world)], [("ReduceScatter", world)]),
            # (2, 4) and (8,) share the refinement (2, 4): dim 1's inner axis moves to the
            # end of dim 0's split, an AllToAll within each group of 4 consecutive ranks.
            ((2, 4), (1, 0, -1), (), (8,), (0, -1, -1),
             [("AllToAll", inner)], [("AllToAll", inner)]),
            # Refinement (2, 2, 2): dims (0 | 1, 2 | -) -> (- | 0, 1 | 2): no suffix move.
            ((2, 2, 2), (2, (1, 0), -1), (), (4, 2), (-1, 1, 0),
             [("AllToAllV", world)], [("AllToAllV", world)]),
            # Partial over the outer axis, dst splits dim 0 with it (after the inner axis):
            # ReduceScatter over the outer pair onto dim 0, then the exchange; adjoint reversed.
            ((2, 4), (-1, 0, -1), (1,), (2, 4), ((0, 1), -1, -1),
             [("ReduceScatter", outer), ("AllToAllV", world)],
             [("AllToAllV", world), ("AllGather", outer)]),
            # Partial over both axes, dst splits dim 1 over all 8: one ReduceScatter.
            ((2, 4), (-1, -1, -1), (0, 1), (8,), (-1, 0, -1),
             [("ReduceScatter", world)], [("AllGather", world)]),
            # P -> R: AllReduce, its own adjoint.
            ((8,), (-1, -1, -1), (0,), (8,), (-1, -1, -1),
             [("AllReduce", world)], [("AllReduce", world)]),
            ((8,), (-1, -1, -1), (), (8,), (-1, -1, -1), [], []),
            ((2, 4), (1, -1, -1), (), (2, 4), (1, -1, -1), [], []),
        ]
    # p = 1, 2 or 4: the same four moves over every rank; on one rank none communicates.
    some = p > 1
    return [((p,), (0, -1, -1), (), (p,), (-1, 0, -1),
             [("AllToAll", world)] * some, [("AllToAll", world)] * some),
            ((p,), (0, -1, -1), (), (p,), (-1, -1, -1),
             [("AllGather", world)] * some, [("ReduceScatter", world)] * some),
            ((p,), (-1, -1, -1), (0,), (p,), (0, -1, -1),
             [("ReduceScatter", world)] * some, [("AllGather", world)] * some),
            ((p,), (-1, -1, -1), (0,), (p,), (-1, -1, -1),
             [("AllReduce", world)] * some, [("AllReduce", world)] * some)]


@pytest.mark.mpi
def test_adjoint_is_the_transpose():
    rank, p = comm.get_rank(), comm.get_group_size()
    kinds_seen: set[str] = set()
    problems: list[str] = []
    for k, (sdm, sm, part, ddm, dm, want_fwd, want_adj) in enumerate(_cases(p, rank)):
        src, dst = TensorLayout(sdm, sm, SHAPE, part), TensorLayout(ddm, dm, SHAPE)
        pl = plan(src, dst, enable_alltoall=True)  # the cases were written for it
        kinds_seen.update(pl.kinds())
        rng = np.random.default_rng([k, rank])
        x = rng.standard_normal(src.local_shape())
        g = rng.standard_normal(dst.local_shape())
        with CommTrace() as forward:
            y = execute(pl, x)
        with CommTrace() as backward:
            xt = execute_adjoint(pl, g)
        assert y.shape == dst.local_shape() and xt.shape == src.local_shape()
        both = comm.all_reduce(np.array([np.vdot(y, g), np.vdot(x, xt)]))
        assert np.isclose(both[0], both[1], rtol=1e-12, atol=1e-12), (pl, both)
        got_fwd = [(e.kind, e.group) for e in forward.events]
        got_adj = [(e.kind, e.group) for e in backward.events]
        if (got_fwd, got_adj) != (want_fwd, want_adj):
            problems.append(f"case {k} {src} -> {dst}: ran {got_fwd} / adjoint {got_adj}, by "
                            f"hand {want_fwd} / {want_adj}")
        sums = [e.op for e in forward.events + backward.events
                if e.kind in ("AllReduce", "ReduceScatter")]
        if any(op != "sum" for op in sums):
            problems.append(f"case {k}: reductions {sums}, all must be sums")
    bad = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
    assert not bad, f"rank {rank}: " + ("; ".join(problems) or "another rank failed")
    if p == 8:
        assert kinds_seen >= {"AllToAll", "AllGather", "Slice", "AllToAllV", "ReduceScatter",
                              "AllReduce"}
