"""Transpose, Reshape, Concat and Split under every candidate strategy."""

from __future__ import annotations

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import ops
from simpar.layout import TensorLayout
from simpar.ops import StrategyError
from simpar.ops.array_ops import reshape_layout
from simpar.parallel import get_parallel_info
from tests.ophelpers import check_strategies, fd_check

RNG = np.random.default_rng(11)


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def _limit() -> int | None:
    return None if comm.get_group_size() == 8 else 10


CASES = [
    ("Transpose", lambda: ops.Transpose((1, 0, 2)), [_r(4, 8, 2)]),
    ("Transpose_rev", lambda: ops.Transpose(), [_r(4, 8)]),
    ("Reshape_split_last", lambda: ops.Reshape((8, 4, 4)), [_r(8, 16)]),
    ("Reshape_merge", lambda: ops.Reshape((32, 4)), [_r(4, 8, 4)]),
    ("Reshape_heads", lambda: ops.Reshape((2, 4, 4, 2)), [_r(2, 4, 8)]),
    ("Reshape_flat", lambda: ops.Reshape((-1,)), [_r(4, 8)]),
    ("Concat", lambda: ops.Concat(axis=1), [_r(8, 4), _r(8, 4)]),
    ("Split", lambda: ops.Split(axis=1, output_num=2), [_r(8, 4)]),
]


@pytest.mark.mpi
@pytest.mark.parametrize("name,make,inputs", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_matches_single_device(name, make, inputs):
    assert check_strategies(make, inputs, limit=_limit()) >= 1


SINGLE_OUTPUT = [c for c in CASES if c[0] != "Split"]


@pytest.mark.parametrize("name,make,inputs", SINGLE_OUTPUT, ids=[c[0] for c in SINGLE_OUTPUT])
def test_vjp_matches_finite_differences(name, make, inputs):
    fd_check(make(), inputs)


def test_split_vjp_is_concat():
    x = _r(8, 4)
    op = ops.Split(axis=1, output_num=2)
    parts = op.kernel(x)
    (g,) = op.vjp([x], parts, parts)
    assert np.array_equal(g, x)


def test_reshape_keeps_layout_when_splits_survive():
    lay = TensorLayout((2, 4), (1, 0), (8, 16))
    out = reshape_layout(lay, (8, 4, 4))
    assert out is not None and out.tensor_map == (1, 0, -1)
    merged = reshape_layout(TensorLayout((2, 4), (1, -1, -1), (8, 4, 4)), (32, 4))
    assert merged is not None and merged.cuts == (2, 1)
    assert reshape_layout(lay, (128,)) is None       # a column cut is not contiguous


def test_reshape_needs_redistribution_and_says_so():
    op = ops.Reshape((128,)).shard(((1, 8),))
    simpar.set_auto_parallel_context(enable_alltoall=True)
    try:
        info = get_parallel_info(op, [(8, 16)], 8, 0)
    finally:
        simpar.reset_auto_parallel_context()
    kinds = [c["op"] for c in info["forward_comm"]]
    assert kinds and "AllGather" not in kinds          # moved (AllToAll), not gathered
    assert info["outputs_tensor_map"] == [[0]]
    # MindSpore's default, enable_alltoall=False, honoured by Reshape's own pre-plan too.
    plain = [c["op"] for c in get_parallel_info(op, [(8, 16)], 8, 0)["forward_comm"]]
    assert plain == ["AllGather"] and kinds == ["AllToAll"]


def test_concat_axis_must_be_unsplit():
    with pytest.raises(StrategyError, match="cannot be split"):
        ops.Concat(axis=1).sharding([(8, 4), (8, 4)], 8, ((1, 2), (1, 2)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="not a permutation"):
        ops.Transpose((0, 0)).kernel(_r(2, 2))
    with pytest.raises(ValueError, match="cannot reshape"):
        ops.Reshape((3, 3)).kernel(_r(2, 4))
    with pytest.raises(ValueError, match="at most one -1"):
        ops.Reshape((-1, -1)).kernel(_r(2, 4))
    with pytest.raises(ValueError, match="equal outputs"):
        ops.Split(axis=0, output_num=3).kernel(_r(4, 2))
    with pytest.raises(ValueError, match="differs from input 0"):
        ops.Concat(axis=0).kernel(_r(2, 3), _r(2, 4))
    with pytest.raises(ValueError, match="output_num must be a positive int"):
        ops.Split(output_num=0)
