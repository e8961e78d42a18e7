"""The collectives of one strategy of every op family, written out by hand.

``tests/ophelpers.check_one`` compares a run's CommTrace with ``get_parallel_info``, which comes
from the same sharding rule the executor runs: a wrong rule passes its own check. Here every
expectation is derived from the strategy alone (which device axes cut which dims, which result
is partial, which input is replicated) and written as ``(kind, op, group, local shape)`` per
collective, forward and backward, as a function of the world size n (1, 2, 4 or 8; at n = 1
nothing communicates). ``run_op``'s own assembly of the results (label ``run_op:assemble``) is
not part of the op and is left out; any other collective outside the op fails the test.

The gradient semantics that the backward expectations follow (simpar/ops/_base.py): a
replicated output's cotangent is divided among its replicas, so the adjoint of a forward
AllReduce is an AllReduce that sums those shares; an input replicated over some device axes
gets its gradient completed by one AllReduce over them.

    python -m pytest -q --with-mpi tests/test_ops_expected_comm_mpi.py
    mpirun -n 8 python -m pytest -q --with-mpi -m mpi tests/test_ops_expected_comm_mpi.py
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import ops
from simpar.check import relative_error
from simpar.comm import CommEvent
from simpar.parallel import run_op

#: (kind, reduction op or None, group, local input shape) of one collective.
Event = tuple[str, str | None, tuple[int, ...], tuple[int, ...]]
TOL = 1e-12  # float64 throughout


# ------------------------------------------------------------------ groups, by hand
def _block(rank: int, size: int) -> tuple[int, ...]:
    """The ``size`` consecutive ranks around ``rank``: its group along the innermost axis of
    a device matrix (..., size) (row-major: the last axis varies fastest)."""
    start = rank - rank % size
    return tuple(range(start, start + size))


def _strided(rank: int, inner: int, size: int) -> tuple[int, ...]:
    """``rank``'s group along the axis of ``size`` just outside an inner extent of ``inner``
    ranks: on (2, 4), rank 5's group along axis 0 is ``_strided(5, 4, 2) == (1, 5)``."""
    outer = inner * size
    first = rank - rank % outer + rank % inner
    return tuple(first + k * inner for k in range(size))


def _ar(group: tuple[int, ...], shape: tuple[int, ...], op: str = "sum") -> Event:
    return ("AllReduce", op, group, shape)


def _hybrid(n: int) -> tuple[int, int]:
    """(d, m): a device matrix (d, m) of n devices with both axes cut from n = 4 on, and the
    inner one (m) cut from n = 2 on."""
    d = 2 if n >= 4 else 1
    return d, n // d


# ------------------------------------------------------------------ the cases
@dataclass(frozen=True)
class Case:
    """``build(n, rank)`` gives (op with its strategy, global inputs, forward, backward)."""

    name: str
    build: Callable[[int, int], tuple[ops.Primitive, list[np.ndarray], list[Event],
                                      list[Event]]]
    enable_alltoall: bool = True  # the context key; MindSpore's default is False


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)  # the same on every rank


def _matmul(n: int, rank: int) -> Any:
    # ((d, m), (m, 1)): k is cut m ways, so each rank's product is a partial sum over the m
    # consecutive ranks of its row block (on 8: [0..3] and [4..7]); B is replicated over the
    # d row blocks, so its gradient is summed over them.
    d, m = _hybrid(n)
    rng = _rng()
    a, b = rng.standard_normal((4, 8)), rng.standard_normal((8, 3))
    row = _block(rank, m)
    fwd = [_ar(row, (4 // d, 3))] if m > 1 else []
    bwd = list(fwd)  # the adjoint of the output AllReduce
    if d > 1:
        bwd.append(_ar(_strided(rank, m, d), (8 // m, 3)))  # dB over the row blocks
    return ops.MatMul().shard(((d, m), (m, 1))), [a, b], fwd, bwd


def _batch_matmul(n: int, rank: int) -> Any:
    # Batch split n ways, B (2-D, broadcast over the batch) replicated: nothing forward, B's
    # gradient summed over every rank.
    rng = _rng()
    a, b = rng.standard_normal((8, 2, 4)), rng.standard_normal((4, 3))
    bwd = [_ar(tuple(range(n)), (4, 3))] if n > 1 else []
    return ops.BatchMatMul().shard(((n, 1, 1), (1, 1))), [a, b], [], bwd


def _add_broadcast(n: int, rank: int) -> Any:
    # y (1, 8) broadcasts along x's rows, which are cut dd ways: y is replicated over the row
    # axis and its gradient is summed over it.
    dd = 2 if n >= 2 else 1
    mm = n // dd
    rng = _rng()
    x, y = rng.standard_normal((4, 8)), rng.standard_normal((1, 8))
    bwd = [_ar(_strided(rank, mm, dd), (1, 8 // mm))] if dd > 1 else []
    return ops.Add().shard(((dd, mm), (1, mm))), [x, y], [], bwd


def _mul(n: int, rank: int) -> Any:
    d, m = _hybrid(n)
    rng = _rng()
    x, y = rng.standard_normal((4, 8)), rng.standard_normal((4, 8))
    return ops.Mul().shard(((d, m), (d, m))), [x, y], [], []


def _bias_add(n: int, rank: int) -> Any:
    # Data parallel: the bias is replicated on every rank, its gradient summed over all.
    rng = _rng()
    x, b = rng.standard_normal((8, 4)), rng.standard_normal(4)
    bwd = [_ar(tuple(range(n)), (4,))] if n > 1 else []
    return ops.BiasAdd().shard(((n, 1), (1,))), [x, b], [], bwd


def _relu_split(n: int, rank: int) -> Any:
    x = _rng().standard_normal((4, 8))
    return ops.ReLU().shard(((1, n),)), [x], [], []


def _gelu_repeated(n: int, rank: int) -> Any:
    # Repeated calculation: every rank computes the whole (4, 4). The output's cotangent is
    # shared among the n replicas, and x's gradient is completed over all of them.
    x = _rng().standard_normal((4, 4))
    bwd = [_ar(tuple(range(n)), (4, 4))] if n > 1 else []
    return ops.GeLU().shard(((1, 1),)), [x], [], bwd


def _transpose(n: int, rank: int) -> Any:
    d, m = _hybrid(n)
    x = _rng().standard_normal((4, 8))
    return ops.Transpose((1, 0)).shard(((d, m),)), [x], [], []


def _reshape_local(n: int, rank: int) -> Any:
    # Rows cut n ways survive (8, 4) -> (8, 2, 2) whole: a local reshape.
    x = _rng().standard_normal((8, 4))
    return ops.Reshape((8, 2, 2)).shard(((n, 1),)), [x], [], []


def _reshape_redistributing(n: int, rank: int) -> Any:
    # Columns cut n ways do not stay contiguous in (64,): the cheapest fix moves the cut onto
    # the rows, one AllToAll over every rank (an AllGather would receive n^2 times more);
    # backward, the inverse AllToAll of the row-cut cotangent.
    x = _rng().standard_normal((8, 8))
    world = tuple(range(n))
    fwd: list[Event] = [("AllToAll", None, world, (8, 8 // n))] if n > 1 else []
    bwd: list[Event] = [("AllToAll", None, world, (8 // n, 8))] if n > 1 else []
    return ops.Reshape((64,)).shard(((1, n),)), [x], fwd, bwd


def _reshape_gathering(n: int, rank: int) -> Any:
    # The same reshape with MindSpore's default enable_alltoall=False: the pre-plan gathers
    # the column blocks (AllGather over every rank) and slices rows locally; backward, the
    # slice's adjoint zero-pads (a partial cotangent) and the AllGather's is a ReduceScatter.
    x = _rng().standard_normal((8, 8))
    world = tuple(range(n))
    fwd: list[Event] = [("AllGather", None, world, (8, 8 // n))] if n > 1 else []
    bwd: list[Event] = [("ReduceScatter", "sum", world, (8, 8))] if n > 1 else []
    return ops.Reshape((64,)).shard(((1, n),)), [x], fwd, bwd


def _concat_repeated(n: int, rank: int) -> Any:
    # Rows cut n/2 ways, the remaining factor 2 repeats (the last device axis: rank pairs
    # (0, 1), (2, 3), ...); each input's gradient is completed over its pair.
    r = max(n // 2, 1)
    rng = _rng()
    a, b = rng.standard_normal((8, 2)), rng.standard_normal((8, 3))
    pair = _block(rank, 2) if n > 1 else (rank,)
    bwd = [_ar(pair, (8 // r, 2)), _ar(pair, (8 // r, 3))] if n > 1 else []
    return ops.Concat(axis=1).shard(((r, 1), (r, 1))), [a, b], [], bwd


def _split(n: int, rank: int) -> Any:
    x = _rng().standard_normal((8, 4))
    return ops.Split(axis=1, output_num=2).shard(((n, 1),)), [x], [], []


def _gather(n: int, rank: int) -> Any:
    # Table rows cut m ways (vocabulary parallel), ids rows d ways: device matrix (d, 1, m, 1).
    # Each rank looks up the ids it owns (zeros elsewhere): the output is partial over its
    # m-block and one AllReduce completes it. Backward: the adjoint AllReduce, then the table's
    # gradient summed over the d id blocks that replicate it.
    d, m = _hybrid(n)
    rng = _rng()
    table = rng.standard_normal((16, 4))
    ids = rng.integers(0, 16, (4, 3)).astype(np.int32)
    block = _block(rank, m)
    fwd = [_ar(block, (4 // d, 3, 4))] if m > 1 else []
    bwd = list(fwd)
    if d > 1:
        bwd.append(_ar(_strided(rank, m, d), (16 // m, 4)))
    return ops.Gather().shard(((m, 1), (d, 1))), [table, ids], fwd, bwd


def _dropout(n: int, rank: int) -> Any:
    # The mask is a function of the global element index: no communication either way.
    d, m = _hybrid(n)
    x = _rng().standard_normal((8, 4))
    return ops.Dropout(0.6, 1, 2).shard(((d, m),)), [x], [], []


def _softmax(log: bool) -> Callable[[int, int], Any]:
    def build(n: int, rank: int) -> Any:
        # Softmax axis cut m ways: max-AllReduce then sum-AllReduce of one number per local
        # row over the m-block; backward one sum-AllReduce (of y*dy, or of dy for the log).
        d, m = _hybrid(n)
        x = _rng().standard_normal((4, 8))
        block = _block(rank, m)
        stat = (4 // d, 1)
        fwd = [_ar(block, stat, "max"), _ar(block, stat)] if m > 1 else []
        bwd = [_ar(block, stat)] if m > 1 else []
        op = ops.LogSoftmax() if log else ops.Softmax()
        return op.shard(((d, m),)), [x], fwd, bwd
    return build


def _layer_norm(n: int, rank: int) -> Any:
    # Normalised axis cut m ways: two sum-AllReduces of one number per row (mean, variance),
    # never the activations; backward one sum-AllReduce of the stacked [sum g, sum g*xhat].
    # gamma and beta are replicated over the d row blocks: each gradient summed over them.
    d, m = _hybrid(n)
    rng = _rng()
    x = 3.0 + rng.standard_normal((4, 8))
    gamma, beta = rng.standard_normal(8), rng.standard_normal(8)
    block, rows = _block(rank, m), 4 // d
    fwd = [_ar(block, (rows, 1)), _ar(block, (rows, 1))] if m > 1 else []
    bwd = [_ar(block, (2, rows, 1))] if m > 1 else []
    if d > 1:
        col = _strided(rank, m, d)
        bwd += [_ar(col, (8 // m,)), _ar(col, (8 // m,))]
    return ops.LayerNorm().shard(((d, m), (m,), (m,))), [x, gamma, beta], fwd, bwd


def _cross_entropy(n: int, rank: int) -> Any:
    # Vocabulary parallel: classes cut m ways, rows d ways. Max-AllReduce of the row maxima,
    # then one sum-AllReduce of the stacked (row sums of exp, target logits) over the m-block;
    # after it every rank of the m-block holds its rows' whole losses, so the scalar loss is
    # partial over the row cut only: one AllReduce over the d ranks holding the other rows
    # (none when d = 1), as Megatron's. Backward: that AllReduce's adjoint only (the logits'
    # gradient is local). Never a gather.
    d, m = _hybrid(n)
    rng = _rng()
    logits = rng.standard_normal((4, 8))
    labels = rng.integers(0, 8, 4).astype(np.int32)
    block, rows = _block(rank, m), 4 // d
    fwd = [_ar(block, (rows,), "max"), _ar(block, (2, rows))] if m > 1 else []
    loss = [_ar(_strided(rank, m, d), ())] if d > 1 else []
    op = ops.SparseSoftmaxCrossEntropyWithLogits().shard(((d, m), (d,)))
    return op, [logits, labels], fwd + loss, list(loss)


def _reduce(kind: str) -> Callable[[int, int], Any]:
    def build(n: int, rank: int) -> Any:
        # The reduced axis cut m ways: sum (or mean) leaves a partial sum completed by one
        # sum-AllReduce over the m-block, max one max-AllReduce; backward, the output's
        # cotangent (shared by the m replicas) is summed over the same block.
        d, m = _hybrid(n)
        x = _rng().standard_normal((4, 8))
        block = _block(rank, m)
        if kind == "sum":
            op, shape, how = ops.ReduceSum(axis=1), (4 // d,), "sum"
        elif kind == "mean":
            op, shape, how = ops.ReduceMean(keep_dims=True, axis=1), (4 // d, 1), "sum"
        else:
            op, shape, how = ops.ReduceMax(axis=1), (4 // d,), "max"
        fwd = [_ar(block, shape, how)] if m > 1 else []
        bwd = [_ar(block, shape)] if m > 1 else []
        return op.shard(((d, m),)), [x], fwd, bwd
    return build


def _floordiv_broadcast(n: int, rank: int) -> Any:
    # Add's rule, but floor has no gradient: y is replicated over the row cut, and still
    # nothing is communicated either way.
    dd = 2 if n >= 2 else 1
    rng = _rng()
    x, y = 5.0 * rng.standard_normal((4, 8)), 1.5 + np.abs(rng.standard_normal((1, 8)))
    return ops.FloorDiv().shard(((dd, n // dd), (1, n // dd))), [x, y], [], []


def _prelu(n: int, rank: int) -> Any:
    # Channels cut m ways with the weight, the batch d ways: the weight's gradient is this
    # rank's partial sum over its rows, completed over the d row blocks (its Mirror).
    d, m = _hybrid(n)
    rng = _rng()
    x, w = rng.standard_normal((4, 8, 2)), rng.standard_normal(8)
    bwd = [_ar(_strided(rank, m, d), (8 // m,))] if d > 1 else []
    return ops.PReLU().shard(((d, m, 1), (m,))), [x, w], [], bwd


def _prelu_shared(n: int, rank: int) -> Any:
    # One slope for every channel, data parallel: the (1,) weight is on every rank.
    rng = _rng()
    x, w = rng.standard_normal((8, 4)), rng.standard_normal(1)
    bwd = [_ar(tuple(range(n)), (1,))] if n > 1 else []
    return ops.PReLU().shard(((n, 1), (1,))), [x, w], [], bwd


def _bn_inputs(rng: np.random.Generator, x_shape: tuple[int, ...]) -> list[np.ndarray]:
    c = x_shape[1]
    return [3.0 + rng.standard_normal(x_shape), rng.standard_normal(c),
            rng.standard_normal(c), rng.standard_normal(c), 0.5 + np.abs(rng.standard_normal(c))]


def _batch_norm(training: bool) -> Callable[[int, int], Any]:
    def build(n: int, rank: int) -> Any:
        # Batch cut d ways, channels m ways. Training (SyncBatchNorm): the per-channel sums,
        # then the squared deviations, AllReduced over the d batch blocks that share the
        # rank's channels (keepdims: (1, C/m, 1, 1)); backward one AllReduce of the stacked
        # [sum dy, sum dy*xhat] (2, C/m) for dx, then scale's and bias's gradients over the
        # same ranks (their replicas). Inference: only those two gradients.
        d, m = _hybrid(n)
        c = 8 // m
        col = _strided(rank, m, d)
        fwd = [_ar(col, (1, c, 1, 1)), _ar(col, (1, c, 1, 1))] if d > 1 and training else []
        bwd = [_ar(col, (2, c))] if d > 1 and training else []
        bwd += [_ar(col, (c,)), _ar(col, (c,))] if d > 1 else []
        xs = _bn_inputs(_rng(), (4, 8, 2, 2))
        op = ops.BatchNorm(training).shard(((d, m, 1, 1),) + ((m,),) * 4)
        return op, xs, fwd, bwd
    return build


def _batch_norm_data_parallel(n: int, rank: int) -> Any:
    # (N, C) cut over every rank along N: the statistics of 3 channels are AllReduced over all.
    world = tuple(range(n))
    xs = _bn_inputs(_rng(), (8, 3))
    fwd = [_ar(world, (1, 3)), _ar(world, (1, 3))] if n > 1 else []
    bwd = [_ar(world, (2, 3)), _ar(world, (3,)), _ar(world, (3,))] if n > 1 else []
    return ops.BatchNorm(True).shard(((n, 1),) + ((1,),) * 4), xs, fwd, bwd


def _assign_repeated(n: int, rank: int) -> Any:
    # Rows cut n/2 ways, a repeat of 2 (rank pairs): the variable's gradient (MindSpore's bprop
    # hands it the output's cotangent) is completed over its pair; the value gets none.
    r = max(n // 2, 1)
    rng = _rng()
    variable, value = rng.standard_normal((8, 2)), rng.standard_normal((8, 2))
    bwd = [_ar(_block(rank, 2), (8 // r, 2))] if n > 1 else []
    return ops.Assign().shard(((r, 1), (r, 1))), [variable, value], [], bwd


CASES = [
    Case("MatMul_k_split", _matmul),
    Case("BatchMatMul_batch_split", _batch_matmul),
    Case("Add_broadcast", _add_broadcast),
    Case("Mul", _mul),
    Case("BiasAdd_data_parallel", _bias_add),
    Case("ReLU_split", _relu_split),
    Case("GeLU_repeated", _gelu_repeated),
    Case("Transpose", _transpose),
    Case("Reshape_local", _reshape_local),
    Case("Reshape_redistributing", _reshape_redistributing),
    Case("Reshape_gathering_without_alltoall", _reshape_gathering, enable_alltoall=False),
    Case("Concat_repeated", _concat_repeated),
    Case("Split", _split),
    Case("Gather_row_split_table", _gather),
    Case("Dropout", _dropout),
    Case("Softmax_split_axis", _softmax(log=False)),
    Case("LogSoftmax_split_axis", _softmax(log=True)),
    Case("LayerNorm_split_normalised_axis", _layer_norm),
    Case("CrossEntropy_vocabulary_parallel", _cross_entropy),
    Case("ReduceSum_split_axis", _reduce("sum")),
    Case("ReduceMean_split_axis_keep_dims", _reduce("mean")),
    Case("ReduceMax_split_axis", _reduce("max")),
    Case("FloorDiv_broadcast_no_gradient", _floordiv_broadcast),
    Case("PReLU_batch_and_channel_split", _prelu),
    Case("PReLU_shared_weight_data_parallel", _prelu_shared),
    Case("BatchNorm_sync_batch_and_channel_split", _batch_norm(True)),
    Case("BatchNorm_inference_batch_and_channel_split", _batch_norm(False)),
    Case("BatchNorm_sync_data_parallel_2d", _batch_norm_data_parallel),
    Case("Assign_repeated", _assign_repeated),
]


# ------------------------------------------------------------------ running and checking
def _events(events: Sequence[CommEvent], phase: str) -> list[Event]:
    return [(e.kind, e.op, e.group, e.shape) for e in events
            if e.label.startswith(f"run_op:{phase}")]


def _shard_problems(op: ops.Primitive, xs: Sequence[np.ndarray], dys: tuple[np.ndarray, ...],
                    run: Any, rank: int) -> list[str]:
    """This rank's shards against the numpy globals: inputs, outputs and gradients."""
    sh = run.sharding
    problems = []
    for i, (x, lay, local) in enumerate(zip(xs, sh.in_layouts, run.local_inputs)):
        if relative_error(local, x[lay.slices(rank)]) != 0.0:
            problems.append(f"input {i} shard is not its slice")
    want = op.kernel(*xs)
    wants = want if isinstance(want, tuple) else (want,)
    locals_ = run.local_output if isinstance(run.local_output, tuple) else (run.local_output,)
    for k, (w, local, (_, lay, _)) in enumerate(zip(wants, locals_, sh.outputs)):
        if local.shape != lay.local_shape() or relative_error(
                local, np.asarray(w)[lay.slices(rank)]) > TOL:
            problems.append(f"output {k} shard differs from its slice of one device")
    grads = op.vjp(list(xs), want, dys if isinstance(want, tuple) else dys[0])
    for i, (g, w, lay) in enumerate(zip(run.local_grads, grads, sh.in_layouts)):
        if (g is None) != (w is None):
            problems.append(f"gradient {i}: present {g is not None}, one device {w is not None}")
        elif g is not None and (g.shape != lay.local_shape() or relative_error(
                g, np.asarray(w)[lay.slices(rank)]) > TOL):
            problems.append(f"gradient {i} shard differs from its slice of one device")
    return problems


def _all_agree(problems: list[str]) -> None:
    """Fail on every rank if any rank found a problem (collective)."""
    bad = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
    if bad:
        raise AssertionError(f"rank {comm.get_rank()}: " + (
            "; ".join(problems) if problems else "fine here, but another rank failed"))


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_collectives_are_the_hand_written_ones(case: Case) -> None:
    rank, n = comm.get_rank(), comm.get_group_size()
    op, xs, want_fwd, want_bwd = case.build(n, rank)
    y = op.kernel(*xs)
    rng = np.random.default_rng(1)
    dys = tuple(rng.standard_normal(np.shape(o)) for o in (y if isinstance(y, tuple) else (y,)))
    simpar.set_auto_parallel_context(enable_alltoall=case.enable_alltoall)
    try:
        with comm.CommTrace() as trace:
            run = run_op(op, *xs, grad_output=dys if isinstance(y, tuple) else dys[0],
                         check=True, full=True)
    finally:
        simpar.reset_auto_parallel_context()
    fwd, bwd = _events(trace.events, "forward"), _events(trace.events, "backward")
    problems = _shard_problems(op, xs, dys, run, rank)
    if fwd != want_fwd:
        problems.append(f"forward collectives {fwd}, by hand {want_fwd}")
    if bwd != want_bwd:
        problems.append(f"backward collectives {bwd}, by hand {want_bwd}")
    stray = [str(e) for e in trace.events
             if not e.label.startswith(("run_op:forward", "run_op:backward", "run_op:assemble"))]
    if stray:
        problems.append(f"collectives outside the op: {stray}")
    _all_agree(problems)


def test_every_op_family_has_a_case() -> None:
    """Each module of simpar/ops is represented (and the ops the issue names)."""
    names = {type(c.build(8, 0)[0]).__name__ for c in CASES}
    assert names >= {"MatMul", "BatchMatMul", "Add", "Mul", "BiasAdd", "ReLU", "GeLU",
                     "Reshape", "Transpose", "Concat", "Split", "Gather", "Dropout", "Softmax",
                     "LogSoftmax", "LayerNorm", "SparseSoftmaxCrossEntropyWithLogits",
                     "ReduceSum", "ReduceMean", "ReduceMax", "FloorDiv", "PReLU", "BatchNorm",
                     "Assign"}, names
    modules = {type(c.build(8, 0)[0]).__module__ for c in CASES}
    assert modules == {f"simpar.ops.{m}" for m in ("matmul", "elementwise", "array_ops",
                                                   "gather_dropout", "nn_ops", "reduce_ops")}


def test_groups_by_hand() -> None:
    """The two group helpers, against the mesh examples of DESIGN.md."""
    assert _block(5, 4) == (4, 5, 6, 7) and _block(2, 4) == (0, 1, 2, 3)
    assert _strided(5, 4, 2) == (1, 5) and _strided(6, 2, 2) == (4, 6)
    assert _strided(3, 1, 4) == (0, 1, 2, 3)
