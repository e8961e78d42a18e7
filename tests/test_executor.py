"""The compiled executor (simpar/runtime/executor.py), in one process.

It must compute exactly what the ops' own kernels compute, read its inputs without writing
them, and run each view op as a view. tests/test_backward_plan_mpi.py and
tests/test_runtime_mpi.py check the same executor on real ranks, against one device.

    python -m pytest tests/test_executor.py -q
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import simpar
from simpar import graph, nn, ops
from simpar.ops.kernels import Tape
from simpar.runtime import lower
from simpar.runtime.executor import Executor
from simpar.runtime.op_runner import OpRunner
from simpar.search import plan_strategies


@pytest.fixture(autouse=True)
def _clean_context() -> Any:
    simpar.reset_auto_parallel_context()
    yield
    simpar.reset_auto_parallel_context()


def _gpt_train(dtype: Any = np.float64) -> tuple[nn.TrainOneStepCell, np.ndarray, np.ndarray]:
    gpt = nn.GPT(vocab_size=16, seq_length=8, d_model=16, n_layers=2, n_heads=4, dtype=dtype)
    cell = nn.WithLossCell(gpt, nn.SoftmaxCrossEntropyWithLogits())
    train = nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), 0.1),
                                parallel_mode="stand_alone", seed=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 16, (4, 8), dtype=np.int32)
    labels = rng.integers(0, 16, (4, 8), dtype=np.int32)
    return train, ids, labels


def _eager_loss_and_grads(train: nn.TrainOneStepCell, ids: np.ndarray, labels: np.ndarray
                          ) -> tuple[float, dict[str, np.ndarray]]:
    """The same step by the ops' own single-device kernels and VJPs, node by node."""
    prog = train.program
    assert prog is not None
    g = prog.graph
    vals: dict[int, Any] = {g.inputs[0].id: ids, g.inputs[1].id: labels}
    vals.update((v.id, train.params[v.name]) for v in g.params)
    vals.update((v.id, v.const) for v in g.consts)
    for node in g.nodes:
        vals[node.outputs[0].id] = node.op.kernel(*(vals[v.id] for v in node.inputs))
    out = g.outputs[0]
    grads: dict[int, np.ndarray] = {out.id: np.ones_like(vals[out.id])}
    for node in reversed(g.nodes):
        dy = grads.pop(node.outputs[0].id, None)
        if dy is None:
            continue
        xs = [vals[v.id] for v in node.inputs]
        for v, d in zip(node.inputs, node.op.vjp(xs, vals[node.outputs[0].id], dy)):
            if d is not None and v.dtype.kind == "f":
                grads[v.id] = grads[v.id] + d if v.id in grads else d
    return float(vals[out.id]), {v.name: grads[v.id] for v in g.params}


def test_the_compiled_step_is_the_ops_own_kernels_node_by_node() -> None:
    train, ids, labels = _gpt_train()
    train.build(ids, labels)
    want_loss, want = _eager_loss_and_grads(train, ids, labels)
    loss, grads = train.value_and_grad(ids, labels)
    assert loss == pytest.approx(want_loss, rel=1e-13)
    assert set(grads) == set(want)
    for name, g in grads.items():
        np.testing.assert_allclose(g, want[name], rtol=1e-10, atol=1e-13, err_msg=name)


def test_inputs_are_read_not_written_and_may_be_read_only() -> None:
    train, ids, labels = _gpt_train()
    ids.setflags(write=False)
    labels.setflags(write=False)
    before = ids.copy(), labels.copy()
    losses = [train(ids, labels) for _ in range(3)]
    np.testing.assert_array_equal(ids, before[0])
    np.testing.assert_array_equal(labels, before[1])
    assert losses[-1] < losses[0]


def test_the_same_seed_gives_bitwise_identical_losses() -> None:
    runs = []
    for _ in range(2):
        train, ids, labels = _gpt_train(np.float32)
        runs.append([train(ids, labels) for _ in range(4)])
    assert runs[0] == runs[1]


def test_the_program_is_compiled_once_per_rank_and_views_run_as_views() -> None:
    train, ids, labels = _gpt_train()
    train(ids, labels)
    prog = train.program
    assert prog is not None
    ex = prog.executor(0)
    assert isinstance(ex, Executor) and prog.executor(0) is ex
    # Every Reshape and Transpose of the GPT runs as one view call and keeps nothing.
    kinds = {"Reshape", "Transpose"}
    assert all(f.view == (s.node.op.name in kinds) for s, f in zip(prog.steps, ex.fwd))
    assert {s.node.op.name for s, f in zip(prog.steps, ex.fwd) if f.view} == kinds
    assert len(ex.backwards) == 1                      # one backward per set of seeds


def test_the_source_is_one_line_per_op_and_plain_ops_are_written_inline() -> None:
    """The generated forward runs every op once, in program order, each under its name; an
    op on Primitive's own per-rank path (MatMul, BiasAdd, Add, Mul) is written into the code
    as its Inline expression (``v7 = v5 @ v6.T``), its tape built inline, and the backward
    writes its gradients the same way; every other op is one call."""
    train, ids, labels = _gpt_train()
    train(ids, labels)
    prog = train.program
    assert prog is not None
    ex = prog.executor(0)
    text = ex.source()
    assert text.startswith("def forward(") and "\ndef backward(" in text
    forward, backward = text.split("\ndef backward(")
    lines = [line.strip() for line in forward.splitlines()]
    heads = [i for i, line in enumerate(lines) if line.startswith("# ")]
    assert len(heads) == len(prog.steps)
    updated = []
    for s, f, i in zip(prog.steps, ex.fwd, heads, strict=True):
        assert lines[i] == f"# {s.node.name}: {s.node.op.name}"
        line = lines[i + 1]
        update = re.match(r"(v\d+) [-+*]= ", line)
        if update:   # written into its input: ``v45 += v7`` then ``v46 = v45``
            assert lines[i + 2] == f"v{f.out} = {update[1]}", lines[i + 2]
            updated.append(s.node.op.name)
        else:
            assert re.match(rf"v{f.out}[ ,]" if f.out >= 0 else r"r, ", line), line
        written = s.node.op.name in {"MatMul", "BiasAdd", "Add", "Mul", "BatchMatMul"}
        assert (f.inline is not None) == written and f.plain == written, s.node.op.name
        assert ("R" not in line) == written, line
    assert sum(f.inline is not None for f in ex.fwd) >= 20
    # Every bias is added in place to its MatMul's product, and each attention's mask to its
    # scaled scores; the residual Adds are not (their x is read by the next LayerNorm too).
    assert sorted(updated) == ["Add"] * 2 + ["BiasAdd"] * 10, updated
    assert re.search(r"\n    C = \(d @ T\[0\]\[1\], d\.T @ T\[0\]\[0\],\)\n", backward)


def test_a_value_no_tape_keeps_is_dropped_after_its_last_use() -> None:
    """Dense(32, 16, relu) with frozen parameters, float64: no op keeps anything for a
    backward, so the MatMul's output is dropped once the BiasAdd has read it, and the
    BiasAdd's once the ReLU has: the executor never holds more than x, w, b and one (8, 16)
    array (holding every value to the end, it would peak at three)."""
    from simpar.runtime import watching_memory

    dense = nn.Dense(32, 16, activation="relu", dtype=np.float64)
    for p in dense.get_parameters():
        p.requires_grad = False
    g = graph.trace(dense, [((8, 32), np.float64)], ["x"])
    prog = lower(g, plan_strategies(g, 1, "stand_alone"))
    assert not prog.grad_nodes
    with watching_memory() as watch:
        outs, tape = prog.forward([np.ones((8, 32))], {"weight": np.ones((16, 32)),
                                                        "bias": np.zeros(16)})
    assert tape == [] and outs[0].shape == (8, 16)
    assert watch.peak == (8 * 32 + 16 * 32 + 16 + 8 * 16) * 8


@pytest.mark.parametrize("op, shape, strategy", [
    (ops.Reshape((4, 6, 2)), (4, 12), ((1, 1),)),
    (ops.Transpose((1, 0, 2)), (2, 3, 4), ((1, 1, 1),)),
])
def test_a_view_op_gives_views_both_ways_equal_to_its_kernel(op: ops.Primitive,
                                                            shape: tuple[int, ...],
                                                            strategy: Any) -> None:
    x = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    sh = op.sharding([shape], 1, strategy)
    view = op.local_view(sh)
    assert view is not None
    forward, backward = view
    y = forward(x)
    assert np.shares_memory(y, x)
    np.testing.assert_array_equal(y, op.kernel(x))
    dy = np.arange(y.size, dtype=np.float64).reshape(y.shape)
    dx = backward(dy)
    assert dx.shape == x.shape and np.shares_memory(dx, dy)
    np.testing.assert_array_equal(dx, op.vjp((x,), y, dy)[0])
    assert ops.MatMul().local_view(ops.MatMul().sharding([(2, 2), (2, 2)], 1)) is None


def test_a_gradient_handed_to_the_caller_is_writeable() -> None:
    # loss = ReduceMean(x + w): ReduceMean's gradient is a read-only broadcast view, which
    # Add passes on to w as it is; the caller gets a writeable array of its own.
    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(np.zeros((4, 3)), "w")
            self.add, self.mean = ops.Add(), ops.ReduceMean()

        def construct(self, x: Any, y: Any) -> Any:
            return self.mean(self.add(x, self.w))

    net = Net()
    train = nn.TrainOneStepCell(net, nn.SGD(net.trainable_params(), 0.1),
                                parallel_mode="stand_alone")
    x = np.ones((4, 3))
    _, grads = train.value_and_grad(x, x)
    g = next(iter(grads.values()))
    assert g.flags.writeable
    np.testing.assert_array_equal(g, np.full((4, 3), 1 / 12))
    g *= 0.5


def test_sgd_follows_parameters_that_change_shape() -> None:
    p = nn.Parameter(np.ones((4, 4)), "w")
    opt = nn.SGD([p], 0.1)
    opt.step({"w": np.ones((4, 4))}, {"w": np.ones((4, 4))})
    shards = {"w": np.ones((2, 4))}
    opt.init_state(shards)
    opt.step(shards, {"w": np.ones((2, 4))})
    np.testing.assert_allclose(shards["w"], 0.9)


def test_gelu_keeps_its_tanh_and_gives_the_kernels_values_bitwise() -> None:
    op = ops.GeLU()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    dy = rng.standard_normal((6, 5)).astype(np.float32)
    sh = op.sharding([x.shape], 1)
    y, saved = op.local_forward(sh, x)
    assert str(op.tape) == "input+new" and saved[0] is x and saved[1].shape == x.shape
    np.testing.assert_array_equal(y, op.kernel(x))
    (dx,) = op.local_backward(sh, saved, dy)
    np.testing.assert_array_equal(dx, op.vjp((x,), y, dy)[0])


def test_a_backward_kernel_skips_the_gradients_not_needed() -> None:
    op = ops.MatMul()
    a, b = np.ones((3, 4)), np.ones((4, 2))
    sh = op.sharding([a.shape, b.shape], 1)
    y, saved = op.local_forward(sh, a, b)
    both = OpRunner(sh).backward_kernel((True, True))(saved, np.ones_like(y))
    only_b = OpRunner(sh).backward_kernel((False, True))(saved, np.ones_like(y))
    assert only_b[0] is None
    np.testing.assert_array_equal(only_b[1], both[1])


@pytest.mark.parametrize("op, shapes, kept", [
    (ops.MatMul(transpose_b=True), [(3, 4), (2, 4)], "inputs"),
    (ops.BatchMatMul(), [(2, 3, 4), (2, 4, 5)], "inputs"),
    (ops.Mul(), [(3, 4), (3, 4)], "inputs"),
    (ops.Add(), [(3, 4), (4,)], "nothing"),
    (ops.Sub(), [(3, 4), (3, 4)], "nothing"),
    (ops.BiasAdd(), [(3, 4), (4,)], "nothing"),
])
def test_a_plain_op_keeps_what_its_tape_kind_says_and_its_vjp_reads(
        op: ops.Primitive, shapes: list[tuple[int, ...]], kept: str) -> None:
    """Primitive's own per-rank forward keeps what the op's Tape kind names, which the cost
    model counts: the inputs without the product for MatMul and Mul, and for Add, Sub and
    BiasAdd only their inputs' shapes (stand-ins holding one element); the backward from
    that tape is the VJP's from the real arrays, bit for bit."""
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(s) for s in shapes]
    sh = op.sharding(shapes, 1)
    y, saved = op.local_forward(sh, *xs)
    assert str(op.tape) == kept and saved[1] is None
    if kept == "inputs":
        assert all(a is x for a, x in zip(saved[0], xs))
    else:
        assert [a.shape for a in saved[0]] == shapes
        assert all(a.base is not None and a.base.nbytes == 8 for a in saved[0])
    dy = rng.standard_normal(y.shape)
    got = op.local_backward(sh, saved, dy)
    for g, want in zip(got, op.vjp(xs, y, dy), strict=True):
        np.testing.assert_array_equal(g, want)


class _KeepingAdd(ops.Add):
    """Add with a tape that keeps its output too (as an op whose VJP reads y does)."""

    tape = Tape.INPUTS_AND_OUTPUT


def _dense_like(case: str) -> tuple[Any, dict[str, np.ndarray]]:
    rng = np.random.default_rng(4)
    w = nn.Parameter(rng.standard_normal((6, 5)), name="w")
    b = nn.Parameter(rng.standard_normal(6), name="b")
    c = nn.Parameter(rng.standard_normal((4, 6)), name="c")

    def f(x: Any) -> Any:
        p = ops.MatMul(transpose_b=True)(x, w)
        if case == "bias":        # the bias goes into the product
            return ops.BiasAdd()(p, b)
        if case == "shared":      # the product has a second reader: the bias may not go in
            return ops.Add()(ops.BiasAdd()(p, b), p)
        if case == "scaled":      # Mul's tape keeps its input; the Add after it goes into
            return ops.Add()(ops.Mul()(p, c), c)   # Mul's product
        if case == "kept":        # ReLU's tape keeps its output: nothing goes in
            return ops.Add()(ops.ReLU()(p), c)
        return ops.BiasAdd()(_KeepingAdd()(p, c), b)   # the Add's tape keeps its sum

    return f, {"w": w.initial_value(0, None), "b": b.initial_value(0, None),
               "c": c.initial_value(0, None)}


@pytest.mark.parametrize("case, updated", [
    ("bias", ["BiasAdd"]), ("shared", ["Add"]), ("scaled", ["Add"]), ("kept", []),
    ("kept by its maker", [])])
def test_an_op_writes_into_its_input_only_where_nothing_else_holds_it(
        case: str, updated: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An Add or BiasAdd writes its result into its input 0 (``v3 += v4``) where that array
    has no other reader, no tape keeps it, and an inline expression made it; the step is
    bit for bit the one with every such write switched off, and it leaves the input and
    the parameters as they were."""
    f, params = _dense_like(case)
    x = np.random.default_rng(5).standard_normal((4, 5))
    runs = []
    for allowed in (True, False):
        if not allowed:
            monkeypatch.setattr(Executor, "_updates", lambda *args: False)
        g = graph.trace(f, [(x.shape, x.dtype)], ["x"])
        prog = lower(g, plan_strategies(g, 1, "stand_alone"))
        before = {n: a.copy() for n, a in params.items()}
        outs, tape = prog.forward([x], params)
        grads = prog.backward(tape, [np.full(outs[0].shape, 0.5)])
        for n, a in params.items():
            np.testing.assert_array_equal(a, before[n])
        lines = [line.strip() for line in prog.executor(0).source().splitlines()]
        runs.append((outs[0], grads, [lines[i - 1].split(": ")[-1] for i, line in
                                      enumerate(lines) if re.match(r"v\d+ [-+*]= ", line)]))
    assert runs[0][2] == updated and runs[1][2] == []
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1].keys() == runs[1][1].keys()
    for n in runs[0][1]:
        np.testing.assert_array_equal(runs[0][1][n], runs[1][1][n])


def test_a_kernel_alone_runs_no_collective_of_its_own() -> None:
    """simpar.ops runs no collective: a kernel called by itself gets ``ONE_DEVICE``, which
    refuses one over several ranks; the runtime's OpRunner hands kernels the real ones."""
    op = ops.Softmax().shard(((1, 8),))
    sh = op.sharding([(2, 16)], 8)
    assert [c.kind for c in sh.internal_forward] == ["AllReduce", "AllReduce"]
    with pytest.raises(ValueError, match=re.escape("needs the ranks of its group; run the op "
                                                   "through simpar.runtime")):
        op.local_forward(sh, np.ones((2, 2)))
    alone = ops.Softmax().sharding([(2, 16)], 1)
    y, _ = OpRunner(alone).forward(np.ones((2, 16)))
    np.testing.assert_array_equal(y, ops.Softmax().kernel(np.ones((2, 16))))
