"""MatMul, BatchMatMul and the elementwise family under every candidate strategy."""

from __future__ import annotations

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import ops
from simpar.ops import StrategyError
from simpar.parallel import get_parallel_info
from tests.ophelpers import check_strategies, fd_check

RNG = np.random.default_rng(7)


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def _limit() -> int | None:
    return None if comm.get_group_size() == 8 else 12


CASES = [
    ("MatMul", lambda: ops.MatMul(), [_r(8, 16), _r(16, 8)]),
    ("MatMul_ta", lambda: ops.MatMul(transpose_a=True), [_r(16, 8), _r(16, 8)]),
    ("MatMul_tb", lambda: ops.MatMul(transpose_b=True), [_r(8, 16), _r(8, 16)]),
    ("BatchMatMul", lambda: ops.BatchMatMul(), [_r(4, 4, 8), _r(4, 8, 4)]),
    ("BatchMatMul_bcast", lambda: ops.BatchMatMul(transpose_b=True), [_r(2, 4, 8), _r(4, 8)]),
    ("Add", lambda: ops.Add(), [_r(8, 4, 8), _r(8)]),
    ("Sub", lambda: ops.Sub(), [_r(8, 1, 8), _r(4, 8)]),
    ("Mul", lambda: ops.Mul(), [_r(8, 8), _r(8, 8)]),
    ("Mul_0d", lambda: ops.Mul(), [np.asarray(3.0), _r(8, 4)]),
    ("RealDiv", lambda: ops.RealDiv(), [_r(8, 8), 2.0 + np.abs(_r(1, 8))]),
    ("BiasAdd", lambda: ops.BiasAdd(), [_r(8, 16), _r(16)]),
    ("BiasAdd_NHWC", lambda: ops.BiasAdd("NHWC"), [_r(4, 2, 8), _r(8)]),
    ("ReLU", lambda: ops.ReLU(), [_r(8, 8)]),
    ("GeLU", lambda: ops.GeLU(), [_r(8, 8)]),
    ("Tanh", lambda: ops.Tanh(), [_r(8, 8)]),
    ("Sigmoid", lambda: ops.Sigmoid(), [_r(8, 8)]),
    ("Cast", lambda: ops.Cast("float32"), [_r(8, 8)]),
    ("Identity", lambda: ops.Identity(), [_r(8, 4)]),
]


@pytest.mark.mpi
@pytest.mark.parametrize("name,make,inputs", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_matches_single_device(name, make, inputs):
    n = check_strategies(make, inputs, limit=_limit())
    assert n >= 1


@pytest.mark.parametrize("name,make,inputs", [c for c in CASES if c[0] != "Cast"],
                         ids=[c[0] for c in CASES if c[0] != "Cast"])
def test_vjp_matches_finite_differences(name, make, inputs):
    small = [x[tuple(slice(0, min(n, 4)) for n in x.shape)] if x.ndim and name.startswith(
        ("ReLU", "GeLU", "Tanh", "Sigmoid", "Mul")) else x for x in inputs]
    fd_check(make(), small)


def test_matmul_info_matches_mindspore_ir():
    op = ops.MatMul().shard(((2, 4), (4, 1)))
    for rank in range(8):
        info = get_parallel_info(op, [(8, 16), (16, 8)], device_num=8, rank=rank)
        assert info["device_matrix"] == [2, 4, 1]
        assert info["inputs_tensor_map"] == [[2, 1], [1, 0]]
        assert info["outputs_tensor_map"] == [[2, 0]]
        fwd = info["forward_comm"]
        assert [c["op"] for c in fwd] == ["AllReduce"]
        assert fwd[0]["group"] == ([0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7])
        assert fwd[0]["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_matmul_design_example_layouts():
    info = get_parallel_info(ops.MatMul().shard(((2, 1), (1, 4))), [(8, 16), (16, 8)], 8, 5)
    assert info["device_matrix"] == [2, 1, 4]
    assert info["inputs_tensor_map"] == [[2, 1], [1, 0]]
    assert info["outputs_tensor_map"] == [[2, 0]]
    assert info["forward_comm"] == []
    assert info["inputs_slice_shape"] == [[4, 16], [16, 2]]
    assert info["flops"] == 2 * 4 * 2 * 16


def test_out_strategy_reduce_scatter():
    op = ops.MatMul().shard(((2, 4), (4, 1)), out_strategy=((8, 1),))
    info = get_parallel_info(op, [(8, 16), (16, 8)], 8, 0)
    assert [c["op"] for c in info["forward_comm"]] == ["ReduceScatter"]
    assert info["outputs_tensor_map"] == [[[2, 1], 0]]


def test_repeated_calculation_goes_right():
    info = get_parallel_info(ops.MatMul().shard(((1, 2), (2, 1))), [(8, 16), (16, 8)], 8, 0)
    assert info["device_matrix"] == [1, 2, 1, 4]
    assert info["inputs_tensor_map"] == [[3, 2], [2, 1]]


@pytest.mark.parametrize("strategy,device_num,words", [
    (((2, 4), (2, 1)), 8, "Strategies of relevant dimensions are not equal"),
    (((2, 1),), 8, "has 1 entries but the operator has 2 inputs"),
    (((2, 1, 1), (1, 4)), 8, "has 3 entries but the input has 2 dimensions"),
    (((0, 1), (1, 4)), 8, "cuts must be >= 1"),
    (((3, 1), (1, 1)), 6, "8 is not divisible by 3"),
    (((2, 2), (2, 2)), 4, "uses 8 devices, which does not divide device_num 4"),
])
def test_bad_strategies(strategy, device_num, words):
    with pytest.raises(StrategyError, match=words):
        ops.MatMul().sharding([(8, 16), (16, 8)], device_num, strategy)


@pytest.mark.parametrize("strategy", [((0, 1), (1, 4)), ((2, -2), (1, 4)), ((2, 1), (1, 0))])
def test_shard_refuses_zero_and_negative_cuts_at_once(strategy):
    with pytest.raises(StrategyError, match=r"MatMul: in_strategy .* holds the cut -?\d; cuts "
                       r"must be >= 1"):
        ops.MatMul().shard(strategy)
    with pytest.raises(StrategyError, match="out_strategy .* holds the cut 0"):
        ops.MatMul().shard(((2, 1), (1, 1)), out_strategy=((0, 1),))


def test_bad_strategy_types():
    """MindSpore's checks and messages: a tuple, of tuples, of ints."""
    with pytest.raises(TypeError, match="in_strategy must be tuple type, but got:<class 'int'>"):
        ops.MatMul().shard(2)
    with pytest.raises(TypeError, match="in_strategy must be tuple type, but got:<class 'list'>"):
        ops.MatMul().shard([(2, 1), (1, 4)])
    with pytest.raises(TypeError, match="The element of strategy must be tuple type, but "
                                        "got:<class 'list'>"):
        ops.MatMul().shard(((2, 1), [1, 4]))
    with pytest.raises(TypeError, match="of MatMul is not valid, the value of strategy must be "
                                        "int type, but got:<class 'float'>"):
        ops.MatMul().shard(((2.0, 1), (1, 4)))
    with pytest.raises(TypeError, match="out_strategy must be tuple type"):
        ops.MatMul().shard(((2, 1), (1, 4)), out_strategy=[(2, 4)])
    with pytest.raises(StrategyError, match="out_strategy is not supported"):
        ops.Add().shard(((1, 1), (1, 1)), out_strategy=((1, 1),))


def test_broadcast_dim_cut_must_be_one():
    with pytest.raises(StrategyError, match="has size 1"):
        ops.Add().sharding([(8, 4), (1, 4)], 8, ((2, 1), (2, 1)))


def test_candidates_power_of_two_and_not():
    c8 = ops.MatMul().candidate_strategies([(8, 16), (16, 8)], 8, fully_use_devices=True)
    assert c8 and all(np.prod(s[0]) * s[1][1] == 8 for s in c8)
    c6 = ops.MatMul().candidate_strategies([(6, 12), (12, 6)], 6, fully_use_devices=True)
    assert ((6, 1), (1, 1)) in c6 and ((3, 2), (2, 1)) in c6
    assert all(np.prod(s[0]) * s[1][1] == 6 for s in c6)
    partial = ops.MatMul().candidate_strategies([(8, 16), (16, 8)], 8, fully_use_devices=False)
    assert ((1, 1), (1, 1)) in partial and len(partial) > len(c8)
    # The default is the algo parameter, False as in MindSpore 2.4 and later.
    assert ops.MatMul().candidate_strategies([(8, 16), (16, 8)], 8) == partial
    simpar.set_algo_parameters(fully_use_devices=True)
    try:
        assert ops.MatMul().candidate_strategies([(8, 16), (16, 8)], 8) == c8
    finally:
        simpar.reset_algo_parameters()


def test_tensor_slice_align(monkeypatch):
    import simpar

    # derived once without the setting: the op's memo of shardings must not let it through
    ops.MatMul().sharding([(16, 16), (16, 16)], 4, ((4, 1), (1, 1)))
    simpar.set_algo_parameters(tensor_slice_align_enable=True, tensor_slice_align_size=8)
    try:
        cands = ops.MatMul().candidate_strategies([(16, 16), (16, 16)], 4)
        assert all(16 // s[0][0] % 8 == 0 and 16 // s[0][1] % 8 == 0 for s in cands)
        with pytest.raises(StrategyError, match="tensor_slice_align_size"):
            ops.MatMul().sharding([(16, 16), (16, 16)], 4, ((4, 1), (1, 1)))
    finally:
        simpar.reset_algo_parameters()
