"""Strategy files MindSpore wrote: their op keys name MindSpore's graph, so simpar applies
their parameter layouts (by parameter name, a pipeline merge's stage prefix and a wrapper's
prefix aside), keeps the op strategies whose keys match, plans the rest, and names the
unmatched ops in one warning."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import simpar
from simpar import comm, graph, nn
from simpar.check import check_against_single_device
from simpar.search import request_from_context
from simpar.strategy_import import UnmatchedStrategyWarning, plan_with_file
from tests.mpi_guard import shared_dir


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    yield
    simpar.reset_auto_parallel_context()


def _mindspore_file(path: Path, n: int, stage_prefix: str = "", bare: bool = True) -> Path:
    """A file as MindSpore writes it for this MLP: its own op keys (none of which simpar's
    graph has), and fc1.weight's rows cut n ways."""
    prefix = "" if bare else "_backbone."
    doc = {
        "current_stage": 1,
        "parallel_strategy_item": {
            f"Default/network-WithLossCell/_backbone-MLP/fc{k}-Dense/MatMul-op{40 + k}":
                {"stage": 0, "parallel_strategy": [[1, 1], [n, 1]]} for k in (1, 2)},
        "parallel_layout_item": {
            f"{stage_prefix}{prefix}fc1.weight": {
                "dev_matrix": [n], "tensor_map": [0, -1], "tensor_shape": [32, 16],
                "param_split_shape": [], "indices_offset": [], "field": 0,
                "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}},
    }
    path.write_text(json.dumps(doc))
    return path


def _net() -> nn.WithLossCell:
    return nn.WithLossCell(nn.MLP(16, 32, 8), nn.SoftmaxCrossEntropyWithLogits())


@pytest.mark.parametrize("stage_prefix, bare", [("", True), ("", False), ("0-", True)])
def test_a_mindspore_file_applies_its_parameter_layouts(tmp_path: Path, stage_prefix: str,
                                                        bare: bool) -> None:
    net = _net()
    g = graph.trace(net, [((16, 16), np.float32), ((16,), np.int32)], ["data", "label"])
    request = request_from_context(g, device_num=8, mode="semi_auto_parallel",
                                   dataset_strategy="data_parallel")
    path = _mindspore_file(tmp_path / "ms.json", 8, stage_prefix, bare)
    with pytest.warns(UnmatchedStrategyWarning) as caught:
        smap = plan_with_file(str(path), request)
    assert len(caught) == 1                                   # one warning, not one per op
    text = str(caught[0].message)
    assert "holds 2 op strategies this graph has no op for" in text
    assert "MatMul-op41" in text and "1 parameter layouts" in text
    assert smap.params["_backbone.fc1.weight"].cuts == (8, 1)   # the file's layout, applied
    assert set(smap.ops) == {node.name for node in g.nodes}     # every op planned


def test_a_file_simpar_wrote_loads_as_it_is(tmp_path: Path) -> None:
    net = _net()
    g = graph.trace(net, [((16, 16), np.float32), ((16,), np.int32)], ["data", "label"])
    request = request_from_context(g, device_num=8, mode="auto_parallel",
                                   search_mode="dynamic_programming",
                                   dataset_strategy="data_parallel")
    path = tmp_path / "simpar.json"
    simpar.strategy_file.save_strategy(str(path), simpar.search.plan_request(request), g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmatchedStrategyWarning)
        again = plan_with_file(str(path), request)
    assert {k: v.in_strategy for k, v in again.ops.items()} == {
        k: v.in_strategy for k, v in simpar.search.plan_request(request).ops.items()}


@pytest.mark.mpi(min_size=2)
def test_training_from_a_mindspore_file_passes_the_check(tmp_path: Path) -> None:
    n = comm.get_group_size()
    path = _mindspore_file(shared_dir(tmp_path) / "ms.json", n)
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                     dataset_strategy="data_parallel",
                                     strategy_ckpt_config={"load_file": str(path)})

    def build() -> nn.TrainOneStepCell:
        net = _net()
        return nn.TrainOneStepCell(net, nn.Momentum(net.trainable_params(), 0.1, 0.9), seed=3)

    train = build()
    rng = np.random.default_rng(0)
    batches: list[Any] = [(rng.standard_normal((16, 16)).astype(np.float32),
                           rng.integers(0, 8, 16).astype(np.int32)) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnmatchedStrategyWarning)
        report = check_against_single_device(train, build, batches)
    assert report.passed, report.summary()
    assert train.program is not None
    assert train.program.param_layouts["_backbone.fc1.weight"].cuts == (n, 1)
