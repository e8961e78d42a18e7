"""simpar.cost.mindspore: MindSpore's cost model, checked against numbers worked by hand.

Every expected value below is written out from MindSpore's formulas (operator_costmodel.cc,
costmodel.cc, tensor_redistribution.cc), not from the code under test. Single process, pure.

    python -m pytest -q -p no:cacheprovider tests/test_cost_mindspore.py
"""

from __future__ import annotations

import dataclasses
import doctest
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from simpar import cost_model_context as cmc
from simpar.context import ContextError, ContextTypeError, NotHonouredWarning
from simpar.cost import mindspore as ms
from simpar.cost import mindspore_ops, mindspore_redistribution
from simpar.cost.mindspore import (
    EPS,
    STEP_OPERATORS,
    MindSporeOpCost,
    RedistributionCost,
    edge_cost,
    edge_objective,
    fits,
    mindspore_cost_class,
    objective,
    op_cost,
    redistribution_cost,
    refine_communication,
    strategy_cost,
)
from simpar.cost_model_context import (
    CostModelContext,
    cost_model_context,
    get_cost_model_context,
    reset_cost_model_context,
    set_cost_model_context,
)
from simpar.layout import TensorLayout
from simpar.ops import (
    Add,
    BiasAdd,
    MatMul,
    ReduceMean,
    ReduceSum,
    ReLU,
    Softmax,
    registry,
)
from simpar.redistribution import StepKind, plan

F32 = 4

MINDSPORE_DEFAULTS: dict[str, float | int] = {
    "device_memory_capacity": 1024.0 * 1024.0 * 1024.0 * 16.0,
    "costmodel_alpha": 1.0,
    "costmodel_beta": 400.0,
    "costmodel_gamma": 0.001,
    "costmodel_communi_threshold": 2048.0,
    "costmodel_communi_const": 3072.0,
    "costmodel_communi_bias": 1024.0,
    "run_phase": 0,
    "costmodel_allreduce_fusion_algorithm": 0,
    "costmodel_allreduce_fusion_times": 0,
    "costmodel_allreduce_fusion_tail_percent": 0.1,
    "costmodel_allreduce_fusion_tail_time": 0.1,
    "costmodel_allreduce_fusion_allreduce_inherent_time": 0.1,
    "costmodel_allreduce_fusion_allreduce_bandwidth": 0.1,
    "costmodel_allreduce_fusion_computation_time_parameter": 0.1,
}


@pytest.fixture(autouse=True)
def _fresh_context() -> Iterator[None]:
    reset_cost_model_context()
    yield
    reset_cost_model_context()


def test_the_docstring_examples_hold() -> None:
    # MindSpore's model spans four modules: the objective, op costs, redistribution, context
    results = [doctest.testmod(m, optionflags=doctest.ELLIPSIS)
               for m in (ms, mindspore_ops, mindspore_redistribution, cmc)]
    assert sum(r.attempted for r in results) > 10 and not any(r.failed for r in results)
    reset_cost_model_context()


# ------------------------------------------------------------------ context
def test_defaults_are_mindsporess() -> None:
    assert {k: get_cost_model_context(k) for k in MINDSPORE_DEFAULTS} == MINDSPORE_DEFAULTS
    assert dataclasses.asdict(cost_model_context()) == MINDSPORE_DEFAULTS
    assert cost_model_context() == CostModelContext()
    assert cost_model_context().training


NEW_VALUES: dict[str, float | int] = {
    "device_memory_capacity": 2.0 ** 30, "costmodel_alpha": 2.0, "costmodel_beta": 50.0,
    "costmodel_gamma": 0.5, "costmodel_communi_threshold": 0.0, "costmodel_communi_const": 1.0,
    "costmodel_communi_bias": 0.0, "run_phase": 1, "costmodel_allreduce_fusion_algorithm": 2,
    "costmodel_allreduce_fusion_times": 3, "costmodel_allreduce_fusion_tail_percent": 0.0,
    "costmodel_allreduce_fusion_tail_time": 0.5,
    "costmodel_allreduce_fusion_allreduce_inherent_time": 0.0,
    "costmodel_allreduce_fusion_allreduce_bandwidth": 7.0,
    "costmodel_allreduce_fusion_computation_time_parameter": 0.3,
}


def test_set_get_reset_round_trip() -> None:
    assert set(NEW_VALUES) == set(MINDSPORE_DEFAULTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotHonouredWarning)
        set_cost_model_context(**NEW_VALUES)
    assert {k: get_cost_model_context(k) for k in NEW_VALUES} == NEW_VALUES
    assert dataclasses.asdict(cost_model_context()) == NEW_VALUES
    assert not cost_model_context().training
    reset_cost_model_context()
    assert dataclasses.asdict(cost_model_context()) == MINDSPORE_DEFAULTS


def test_the_snapshot_does_not_follow_later_changes() -> None:
    before = cost_model_context()
    set_cost_model_context(costmodel_beta=50.0)
    assert before.costmodel_beta == 400.0 and cost_model_context().costmodel_beta == 50.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.costmodel_beta = 1.0  # type: ignore[misc]


def test_fusion_keys_warn_that_they_are_not_honoured() -> None:
    cmc._warned.discard("costmodel_allreduce_fusion_times")
    with pytest.warns(NotHonouredWarning, match="costmodel_allreduce_fusion_times=4 .*not "
                                                "honoured.*AllReduce"):
        set_cost_model_context(costmodel_allreduce_fusion_times=4)


@pytest.mark.parametrize("func", [set_cost_model_context, get_cost_model_context])
def test_an_unknown_key_is_named_with_a_suggestion_and_the_known_keys(func: Any) -> None:
    call = (lambda: func(costmodel_gama=0.5)) if func is set_cost_model_context else (
        lambda: func("costmodel_gama"))
    with pytest.raises(ContextError) as err:
        call()
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "unknown key 'costmodel_gama' (did you mean 'costmodel_gamma'?)" in msg
    assert all(k in msg for k in MINDSPORE_DEFAULTS)


def test_a_key_far_from_every_known_one_gets_no_suggestion() -> None:
    with pytest.raises(ContextError, match=r"unknown key 'zzz'; the known keys are"):
        set_cost_model_context(zzz=1.0)
    with pytest.raises(ContextTypeError, match="the key must be a str, but got 3"):
        get_cost_model_context(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("costmodel_gamma", True, r"a float in \[0, 1\]"),           # a bool is not a number
    ("run_phase", True, r"an int in \{0, 1\}"),
    ("run_phase", 1.0, r"an int in \{0, 1\}"),
    ("costmodel_alpha", "1.0", r"a float in \(0, inf\)"),
    ("costmodel_allreduce_fusion_times", False, r"an int in \[0, inf\)"),
])
def test_a_wrong_type_names_key_value_and_type(key: str, value: object, allowed: str) -> None:
    with pytest.raises(ContextTypeError, match=rf"{key} must be {allowed}, but got "
                                               rf"{value!r} of type {type(value).__name__}"):
        set_cost_model_context(**{key: value})
    assert get_cost_model_context(key) == MINDSPORE_DEFAULTS[key]


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("device_memory_capacity", 0.0, r"a float in \(0, inf\)"),
    ("device_memory_capacity", math.inf, r"a float in \(0, inf\)"),
    ("costmodel_alpha", -1.0, r"a float in \(0, inf\)"),
    ("costmodel_beta", 0.0, r"a float in \(0, inf\)"),
    ("costmodel_gamma", 1.5, r"a float in \[0, 1\]"),
    ("costmodel_gamma", math.nan, r"a float in \[0, 1\]"),
    ("costmodel_communi_threshold", -1.0, r"a float in \[0, inf\)"),
    ("costmodel_communi_const", -0.5, r"a float in \[0, inf\)"),
    ("costmodel_communi_bias", -2.0, r"a float in \[0, inf\)"),
    ("run_phase", 2, r"an int in \{0, 1\}"),
    ("costmodel_allreduce_fusion_algorithm", 3, r"an int in \{0, 1, 2\}"),
    ("costmodel_allreduce_fusion_tail_percent", 1.0, r"a float in \[0, 1\)"),
])
def test_out_of_range_names_key_value_and_range(key: str, value: float, allowed: str) -> None:
    with pytest.raises(ContextError, match=rf"{key} must be {allowed}, but got {value!r}\."):
        set_cost_model_context(**{key: value})
    assert isinstance(ContextError(""), ValueError)


def test_an_int_is_taken_where_a_float_goes() -> None:
    """MindSpore's ``costmodel_beta=50``: an int for a float key, kept as the float."""
    set_cost_model_context(costmodel_beta=50, device_memory_capacity=2 ** 34)
    assert get_cost_model_context("costmodel_beta") == 50.0
    assert type(get_cost_model_context("costmodel_beta")) is float
    assert get_cost_model_context("device_memory_capacity") == float(2 ** 34)
    reset_cost_model_context()


def test_a_call_with_one_bad_key_changes_nothing() -> None:
    with pytest.raises(ContextError, match="costmodel_gamma"):
        set_cost_model_context(costmodel_beta=50.0, costmodel_gamma=2.0)
    assert get_cost_model_context("costmodel_beta") == 400.0


def test_a_built_context_is_validated_too() -> None:
    assert CostModelContext(costmodel_beta=50.0).costmodel_beta == 50.0
    with pytest.raises(ContextError, match=r"CostModelContext: costmodel_gamma must be a float "
                                           r"in \[0, 1\], but got -0.1\."):
        CostModelContext(costmodel_gamma=-0.1)
    with pytest.raises(ContextTypeError, match="run_phase must be an int"):
        dataclasses.replace(CostModelContext(), run_phase=0.0)


# ------------------------------------------------------------------ operator costs
# Worked by hand for MatMul (64, 32) x (32, 16) on 8 devices, float32.

def test_matmul_with_k_split_and_b_a_replicated_parameter() -> None:
    sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((2, 4), (4, 1)))
    a, b, out = 32 * 8 * F32, 8 * 16 * F32, 32 * 16 * F32      # 1024, 512, 2048 bytes
    c = op_cost(sh, parameters={1})
    assert c == MindSporeOpCost(
        "MatMul", "MatMulCost",
        forward_computation=a + b + out,      # k is split: + the AllReduce'd output slice
        backward_computation=b,               # B uses 4 of 8 devices: its gradient AllReduce
        forward_communication=out,            # AllReduce of the partial output
        backward_communication=b,
        memory=b + a,                         # B is a Parameter, and dB needs A
        inference_memory=out)
    assert (c.computation, c.communication, c.communication_without_parameter) == (
        3584.0, 2560.0, 2048.0)


def test_matmul_with_k_unsplit_is_data_parallel() -> None:
    sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((8, 1), (1, 1)))
    a, b = 8 * 32 * F32, 32 * 16 * F32                          # 1024, 2048 bytes
    c = op_cost(sh, parameters={1})
    assert (c.forward_computation, c.forward_communication) == (a + b, 0.0)
    assert (c.backward_communication, c.backward_computation) == (b, b)   # B replicated x8
    assert c.memory == a + b and c.inference_memory == 8 * 16 * F32


def test_matmul_with_b_split_over_every_device_needs_no_gradient_allreduce() -> None:
    sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((1, 4), (4, 2)))
    a, b, out = 64 * 8 * F32, 8 * 8 * F32, 64 * 8 * F32         # 2048, 256, 2048 bytes
    c = op_cost(sh, parameters={1})
    assert (c.forward_computation, c.forward_communication) == (a + b + out, out)
    assert (c.backward_communication, c.backward_computation) == (0.0, 0.0)


def test_matmul_charges_only_b_as_mindspore_does() -> None:
    sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((8, 1), (1, 1)))
    c = op_cost(sh, parameters={0})    # A a Parameter: MatMulCost looks at B only
    assert c.backward_communication == 0.0
    assert op_cost(sh).memory == 0.0   # nothing parameter-involved: nothing kept


def test_relu_with_a_replicated_parameter_input() -> None:
    sh = ReLU().sharding([(64, 32)], 8, ((2, 2),))                # repeat 2
    x = 32 * 16 * F32                                             # 2048 bytes
    c = op_cost(sh, parameters={0})
    assert (c.cost_class, c.forward_computation, c.forward_communication) == ("SqrtCost", x, 0.0)
    assert (c.backward_communication, c.backward_computation) == (x, 0.0)
    assert c.memory == x + x           # SqrtCost: the output (parameter-involved) and x
    unsplit = op_cost(ReLU().sharding([(64, 32)], 8, ((2, 4),)), parameters={0})
    assert unsplit.backward_communication == 0.0


def test_softmax_computes_on_its_output_slice() -> None:
    sh = Softmax().sharding([(64, 32)], 8, ((8, 1),))
    y = 8 * 32 * F32                                              # 1024 bytes
    c = op_cost(sh)
    assert (c.forward_computation, c.forward_communication, c.communication) == (y, 0.0, 0.0)
    assert c.memory == 0.0
    assert op_cost(sh, involved={0}).memory == y   # output kept, input not (not a Parameter)


def test_add_reads_both_slices_and_reduces_a_replicated_parameter() -> None:
    sh = Add().sharding([(64, 32), (64, 32)], 8, ((2, 2), (2, 2)))
    x = 32 * 16 * F32                                             # 2048 bytes each
    c = op_cost(sh, parameters={1})
    assert (c.cost_class, c.forward_computation, c.forward_communication) == (
        "TensorAddCost", 2 * x, 0.0)
    assert (c.backward_communication, c.backward_computation) == (x, x)
    assert c.memory == x               # SubCost keeps the Parameter only


def test_bias_add_with_a_replicated_bias() -> None:
    sh = BiasAdd().sharding([(64, 32), (32,)], 8, ((8, 1), (1,)))
    x, bias = 8 * 32 * F32, 32 * F32                              # 1024, 128 bytes
    c = op_cost(sh, parameters={1})
    assert (c.forward_computation, c.backward_communication) == (x + bias, bias)


def test_reduce_sum_over_a_split_dim_allreduces_its_output() -> None:
    sh = ReduceSum(axis=1).sharding([(64, 32)], 8, ((2, 4),))
    x, y = 32 * 8 * F32, 32 * F32                                 # 1024, 128 bytes
    c = op_cost(sh)
    assert (c.cost_class, c.forward_communication, c.forward_computation) == (
        "ReduceSumCost", y, x + y)
    mean = op_cost(ReduceMean(axis=1).sharding([(64, 32)], 8, ((2, 4),)))
    assert (mean.forward_communication, mean.forward_computation) == (y, x + 2 * y)
    kept = op_cost(ReduceSum(axis=1).sharding([(64, 32)], 8, ((8, 1),)))
    assert (kept.forward_communication, kept.forward_computation) == (0.0, 8 * 32 * F32)


def test_itemsize_scales_every_term() -> None:
    sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((2, 4), (4, 1)))
    c4, c2 = op_cost(sh, parameters={1}), op_cost(sh, parameters={1}, itemsize=2)
    assert dataclasses.astuple(c2)[2:] == tuple(v / 2 for v in dataclasses.astuple(c4)[2:])


def test_every_registered_op_has_a_mindspore_cost_class() -> None:
    missing = [name for name in registry() if mindspore_cost_class(name) == "simpar default"]
    assert missing == []


def test_an_op_without_a_class_gets_the_documented_default() -> None:
    class Plus(Add):  # not in MindSpore's table (and not registered)
        pass

    sh = Plus().sharding([(64, 32), (64, 32)], 8, ((2, 2), (2, 2)))
    x = 32 * 16 * F32
    c = op_cost(sh, parameters={0, 1})
    assert c.cost_class == "simpar default"
    assert (c.forward_computation, c.forward_communication) == (2 * x, 0.0)
    assert (c.backward_communication, c.backward_computation, c.memory) == (2 * x, 2 * x, 2 * x)


def test_bad_arguments_name_the_op_and_the_value() -> None:
    sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((2, 4), (4, 1)))
    with pytest.raises(ValueError, match=r"op_cost: MatMul: parameters holds input position 2, "
                                         r"but the op has 2 inputs"):
        op_cost(sh, parameters={2})
    with pytest.raises(TypeError, match="op_cost: MatMul: parameters must hold input positions"):
        op_cost(sh, parameters={True})
    with pytest.raises(ValueError, match="itemsize must be a positive int .* got 0"):
        op_cost(sh, itemsize=0)
    with pytest.raises(ValueError, match="device_num must be a positive int, got 0"):
        objective(op_cost(sh), ((2, 4), (4, 1)), 0)


# ------------------------------------------------------------------ objective
def _matmul_k_split() -> MindSporeOpCost:
    sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((2, 4), (4, 1)))
    return op_cost(sh, parameters={1})   # comp 3584, fwd 2048, bwd 512


def test_refinement_of_one_communication_value() -> None:
    assert refine_communication(0.0) == 0.0
    assert refine_communication(EPS) == EPS                      # not above EPS: untouched
    assert refine_communication(1.0) == 3072.0                   # (EPS, threshold] -> const
    assert refine_communication(2048.0) == 3072.0                # the threshold itself
    assert refine_communication(2049.0) == 2049.0 + 1024.0       # above: + bias


def test_objective_refines_the_forward_communication_below_the_threshold() -> None:
    # forward 2048 <= 2048 becomes 3072; the backward (parameter) 512 is kept.
    want = 3584.0 + 400.0 * (3072.0 + 0.001 * 512.0)
    assert objective(_matmul_k_split(), ((2, 4), (4, 1)), 8) == pytest.approx(want)
    s = strategy_cost(_matmul_k_split(), ((2, 4), (4, 1)), 8)
    assert (s.communication, s.communication_without_parameter) == (3072.0 + 512.0, 3072.0)


def test_objective_adds_the_bias_above_the_threshold() -> None:
    ctx = CostModelContext(costmodel_communi_threshold=1024.0, costmodel_communi_bias=100.0)
    want = 3584.0 + 400.0 * (2048.0 + 100.0 + 0.001 * 512.0)
    assert objective(_matmul_k_split(), ((2, 4), (4, 1)), 8, ctx) == pytest.approx(want)


def test_objective_reads_the_process_context_by_default() -> None:
    set_cost_model_context(costmodel_beta=50.0, costmodel_alpha=2.0)
    want = 2.0 * 3584.0 + 50.0 * (3072.0 + 0.001 * 512.0)
    assert objective(_matmul_k_split(), ((2, 4), (4, 1)), 8) == pytest.approx(want)


def test_inference_weighs_the_forward_communication_only() -> None:
    ctx = CostModelContext(run_phase=1)
    assert objective(_matmul_k_split(), ((2, 4), (4, 1)), 8, ctx) == pytest.approx(
        3584.0 + 400.0 * 3072.0)


def test_the_tie_break_prefers_data_parallel() -> None:
    sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((8, 1), (1, 1)))
    c = op_cost(sh, parameters={1})      # comp 3072, fwd 0, bwd 2048
    s = strategy_cost(c, ((8, 1), (1, 1)), 8)
    # 1.0 off computation and communication; forward communication is 0, so it stays;
    # the refinement then rebuilds with_partial_para = 0 + gamma * (2047 - 0).
    assert (s.computation, s.communication, s.communication_without_parameter) == (
        3071.0, 2047.0, 0.0)
    assert s.communication_with_partial_para == pytest.approx(0.001 * 2047.0)
    assert objective(c, ((8, 1), (1, 1)), 8) == pytest.approx(3071.0 + 400.0 * 2.047)
    # The same numbers under a strategy whose first cut is not the device count: no tie-break.
    assert objective(c, ((4, 1), (1, 1)), 8) == pytest.approx(3072.0 + 400.0 * 2.048)


def test_the_tie_break_leaves_components_of_at_most_one_alone() -> None:
    c = MindSporeOpCost("X", "CastCost", 1.0, 0.0, 0.5, 0.0, 0.0, 0.0)
    s = strategy_cost(c, ((8,),), 8, CostModelContext(costmodel_communi_threshold=0.0,
                                                      costmodel_communi_bias=0.0))
    assert (s.computation, s.communication_without_parameter) == (1.0, 0.5)


def test_fits_compares_memory_with_the_capacity() -> None:
    c = _matmul_k_split()                 # training memory 1536, inference 2048
    assert fits(c, CostModelContext(device_memory_capacity=1536.0))
    assert not fits(c, CostModelContext(device_memory_capacity=1535.0))
    inference = CostModelContext(device_memory_capacity=2000.0, run_phase=1)
    assert not fits(c, inference)
    sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((2, 4), (4, 1)))
    assert fits(op_cost(sh, parameters={1}, output_critical=False), inference)
    assert fits(float(2 ** 34)) and not fits(float(2 ** 34 + 1))
    assert strategy_cost(c, ((2, 4), (4, 1)), 8).memory == 1536.0


# ------------------------------------------------------------------ redistribution
N = 2048 * 2048 // 8                       # elements of one rank's S0 or S1 slice
S0 = TensorLayout((8,), (0, -1), (2048, 2048))
S1 = TensorLayout((8,), (-1, 0), (2048, 2048))
R = TensorLayout((8,), (-1, -1), (2048, 2048))


def test_s0_to_s1_with_alltoall_is_one_permute() -> None:
    p = plan(S0, S1, enable_alltoall=True)
    assert p.kinds() == ["AllToAll"]
    # PermuteByAxis: forward and backward 2n; the gathered dim is 0, so computation n.
    assert redistribution_cost(p, F32) == (2 * N * F32, 2 * N * F32, N * F32)


def test_s0_to_s1_without_alltoall_is_allgather_then_slice() -> None:
    p = plan(S0, S1)
    assert p.kinds() == ["AllGather", "Slice"]
    # ConcatByAxis on dim 0 over 8: forward 0.5 n 8, backward 0.5 n, computation n; then
    # SplitByAxis of the whole tensor (8 n elements): computation 8 n.
    assert redistribution_cost(p, F32) == RedistributionCost(
        0.5 * N * 8 * F32, 0.5 * N * F32, (N + 8 * N) * F32)


def test_gathering_a_dim_other_than_0_adds_split_and_concat() -> None:
    p = plan(S1, R)
    assert p.kinds() == ["AllGather"]
    assert redistribution_cost(p, F32) == (0.5 * N * 8 * F32, 0.5 * N * F32,
                                           (N + 2 * N * 8) * F32)


def test_a_slice_costs_its_input_slice() -> None:
    assert redistribution_cost(plan(R, S0), F32) == (0.0, 0.0, 8 * N * F32)
    two_dims = TensorLayout((2, 4), (1, 0), (2048, 2048))
    full = TensorLayout((2, 4), (-1, -1), (2048, 2048))
    # Two SplitByAxis: the whole tensor, then the half left after the first.
    assert redistribution_cost(plan(full, two_dims), 1).computation == 8 * N + 4 * N


def test_resolving_a_partial_sum_is_charged_as_the_operators_collective() -> None:
    partial = R.with_partial_axes([0])
    (ar,) = plan(partial, R).steps
    assert ar.kind == StepKind.ALL_REDUCE
    assert redistribution_cost(plan(partial, R), F32) == (8 * N * F32, 0.0, 8 * N * F32)
    (rs,) = plan(partial, S0).steps
    assert rs.kind == StepKind.REDUCE_SCATTER
    assert redistribution_cost(plan(partial, S0), F32) == (N * F32, 0.0, N * F32)


def test_nothing_to_do_costs_nothing() -> None:
    assert redistribution_cost(plan(S0, S0)) == (0.0, 0.0, 0.0)


def test_every_step_kind_has_a_mindspore_charge() -> None:
    assert set(STEP_OPERATORS) == {k.value for k in StepKind}


def test_edge_costs_refine_forward_and_backward_separately() -> None:
    cost = redistribution_cost(plan(S0, S1, enable_alltoall=True), F32)   # 4 MiB each way
    e = edge_cost(cost)
    refined = 2 * N * F32 + 1024.0
    assert (e.communication, e.communication_with_partial_para, e.communication_forward) == (
        2 * refined, 2 * refined, refined)
    assert edge_objective(cost) == pytest.approx(N * F32 + 400.0 * 2 * refined)
    assert edge_objective(cost, CostModelContext(run_phase=1)) == pytest.approx(
        N * F32 + 400.0 * refined)
    small = RedistributionCost(100.0, 0.0, 0.0)
    assert edge_cost(small).communication == 3072.0     # below the threshold: the constant
