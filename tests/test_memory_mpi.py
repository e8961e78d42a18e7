"""Each rank materialises only its shards: building a model whose whole parameters exceed a
rank's budget stays within the budget, because every rank draws just its own block of every
parameter (counter-based initial values) and no rank ever holds a whole tensor.

    mpirun -n 8 python -m pytest tests/test_memory_mpi.py -q --with-mpi -m mpi
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn
from simpar.layout import distribute

IN, OUT = 1024, 4096          # a float64 weight of 32 MiB
MiB = 2**20


@pytest.mark.mpi(min_size=2)
def test_building_a_model_larger_than_a_ranks_budget_stays_within_it() -> None:
    n, rank = comm.get_group_size(), comm.get_rank()
    full = IN * OUT * 8
    shard = full // n
    budget = shard + 4 * MiB           # this rank's weight block, and room for small things
    assert budget < full, "the model must not fit the budget whole"
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", enable_alltoall=True,
                                     dataset_strategy="full_batch")
    try:
        dense = nn.Dense(IN, OUT, has_bias=False, dtype=np.float64)
        dense.matmul.shard(((1, 1), (n, 1)))          # the weight's rows over every rank
        net = nn.WithLossCell(dense, nn.MSELoss())
        train = nn.TrainOneStepCell(net, nn.SGD(net.trainable_params(), 0.1))
        x, y = np.zeros((2, IN)), np.zeros((2, OUT))
        tracemalloc.start()
        try:
            train.build(x, y)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        held = train.params["_backbone.weight"]
        problems = []
        if held.shape != (OUT // n, IN):
            problems.append(f"rank {rank} holds {held.shape}, not its (OUT/n, IN) block")
        if peak > budget:
            problems.append(f"rank {rank} peaked at {peak / MiB:.1f} MiB building the model, "
                            f"over its budget of {budget / MiB:.1f} MiB (the whole weight is "
                            f"{full / MiB:.0f} MiB)")
        # The block is exactly the slice of the one-device initial value.
        assert dense.weight.name == "_backbone.weight"
        lay = train.program.param_layouts["_backbone.weight"] if train.program else None
        assert lay is not None
        want = distribute(dense.weight.initial_value(train.seed), lay, rank)
        if not np.array_equal(held, want):
            problems.append(f"rank {rank}'s block differs from its slice of the whole weight")
        bad = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
        assert not bad, "; ".join(problems) or "fine here, but another rank failed"
    finally:
        simpar.reset_auto_parallel_context()
