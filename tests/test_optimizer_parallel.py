"""Optimizer parallel, planned in one process: the slice each rank stores, which parameters
are sliced and why the others are not, MindSpore's keys for it, and the plan and program it
gives (shapes only, no MPI). The runs against one device are tests/test_optimizer_parallel_mpi.py.

    python -m pytest -q -p no:cacheprovider tests/test_optimizer_parallel.py
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import simpar
from simpar import context, graph, nn
from simpar.layout import TensorLayout
from simpar.optimizer_parallel import (
    OptimizerLevel,
    OptimizerParallel,
    ParamFacts,
    ParamShard,
    shard_parameters,
    slice_layout,
)
from simpar.runtime import lower
from simpar.runtime.program_schedule import Role
from simpar.search import (
    OptimizerShardWarning,
    StrategyMap,
    plan_request,
    request_from_context,
)
from tests.layout_strategies import layouts


@pytest.fixture(autouse=True)
def _fresh_context() -> Any:
    context.reset_auto_parallel_context()
    yield
    context.reset_auto_parallel_context()


# ------------------------------------------------------------------ the slice a rank stores
def _block(lay: TensorLayout, rank: int) -> tuple[tuple[int, int], ...]:
    return lay.slice_of(rank)


@given(layouts(allow_partial=False), st.data())
def test_a_slice_cuts_dimension_0_of_its_block_among_consecutive_replicas(
        lay: TensorLayout, data: st.DataObject) -> None:
    if not lay.ndim:
        return
    repeated = math.prod(lay.device_matrix[a] for a in lay.replica_axes)
    size = data.draw(st.sampled_from([d for d in range(1, repeated + 1) if repeated % d == 0
                                      and lay.local_shape()[0] % d == 0]))
    try:
        sliced = slice_layout(lay, size)
    except ValueError as e:
        assert "consecutive" in str(e) or "scalar" in str(e)
        return
    assert sliced.local_shape()[0] * size == lay.local_shape()[0]
    assert sliced.local_shape()[1:] == lay.local_shape()[1:]
    by_block: dict[Any, list[int]] = {}
    for rank in range(lay.device_num):
        block, part = _block(lay, rank), _block(sliced, rank)
        # Inside the rank's own block: every dimension but 0 whole, dimension 0 a part.
        assert part[1:] == block[1:]
        assert block[0][0] <= part[0][0] < part[0][1] <= block[0][1]
        by_block.setdefault(block, []).append(rank)
    for block, ranks in by_block.items():
        groups: dict[tuple[int, int], list[int]] = {}
        for r in ranks:
            groups.setdefault(_block(sliced, r)[0], []).append(r)
        # The block's rows, cut in ``size`` disjoint parts covering it...
        rows = sorted(groups)
        assert len(rows) == size
        assert rows[0][0] == block[0][0] and rows[-1][1] == block[0][1]
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
        # ...each part held by the same number of replicas, and the ``size`` ranks holding
        # the different parts are consecutive in the block's rank list (MindSpore's group).
        assert len({len(rs) for rs in groups.values()}) == 1
        for k in range(0, len(ranks), size):
            run = ranks[k:k + size]
            assert sorted(_block(sliced, r)[0] for r in run) == rows


def test_a_slice_of_a_model_parallel_weight_uses_its_replica_axis() -> None:
    # dp 2 x mp 4: a column-parallel weight (rows whole, columns over mp) repeats over dp.
    lay = TensorLayout((2, 4), (-1, 0), (8, 16))
    sliced = slice_layout(lay, 2)
    assert [sliced.slice_of(r) for r in (1, 5)] == [((0, 4), (4, 8)), ((4, 8), (4, 8))]
    with pytest.raises(ValueError, match="not a run of consecutive ranks"):
        slice_layout(lay, 4)   # only 2 ranks hold each block alike


# ------------------------------------------------------------------ which parameters
def _facts(lay: TensorLayout, itemsize: int = 8, trainable: bool = True) -> ParamFacts:
    return ParamFacts(lay, itemsize, trainable)


def test_which_parameters_stay_whole_and_why() -> None:
    dp8 = TensorLayout((8,), (-1, -1), (64, 32))
    params = {
        "w": _facts(dp8),                                             # 16 KiB: sliced at 0
        "tiny": _facts(TensorLayout((8,), (-1,), (8,))),              # 64 bytes
        "frozen": _facts(dp8, trainable=False),
        "split": _facts(TensorLayout((8,), (0, -1), (64, 32))),       # no replica
        "rows": _facts(TensorLayout((8,), (-1, -1), (4, 32))),        # 4 rows, 8 slices
    }
    shards, whole = shard_parameters(params, OptimizerParallel("level2", -1, 1))
    assert set(shards) == {"w"} and shards["w"].size == 8
    assert shards["w"].level is OptimizerLevel.LEVEL2
    assert "under parallel_optimizer_threshold 1 KB" in whole["tiny"]
    assert whole["frozen"] == "not trainable"
    assert "no two ranks" in whole["split"]
    assert "4 rows, which do not divide into 8 slices" in whole["rows"]
    # MindSpore's default threshold (64 KB) keeps the 16 KiB weight whole too.
    assert shard_parameters(params, OptimizerParallel("level1"))[0] == {}
    # A shard size divides the group or the parameter stays whole; larger than the group,
    # it is the whole group (MindSpore clamps it).
    shards, whole = shard_parameters({"w": _facts(dp8), "mp": _facts(
        TensorLayout((2, 4), (-1, 0), (64, 32)))}, OptimizerParallel("level1", 4, 0))
    assert shards["w"].size == 4 and shards["mp"].size == 2
    off = shard_parameters(params, OptimizerParallel())
    assert off == ({}, {})


def test_optimizer_settings_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="optimizer_level must be one of"):
        OptimizerParallel("level4")
    with pytest.raises(ValueError, match="optimizer_weight_shard_size must be -1"):
        OptimizerParallel("level1", 0)
    with pytest.raises(ValueError, match="parallel_optimizer_threshold must be an int >= 0"):
        OptimizerParallel("level1", -1, -5)


# ------------------------------------------------------------------ MindSpore's keys
def test_context_keys_defaults_and_the_gradient_accumulation_shard_view() -> None:
    assert context.get_auto_parallel_context("enable_parallel_optimizer") is False
    assert context.get_auto_parallel_context("parallel_optimizer_config") == {
        "parallel_optimizer_threshold": 64, "optimizer_weight_shard_size": -1,
        "optimizer_level": "level1", "gradient_accumulation_shard": False}
    context.set_auto_parallel_context(parallel_optimizer_config={
        "gradient_accumulation_shard": True})
    assert context.get_auto_parallel_context("parallel_optimizer_config")[
        "optimizer_level"] == "level2"
    context.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level3"})
    config = context.get_auto_parallel_context("parallel_optimizer_config")
    assert config["optimizer_level"] == "level3" and not config["gradient_accumulation_shard"]


@pytest.mark.parametrize(("config", "error", "match"), [
    ({"optimizer_level": "level0"}, ValueError, r"parallel_optimizer_config\['optimizer_level'\]"
                                                r" must be one of 'level1', 'level2', 'level3'"),
    ({"shard": 2}, ValueError, "unknown parallel_optimizer_config key 'shard'"),
    ({"optimizer_weight_shard_size": 0}, ValueError, "must be -1 .* or an int >= 1, but got 0"),
    ({"optimizer_weight_shard_size": 2.0}, TypeError, "must be -1"),
    ({"parallel_optimizer_threshold": -1}, ValueError, "parallel_optimizer_threshold"),
    ({"gradient_accumulation_shard": True, "optimizer_level": "level1"}, ValueError,
     "which means level2; pass one of them"),
    ([("optimizer_level", "level1")], TypeError, "must be a dict"),
])
def test_bad_optimizer_config_raises_naming_the_key(config: Any, error: type,
                                                    match: str) -> None:
    before = context.get_auto_parallel_context("parallel_optimizer_config")
    with pytest.raises(error, match=match):
        context.set_auto_parallel_context(enable_parallel_optimizer=True,
                                          parallel_optimizer_config=config)
    assert context.get_auto_parallel_context("parallel_optimizer_config") == before
    assert context.get_auto_parallel_context("enable_parallel_optimizer") is False


def test_a_shard_size_of_one_warns_and_is_ignored_as_in_mindspore() -> None:
    with pytest.warns(UserWarning, match="optimizer_weight_shard_size.*=1 slices nothing"):
        context.set_auto_parallel_context(parallel_optimizer_config={
            "optimizer_weight_shard_size": 1})
    assert context.get_auto_parallel_context("parallel_optimizer_config")[
        "optimizer_weight_shard_size"] == -1


WEIGHTS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _mlp_graph(batch: int = 8) -> graph.Graph:
    net = nn.WithLossCell(nn.MLP(16, 64, 8, n_hidden=1, dtype=np.float64),
                          nn.SoftmaxCrossEntropyWithLogits())
    return graph.trace(net, [((batch, 16), np.float64), ((batch,), np.int32)],
                       ["data", "label"])


def test_the_request_carries_the_settings_and_refuses_a_shard_size_that_divides_nothing(
        ) -> None:
    g = _mlp_graph()
    context.set_auto_parallel_context(parallel_mode="data_parallel",
                                      enable_parallel_optimizer=True, parallel_optimizer_config={
                                          "optimizer_level": "level3",
                                          "optimizer_weight_shard_size": 4,
                                          "parallel_optimizer_threshold": 0})
    request = request_from_context(g, device_num=8)
    assert request.optimizer == OptimizerParallel("level3", 4, 0)
    assert request_from_context(g, mode="stand_alone").optimizer == OptimizerParallel()
    context.set_auto_parallel_context(parallel_optimizer_config={
        "optimizer_weight_shard_size": 3})
    with pytest.raises(ValueError, match="optimizer_weight_shard_size 3 does not divide "
                                         "device_num 8"):
        request_from_context(g, device_num=8)


def test_hsdp_sets_every_optimizer_key_for_its_network_only() -> None:
    ap = nn.AutoParallel(nn.Dense(4, 2), parallel_mode="semi_auto")
    ap.hsdp(shard_size=2, threshold=0, optimizer_level="level3")
    with ap.parallel_context() as ctx:
        assert ctx.enable_parallel_optimizer
        assert ctx.parallel_optimizer_config.as_dict() == {
            "parallel_optimizer_threshold": 0, "optimizer_weight_shard_size": 2,
            "optimizer_level": "level3", "gradient_accumulation_shard": False}
    assert context.get_auto_parallel_context("enable_parallel_optimizer") is False
    # A setting made globally does not reach a wrapper that sets hsdp's defaults.
    context.set_auto_parallel_context(parallel_optimizer_config={
        "optimizer_weight_shard_size": 4})
    plain = nn.AutoParallel(nn.Dense(4, 2), parallel_mode="semi_auto")
    plain.hsdp()
    with plain.parallel_context() as ctx:
        assert ctx.parallel_optimizer_config.optimizer_weight_shard_size == -1
        assert ctx.parallel_optimizer_config.parallel_optimizer_threshold == 64


# ------------------------------------------------------------------ the plan and the program
def _program(level: str, n: int = 8, size: int = -1, mode: str = "data_parallel") -> Any:
    g = _mlp_graph()
    context.set_auto_parallel_context(parallel_mode=mode,
                                      enable_parallel_optimizer=True, parallel_optimizer_config={
                                          "optimizer_level": level,
                                          "optimizer_weight_shard_size": size,
                                          "parallel_optimizer_threshold": 0})
    request = request_from_context(g, device_num=n)
    smap = plan_request(request)
    return smap, lower(g, smap, request.enable_alltoall)


def test_the_plan_records_each_slice_and_round_trips() -> None:
    smap, _ = _program("level2")
    assert set(smap.shards) == {f"_backbone.{n}" for n in WEIGHTS}
    assert all(s.level is OptimizerLevel.LEVEL2 and s.size == 8 for s in smap.shards.values())
    back = StrategyMap.from_dict(json.loads(json.dumps(smap.to_dict())))
    assert back == smap and dict(back.shards) == dict(smap.shards)
    assert "optimizer shard _backbone.fc1.weight: level2 over 8 ranks" in str(smap)
    # A map whose slice does not cut its parameter's layout is refused by lowering.
    odd = dict(smap.shards)
    odd["_backbone.fc1.weight"] = ParamShard("level2", 8, TensorLayout((8,), (-1, 0), (64, 16)))
    with pytest.raises(ValueError, match="fc1.weight's optimizer shard .* is not its layout"):
        lower(_mlp_graph(), dataclasses.replace(smap, shards=odd))


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_the_schedule_gathers_before_use_and_reduce_scatters_the_gradients(level: str) -> None:
    _, prog = _program(level)
    for rank in (0, 5):
        sched = prog.schedule(rank)
        mirrors = [s for s in sched if s.role == Role.MIRROR]
        assert [s.collective for s in mirrors] == ["ReduceScatter"] * 4
        assert all(s.group == tuple(range(8)) for s in mirrors)
        fwd_gathers = [s for s in sched if s.role == Role.GATHER and not s.backward]
        assert [s.label.split(":")[0] for s in fwd_gathers] == [
            f"_backbone.{n}" for n in WEIGHTS]
        # Each gather comes right before the first op reading its weight.
        for s in fwd_gathers:
            nxt = sched[s.index + 1]
            assert nxt.role == Role.COMPUTE and ("MatMul" in nxt.op or "BiasAdd" in nxt.op)
        again = [s.label.split(":")[0] for s in sched if s.role == Role.GATHER and s.backward]
        # level3 gathers again what a tape would keep and the backward reads: fc2's weight,
        # for its input's gradient; not fc1's (its input is the data, which needs no
        # gradient, and its weight's own gradient reads only that input), nor the biases
        # (BiasAdd keeps nothing).
        assert again == (["_backbone.fc2.weight"] if level == "level3" else [])
        # Each gradient is reduce-scattered right after the backward of its first reader.
        for s in mirrors:
            name = s.label.removeprefix("Mirror:").split("/")[0]
            before = sched[s.index - 1]
            assert before.backward and (before.role == Role.COMPUTE or
                                        before.role == Role.MIRROR)
            assert name.split(".")[1] in before.op or before.role == Role.MIRROR
        assert all(prog.param_shards[n].layout.local_shape()[0] * 8 ==
                   prog.param_layouts[n].local_shape()[0] for n in prog.param_shards)


def test_a_shard_size_below_the_group_adds_an_allreduce_across_the_slices() -> None:
    _, prog = _program("level1", size=2)
    sched = prog.schedule(3)
    mirrors = [(s.collective, s.group) for s in sched if s.role == Role.MIRROR]
    # ReduceScatter within the 2 consecutive ranks, AllReduce across the 4 such pairs.
    assert mirrors[:2] == [("ReduceScatter", (2, 3)), ("AllReduce", (1, 3, 5, 7))]
    gathers = {(s.collective, s.group) for s in sched if s.role == Role.GATHER}
    assert gathers == {("AllGather", (2, 3))}


def test_stored_memory_falls_with_the_slices() -> None:
    _, plain = _program("level1", size=-1)
    cost = plain.cost("cpu-local", "adam")
    context.reset_auto_parallel_context()
    g = _mlp_graph()
    context.set_auto_parallel_context(parallel_mode="data_parallel")
    request = request_from_context(g, device_num=8)
    whole = lower(g, plan_request(request)).cost("cpu-local", "adam")
    row, row_whole = cost.memory[0], whole.memory[0]
    assert row.parameters * 8 == row_whole.parameters
    assert row.gradients * 8 == row_whole.gradients
    assert row.optimizer * 8 == row_whole.optimizer


def test_parameters_left_whole_for_a_reason_warn_once() -> None:
    g = graph.trace(nn.WithLossCell(nn.Dense(16, 6, dtype=np.float64), nn.MSELoss()),
                    [((8, 16), np.float64), ((8, 6), np.float64)], ["x", "y"])
    context.set_auto_parallel_context(parallel_mode="data_parallel",
                                      enable_parallel_optimizer=True, parallel_optimizer_config={
                                          "parallel_optimizer_threshold": 0})
    with pytest.warns(OptimizerShardWarning, match="leaves 2 parameters whole: "
                                                   "_backbone.weight: dimension 0 of its block "
                                                   "has 6 rows, which do not divide into 4"):
        smap = plan_request(request_from_context(g, device_num=4))
    assert dict(smap.shards) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizerShardWarning)
        context.set_auto_parallel_context(parallel_optimizer_config={
            "parallel_optimizer_threshold": 64})   # the threshold is not worth a warning
        assert plan_request(request_from_context(g, device_num=4)).shards == {}


# ------------------------------------------------------------------ what a tape keeps
def _run_ops(net: nn.Cell, inputs: list[np.ndarray]) -> list[tuple[str, int, bool, bool]]:
    """For each op of ``net``'s stand-alone program and each input: (op, k, the tape holds
    the input array itself, the op says it keeps it)."""
    g = graph.trace(net, [(x.shape, x.dtype) for x in inputs], None)
    context.set_auto_parallel_context(parallel_mode="stand_alone")
    prog = lower(g, plan_request(request_from_context(g, mode="stand_alone")))
    values: dict[int, Any] = {v.id: x for v, x in zip(g.inputs, inputs)}
    values.update((v.id, v.param.initial_value(0)) for v in g.params if v.param is not None)
    values.update((v.id, v.const) for v in g.consts)
    out = []
    for s in prog.steps:
        xs = [values[v.id] for v in s.node.inputs]
        y, tape = s.node.op.local_forward(s.sharding, *xs)
        ys = y if s.sharding.more_outs else (y,)
        for v, yv in zip(s.node.outputs, ys):
            values[v.id] = yv
        flat = list(_flatten(tape))
        for k, x in enumerate(xs):
            out.append((s.node.op.name, k, any(t is x for t in flat), s.node.op.keeps_input(k)))
    return out


def _flatten(tape: Any) -> Any:
    if isinstance(tape, (tuple, list)):
        for t in tape:
            yield from _flatten(t)
    else:
        yield tape


def test_keeps_input_says_what_every_tape_holds() -> None:
    rng = np.random.default_rng(0)
    gpt = nn.WithLossCell(nn.GPT(32, 8, 16, 1, 2, dtype=np.float64),
                          nn.SoftmaxCrossEntropyWithLogits())
    ids = rng.integers(0, 32, (2, 8)).astype(np.int32)
    seen = _run_ops(gpt, [ids, ids.copy()])
    bn = nn.WithLossCell(nn.BatchNorm2d(3, dtype=np.float64), nn.MSELoss())
    x = rng.standard_normal((2, 3, 4, 4))
    seen += _run_ops(bn, [x, x.copy()])
    wrong = [(op, k, held, said) for op, k, held, said in seen if held != said]
    assert not wrong, wrong
    ops = {op for op, _, _, _ in seen}
    assert {"MatMul", "LayerNorm", "Gather", "BatchNorm", "GeLU"} <= ops
    assert any(held for op, k, held, _ in seen if op == "LayerNorm" and k == 1)


def test_level3_drops_the_weight_every_keeping_tape_holds() -> None:
    """The executor's stand-in for a dropped weight replaces exactly that array."""
    from simpar.runtime.tapes import Dropped, rehold, unhold
    w, x = np.ones(3), np.zeros(2)
    marker = Dropped("w")
    tape = ((x, w), None, (w, (w, 1)))
    dropped = unhold(tape, w, marker)
    assert not any(t is w for t in _flatten(dropped))
    for a, b in itertools.zip_longest(_flatten(rehold(dropped, marker, w)), _flatten(tape)):
        assert a is b
    assert simpar.optimizer_parallel.OptimizerLevel.LEVEL3.regathers
    # context keeps its own copy of the level names (it imports nothing above it).
    assert context._LEVELS == simpar.optimizer_parallel.LEVELS


def test_the_strategy_file_records_mindspores_opt_weight_shard_fields(tmp_path: Any) -> None:
    from simpar.strategy_file import save_strategy
    smap, _ = _program("level1", size=2)
    path = tmp_path / "s.json"
    save_strategy(str(path), smap, _mlp_graph())
    items = json.loads(path.read_text())["parallel_layout_item"]
    # Data parallel on 8 ranks: the repeated group is every rank (stride 1), sliced over 2.
    assert {(items[n]["opt_weight_shard_size"], items[n]["opt_weight_shard_step"])
            for n in smap.shards} == {(2, 1)}
    context.reset_auto_parallel_context()
    plain = plan_request(request_from_context(_mlp_graph(), mode="data_parallel", device_num=8))
    save_strategy(str(path), plain, _mlp_graph())
    items = json.loads(path.read_text())["parallel_layout_item"]
    assert {(i["opt_weight_shard_size"], i["opt_weight_shard_step"]) for i in items.values()} \
        == {(0, 0)}


# ------------------------------------------------------------------ gradient accumulation
def _mlp_cell(micro: int | None) -> nn.TrainOneStepCell:
    net: nn.Cell = nn.WithLossCell(nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64),
                                   nn.SoftmaxCrossEntropyWithLogits())
    opt = nn.Adam(net.trainable_params(), 1e-2)
    if micro is not None:
        net = nn.GradAccumulation(net, micro)
    return nn.TrainOneStepCell(net, opt, parallel_mode="stand_alone", seed=3)


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_micro_batches_give_the_whole_batch_loss_and_gradients(micro: int) -> None:
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 16)), rng.integers(0, 8, 8).astype(np.int32)
    whole, split = _mlp_cell(None), _mlp_cell(micro)
    loss, grads = whole.value_and_grad(x, y)
    loss_m, grads_m = split.value_and_grad(x, y)
    assert split.program is not None and split.program.micro_batches == micro
    assert split.program.graph.inputs[0].shape == (8 // micro, 16)   # one micro-batch's
    assert abs(loss - loss_m) <= 1e-12 * abs(loss)
    for name, g in grads.items():
        assert np.isfinite(g).all()   # assert_allclose takes NaN == NaN
        np.testing.assert_allclose(grads_m[name], g, rtol=1e-10, atol=1e-14)
    # Training steps stay equal too.
    for k in range(3):
        assert abs(whole(x + k, y) - split(x + k, y)) <= 1e-10


def test_bad_accumulation_input_raises_naming_it() -> None:
    net = nn.WithLossCell(nn.Dense(4, 2), nn.MSELoss())
    with pytest.raises(TypeError, match="'micro_size' must be integer"):
        nn.GradAccumulation(net, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'micro_size' must be large than 0, but got 0"):
        nn.GradAccumulation(net, 0)
    with pytest.raises(TypeError, match="'network' must cell type"):
        nn.GradAccumulation(lambda x: x, 2)  # type: ignore[arg-type]
    train = _mlp_cell(3)
    with pytest.raises(ValueError, match=r"the 0th dimension shape of input\(8\) must be "
                                         r"divided by micro size\(3\)"):
        train(np.zeros((8, 16)), np.zeros(8, dtype=np.int32))


def test_with_micro_batches_the_once_a_step_syncs_are_deferred() -> None:
    g = _mlp_graph(4)
    context.set_auto_parallel_context(parallel_mode="data_parallel",
                                      enable_parallel_optimizer=True, parallel_optimizer_config={
                                          "optimizer_level": "level1",
                                          "parallel_optimizer_threshold": 0})
    for micro, level in [(2, "level1"), (2, "level2"), (1, "level1")]:
        context.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": level})
        request = request_from_context(g, device_num=4, micro_batches=micro)
        smap = plan_request(request)
        assert smap.micro_batches == micro
        assert StrategyMap.from_dict(json.loads(json.dumps(smap.to_dict()))) == smap
        sched = lower(g, smap).schedule(0)
        deferred = [s for s in sched if s.deferred]
        # level1 under micro-batches: the slices are cut once, after the last micro-batch;
        # level2 reduce-scatters each micro-batch's gradient as it is made.
        want = 4 if (micro, level) == (2, "level1") else 0
        assert len(deferred) == want and all(s.role == Role.MIRROR for s in deferred)
        assert deferred == [s for s in sched if s.backward][-want:] if want else True
