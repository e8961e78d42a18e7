"""Softmax, LogSoftmax, LayerNorm and SparseSoftmaxCrossEntropyWithLogits under every candidate
strategy, with the reduced axis (softmax axis, normalised axes, classes) split across ranks."""

from __future__ import annotations

import numpy as np
import pytest

import simpar.comm as comm
from simpar.mesh import DeviceMesh
from simpar.ops import StrategyError
from simpar.ops.nn_ops import LayerNorm, LogSoftmax, Softmax, SparseSoftmaxCrossEntropyWithLogits
from simpar.parallel import get_parallel_info, run_op
from tests.ophelpers import check_strategies, fd_check

RNG = np.random.default_rng(11)
SSCE = SparseSoftmaxCrossEntropyWithLogits


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def _limit() -> int | None:
    return None if comm.get_group_size() == 8 else 6


LABELS = RNG.integers(0, 16, size=8)

# (name, make, inputs, iteration dims that are reduced: at least one candidate must split one)
CASES = [
    ("Softmax", lambda: Softmax(), [_r(4, 8)], (1,)),
    ("Softmax_axis0", lambda: Softmax(axis=0), [_r(8, 4)], (0,)),
    ("Softmax_tuple", lambda: Softmax(axis=(1, 2)), [_r(2, 4, 4)], (1, 2)),
    ("LogSoftmax", lambda: LogSoftmax(), [_r(4, 8)], (1,)),
    ("LogSoftmax_mid", lambda: LogSoftmax(axis=1), [_r(2, 4, 4)], (1,)),
    # A large mean: the two-pass variance must stay exact when the normalised axes are split.
    ("LayerNorm", lambda: LayerNorm(), [50.0 + _r(4, 8), _r(8), _r(8)], (1,)),
    ("LayerNorm_params_last", lambda: LayerNorm(1, -1), [_r(2, 4, 4), _r(4), _r(4)], (1, 2)),
    ("LayerNorm_params_wide", lambda: LayerNorm(-1, 1, 1e-5), [_r(2, 4, 4), _r(4, 4), _r(4, 4)],
     (2,)),
    ("SSCE_int32", lambda: SSCE(), [3.0 * _r(8, 16), LABELS.astype(np.int32)], (1,)),
    ("SSCE_int64", lambda: SSCE(), [_r(8, 16), LABELS.astype(np.int64)], (1,)),
]
IDS = [c[0] for c in CASES]


@pytest.mark.mpi
@pytest.mark.parametrize("name,make,inputs,reduced", CASES, ids=IDS)
def test_every_strategy_matches_single_device(name, make, inputs, reduced):
    n = check_strategies(make, inputs, limit=_limit())
    assert n >= 1


@pytest.mark.parametrize("name,make,inputs,reduced", CASES, ids=IDS)
def test_candidates_split_the_reduced_axis(name, make, inputs, reduced):
    for device_num in (2, 4, 8):
        cands = make().candidate_strategies([x.shape for x in inputs], device_num,
                                            fully_use_devices=False)
        assert any(s[0][d] > 1 for s in cands for d in reduced), (name, device_num)
        if name.startswith("SSCE"):
            assert all(s[0][0] == s[1][0] for s in cands)


def _forward_backward(run_trace):
    fwd = [e for e in run_trace.events if "run_op:forward" in e.label]
    bwd = [e for e in run_trace.events if "run_op:backward" in e.label]
    return fwd, bwd


def _run_traced(op, inputs):
    dy = np.random.default_rng(3).standard_normal(op.kernel(*inputs).shape)
    with comm.CommTrace() as trace:
        run = run_op(op, *inputs, grad_output=dy, check=True, full=True)
    rank = comm.get_rank()
    want = op.kernel(*inputs)
    np.testing.assert_allclose(run.local_output, want[run.sharding.out.slices(rank)],
                               rtol=1e-12, atol=1e-14)
    for x, lay, local in zip(inputs, run.sharding.in_layouts, run.local_inputs):
        np.testing.assert_array_equal(local, x[lay.slices(rank)])
    return run, _forward_backward(trace)


@pytest.mark.mpi
@pytest.mark.parametrize("make", [Softmax, LogSoftmax], ids=["Softmax", "LogSoftmax"])
def test_split_softmax_axis_is_two_allreduces_never_a_gather(make):
    if comm.get_group_size() != 8:
        pytest.skip("needs 8 ranks")
    rank = comm.get_rank()
    x = _r(4, 8)
    run, (fwd, bwd) = _run_traced(make().shard(((2, 4),)), [x])
    group = (0, 1, 2, 3) if rank < 4 else (4, 5, 6, 7)
    assert [(e.kind, e.op, e.group) for e in fwd] == [("AllReduce", "max", group),
                                                       ("AllReduce", "sum", group)]
    assert all(e.shape == (2, 1) for e in fwd)       # 2 local rows, one number each
    assert [(e.kind, e.op, e.group) for e in bwd] == [("AllReduce", "sum", group)]
    assert not [e for e in fwd + bwd if e.kind == "AllGather"]
    assert run.local_output.shape == (2, 2)


@pytest.mark.mpi
def test_split_normalised_axis_allreduces_row_statistics_only():
    if comm.get_group_size() != 8:
        pytest.skip("needs 8 ranks")
    rank = comm.get_rank()
    inputs = [3.0 + _r(4, 8), _r(8), _r(8)]
    run, (fwd, bwd) = _run_traced(LayerNorm().shard(((2, 4), (4,), (4,))), inputs)
    group = (0, 1, 2, 3) if rank < 4 else (4, 5, 6, 7)
    assert [(e.kind, e.op, e.group, e.shape) for e in fwd] == [
        ("AllReduce", "sum", group, (2, 1)), ("AllReduce", "sum", group, (2, 1))]
    rows = tuple(r for r in range(8) if r % 4 == rank % 4)   # gamma's replicas: the row split
    assert [(e.kind, e.group, e.shape) for e in bwd] == [
        ("AllReduce", group, (2, 2, 1)), ("AllReduce", rows, (2,)), ("AllReduce", rows, (2,))]
    assert not [e for e in fwd + bwd if e.kind == "AllGather"]


@pytest.mark.mpi
def test_vocabulary_parallel_cross_entropy_comm():
    if comm.get_group_size() != 8:
        pytest.skip("needs 8 ranks")
    rank = comm.get_rank()
    inputs = [_r(8, 16), LABELS.astype(np.int32)]
    run, (fwd, bwd) = _run_traced(SSCE().shard(((2, 4), (2,))), inputs)
    group = (0, 1, 2, 3) if rank < 4 else (4, 5, 6, 7)
    rows = (rank % 4, rank % 4 + 4)   # the two row blocks of this rank's class chunk
    # After the statistics every rank of a class group holds its rows' whole loss: the
    # scalar is summed over the row blocks only, as Megatron's (not over all 8 ranks).
    assert [(e.kind, e.op, e.group, e.shape) for e in fwd] == [
        ("AllReduce", "max", group, (4,)), ("AllReduce", "sum", group, (2, 4)),
        ("AllReduce", "sum", rows, ())]
    # Backward: only the adjoint of the output AllReduce (1 number); the rest is local.
    assert [(e.kind, e.group) for e in bwd] == [("AllReduce", rows)]
    assert run.local_grads is not None and run.local_grads[1] is None


@pytest.mark.mpi
def test_float32_with_the_reduced_axis_split_over_every_rank():
    p = comm.get_group_size()
    f32 = np.float32
    check_strategies(Softmax, [_r(4, 8).astype(f32)], strategies=[((1, p),)])
    check_strategies(LogSoftmax, [_r(4, 8).astype(f32)], strategies=[((1, p),)])
    check_strategies(LayerNorm, [(50.0 + _r(4, 8)).astype(f32), _r(8).astype(f32),
                                 _r(8).astype(f32)], strategies=[((1, p), (p,), (p,))])
    check_strategies(SSCE, [_r(8, 16).astype(f32), LABELS.astype(np.int32)],
                     strategies=[((1, p), (1,))])


@pytest.mark.mpi
def test_bad_label_raises_on_every_rank_holding_it():
    # Every row is bad, so every rank raises before its first collective (no rank hangs).
    size = comm.get_group_size()
    labels = np.full(8, 16, dtype=np.int32)
    classes, batch = min(size, 2), max(size // 2, 1)
    op = SSCE().shard(((batch, classes), (batch,)))
    with pytest.raises(ValueError, match=r"label 16 at row \d is outside \[0, 16\)"):
        run_op(op, _r(8, 16), labels)


def test_parallel_info_of_split_softmax():
    for rank in (0, 5):
        info = get_parallel_info(Softmax().shard(((2, 4),)), [(4, 8)], 8, rank, "float64")
        group = [0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7]
        assert info["device_matrix"] == [2, 4]
        assert info["inputs_tensor_map"] == [[1, 0]]
        assert [(c["op"], c["group"]) for c in info["forward_comm"]] == [("AllReduce", group)] * 2
        assert [c["bytes"] for c in info["forward_comm"]] == [2 * 3 * 16 // 4] * 2
        assert [(c["op"], c["group"]) for c in info["backward_comm"]] == [("AllReduce", group)]
    unsplit = get_parallel_info(Softmax().shard(((8, 1),)), [(8, 8)], 8, 0)
    assert unsplit["forward_comm"] == [] and unsplit["backward_comm"] == []


def test_parallel_info_of_cross_entropy():
    info = get_parallel_info(SSCE().shard(((8, 1), (8,))), [(8, 16), (8,)], 8, 3, "float64")
    assert [(c["op"], c["group"]) for c in info["forward_comm"]] == [("AllReduce",
                                                                     list(range(8)))]
    assert info["outputs_tensor_map"] == [[]] and info["outputs_slice_shape"] == [[]]
    info = get_parallel_info(SSCE().shard(((2, 4), (2,))), [(8, 16), (8,)], 8, 6, "float64")
    assert info["device_matrix"] == [2, 4]
    assert [c["group"] for c in info["forward_comm"]] == [[4, 5, 6, 7]] * 2 + [[2, 6]]
    # 4 row maxima; (2, 4) sums and targets; the 0-d loss over the 2 row blocks (8 bytes:
    # 2*1/2*8 = 8, as traced).
    assert [c["bytes"] for c in info["forward_comm"]] == [2 * 3 * 32 // 4, 2 * 3 * 64 // 4,
                                                          2 * 1 * 8 // 2]
    assert [(c["op"], c["group"]) for c in info["backward_comm"]] == [("AllReduce", [2, 6])]


def test_repeated_calculation_ranks_share_statistics():
    info = get_parallel_info(LayerNorm().shard(((1, 2), (2,), (2,))), [(4, 8), (8,), (8,)], 8, 0)
    dm = info["device_matrix"]
    assert sorted(dm) == [1, 2, 4]                    # cuts 1 and 2, a repeat axis of 4
    axis = len(dm) - 1 - info["inputs_tensor_map"][0][1]
    assert dm[axis] == 2
    group = list(DeviceMesh(tuple(dm)).group_of(0, (axis,)))
    assert [c["group"] for c in info["forward_comm"]] == [group, group]


# ------------------------------------------------------------------ finite differences
FD = [
    ("Softmax", Softmax(), [_r(3, 4)], None),
    ("Softmax_tuple", Softmax(axis=(0, 2)), [_r(2, 3, 2)], None),
    ("LogSoftmax", LogSoftmax(axis=0), [_r(4, 3)], None),
    ("LayerNorm", LayerNorm(), [_r(3, 4), _r(4), _r(4)], None),
    ("LayerNorm_params_wide", LayerNorm(-1, 0, 1e-3), [_r(2, 2, 3), _r(2, 2, 3), _r(2, 2, 3)],
     None),
    ("SSCE", SSCE(), [_r(4, 5), np.array([0, 4, 2, 2], dtype=np.int32)], (0,)),
]


@pytest.mark.parametrize("name,op,inputs,diff", FD, ids=[f[0] for f in FD])
def test_vjp_matches_finite_differences(name, op, inputs, diff):
    fd_check(op, inputs, diff=diff)


def test_kernels_match_closed_forms():
    x = _r(3, 5)
    e = np.exp(x)
    np.testing.assert_allclose(Softmax().kernel(x), e / e.sum(1, keepdims=True), rtol=1e-13)
    np.testing.assert_allclose(LogSoftmax().kernel(x), x - np.log(e.sum(1, keepdims=True)),
                               rtol=1e-13)
    g, b = _r(5), _r(5)
    mu, var = x.mean(1, keepdims=True), x.var(1, keepdims=True)
    np.testing.assert_allclose(LayerNorm(epsilon=1e-5).kernel(x, g, b),
                               (x - mu) / np.sqrt(var + 1e-5) * g + b, rtol=1e-12)
    labels = np.array([4, 0, 2], dtype=np.int64)
    loss = SSCE().kernel(x, labels)
    assert loss.shape == () and loss.dtype == np.float64
    want = -np.mean(np.log(e / e.sum(1, keepdims=True))[np.arange(3), labels])
    assert abs(float(loss) - want) < 1e-13
    assert SSCE().kernel(x.astype(np.float32), labels).dtype == np.float32


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("make,exc,words", [
    (lambda: Softmax(axis=1.0), TypeError, "Softmax: axis must be an int"),
    (lambda: Softmax(axis=()), ValueError, "non-empty tuple"),
    (lambda: Softmax(axis=(0, "a")), TypeError, "axis must be an int"),
    (lambda: LogSoftmax(axis=(0, 1)), TypeError, "LogSoftmax: axis must be an int"),
    (lambda: LayerNorm(begin_norm_axis=True), TypeError, "begin_norm_axis must be an int"),
    (lambda: LayerNorm(begin_params_axis="1"), TypeError, "begin_params_axis must be an int"),
    (lambda: LayerNorm(epsilon="small"), TypeError, "epsilon must be a float"),
    (lambda: LayerNorm(epsilon=-1e-5), ValueError, "epsilon must be a finite float >= 0"),
    (lambda: SSCE(is_grad=1), TypeError, "is_grad must be a bool"),
    (lambda: SSCE(is_grad=True), ValueError, "is_grad=True .* is not supported"),
])
def test_bad_attributes(make, exc, words):
    with pytest.raises(exc, match=words):
        make()


@pytest.mark.parametrize("op,inputs,exc,words", [
    (Softmax(axis=2), [_r(2, 3)], ValueError, r"axis=2 is out of range .* rank 2; allowed -2..1"),
    (Softmax(axis=(1, -1)), [_r(2, 3)], ValueError, "more than once"),
    (Softmax(), [np.ones((2, 3), dtype=np.int64)], TypeError, "floating-point array, got dtype "
     "int64"),
    (LogSoftmax(axis=-3), [_r(2, 3)], ValueError, "LogSoftmax: axis=-3 is out of range"),
    (LayerNorm(), [_r(2, 3), _r(4), _r(3)], ValueError,
     r"gamma has shape \(4,\) but must have shape \(3,\)"),
    (LayerNorm(), [_r(2, 3), _r(3), _r(2, 3)], ValueError, "beta has shape"),
    (LayerNorm(begin_norm_axis=2), [_r(2, 3), _r(3), _r(3)], ValueError,
     "begin_norm_axis=2 is out of range"),
    (LayerNorm(begin_params_axis=-3), [_r(2, 3), _r(3), _r(3)], ValueError,
     "begin_params_axis=-3 is out of range"),
    (LayerNorm(), [np.ones((2, 3), dtype=np.int32), _r(3), _r(3)], TypeError,
     "LayerNorm: x must be a floating-point array"),
    (SSCE(), [_r(4, 5), np.array([0, 5, 1, 1])], ValueError,
     r"label 5 at row 1 is outside \[0, 5\)"),
    (SSCE(), [_r(4, 5), np.array([0, 1, -1, 1])], ValueError,
     r"label -1 at row 2 is outside \[0, 5\)"),
    (SSCE(), [_r(4, 5), np.array([0.0, 1, 1, 1])], TypeError,
     "labels must be int32 or int64, got dtype float64"),
    (SSCE(), [np.ones((4, 5), dtype=np.int64), np.zeros(4, dtype=np.int64)], TypeError,
     "logits must be a floating-point array"),
    (SSCE(), [_r(4, 5), np.zeros(3, dtype=np.int64)], ValueError,
     r"logits must be \(N, C\) and labels \(N,\), got shapes \(4, 5\) and \(3,\)"),
    (SSCE(), [_r(4, 5, 1), np.zeros(4, dtype=np.int64)], ValueError, "logits must be"),
])
def test_bad_inputs(op, inputs, exc, words):
    with pytest.raises(exc, match=words):
        op.kernel(*inputs)


@pytest.mark.parametrize("op,shapes,strategy,words", [
    (LayerNorm(), [(4, 8), (8,), (8,)], ((2, 4), (2,), (4,)),
     "Strategies of relevant dimensions are not equal"),
    (LayerNorm(1, 0), [(4, 8), (4, 8), (4, 8)], ((2, 4), (1, 4), (2, 4)),
     "Strategies of relevant dimensions are not equal"),
    (SSCE(), [(8, 16), (8,)], ((2, 4), (4,)), "Strategies of relevant dimensions are not equal"),
    (SSCE(), [(8, 16), (8,)], ((2, 4),), "has 1 entries but the operator has 2 inputs"),
    (SSCE(), [(8, 16), (8,)], ((3, 1), (3,)), "8 is not divisible by 3"),
    (Softmax(), [(4, 8)], ((2, 8),), "uses 16 devices, which does not divide device_num 8"),
])
def test_bad_strategies(op, shapes, strategy, words):
    with pytest.raises(StrategyError, match=words):
        op.sharding(shapes, 8, strategy)


def test_bad_shapes_in_planning():
    with pytest.raises(ValueError, match="SparseSoftmaxCrossEntropyWithLogits: logits must be"):
        SSCE().candidate_strategies([(8,), (8,)], 8)
    with pytest.raises(ValueError, match="LayerNorm: the input must have rank >= 1"):
        LayerNorm().sharding([(), (), ()], 1, ((), (), ()))
