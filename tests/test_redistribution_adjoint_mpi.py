"""The backward of a redistribution is its adjoint: <execute(P, x), g> = <x, adjoint(P, g)>,
summed over ranks, for every kind of step (the dot-product test), on every rank."""

from __future__ import annotations

import numpy as np
import pytest

import simpar.comm as comm
from simpar.layout import TensorLayout
from simpar.redistribution import execute, execute_adjoint, plan

SHAPE = (16, 8, 4)


def _cases(p: int) -> list[tuple[TensorLayout, TensorLayout]]:
    if p == 8:
        specs = [
            ((8,), (0, -1, -1), (), (8,), (-1, 0, -1)),            # AllToAll
            ((8,), (0, -1, -1), (), (8,), (-1, -1, -1)),           # AllGather
            ((8,), (-1, -1, -1), (), (8,), (-1, 0, -1)),           # Slice
            ((2, 4), (1, 0, -1), (), (2, 4), (0, 1, -1)),          # AllToAllV
            ((2, 4), (1, 0, -1), (), (2, 4), (-1, -1, -1)),        # AllGather over 2 dims
            ((2, 4), (1, 0, -1), (), (8,), (0, -1, -1)),           # device-matrix change
            ((2, 2, 2), (2, (1, 0), -1), (), (4, 2), (-1, 1, 0)),
            ((2, 4), (-1, 0, -1), (0,), (2, 4), ((0, 1), -1, -1)),  # ReduceScatter + more
            ((2, 4), (-1, -1, -1), (0, 1), (8,), (-1, 0, -1)),     # ReduceScatter over 8
            ((8,), (-1, -1, -1), (0,), (8,), (-1, -1, -1)),        # AllReduce
            ((8,), (-1, -1, -1), (), (8,), (-1, -1, -1)),          # nothing
            ((2, 4), (1, -1, -1), (), (2, 4), (1, -1, -1)),        # nothing
        ]
    else:
        specs = [((p,), (0, -1, -1), (), (p,), (-1, 0, -1)),
                 ((p,), (0, -1, -1), (), (p,), (-1, -1, -1)),
                 ((p,), (-1, -1, -1), (0,), (p,), (0, -1, -1)),
                 ((p,), (-1, -1, -1), (0,), (p,), (-1, -1, -1))]
    return [(TensorLayout(sdm, sm, SHAPE, part), TensorLayout(ddm, dm, SHAPE))
            for sdm, sm, part, ddm, dm in specs]


@pytest.mark.mpi
def test_adjoint_is_the_transpose():
    rank, p = comm.get_rank(), comm.get_group_size()
    kinds_seen: set[str] = set()
    for k, (src, dst) in enumerate(_cases(p)):
        pl = plan(src, dst)
        kinds_seen.update(pl.kinds())
        rng = np.random.default_rng([k, rank])
        x = rng.standard_normal(src.local_shape())
        g = rng.standard_normal(dst.local_shape())
        y = execute(pl, x)
        xt = execute_adjoint(pl, g)
        assert y.shape == dst.local_shape() and xt.shape == src.local_shape()
        both = comm.all_reduce(np.array([np.vdot(y, g), np.vdot(x, xt)]))
        assert np.isclose(both[0], both[1], rtol=1e-12, atol=1e-12), (pl, both)
    if p == 8:
        assert kinds_seen >= {"AllToAll", "AllGather", "Slice", "AllToAllV", "ReduceScatter",
                              "AllReduce"}
