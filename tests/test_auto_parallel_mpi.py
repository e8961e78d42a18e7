"""auto_parallel end to end (mpirun -n 2, 4, 8): the searched strategies train like one device."""

from __future__ import annotations

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn
from simpar.check import check_against_single_device
from simpar.comm import CommTrace
from simpar.dataset import random_classification

pytestmark = pytest.mark.mpi(min_size=2)


def _make(mode: str) -> nn.TrainOneStepCell:
    net = nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64)
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                               nn.SGD(net.trainable_params(), 0.1), parallel_mode=mode, seed=3)


def test_exact_search_trains_like_one_device_and_runs_its_schedule() -> None:
    """search_mode "exact" picks every op's strategy (marked "searched"); three steps match
    one device on every rank's shards, and the traced collectives are the schedule's."""
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="exact",
                                     gradients_mean=True, dataset_strategy="data_parallel",
                                     enable_alltoall=True)
    try:
        train = _make("auto_parallel")
        batches = [random_classification(k, 8, 16, 8, 0, np.dtype(np.float64))
                   for k in range(3)]
        report = check_against_single_device(train, lambda: _make("stand_alone"), batches)
        assert report.passed, str(report)
        assert train.program is not None
        assert {str(s.chosen) for s in train.program.steps} == {"searched"}
        with CommTrace() as trace:
            train(*random_classification(3, 8, 16, 8, 0, np.dtype(np.float64)))
        steps = train.program.schedule(comm.get_rank())
        assert [e.step for e in trace.events] == [s.index for s in steps if s.collective]
    finally:
        simpar.reset_auto_parallel_context()
