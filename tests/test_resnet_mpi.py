"""A tiny ResNet (MindSpore's structure: stem, max pool, four stages with down-sampling
shortcuts, global mean, classifier) trained on real ranks (mpirun -n 2, 4 or 8) in every
mode, against one device on every rank (``check_against_single_device``: every step's loss,
every rank's parameter shards, the moving statistics of every BatchNorm included).

* data_parallel; semi_auto_parallel with the classifier's classes cut (``shard_classifier``,
  with MindSpore's label-smoothed loss: OneHot and the dense cross entropy cut alike);
  auto_parallel with each search. The collectives traced in a further step are exactly the
  program's schedule, in order;
* the BatchNorms' moving statistics move off their initial values, equal on every rank to
  one device's, and a pipelined run (two stages) updates them too;
* float32 in data parallel (the tolerance of float32).

    mpirun -n 8 python -m pytest -q --with-mpi -m mpi tests/test_resnet_mpi.py
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn
from simpar.check import check_against_single_device
from simpar.comm import CommTrace
from simpar.nn.resnet import CrossEntropySmooth, shard_classifier

pytestmark = pytest.mark.mpi

CLASSES = 8


def _make(mode: str, depth: int = 18, dtype: type = np.float64,
          stages: int = 1) -> nn.TrainOneStepCell:
    net = nn.resnet(depth, num_classes=CLASSES, width=4, layer_nums=(1, 1, 1, 1), dtype=dtype)
    # ResNet-50 trains with MindSpore's recipe's loss (OneHot, then the dense cross entropy)
    loss: Any = CrossEntropySmooth(smooth_factor=0.1, num_classes=CLASSES) if depth == 50 \
        else nn.SoftmaxCrossEntropyWithLogits()
    if mode == "semi_auto_parallel":
        p = comm.get_group_size()
        shard_classifier(net, max(p // 2, 1), min(p, 2), loss)
    if stages > 1:
        net.conv1.pipeline_stage = net.bn1.pipeline_stage = 0
        net.layer1.pipeline_stage = net.layer2.pipeline_stage = 0
        net.layer3.pipeline_stage = net.layer4.pipeline_stage = 1
        net.end_point.pipeline_stage = 1
    cell = nn.WithLossCell(net, loss)
    return nn.TrainOneStepCell(cell, nn.Momentum(net.trainable_params(), 0.05, 0.9))


def _batches(n: int = 3, dtype: type = np.float64, size: int = 16
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    return [(rng.standard_normal((8, 3, size, size)).astype(dtype),
             rng.integers(0, CLASSES, 8).astype(np.int32)) for _ in range(n)]


@pytest.fixture
def _context() -> Iterator[None]:
    simpar.reset_auto_parallel_context()
    yield
    simpar.reset_auto_parallel_context()


def _moving_statistics(train: nn.TrainOneStepCell) -> dict[str, np.ndarray]:
    return {k: v for k, v in train.global_parameters().items() if "moving_" in k}


@pytest.mark.parametrize(("mode", "search", "depth"), [
    ("data_parallel", None, 18), ("semi_auto_parallel", None, 50),
    ("auto_parallel", "dynamic_programming", 18), ("auto_parallel", "recursive_programming", 50),
    ("auto_parallel", "sharding_propagation", 50)])
def test_each_mode_trains_like_one_device(mode: str, search: str | None, depth: int,
                                          _context: None) -> None:
    settings: dict[str, Any] = {"parallel_mode": mode, "gradients_mean": True}
    if search is not None:
        settings["search_mode"] = search
    if mode != "data_parallel":
        settings["dataset_strategy"] = "data_parallel"
    simpar.set_auto_parallel_context(**settings)
    train = _make(mode, depth)
    batches = _batches(4)
    report = check_against_single_device(train, lambda: _make("stand_alone", depth),
                                         batches[:3])
    assert report.passed, str(report)
    moving = _moving_statistics(train)
    assert len(moving) == 2 * sum(1 for k in report.param_errors if k.endswith(".gamma"))
    assert set(moving) <= set(report.param_errors)    # compared with one device's, every rank
    assert all(np.max(np.abs(v - (0.0 if k.endswith("mean") else 1.0))) > 1e-3
               for k, v in moving.items())            # and updated by every step
    assert train.program is not None
    with CommTrace() as trace:
        train(*batches[3])
    steps = train.program.schedule(comm.get_rank())
    assert [e.step for e in trace.events if e.step is not None] == [
        s.index for s in steps if s.collective]
    if mode == "semi_auto_parallel" and comm.get_group_size() > 1:
        # the classes are cut: the loss's row statistics are AllReduced over the class group
        labels = [e.label for e in trace.events]
        assert any("LogSoftmax" in lab for lab in labels), labels
        weight = train.program.param_layouts["end_point.weight"]
        assert weight.local_shape()[0] == CLASSES // min(comm.get_group_size(), 2)


def test_float32_data_parallel(_context: None) -> None:
    simpar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    train = _make("data_parallel", 18, np.float32)
    # 64 x 64 images: at 16 x 16 the last stage's BatchNorms normalise 8 numbers (a 1 x 1
    # image of 8), whose float32 gradients cancel to ~1e-5 relative round-off (seen:
    # 1.03e-5 for layer4.0.conv1.weight on 4 ranks), the tolerance itself.
    report = check_against_single_device(train, lambda: _make("stand_alone", 18, np.float32),
                                         _batches(2, np.float32, 64))
    assert report.passed, str(report)


@pytest.mark.mpi(min_size=2)
def test_pipelined_resnet_updates_the_moving_statistics(_context: None) -> None:
    # One micro-batch (GPipe): a BatchNorm's statistics are over the micro-batch, so only
    # then is the pipelined step one device's step.
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                                     pipeline_stages=2, dataset_strategy="data_parallel",
                                     pipeline_config={"pipeline_scheduler": "gpipe"})
    train = _make("data_parallel_stages", 18, stages=2)
    report = check_against_single_device(train, lambda: _make("stand_alone", 18),
                                         _batches(2))
    assert report.passed, str(report)
    assert train.pipeline is not None and len(train.pipeline.stages) == 2
    assert all(np.max(np.abs(v - (0.0 if k.endswith("mean") else 1.0))) > 1e-3
               for k, v in _moving_statistics(train).items())
