"""Dropout inside a trained model: each layer draws its own counter-based mask, and the
parallel run still equals the single-device run on every rank."""

from __future__ import annotations

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import graph, nn
from simpar.layout import distribute
from simpar.nn import presets


def _gpt() -> nn.GPT:
    return nn.GPT(vocab_size=32, seq_length=8, d_model=16, n_layers=2, n_heads=4, dropout=0.2,
                  dtype=np.float64)


def test_each_dropout_layer_has_its_own_seed():
    net = nn.WithLossCell(_gpt(), nn.SoftmaxCrossEntropyWithLogits())
    net.name_parameters()
    g = graph.trace(net, [((2, 8), np.int32), ((2, 8), np.int32)])
    seeds = [n.op.seed1 for n in g.nodes if n.op.name == "Dropout"]
    assert len(seeds) == 4 and len(set(seeds)) == 4


@pytest.mark.mpi(min_size=2)
def test_dropout_training_matches_single_device():
    rank, p = comm.get_rank(), comm.get_group_size()
    dp, mp = (2, p // 2) if p >= 4 else (1, p)
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                                     enable_alltoall=True, dataset_strategy=((dp, 1), (dp, 1)))
    try:
        rng = np.random.default_rng(3)
        batches = [(rng.integers(0, 32, (4, 8)).astype(np.int32),
                    rng.integers(0, 32, (4, 8)).astype(np.int32)) for _ in range(3)]
        model, loss = _gpt(), nn.SoftmaxCrossEntropyWithLogits()
        presets.megatron_gpt(model, dp, mp, loss)
        train = nn.TrainOneStepCell(nn.WithLossCell(model, loss),
                                    nn.Adam(model.trainable_params(), 1e-2))
        ref_model = _gpt()
        ref = nn.TrainOneStepCell(nn.WithLossCell(ref_model, nn.SoftmaxCrossEntropyWithLogits()),
                                  nn.Adam(ref_model.trainable_params(), 1e-2),
                                  parallel_mode="stand_alone")
        got = [train(x, y) for x, y in batches]
        want = [ref(x, y) for x, y in batches]
        assert train.program is not None
        worst = max(float(np.max(np.abs(train.params[n] - distribute(
            ref.params[n], lay, rank)))) for n, lay in train.program.param_layouts.items())
        verdict = comm.all_reduce(np.array([worst, max(abs(a - b) for a, b in zip(got, want))]),
                                  op="max")
        assert verdict[0] < 1e-10 and verdict[1] < 1e-10, verdict
    finally:
        simpar.reset_auto_parallel_context()
