"""simpar.viz's pictures on small cases: each PNG is written, has the size asked for, and is
not blank (its pixels take many values; the cake's blocks each their holders' colour)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from simpar import ops, viz
from simpar.cost import load_profile
from simpar.plan import PlanOptions, make_plan


def _pixels(path: Path) -> np.ndarray:
    import matplotlib.image as mpimg
    return np.asarray(mpimg.imread(path))


def _colours(img: np.ndarray) -> int:
    return len(np.unique(img.reshape(-1, img.shape[-1])[:, :3].round(3), axis=0))


def test_the_cake_colours_each_holder_set(tmp_path: Path) -> None:
    sh = ops.MatMul().shard(((2, 4), (4, 1))).sharding([(8, 16), (16, 4)], 8)
    a = _pixels(viz.layout_png(sh.in_layouts[0], tmp_path / "a.png", "a"))
    b = _pixels(viz.layout_png(sh.in_layouts[1], tmp_path / "b.png", "b"))
    partial = _pixels(viz.layout_png(sh.raw_out, tmp_path / "raw.png", "raw"))
    assert a.shape[0] > 100 and a.shape[1] > 200
    # eight blocks of eight holders: at least eight fill colours besides white and text
    assert _colours(a) > _colours(partial) >= 4
    assert a.std() > 0.1 and b.std() > 0.1
    scalar = ops.ReduceSum(axis=()).sharding([(8,)], 4, ((4,),)).raw_out
    assert _pixels(viz.layout_png(scalar, tmp_path / "s.png")).std() > 0.05


def test_cost_and_fidelity_pictures(tmp_path: Path) -> None:
    plan = make_plan(PlanOptions("mlp", hidden=256, layers=1, batch=64, device_num=8,
                                 search_mode="dynamic_programming",
                                 profile=load_profile("cpu-local"), in_features=64,
                                 classes=16))
    img = _pixels(viz.cost_png(plan.report, tmp_path / "cost.png"))
    assert img.shape[1] > 600 and img.std() > 0.1 and _colours(img) > 8
    img = _pixels(viz.fidelity_png(["dp", "mp"], [0.010, 0.004], [0.012, 0.005],
                                   tmp_path / "fidelity.png"))
    assert img.std() > 0.05
    with pytest.raises(ValueError, match="must be as long as each other"):
        viz.fidelity_png(["dp"], [0.01, 0.02], [0.01], tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_the_strategy_graph_marks_the_moves(tmp_path: Path) -> None:
    import simpar
    from simpar import graph, nn
    from simpar.nn import presets
    from simpar.runtime.lowering import build_program
    net = nn.MLP(16, 32, 8, n_hidden=2, dtype=np.float64)
    presets.redistributing_mlp(net, 8)
    cell = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits())
    g = graph.trace(cell, [((16, 16), np.float64), ((16,), np.int32)], ["data", "label"])
    try:
        prog = build_program(g, 8, "semi_auto_parallel", "full_batch", True, cell=cell)
    finally:
        simpar.reset_auto_parallel_context()
    img = _pixels(viz.program_png(prog, tmp_path / "graph.png"))
    assert img.shape[0] > 300 and img.std() > 0.05
    red = (img[:, :, 0] > 0.8) & (img[:, :, 1] < 0.3) & (img[:, :, 2] < 0.3)
    assert red.sum() > 50   # the AllGather and AllToAll edges are drawn red


def test_the_pipelined_step_per_stage(tmp_path: Path) -> None:
    from simpar.pipeline.price import PipelineCost, StageCost
    stages = tuple(StageCost(k, 0.002, 0.004, 0.024, 0.006 * k, 0.001, 0.03, 2 - k,
                             (3 - k) * 2**20) for k in range(2))
    cost = PipelineCost("cpu-local", "1f1b", stages, 4, 1, 0.031, 0.2, 0.0005)
    img = _pixels(viz.pipeline_png(cost, tmp_path / "pipeline.png"))
    assert img.shape[1] > 600 and img.std() > 0.1 and _colours(img) > 8


def test_grouped_bars(tmp_path: Path) -> None:
    img = _pixels(viz.bars_png({"GPT": {"dp": 21.4, "mp": 42.2}, "MLP": {"dp": 17.1, "mp": 7.0}},
                               tmp_path / "bars.png", "ms"))
    assert img.shape[1] > 200 and img.std() > 0.05 and _colours(img) > 4
    with pytest.raises(ValueError, match="at least one value"):
        viz.bars_png({}, tmp_path / "none.png", "ms")


def test_lines_against_the_device_count(tmp_path: Path) -> None:
    panels = {"GPT measured": {"dp": {1: 30.0, 2: 20.0, 4: 21.0, 8: 22.0},
                               "tp": {2: 35.0, 4: 40.0, 8: 42.0}},
              "GPT predicted": {"dp": {1: 30.0, 2: 16.0, 4: 9.0, 8: 5.0}},
              "MLP measured": {"dp": {2: 10.0, 8: 17.0}}}
    img = _pixels(viz.scaling_png(panels, tmp_path / "scaling.png", "ms", columns=2))
    assert img.shape[0] > 400 and img.shape[1] > 500
    assert img.std() > 0.05 and _colours(img) > 4
    with pytest.raises(ValueError, match="at least one point"):
        viz.scaling_png({"GPT": {"dp": {}}}, tmp_path / "none.png", "ms")
    with pytest.raises(ValueError, match="columns must be a positive int, got 0"):
        viz.scaling_png(panels, tmp_path / "bad.png", "ms", columns=0)
    assert not (tmp_path / "none.png").exists() and not (tmp_path / "bad.png").exists()
