"""Gather (vocabulary-parallel embedding lookup) and Dropout (counter-based mask) under every
candidate strategy, their collectives, VJPs and bad input."""

from __future__ import annotations

import numpy as np
import pytest

import simpar.comm as comm
from simpar.layout import distribute
from simpar.ops import StrategyError
from simpar.ops.gather_dropout import Dropout, Gather
from simpar.parallel import get_parallel_info, run_op
from simpar.runtime.op_runner import OpRunner
from tests.ophelpers import check_strategies, fd_check

RNG = np.random.default_rng(5)


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def _ids(high: int, *shape: int, dtype: type = np.int64) -> np.ndarray:
    return RNG.integers(0, high, size=shape).astype(dtype)  # duplicates included


def _limit(n: int = 6) -> int | None:
    return None if comm.get_group_size() == 8 else n


# ------------------------------------------------------------------ Gather
GATHER_CASES = [
    pytest.param(lambda: Gather(), [_r(16, 4), _ids(16, 4)], None, id="rows16_ids1d"),
    pytest.param(lambda: Gather(), [_r(8, 2), _ids(8, 2, 2, dtype=np.int32)], None,
                 id="rows8_ids2d_int32"),
    pytest.param(lambda: Gather(axis=0), [_r(8, 4), np.array(5)], None, id="scalar_id"),
    pytest.param(lambda: Gather(axis=-1), [_r(4, 8), _ids(8, 4)], 6, id="axis1_sampled"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("make,inputs,sample", GATHER_CASES)
def test_gather_every_strategy_matches_single_device(make, inputs, sample):
    n = check_strategies(make, inputs, limit=sample if comm.get_group_size() == 8 else _limit())
    assert n >= 1


def _traced(op, *xs, dy):
    with comm.CommTrace() as trace:
        run = run_op(op, *xs, grad_output=dy, check=True, full=True)
    fwd = [e for e in trace.events if "run_op:forward" in e.label]
    bwd = [e for e in trace.events if "run_op:backward" in e.label]
    return run, fwd, bwd


@pytest.mark.mpi
def test_row_split_gather_is_one_allreduce_and_no_gather():
    size = comm.get_group_size()
    table, ids = _r(16, 4), _ids(16, 6)
    run, fwd, bwd = _traced(Gather().shard(((size, 1), (1,))), table, ids, dy=_r(6, 4))
    np.testing.assert_array_equal(run.output, table[ids])
    everyone = tuple(range(size))
    if size == 1:
        assert fwd == [] and bwd == []
        return
    assert [(e.kind, e.op, e.group) for e in fwd] == [("AllReduce", "sum", everyone)]
    assert fwd[0].shape == (6, 4)  # the (partial) output, never the table
    # Backward: the adjoint AllReduce only; the table is split, so its gradient needs no sum.
    assert [(e.kind, e.group) for e in bwd] == [("AllReduce", everyone)]
    assert not any(e.kind == "AllGather" for e in fwd + bwd)
    # Each rank's table gradient is nonzero only on rows whose ids it owns.
    rank, rows = comm.get_rank(), 16 // size
    assert run.local_inputs[0].shape == (rows, 4)
    g = run.local_grads[0]
    owned = {int(i) - rank * rows for i in ids if rank * rows <= i < (rank + 1) * rows}
    assert {int(r) for r in np.flatnonzero(np.abs(g).sum(axis=1))} <= owned


@pytest.mark.mpi
def test_row_and_index_split_gather_collectives():
    size = comm.get_group_size()
    if size % 2:
        pytest.skip("needs an even number of ranks")
    v = size // 2
    table, ids = _r(8, 2), _ids(8, 4)
    _, fwd, bwd = _traced(Gather().shard(((v, 1), (2,))), table, ids, dy=_r(4, 2))
    rank = comm.get_rank()
    rows_group = tuple(range(rank // v * v, rank // v * v + v))  # device matrix [2, v, 1]
    ids_group = (rank % v, rank % v + v)
    want_fwd = [("AllReduce", rows_group)] if v > 1 else []
    assert [(e.kind, e.group) for e in fwd] == want_fwd
    # adjoint of the output AllReduce, then the table gradient summed over its replicas
    assert [(e.kind, e.group) for e in bwd] == want_fwd + [("AllReduce", ids_group)]


@pytest.mark.mpi
def test_row_split_gather_reduce_scatter_with_out_strategy():
    size = comm.get_group_size()
    table, ids = _r(16, 4), _ids(16, 8)
    op = Gather().shard(((size, 1), (1,)), out_strategy=((size, 1),))
    run, fwd, _ = _traced(op, table, ids, dy=_r(8, 4))
    np.testing.assert_array_equal(run.output, table[ids])
    assert run.local_output.shape == (8 // size, 4)
    assert [e.kind for e in fwd] == ([] if size == 1 else ["ReduceScatter"])


@pytest.mark.mpi
def test_out_of_range_id_fails_on_every_rank():
    size = comm.get_group_size()
    ids = np.array([1, 16, 2, 3])  # replicated ids: every rank sees the bad one
    with pytest.raises(ValueError, match="Gather: index 16 is out of range for input_params "
                                         "with 16 entries"):
        run_op(Gather().shard(((size, 1), (1,))), _r(16, 4), ids)


def test_gather_parallel_info_matches_mindspore_layout():
    info = get_parallel_info(Gather().shard(((4, 1), (2, 1))), [(16, 8), (4, 6)], 8, 5)
    assert info["device_matrix"] == [2, 1, 4, 1]  # index strategy, then param strategy
    assert info["inputs_tensor_map"] == [[1, 0], [3, 2]]
    assert info["outputs_tensor_map"] == [[3, 2, 0]]
    assert [(c["op"], c["group"]) for c in info["forward_comm"]] == [("AllReduce", [4, 5, 6, 7])]
    info = get_parallel_info(Gather().shard(((1, 8), (1,))), [(16, 8), (4,)], 8, 5)
    assert info["forward_comm"] == []
    assert info["outputs_slice_shape"] == [[4, 1]]


GATHER_KERNELS = [
    (Gather(), (10, 3), (4,)),
    (Gather(), (10, 3), (2, 3)),
    (Gather(), (10,), ()),
    (Gather(axis=1), (3, 10, 2), (2, 2)),
    (Gather(axis=-1), (3, 10), (5,)),
]


@pytest.mark.parametrize("op,pshape,ishape", GATHER_KERNELS)
def test_gather_kernel_matches_numpy_take(op, pshape, ishape):
    params, ids = _r(*pshape), _ids(10, *ishape)
    got = op.kernel(params, ids)
    want = np.take(params, ids, axis=op.axis)
    assert got.shape == want.shape == op.infer_shape(pshape, ishape)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op,pshape,ishape", GATHER_KERNELS)
def test_gather_vjp_matches_finite_differences(op, pshape, ishape):
    fd_check(op, [_r(*pshape), _ids(10, *ishape)], diff=[0])
    grads = op.vjp([_r(*pshape), _ids(10, *ishape)], None, _r(*op.infer_shape(pshape, ishape)))
    assert grads[1] is None


def test_gather_shard_looks_up_its_own_rows_and_writes_zeros_elsewhere():
    table, ids = _r(8, 2), np.array([0, 2, 3, 7, 2])
    local = Gather()._lookup(table[2:4], ids, 2, False)  # the shard holding rows 2..3
    owned = ((ids >= 2) & (ids < 4))[:, None]
    np.testing.assert_array_equal(local, np.where(owned, table[ids], 0.0))
    g = Gather()._scatter((2, 2), np.dtype(np.float64), ids, np.ones((5, 2)), 2, False)
    np.testing.assert_array_equal(g, [[2.0, 2.0], [1.0, 1.0]])  # id 2 twice, id 3 once
    # The whole table (every id its own): the same values as the masked path, bit for bit.
    whole = Gather()._lookup(table, ids, 0, True)
    np.testing.assert_array_equal(whole, Gather()._lookup(table, ids, 0, False))
    dy = _r(5, 2)
    np.testing.assert_array_equal(
        Gather()._scatter((8, 2), np.dtype(np.float64), ids, dy, 0, True),
        Gather()._scatter((8, 2), np.dtype(np.float64), ids, dy, 0, False))


@pytest.mark.parametrize("call,err,words", [
    (lambda: Gather(axis=1.0), TypeError, "Gather: axis must be an int, got float"),
    (lambda: Gather(axis=True), TypeError, "Gather: axis must be an int"),
    (lambda: Gather(axis=2).infer_shape((4, 3), (2,)), ValueError,
     r"axis 2 is out of range for input_params with 2 dimensions; allowed -2..1"),
    (lambda: Gather().kernel(np.array(1.0), np.array(0)), ValueError,
     "at least 1 dimension"),
    (lambda: Gather().kernel(_r(4, 3), np.array([0.0, 1.0])), TypeError,
     "input_indices must be int32 or int64, got dtype float64"),
    (lambda: Gather().kernel(_r(4, 3), np.array([0, 1], dtype=np.int16)), TypeError,
     "int32 or int64, got dtype int16"),
    (lambda: Gather().kernel(np.array(["a", "b"]), np.array([0])), TypeError,
     "input_params must be a float or integer array"),
    (lambda: Gather().kernel(_r(4, 3), np.array([0, 4])), ValueError,
     r"index 4 is out of range for input_params with 4 entries along axis 0; allowed 0..3"),
    (lambda: Gather().kernel(_r(4, 3), np.array([-1, 2])), ValueError,
     "index -1 is out of range"),
    (lambda: Gather().sharding([(8, 2), (4,)], 8, ((8, 1), (2,))), StrategyError,
     "uses 16 devices"),
])
def test_gather_bad_input(call, err, words):
    with pytest.raises(err, match=words):
        call()


# ------------------------------------------------------------------ Dropout
DROPOUT_CASES = [
    pytest.param(lambda: Dropout(0.7, seed0=3, seed1=4), [_r(8, 8)], None, id="2d_float64"),
    pytest.param(lambda: Dropout(0.5), [_r(2, 4, 4).astype(np.float32)], 6,
                 id="3d_float32_sampled"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("make,inputs,sample", DROPOUT_CASES)
def test_dropout_every_strategy_matches_single_device(make, inputs, sample):
    n = check_strategies(make, inputs, limit=sample if comm.get_group_size() == 8 else _limit())
    assert n >= 1


@pytest.mark.mpi
@pytest.mark.parametrize("step", [0, 7])
def test_dropout_sharded_mask_is_bitwise_the_single_device_mask(step):
    rank, size = comm.get_rank(), comm.get_group_size()
    x = _r(4, 2, 8)
    ref = Dropout(0.6, seed0=1, seed1=2)
    ref.step = step
    want_y, want_mask = ref.kernel(x), ref.keep_mask(x.shape)
    for s in ref.candidate_strategies([x.shape], size, fully_use_devices=False):
        op = Dropout(0.6, seed0=1, seed1=2).shard(s)
        op.step = step
        sh = op.sharding([x.shape], size)
        with comm.CommTrace() as trace:
            y, mask = OpRunner(sh).forward(distribute(x, sh.in_layouts[0], rank))
            (g,) = OpRunner(sh).backward(mask, np.ones(sh.out.local_shape()))
        assert trace.events == [], s  # elementwise: no communication
        sl = sh.out.slices(rank)
        assert np.array_equal(mask, want_mask[sl]), s
        assert np.array_equal(y, want_y[sl]), s
        assert np.array_equal(g, np.where(want_mask[sl], 1 / 0.6, 0.0)), s


def test_dropout_masks_differ_across_steps_and_seeds():
    shape = (64, 64)
    base = Dropout(0.5, seed0=1, seed1=1)
    m0 = base.keep_mask(shape)
    base.step = 1
    m1 = base.keep_mask(shape)
    others = [m1, Dropout(0.5, seed0=2, seed1=1).keep_mask(shape),
              Dropout(0.5, seed0=1, seed1=2).keep_mask(shape)]
    for m in others:
        assert not np.array_equal(m, m0)
        assert abs(float(np.mean(m == m0)) - 0.5) < 0.03  # independent masks agree half the time
    assert np.array_equal(Dropout(0.5, 1, 1).keep_mask(shape), m0)  # a pure function


@pytest.mark.parametrize("keep_prob", [0.1, 0.5, 0.9])
def test_dropout_keep_fraction(keep_prob):
    op = Dropout(keep_prob, seed0=9)
    frac = float(op.keep_mask((200, 200)).mean())
    assert abs(frac - keep_prob) < 0.01
    x = _r(200, 200)
    y = op.kernel(x)
    kept = op.keep_mask(x.shape)
    np.testing.assert_array_equal(y[~kept], 0.0)
    np.testing.assert_allclose(y[kept], x[kept] / keep_prob, rtol=1e-15)
    assert abs(float(y.mean()) - float(x.mean())) < 0.05  # unbiased in expectation


def test_dropout_keep_prob_one_is_identity_and_zero_d_works():
    x = _r(3, 5)
    np.testing.assert_array_equal(Dropout(1.0).kernel(x), x)
    y = Dropout(0.5, seed0=4).kernel(np.array(2.0))
    assert y.shape == () and float(y) in (0.0, 4.0)


def test_dropout_keep_mask_box_is_a_slice_of_the_full_mask():
    op = Dropout(0.3, 5, 6)
    op.step = 11
    full = op.keep_mask((6, 8, 4))
    assert np.array_equal(op.keep_mask((6, 8, 4), ((2, 4), (0, 8), (1, 3))), full[2:4, :, 1:3])


def test_dropout_vjp_matches_finite_differences():
    op = Dropout(0.6, seed0=2)
    op.step = 3
    fd_check(op, [_r(4, 5)])


@pytest.mark.parametrize("call,err,words", [
    (lambda: Dropout(0.0), ValueError, r"Dropout: keep_prob must be in \(0, 1\], got 0.0"),
    (lambda: Dropout(1.5), ValueError, "keep_prob must be in"),
    (lambda: Dropout(-0.1), ValueError, "keep_prob must be in"),
    (lambda: Dropout("0.5"), TypeError, "Dropout: keep_prob must be a float, got str"),
    (lambda: Dropout(True), TypeError, "keep_prob must be a float, got bool"),
    (lambda: Dropout(0.5, seed0=-1), ValueError, "Dropout: seed0 must be >= 0, got -1"),
    (lambda: Dropout(0.5, seed1=1.0), TypeError, "Dropout: seed1 must be an int, got float"),
    (lambda: setattr(Dropout(), "step", -2), ValueError, "Dropout: step must be >= 0, got -2"),
    (lambda: setattr(Dropout(), "step", 1.5), TypeError, "Dropout: step must be an int"),
    (lambda: Dropout().kernel(np.arange(4)), TypeError,
     "Dropout: input must be a float array, got dtype int64"),
    (lambda: Dropout().sharding([(8, 6)], 8, ((1, 4),)), StrategyError, "6 is not divisible by 4"),
])
def test_dropout_bad_input(call, err, words):
    with pytest.raises(err, match=words):
        call()
