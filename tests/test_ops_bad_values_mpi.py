"""A bad id or label held by some ranks only still raises on every rank, with no hang."""

from __future__ import annotations

import numpy as np
import pytest

import simpar.comm as comm
from simpar import ops
from simpar.parallel import run_op


@pytest.mark.mpi(min_size=2)
def test_one_bad_label_raises_everywhere():
    p = comm.get_group_size()
    x = np.random.default_rng(0).standard_normal((8, 16))
    labels = np.zeros(8, np.int32)
    labels[0] = 16                                  # only the ranks holding row 0 see it
    op = ops.SparseSoftmaxCrossEntropyWithLogits().shard(((2, p // 2), (2,)) if p >= 4
                                                         else ((p, 1), (p,)))
    with pytest.raises(ValueError, match="label 16 at row 0"):
        run_op(op, x, labels)
    comm.barrier()                                  # every rank got here: nobody is waiting


@pytest.mark.mpi(min_size=2)
def test_one_bad_id_raises_everywhere():
    p = comm.get_group_size()
    table = np.random.default_rng(1).standard_normal((8, 4))
    ids = np.arange(8) % 8
    ids[3] = 99
    with pytest.raises(ValueError, match="index 99 is out of range"):
        run_op(ops.Gather().shard(((1, 1), (p,))), table, ids)
    comm.barrier()
