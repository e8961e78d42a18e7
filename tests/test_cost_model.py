"""simpar's cost model and device profiles (pure: one process, shapes only)."""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from simpar import graph, nn, ops
from simpar.calibrate import step_terms
from simpar.cost import DeviceProfile, Link, evaluate, load_profile, profile_names
from simpar.nn import presets
from simpar.optimizer_parallel import OptimizerLevel, OptimizerParallel
from simpar.runtime import ParallelProgram, lower
from simpar.search import plan_request, plan_strategies, request_from_context
from simpar.search.strategy_map import StrategyMap

ALPHA, BETA = 1e-5, 1e9           # a synthetic link: 10 us per ring step, 1 GB/s
FLOPS, MEM_BW = 1e9, 1e10         # 1 GFLOP/s, 10 GB/s


def _profile(devices_per_server: int = 8, capacity: int = 2**30) -> DeviceProfile:
    return DeviceProfile("test", {"float64": FLOPS, "float32": 2 * FLOPS}, capacity, MEM_BW,
                         Link(ALPHA, BETA), Link(10 * ALPHA, BETA / 10), devices_per_server)


# ------------------------------------------------------------------ profiles
@pytest.mark.parametrize("name", ["ascend910a", "ascend910b", "cpu-local"])
def test_shipped_profiles_load_round_trip_and_say_where_each_figure_comes_from(name: str) -> None:
    assert name in profile_names()
    p = load_profile(name)
    assert DeviceProfile.from_dict(p.to_dict()) == p
    if name.startswith("ascend"):
        figures = [f"peak_flops.{d}" for d in p.peak_flops] + [
            "memory_capacity", "memory_bandwidth", "intra_server.bandwidth",
            "intra_server.latency", "inter_server.bandwidth", "inter_server.latency",
            "devices_per_server"]
        assert sorted(p.sources) == sorted(figures)
        assert all(s.startswith("assumption") or "Huawei" in s for s in p.sources.values())


def test_a_profile_file_loads_by_path(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "mine.json"
    _profile().save(path)
    assert load_profile(path) == _profile()
    assert load_profile(str(path)).name == "test"


BAD: list[tuple[str, Any, type[Exception], str]] = [
    ("memory_bandwidth", -1.0, ValueError, r"memory_bandwidth must be a finite number > 0, "
     r"got -1.0"),
    ("memory_bandwidth", "fast", TypeError, r"memory_bandwidth must be a number, got 'fast'"),
    ("devices_per_server", True, ValueError, r"devices_per_server must be an int >= 1, got "
     r"True"),
    ("peak_flops", {"float32": 0}, ValueError, r"peak_flops\['float32'\] must be a finite "
     r"number > 0, got 0"),
    ("intra_server", {"latency": 1e-6}, ValueError, r"intra_server must be"),
    ("colour", "blue", ValueError, r"unknown key\(s\) \['colour'\]"),
]


@pytest.mark.parametrize(("key", "value", "exc", "match"), BAD)
def test_a_bad_profile_figure_is_named(tmp_path: pathlib.Path, key: str, value: Any,
                                       exc: type[Exception], match: str) -> None:
    d = _profile().to_dict()
    d[key] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(exc, match=match):
        load_profile(path)


def test_a_missing_figure_and_an_unknown_name_are_named(tmp_path: pathlib.Path) -> None:
    d = _profile().to_dict()
    del d["inter_server"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"missing 'inter_server' \(link between servers"):
        load_profile(path)
    with pytest.raises(ValueError, match=r"unknown profile 'ascend999'; shipped profiles are "
                       r"\['ascend910a', 'ascend910b', 'cpu-local'\]"):
        load_profile("ascend999")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_profile(path)


# ------------------------------------------------------------------ collectives and kernels
def test_ring_collectives_cost_their_formula_on_the_link_they_cross() -> None:
    p = _profile(devices_per_server=4)
    n = 2**20
    inside, across = (0, 1, 2, 3), (0, 1, 4, 5)
    assert p.collective_seconds("AllReduce", inside, n) == pytest.approx(
        2 * 3 * ALPHA + 2 * 3 / 4 * n / BETA)
    assert p.collective_seconds("AllGather", inside, n) == pytest.approx(3 * ALPHA + 3 * n / BETA)
    assert p.collective_seconds("ReduceScatter", inside, n) == pytest.approx(
        3 * ALPHA + 3 / 4 * n / BETA)
    assert p.collective_seconds("AllToAll", inside, n) == pytest.approx(
        3 * ALPHA + 3 / 4 * n / BETA)
    # a group that spans two servers pays the inter-server link
    assert p.collective_seconds("AllReduce", across, n) == pytest.approx(
        2 * 3 * 10 * ALPHA + 2 * 3 / 4 * n / (BETA / 10))
    assert p.collective_seconds("AllReduce", (3,), n) == 0.0
    assert p.collective_seconds("Broadcast", inside, n) == pytest.approx(2 * ALPHA + n / BETA)


def test_a_rank_table_sets_the_server_boundaries() -> None:
    p = _profile(devices_per_server=4).with_rank_table([0, 1, 0, 1, 0, 1, 0, 1])
    assert [p.server_of(r) for r in range(8)] == [0, 1] * 4
    assert p.link((0, 2, 4, 6)) == p.intra_server and p.link((0, 1)) == p.inter_server
    with pytest.raises(ValueError, match="rank 8 is not in its rank table of 8 devices"):
        p.server_of(8)


def test_a_kernel_costs_the_slower_of_its_flops_and_its_bytes() -> None:
    p = _profile()
    assert p.compute_seconds(1e9, 1e3, np.float64) == pytest.approx(1.0)      # compute-bound
    assert p.compute_seconds(1e3, 1e10, np.float64) == pytest.approx(1.0)     # memory-bound
    assert p.compute_seconds(1e9, 0, np.float32) == pytest.approx(0.5)
    assert p.compute_seconds(1e9, 0, np.float16) == pytest.approx(1.0)        # slowest listed


# ------------------------------------------------------------------ programs
def _split_k_dense(n: int = 2) -> ParallelProgram:
    """y = x @ w.T with k split n ways: one AllReduce of the (8, 16) float64 output."""
    dense = nn.Dense(32, 16, has_bias=False, dtype=np.float64)
    dense.matmul.shard(((1, n), (1, n)))
    g = graph.trace(dense, [((8, 32), np.float64)], ["x"])
    return lower(g, plan_strategies(g, n, "semi_auto_parallel"))


def test_a_split_k_matmul_costs_its_kernels_and_its_allreduce() -> None:
    prog, p = _split_k_dense(2), _profile()
    r = evaluate(prog, p, "sgd")
    (row,) = r.ops
    flops = 2 * 8 * 16 * 16                                  # local (8, 16) x (16, 16)
    nbytes = (8 * 16 + 16 * 16 + 8 * 16) * 8                 # local x, w and output shards
    fwd = max(flops / FLOPS, nbytes / MEM_BW)
    bwd = max(2 * flops / FLOPS, 2 * nbytes / MEM_BW)
    assert row.compute == pytest.approx(fwd + bwd)
    out = 8 * 16 * 8
    allreduce = 2 * 1 * ALPHA + out / BETA                   # p = 2: 2 rounds, traffic n
    # forward AllReduce of the partial output; none backward: the output's cotangent is
    # whole on both ranks, and so is the partial output's (simpar.cotangent)
    assert row.op_comm == pytest.approx(allreduce)
    assert row.redistribution == 0 and r.grad_sync == 0      # w is split: no Mirror
    assert r.optimizer == pytest.approx(4 * 16 * 16 * 8 / MEM_BW)   # SGD: 4 passes over w
    assert r.overhead == pytest.approx(2 * ALPHA + 8 / BETA)  # the inputs' 8-byte check
    assert r.step_seconds == pytest.approx(fwd + bwd + allreduce + r.optimizer + r.overhead)


def test_fixed_costs_per_kernel_call_per_collective_and_per_step() -> None:
    """A profile's software costs: every kernel call (forward and backward), every
    collective call and every step pay them once."""
    base = _profile()
    slow = DeviceProfile("slow", base.peak_flops, base.memory_capacity, MEM_BW,
                         Link(ALPHA, BETA, overhead=1e-3), Link(ALPHA, BETA, overhead=1e-3), 8,
                         kernel_overhead=1e-4, step_overhead=1e-2, array_op_overhead=1e-5)
    prog = _split_k_dense(2)
    fast, costly = evaluate(prog, base, "momentum"), evaluate(prog, slow, "momentum")
    kernels, array_ops = 2, 5             # MatMul forward and backward; Momentum on w
    collectives = 1 + 1                   # the AllReduce (no adjoint), the inputs' check
    assert costly.step_seconds - fast.step_seconds == pytest.approx(
        kernels * 1e-4 + array_ops * 1e-5 + collectives * 1e-3 + 1e-2)


def test_compute_scale_multiplies_the_roofline_not_the_dispatch() -> None:
    """A kernel costs kernel_overhead + compute_scale x roofline; the calibration's step terms
    are read off this model, one coefficient per figure."""
    base = _profile()
    prog = _split_k_dense(2)
    roofline = evaluate(prog, base, "momentum").compute
    scaled = replace(base, kernel_overhead=1e-4, compute_scale=3.0)
    assert evaluate(prog, scaled, "momentum").compute == pytest.approx(2 * 1e-4 + 3 * roofline)
    slow = replace(base, intra_server=Link(ALPHA, BETA, 1e-3),
                   inter_server=Link(ALPHA, BETA, 1e-3), kernel_overhead=1e-4,
                   step_overhead=1e-2, compute_scale=2.0, sync_overhead=-5e-4)
    terms, rest = step_terms(prog, slow, "momentum")
    assert terms[:2] == (1.0, 2.0) and terms[3] == 2.0   # 1 step, 2 kernels, 2 collectives
    assert terms[2] == pytest.approx(roofline)
    priced = evaluate(prog, slow, "momentum").step_seconds
    assert rest + np.dot(terms, [1e-2, 1e-4, 2.0, -5e-4]) == pytest.approx(priced)


@pytest.mark.parametrize(("level", "held"), [(None, 1), ("level1", 1), ("level2", 4)])
def test_each_micro_batch_after_the_first_adds_its_gradients_into_the_sum(
        level: str | None, held: int) -> None:
    """Gradient accumulation costs a call and three passes over each gradient the backward
    hands over, for every micro-batch but the first: the weight's whole shard, or its
    quarter where level2 reduce-scatters every micro-batch. evaluate and the searches'
    per-op price (step_op_seconds) charge it alike."""
    from simpar.cost import SimparCostModel
    dense = nn.Dense(32, 16, has_bias=False, dtype=np.float64)
    g = graph.trace(dense, [((16, 32), np.float64)], ["x"])
    prof = replace(_profile(), array_op_overhead=1e-5)
    optimizer = OptimizerParallel(None if level is None else OptimizerLevel(level), -1, 0)
    summing = 1e-5 + 3 * 16 * 32 * 8 / held / MEM_BW       # the (16, 32) float64 weight
    reports, per_op = [], []
    for micro in (1, 4):
        prog = lower(g, plan_request(request_from_context(
            g, device_num=4, mode="data_parallel", dataset_strategy="data_parallel",
            micro_batches=micro, optimizer=optimizer)))
        reports.append(evaluate(prog, prof, "sgd"))
        (step,) = prog.steps
        model = SimparCostModel(prof, "sgd")
        shards = ({} if level is None else
                  {1: (OptimizerLevel(level), 4)})
        per_op.append(model.step_op(step.sharding, [1], 8, shards=shards, micro_batches=micro)
                      - micro * sum(model.kernel_seconds(step.sharding, 8)))
    one, four = reports
    assert one.accumulation == 0 and four.accumulation == pytest.approx(3 * summing)
    assert four.step_seconds == pytest.approx(
        four.compute + four.op_comm + four.redistribution + four.grad_sync
        + four.accumulation + four.optimizer + four.overhead)
    assert "gradient accumulation" in str(four) and "gradient accumulation" not in str(one)
    # the per-op price: the same sum (its collectives' calls aside, as before)
    extra = per_op[1] - per_op[0]
    collectives = 0.0 if level != "level2" else 3 * prof.step_collective_seconds(
        "ReduceScatter", range(4), 16 * 32 * 8, 0)
    assert extra == pytest.approx(3 * summing + collectives)


def test_sync_overhead_may_be_negative_down_to_minus_the_link_overhead() -> None:
    base = _profile()
    links = {"intra_server": Link(ALPHA, BETA, 1e-3), "inter_server": Link(ALPHA, BETA, 2e-3)}
    assert replace(base, **links, sync_overhead=-1e-3).sync_overhead == -1e-3
    with pytest.raises(ValueError, match=r"sync_overhead must be >= minus the links' per-call "
                       r"overhead \(-0\.001\), got -0\.002"):
        replace(base, **links, sync_overhead=-2e-3)
    with pytest.raises(TypeError, match="sync_overhead must be a number"):
        replace(base, sync_overhead="0")


def test_memory_counts_parameters_gradients_state_and_kept_activations() -> None:
    """Dense(32 -> 16) then ReLU, data parallel on 2 ranks, batch 8, float64. By hand:
    parameters w (16, 32) and b (16,) replicated: 528 elements; the kept activations are
    what each op's backward reads, once per layout: MatMul's input x (4, 32) (not its product,
    which BiasAdd reads and keeps nothing of), BiasAdd's output (4, 16) (ReLU's input) and
    ReLU's output (4, 16)."""
    dense = nn.Dense(32, 16, activation="relu", dtype=np.float64)
    g = graph.trace(dense, [((8, 32), np.float64)], ["x"])
    prog = lower(g, plan_strategies(g, 2, "data_parallel"))
    for optimizer, copies in (("sgd", 0), ("momentum", 1), ("adam", 2)):
        m = evaluate(prog, _profile(), optimizer).memory[0]
        assert (m.parameters, m.gradients, m.optimizer) == (528 * 8, 528 * 8, copies * 528 * 8)
        assert m.activations == (4 * 32 + 2 * 4 * 16) * 8
        assert m.comm_buffer == 528 * 8          # the Mirror's bucket, summed in place
        assert m.backward == (4 * 16 + 4 * 32) * 8  # MatMul: dy, dx (dw: a gradient)
        assert m.update == {"sgd": 1, "momentum": 1, "adam": 4}[optimizer] * 16 * 32 * 8
        assert m.peak == m.parameters + m.gradients + m.optimizer + max(
            m.activations + max(528 * 8, m.backward), m.update)


def test_activations_follow_what_each_op_keeps_for_the_backward() -> None:
    """x (8, 16) -> Reshape (a view, keeps nothing) -> Transpose (a copy, keeps nothing) ->
    Softmax (keeps its output) -> MatMul with w (keeps both inputs, not its product), on one
    device, float64. Kept: Softmax's output (16, 8), once though MatMul keeps it too; x,
    Reshape's view, Transpose's copy and MatMul's output are kept by nobody."""
    w = nn.Parameter(np.ones((8, 4)), name="w")

    def f(x: Any) -> Any:
        y = ops.Softmax()(ops.Transpose((1, 0))(ops.Reshape((8, 16))(x)))
        return ops.MatMul()(y, w)

    g = graph.trace(f, [((16, 8), np.float64)], ["x"])
    m = evaluate(lower(g, plan_strategies(g, 1, "stand_alone")), _profile(), "sgd").memory[0]
    assert m.activations == 16 * 8 * 8


def test_a_strategy_over_capacity_is_reported_per_rank_with_how_far_over() -> None:
    r = evaluate(_split_k_dense(2), _profile(capacity=4096), "adam")
    assert not r.fits
    lines = r.over_capacity()
    assert len(lines) == 2 and lines[0].startswith("rank 0: peak ") and "by " in lines[0]
    assert "OVER" in str(r)


def test_the_report_prints_and_serialises() -> None:
    r = evaluate(_split_k_dense(2), _profile(), "sgd")
    text = str(r)
    assert "predicted step" in text and "MatMul" in text and "fits" in text
    d = json.loads(r.to_json())
    assert d["step_seconds"] == r.step_seconds and d["ops"][0]["op_type"] == "MatMul"
    assert r.to_dict()["fits"] is True


def test_the_program_reports_its_own_cost_on_a_shipped_profile() -> None:
    prog = _split_k_dense(2)
    assert prog.cost("ascend910a").step_seconds == evaluate(prog, "ascend910a").step_seconds
    with pytest.raises(ValueError, match="optimizer must be one of"):
        prog.cost("ascend910a", "lamb")


def test_planning_and_costing_scale_to_thousands_of_devices() -> None:
    """A Megatron MLP on 4096 devices (dp 512 x mp 8), costed on the Ascend profile: ranks are
    sampled, and a group of 512 data-parallel ranks spans servers."""
    mlp = nn.MLP(64, 256, 16, n_hidden=1, dtype=np.float32)
    for k, layer in enumerate(mlp.layers):
        cuts = ((512, 1), (8, 1)) if k % 2 == 0 else ((512, 8), (1, 8))
        layer.matmul.shard(cuts)
    g = graph.trace(mlp, [((4096, 64), np.float32)], ["x"])
    prog = lower(g, plan_strategies(g, 4096, "semi_auto_parallel", ((512, 1),)))
    r = prog.cost("ascend910a")
    assert len(r.memory) == 65 and math.isfinite(r.step_seconds) and r.fits
    assert r.grad_sync > 0                                   # Mirrors over 512 ranks
    assert any(op.op_comm > 0 for op in r.ops)               # the row-parallel AllReduce


def test_an_unused_op_type_does_not_break_costing() -> None:
    x = nn.Parameter(np.ones((4, 4)), name="x")
    g = graph.trace(lambda a: ops.Transpose((1, 0))(ops.MatMul()(a, x)), [((4, 4), np.float64)])
    r = evaluate(lower(g, plan_strategies(g, 1, "stand_alone")), _profile())
    assert [row.op_type for row in r.ops] == ["MatMul", "Transpose"] and r.grad_sync == 0


def test_a_split_k_product_is_not_kept_but_its_allreduced_value_is() -> None:
    """ReLU(x @ w) with k split over 2 devices, float64: the tapes keep x's shard (8, 16), the
    AllReduced output ReLU reads (8, 16) and ReLU's output (8, 16): three arrays of 1 KiB, not
    MatMul's raw partial product (MatMul keeps its inputs only). The AllReduce sums that
    product in place (nothing else holds it): it holds 1 KiB."""
    w = nn.Parameter(np.ones((32, 16)), name="w")
    mm = ops.MatMul().shard(((1, 2), (2, 1)))
    g = graph.trace(lambda x: ops.ReLU()(mm(x, w)), [((8, 32), np.float64)], ["x"])
    m = evaluate(lower(g, plan_strategies(g, 2, "semi_auto_parallel")), _profile()).memory[0]
    assert m.activations == 3 * 8 * 16 * 8
    assert m.comm_buffer == 8 * 16 * 8


def test_a_redistributed_copy_of_a_parameter_is_kept_and_gathers_hold_the_whole() -> None:
    """w (64, 64) float64 read column-split by one MatMul and row-split by another, on 4
    devices: the second gets its own (16, 64) copy (an AllGather then a slice), which its
    tape keeps; that AllGather holds its (64, 16) input and its (64, 64) result. (No search
    plans this, and semi_auto_parallel refuses it as MindSpore does; a strategy map edited by
    hand, or a strategy file, can still ask for it.)"""
    w = nn.Parameter(np.ones((64, 64)), name="w")
    m1, m2 = ops.MatMul().shard(((1, 1), (1, 4))), ops.MatMul()
    g = graph.trace(lambda x: m2(m1(x, w), w), [((8, 64), np.float64)], ["x"])
    edited = plan_strategies(g, 4, "semi_auto_parallel").to_dict()
    edited["ops"]["Default/MatMul-op1"]["in_strategy"] = [[1, 4], [4, 1]]
    prog = lower(g, StrategyMap.from_dict(edited))
    m = evaluate(prog, _profile()).memory[0]
    copy = 16 * 64 * 8
    # x (8, 64); m1's output (8, 16), which m2 reads as is (m2's raw partial product and
    # its AllReduced output, the graph's, are kept by no tape)
    assert m.activations == (8 * 64 + 8 * 16) * 8 + copy
    assert m.comm_buffer >= 64 * 16 * 8 + 64 * 64 * 8


def test_gather_keeps_its_ids_and_kernels_count_each_inputs_own_dtype() -> None:
    table = nn.Parameter(np.ones((100, 64)), name="table")
    gamma, beta = nn.Parameter(np.ones(64), name="g"), nn.Parameter(np.zeros(64), name="b")

    def f(ids: Any) -> Any:
        return ops.LayerNorm(1, 1)(ops.Gather()(table, ids), gamma, beta)

    for ids in (np.int32, np.int64):
        g = graph.trace(f, [((512,), ids)], ["ids"])
        prog = lower(g, plan_strategies(g, 1, "stand_alone"))
        m = evaluate(prog, _profile()).memory[0]
        # the ids, and LayerNorm's xhat (512, 64); not Gather's output
        assert m.activations == 512 * np.dtype(ids).itemsize + 512 * 64 * 8
    g32 = graph.trace(f, [((512,), np.int32)], ["ids"])
    g64 = graph.trace(f, [((512,), np.int64)], ["ids"])
    base = _profile()                     # memory-bound: FLOPs are free
    p = DeviceProfile("bytes", {"float64": 1e18}, base.memory_capacity, MEM_BW,
                      base.intra_server, base.inter_server, 8)
    r32 = evaluate(lower(g32, plan_strategies(g32, 1, "stand_alone")), p).ops[0]
    r64 = evaluate(lower(g64, plan_strategies(g64, 1, "stand_alone")), p).ops[0]
    assert r64.compute - r32.compute == pytest.approx(3 * 512 * 4 / MEM_BW)  # ids only


@pytest.mark.parametrize(("change", "match"), [
    ({"memory_capacity": float("nan")}, r"memory_capacity must be a finite number > 0, got nan"),
    ({"memory_capacity": 1.5e9 + 0.5}, r"memory_capacity must be a whole number of bytes"),
    ({"peak_flops": {"fp16": 1e12}}, r"peak_flops key 'fp16' is not a floating-point dtype"),
    ({"server_map": [0, -1]}, r"server map must list a server index \(an int >= 0\)"),
])
def test_more_bad_figures_are_named(tmp_path: pathlib.Path, change: dict[str, Any],
                                    match: str) -> None:
    d = {**_profile().to_dict(), **change}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=match):
        load_profile(path)


def test_a_rank_table_profile_round_trips() -> None:
    p = _profile(devices_per_server=4).with_rank_table([0, 0, 1, 1])
    assert DeviceProfile.from_dict(p.to_dict()) == p and p.server_map == (0, 0, 1, 1)
    with pytest.raises(ValueError, match="server map"):
        _profile().with_rank_table([0, True])


# ------------------------------------------------------------------ one interface, two models
def test_both_models_answer_one_interface_and_a_report_shows_both() -> None:
    from simpar.cost import (
        CostModel,
        MindSporeCostModel,
        SimparCostModel,
        compare,
        objective,
        op_cost,
        redistribution_cost,
    )
    from simpar.layout import TensorLayout
    from simpar.redistribution import plan

    prog = _split_k_dense(2)
    simparm, msm = SimparCostModel(_profile(), "sgd"), MindSporeCostModel()
    assert isinstance(simparm, CostModel) and isinstance(msm, CostModel)
    (step,) = prog.steps
    # simpar's op cost for the search: the kernels forward and backward and the AllReduce
    # both ways (the weight is split, so no Mirror). The program runs the AllReduce forward
    # only (its output's cotangent is whole): the search's figure is the upper bound that
    # holds whatever the neighbours' strategies make of the cotangent
    report = evaluate(prog, _profile(), "sgd")
    assert simparm.op(step.sharding, {1}, 8) == pytest.approx(
        report.ops[0].compute + 2 * report.ops[0].op_comm)
    assert simparm.program(prog) == report.step_seconds
    # MindSpore's: its objective of its op cost
    assert msm.op(step.sharding, {1}, 8) == objective(
        op_cost(step.sharding, {1}, 8), step.sharding.strategy, 2)
    # an edge: S0 -> S1 on 8 devices with an AllToAll, both ways
    src = TensorLayout((8,), (0, -1), (64, 64))
    dst = TensorLayout((8,), (-1, 0), (64, 64))
    p = plan(src, dst, enable_alltoall=True)
    one = _profile().collective_seconds("AllToAll", range(8), 8 * 64 * 4)
    assert simparm.edge(p, 4) == pytest.approx(2 * one)
    assert msm.edge(p, 4) > 0 and redistribution_cost(p, 4).forward > 0
    # a direct exchange (AllToAllV, over every rank) is priced too
    q = plan(TensorLayout((8, 1, 1), (2, 0), (64, 256)),
             TensorLayout((1, 4, 2), (2, 1), (64, 256)), enable_alltoall=True)
    assert [str(s.kind) for s in q.steps if not s.kind.local] == ["AllToAllV"]
    assert simparm.edge(q, 4) > 0
    table = compare(prog, [simparm, msm])
    assert "simpar (s)" in table and "mindspore (MindSpore cost" in table
    assert "MatMul" in table and "whole program" in table


def test_the_launchers_rank_table_sets_the_servers() -> None:
    from simpar.launch import build_rank_table

    table = build_rank_table(8, [("node-a", 4), ("node-b", 4)])
    p = _profile(devices_per_server=8).with_rank_table(table)
    assert p.server_map == (0, 0, 0, 0, 1, 1, 1, 1)
    assert p.link((0, 4)) == p.inter_server and p.link((0, 3)) == p.intra_server


def test_the_executor_reports_the_peak_bytes_it_holds() -> None:
    """x (8, 32) @ w.T (w (16, 32)), float64, one device: after the forward the executor holds
    w, x and the output (8, 16), each once though the tape keeps x and the output too."""
    from simpar.runtime import watching_memory

    dense = nn.Dense(32, 16, has_bias=False, dtype=np.float64)
    g = graph.trace(dense, [((8, 32), np.float64)], ["x"])
    prog = lower(g, plan_strategies(g, 1, "stand_alone"))
    with watching_memory() as watch:
        prog.forward([np.ones((8, 32))], {"weight": np.ones((16, 32))})
    assert watch.peak == (16 * 32 + 8 * 32 + 8 * 16) * 8


class _EveryRank:
    """A program priced rank by rank: every rank its own class (the reference for
    :meth:`ParallelProgram.rank_classes`)."""

    def __init__(self, program: ParallelProgram) -> None:
        self._program = program

    def __getattr__(self, name: str) -> Any:
        return getattr(self._program, name)

    def rank_classes(self, ranks: Any, link: Any) -> tuple[tuple[int, ...], ...]:
        return tuple((r,) for r in ranks)


def _gpt_program(device_num: int, mode: str, enable_alltoall: bool = False,
                 level: str | None = None) -> ParallelProgram:
    """A one-block GPT on ``device_num`` ranks: searched by ``mode``, or Megatron's dp x mp
    for ``mode="megatron dp x mp"``."""
    gpt, loss = nn.GPT(24, 12, 24, 1, 6, dtype=np.float64), nn.SoftmaxCrossEntropyWithLogits()
    if mode.startswith("megatron"):
        dp, mp = (int(k) for k in mode.split()[1].split("x"))
        presets.megatron_gpt(gpt, dp, mp, loss)
    g = graph.trace(nn.WithLossCell(gpt, loss), [((24, 12), np.int32), ((24, 12), np.int32)],
                    ["data", "label"])
    optimizer = OptimizerParallel(None if level is None else OptimizerLevel(level), -1, 0)
    smap = plan_request(request_from_context(
        g, device_num=device_num,
        mode="semi_auto_parallel" if mode.startswith("megatron") else "auto_parallel",
        dataset_strategy="data_parallel", enable_alltoall=enable_alltoall,
        search_mode=None if mode.startswith("megatron") else mode, optimizer=optimizer))
    return lower(g, smap, enable_alltoall)


@pytest.mark.parametrize(("device_num", "per_server", "mode", "alltoall", "level"), [
    (8, 8, "dynamic_programming", False, None),
    (8, 4, "dynamic_programming", True, None),
    (8, 2, "sharding_propagation", False, "level1"),
    (6, 4, "dynamic_programming", False, None),       # a group straddles a server for some
    (12, 8, "recursive_programming", True, "level3"),
    (12, 5, "dynamic_programming", False, None),
    (6, 4, "megatron 2x3", True, None),               # mp groups {0,1,2} and {3,4,5}
    (12, 8, "megatron 4x3", False, "level2"),
    (8, 6, "megatron 4x2", True, "level1"),
])
def test_one_rank_per_class_prices_as_every_rank_does(device_num: int, per_server: int,
                                                       mode: str, alltoall: bool,
                                                       level: str | None) -> None:
    prog, prof = _gpt_program(device_num, mode, alltoall, level), _profile(per_server)
    fast, slow = evaluate(prog, prof, "adam"), evaluate(_EveryRank(prog), prof, "adam")
    assert slow.rank_classes == device_num
    assert replace(fast, rank_classes=device_num) == slow
    classes = prog.rank_classes(range(device_num), prof.link)
    assert sorted(r for c in classes for r in c) == list(range(device_num))
    for members in classes:   # a class's schedules: step for step alike but for the groups
        first = prog.schedule(members[0])
        for r in members[1:]:
            assert [(s.role, s.collective, len(s.group), prof.link(s.group), s.recv_bytes,
                     s.flops) for s in prog.schedule(r)] == \
                [(s.role, s.collective, len(s.group), prof.link(s.group), s.recv_bytes,
                  s.flops) for s in first]
    if per_server == 8 and device_num == 8:
        assert fast.rank_classes == 1
