"""ReduceSum, ReduceMean and ReduceMax under every candidate strategy, their collectives, VJPs
and bad input."""

from __future__ import annotations

import numpy as np
import pytest

import simpar.comm as comm
from simpar.ops import StrategyError
from simpar.ops.reduce_ops import ReduceMax, ReduceMean, ReduceSum
from simpar.parallel import get_parallel_info, run_op
from tests.ophelpers import check_strategies, fd_check

RNG = np.random.default_rng(11)


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def _limit() -> int | None:
    return None if comm.get_group_size() == 8 else 6


# Shapes put 8 (or 4 x 2) on the reduced dims, so that every device count really splits them.
CASES = [
    pytest.param(lambda: ReduceSum(axis=1), [_r(4, 8)], id="Sum_axis1"),
    pytest.param(lambda: ReduceSum(), [_r(4, 4)], id="Sum_all_0d"),
    pytest.param(lambda: ReduceMean(keep_dims=True, axis=0), [_r(8, 4)], id="Mean_axis0_keep"),
    pytest.param(lambda: ReduceMean(axis=(-1, 0)), [_r(2, 4, 4)], id="Mean_neg_axes_3d"),
    pytest.param(lambda: ReduceMax(axis=-1), [_r(2, 8)], id="Max_axis_neg1"),
    pytest.param(lambda: ReduceMax(keep_dims=True, axis=None), [_r(4, 4)], id="Max_all_keep"),
    pytest.param(lambda: ReduceMax(), [_r(4, 4)], id="Max_all_0d"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("make,inputs", CASES)
def test_every_strategy_matches_single_device(make, inputs):
    assert check_strategies(make, inputs, limit=_limit()) >= 1


@pytest.mark.mpi
def test_max_ties_route_to_every_tied_position_sharded_as_single_device():
    x = RNG.integers(0, 2, size=(2, 8)).astype(np.float64)  # many exact ties
    check_strategies(lambda: ReduceMax(axis=1), [x], limit=4)
    dy = np.array([1.0, 2.0])
    (g,) = ReduceMax(axis=1).vjp([x], ReduceMax(axis=1).kernel(x), dy)
    want = (x == x.max(axis=1, keepdims=True)) * dy[:, None]
    assert np.array_equal(g, want)


@pytest.mark.mpi
def test_integer_sum_forward():
    x = RNG.integers(-5, 5, size=(4, 8)).astype(np.int64)
    check_strategies(lambda: ReduceSum(axis=1), [x], grad=False, limit=4)
    assert ReduceSum(axis=1).kernel(x).dtype == np.int64


def test_predicted_allreduce_bytes_round_like_commtrace():
    # 2 float64 over 8 ranks: CommTrace counts 2 * 7 * 16 // 8 = 28 bytes.
    spec = ReduceSum(axis=1).sharding([(2, 8)], 8, ((1, 8),)).forward_comm[0]
    assert spec.recv_bytes(0, 8) == 28


def _traced(op, x, dy):
    with comm.CommTrace() as trace:
        out, grads = run_op(op, x, grad_output=dy, check=True)
    fwd = [e for e in trace.events if "run_op:forward" in e.label]
    bwd = [e for e in trace.events if "run_op:backward" in e.label]
    return out, grads, fwd, bwd


@pytest.mark.mpi
def test_split_reduce_max_is_one_allreduce_max():
    size = comm.get_group_size()
    x = _r(2, 8)
    out, _, fwd, bwd = _traced(ReduceMax(axis=1).shard(((1, size),)), x, _r(2))
    assert np.array_equal(out, x.max(axis=1))
    if size == 1:
        assert fwd == [] and bwd == []
        return
    assert [(e.kind, e.op, e.group) for e in fwd] == [("AllReduce", "max", tuple(range(size)))]
    assert fwd[0].shape == (2,)  # the local max, never the inputs
    assert [(e.kind, e.op) for e in bwd] == [("AllReduce", "sum")]
    assert not any(e.kind == "AllGather" for e in fwd + bwd)


@pytest.mark.mpi
def test_split_reduce_sum_and_mean_are_one_allreduce_sum():
    size = comm.get_group_size()
    x = _r(2, 8)
    for op in (ReduceSum(axis=1), ReduceMean(axis=1)):
        out, _, fwd, bwd = _traced(op.shard(((1, size),)), x, _r(2))
        want = x.sum(axis=1) if isinstance(op, ReduceSum) else x.mean(axis=1)
        np.testing.assert_allclose(out, want, rtol=1e-12)
        expect = [] if size == 1 else [("AllReduce", "sum", tuple(range(size)))]
        assert [(e.kind, e.op, e.group) for e in fwd] == expect
        assert [(e.kind, e.op) for e in bwd] == [k[:2] for k in expect]


@pytest.mark.mpi
def test_unsplit_reduced_dim_needs_no_collective():
    size = comm.get_group_size()
    x = _r(8, 2)
    for op in (ReduceSum(axis=1), ReduceMean(axis=1), ReduceMax(axis=1)):
        _, _, fwd, bwd = _traced(op.shard(((size, 1),)), x, _r(8))
        assert fwd == [] and bwd == []


def test_parallel_info_layouts():
    info = get_parallel_info(ReduceSum(keep_dims=True, axis=1).shard(((2, 4),)), [(8, 16)], 8, 5)
    assert info["device_matrix"] == [2, 4]
    assert info["outputs_tensor_map"] == [[1, -1]]
    assert info["outputs_slice_shape"] == [[4, 1]]
    assert [(c["op"], c["group"]) for c in info["forward_comm"]] == [("AllReduce", [4, 5, 6, 7])]
    info = get_parallel_info(ReduceSum().shard(((2, 2),)), [(8, 16)], 8, 5)
    assert info["outputs_tensor_map"] == [[]]
    info = get_parallel_info(ReduceMax(axis=-1).shard(((1, 8),)), [(4, 16)], 8, 3)
    assert [c["reason"] for c in info["forward_comm"]] == ["max over the split reduced dims"]
    assert [c["op"] for c in info["backward_comm"]] == ["AllReduce"]
    info = get_parallel_info(ReduceMax(axis=-1).shard(((8, 1),)), [(8, 16)], 8, 3)
    assert info["forward_comm"] == [] and info["backward_comm"] == []


def test_mean_divides_by_global_count_on_each_shard():
    op = ReduceMean(axis=0).shard(((4, 2),))
    sh = op.sharding([(8, 6)], 8)
    x = _r(8, 6)
    local = x[sh.in_layouts[0].slices(3)]
    raw, _ = op.local_forward(sh, local)
    np.testing.assert_allclose(raw, local.sum(axis=0) / 8, rtol=1e-15)


KERNEL_CASES = [
    (ReduceSum(), (2, 3, 4)),
    (ReduceSum(keep_dims=True, axis=(0, 2)), (2, 3, 4)),
    (ReduceMean(axis=-1), (2, 3, 4)),
    (ReduceMean(keep_dims=True), (3, 4)),
    (ReduceMax(axis=1), (2, 3, 4)),
    (ReduceMax(keep_dims=True, axis=[0, -1]), (2, 3, 4)),
    (ReduceMax(), (3, 4)),
]


@pytest.mark.parametrize("op,shape", KERNEL_CASES, ids=[repr(c[0]) for c in KERNEL_CASES])
def test_kernel_matches_numpy(op, shape):
    x = _r(*shape)
    axes = op.reduced_axes(len(shape))
    fn = {"ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max}[op.name]
    want = fn(x, axis=axes, keepdims=op.keep_dims)
    got = op.kernel(x)
    assert got.shape == np.shape(want) == op.infer_shape(shape)
    np.testing.assert_allclose(got, want, rtol=1e-13)


@pytest.mark.parametrize("op,shape", KERNEL_CASES, ids=[repr(c[0]) for c in KERNEL_CASES])
def test_vjp_matches_finite_differences(op, shape):
    fd_check(op, [_r(*shape)])


def test_zero_dim_input():
    x = np.array(3.0)
    for op in (ReduceSum(), ReduceMean(), ReduceMax()):
        assert op.kernel(x).shape == () and float(op.kernel(x)) == 3.0
        (g,) = op.vjp([x], op.kernel(x), np.array(2.0))
        assert float(g) == 2.0


@pytest.mark.parametrize("make,err,words", [
    (lambda: ReduceSum(keep_dims=1), TypeError, "ReduceSum: keep_dims must be a bool, got int"),
    (lambda: ReduceMean(axis=1.0), TypeError, "ReduceMean: axis must be an int"),
    (lambda: ReduceMax(axis="0"), TypeError, "ReduceMax: axis must be an int"),
    (lambda: ReduceSum(axis=(True,)), TypeError, "axis must be an int"),
    (lambda: ReduceSum(axis=(1, 1)), ValueError, r"axis \(1, 1\) lists an axis more than once"),
])
def test_bad_attributes(make, err, words):
    with pytest.raises(err, match=words):
        make()


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"ReduceSum: axis 2 is out of range for a 2-D input; "
                                         r"allowed -2..1"):
        ReduceSum(axis=2).kernel(_r(2, 3))
    with pytest.raises(ValueError, match="axis -3 is out of range"):
        ReduceMax(axis=-3).sharding([(2, 4)], 8, ((1, 1),))
    with pytest.raises(ValueError, match=r"axis \(1, -1\) names the same dimension twice"):
        ReduceSum(axis=(1, -1)).infer_shape((2, 3))
    with pytest.raises(ValueError, match="0-d input; only"):
        ReduceSum(axis=0).kernel(np.array(1.0))
    with pytest.raises(TypeError, match="ReduceMean: input must be a float array, got dtype "
                                        "int64"):
        ReduceMean().kernel(np.arange(4))
    with pytest.raises(TypeError, match="ReduceSum: input must be a float or integer array, got "
                                        "dtype bool"):
        ReduceSum().kernel(np.ones(3, dtype=bool))
    with pytest.raises(ValueError, match="ReduceMax: cannot take the max over an empty"):
        ReduceMax(axis=1).kernel(np.ones((2, 0)))
    with pytest.raises(ValueError, match="ReduceMean: cannot take the mean over an empty"):
        ReduceMean().kernel(np.ones((0, 3)))
    assert ReduceSum(axis=0).kernel(np.ones((0, 3))).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(StrategyError, match="2 is not divisible by 4"):
        ReduceSum(axis=1).sharding([(2, 8)], 8, ((4, 2),))
    with pytest.raises(StrategyError, match="has 2 entries but the input has 3 dimensions"):
        ReduceSum().sharding([(2, 2, 2)], 4, ((2, 2),))
