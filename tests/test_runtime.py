"""Tracing, lowering and the single-device runtime, in one process (no MPI needed).

Planning is pure: these tests lower graphs for 8, 64 and 1024 devices in this process and check
the per-rank program's layouts, strategies and collectives without running them. The
executor runs here only on one device (``stand_alone``); tests/test_runtime_mpi.py runs the
same programs on real ranks.

    python -m pytest tests/test_runtime.py -q
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import simpar
from simpar import context, graph, nn, ops
from simpar.dataset import random_classification
from simpar.graph import Graph
from simpar.nn import presets
from simpar.runtime import ParallelProgram, build_program, lower
from simpar.search import dataset_layouts, parameter_plans, plan_strategies

BATCH = 8
SEMI = "semi_auto_parallel"


@pytest.fixture(autouse=True)
def _clean_context() -> Any:
    simpar.reset_auto_parallel_context()
    yield
    simpar.reset_auto_parallel_context()


def _mlp_cell(in_ch: int = 16, hidden: int = 32, out: int = 8, n_hidden: int = 1
              ) -> nn.WithLossCell:
    cell = nn.WithLossCell(nn.MLP(in_ch, hidden, out, n_hidden=n_hidden, dtype=np.float64),
                           nn.SoftmaxCrossEntropyWithLogits())
    cell.name_parameters()
    return cell


def _gpt_cell(**kw: Any) -> tuple[nn.WithLossCell, nn.GPT, nn.SoftmaxCrossEntropyWithLogits]:
    gpt = nn.GPT(dtype=np.float64, **kw)
    loss = nn.SoftmaxCrossEntropyWithLogits()
    cell = nn.WithLossCell(gpt, loss)
    cell.name_parameters()
    return cell, gpt, loss


def _trace_mlp(cell: nn.Cell, batch: int = BATCH, in_ch: int = 16) -> Graph:
    return graph.trace(cell, [((batch, in_ch), np.float64), ((batch,), np.int32)],
                       ["data", "label"])


def _trace_gpt(cell: nn.Cell, batch: int = BATCH, seq: int = 32) -> Graph:
    return graph.trace(cell, [((batch, seq), np.int32), ((batch, seq), np.int32)],
                       ["data", "label"])


def _step(prog: ParallelProgram, name_part: str) -> Any:
    matches = [s for s in prog.steps if name_part in s.node.name]
    assert len(matches) == 1, [s.node.name for s in matches]
    return matches[0]


# ------------------------------------------------------------------ tracing
def test_trace_mlp_records_one_node_per_primitive_with_global_shapes() -> None:
    g = _trace_mlp(_mlp_cell())
    assert [n.op.name for n in g.nodes] == ["MatMul", "BiasAdd", "ReLU", "MatMul", "BiasAdd",
                                            "SparseSoftmaxCrossEntropyWithLogits"]
    assert [(v.name, v.shape, v.dtype, v.kind) for v in g.inputs] == [
        ("data", (BATCH, 16), np.float64, "input"), ("label", (BATCH,), np.int32, "input")]
    assert [(v.name, v.shape) for v in g.params] == [
        ("_backbone.fc1.weight", (32, 16)), ("_backbone.fc1.bias", (32,)),
        ("_backbone.fc2.weight", (8, 32)), ("_backbone.fc2.bias", (8,))]
    assert all(v.kind == "param" and v.param is not None for v in g.params)
    assert [n.outputs[0].shape for n in g.nodes] == [(BATCH, 32)] * 3 + [(BATCH, 8)] * 2 + [()]
    # Values link to their producers and consumers.
    assert g.nodes[1].inputs[0] is g.nodes[0].outputs[0]
    assert g.outputs == [g.nodes[-1].outputs[0]] and g.outputs[0].producer is g.nodes[-1]
    consumers = g.consumers()
    assert [(n.op.name, k) for n, k in consumers[g.inputs[0].id]] == [("MatMul", 0)]
    assert str(g).startswith("graph(%0:data[8, 16], %1:label[8]):")


def test_trace_gpt_shapes_through_attention_and_loss() -> None:
    cell, gpt, _ = _gpt_cell()
    g = _trace_gpt(cell)
    b, s, d, nh, v = BATCH, 32, 64, 8, 128
    hd, t = d // nh, b * s
    attn = "_backbone-GPT/block1-TransformerBlock/attn-MultiHeadAttention/"
    rows = [(n.name.split("/", 2)[2].rsplit("-op", 1)[0], n.outputs[0].shape) for n in g.nodes]
    block1 = [(name.removeprefix(attn), shape) for name, shape in rows if name.startswith(attn)]
    assert block1 == [
        ("q-Dense/Reshape", (t, d)), ("q-Dense/MatMul", (t, d)), ("q-Dense/BiasAdd", (t, d)),
        ("q-Dense/Reshape", (b, s, d)), ("Reshape", (b, s, nh, hd)),
        ("Transpose", (b, nh, s, hd)),
        ("k-Dense/Reshape", (t, d)), ("k-Dense/MatMul", (t, d)),  # no key bias
        ("k-Dense/Reshape", (b, s, d)), ("Reshape", (b, s, nh, hd)),
        ("Transpose", (b, nh, s, hd)),
        ("v-Dense/Reshape", (t, d)), ("v-Dense/MatMul", (t, d)), ("v-Dense/BiasAdd", (t, d)),
        ("v-Dense/Reshape", (b, s, d)), ("Reshape", (b, s, nh, hd)),
        ("Transpose", (b, nh, s, hd)),
        ("BatchMatMul", (b, nh, s, s)), ("Mul", (b, nh, s, s)), ("Add", (b, nh, s, s)),
        ("Softmax", (b, nh, s, s)), ("BatchMatMul", (b, nh, s, hd)),
        ("Transpose", (b, s, nh, hd)), ("Reshape", (b, s, d)),
        ("proj-Dense/Reshape", (t, d)), ("proj-Dense/MatMul", (t, d)),
        ("proj-Dense/BiasAdd", (t, d)), ("proj-Dense/Reshape", (b, s, d))]
    assert rows[:2] == [("_backbone-GPT/embedding-Embedding/Gather", (b, s, d)),
                        ("_backbone-GPT/Add", (b, s, d))]
    assert rows[-6:] == [
        ("_backbone-GPT/head-Dense/Reshape", (t, d)), ("_backbone-GPT/head-Dense/MatMul", (t, v)),
        ("_backbone-GPT/head-Dense/Reshape", (b, s, v)),
        ("_loss_fn-SoftmaxCrossEntropyWithLogits/Reshape", (t, v)),
        ("_loss_fn-SoftmaxCrossEntropyWithLogits/Reshape", (t,)),
        ("_loss_fn-SoftmaxCrossEntropyWithLogits/SparseSoftmaxCrossEntropyWithLogits", ())]
    # 15 parameters per block (the key Dense has no bias), position, table, ln_f (2), head.
    assert len(g.params) == 2 + 15 * len(gpt.blocks) + 2 + 1 == 35
    assert {v.name for v in g.params} == {p.name for p in cell.trainable_params()}
    assert g.nodes[0].inputs[0].name == "_backbone.embedding.embedding_table"
    # The causal mask and the score scale are constants of the graph, not parameters.
    assert sorted(c.shape for c in g.consts) == [(), (), (s, s), (s, s)]


def test_node_names_are_mindspore_scopes_with_a_running_op_number() -> None:
    g = _trace_mlp(_mlp_cell())
    assert [n.name for n in g.nodes] == [
        "Default/network-WithLossCell/_backbone-MLP/fc1-Dense/MatMul-op0",
        "Default/network-WithLossCell/_backbone-MLP/fc1-Dense/BiasAdd-op1",
        "Default/network-WithLossCell/_backbone-MLP/fc1-Dense/ReLU-op2",
        "Default/network-WithLossCell/_backbone-MLP/fc2-Dense/MatMul-op3",
        "Default/network-WithLossCell/_backbone-MLP/fc2-Dense/BiasAdd-op4",
        "Default/network-WithLossCell/_loss_fn-SoftmaxCrossEntropyWithLogits/"
        "SparseSoftmaxCrossEntropyWithLogits-op5"]
    cell, _, _ = _gpt_cell(n_layers=1)
    names = [n.name for n in _trace_gpt(cell).nodes]
    assert len(set(names)) == len(names)
    assert names[0] == "Default/network-WithLossCell/_backbone-GPT/embedding-Embedding/Gather-op0"
    assert all(n.endswith(f"-op{k}") for k, n in enumerate(names))


class _TwoReshapes(nn.Cell):
    """One Reshape primitive called twice with different target shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.reshape = ops.Reshape()

    def construct(self, x: Any) -> Any:
        return self.reshape(self.reshape(x, (4, 8)), (32,))


def test_each_node_keeps_a_snapshot_of_its_call_attributes() -> None:
    cell = _TwoReshapes()
    g = graph.trace(cell, [((2, 16), np.float64)])
    assert [n.op.attrs()["shape"] for n in g.nodes] == [(4, 8), (32,)]
    assert [n.outputs[0].shape for n in g.nodes] == [(4, 8), (32,)]
    assert g.nodes[0].op is not g.nodes[1].op and g.nodes[0].op is not cell.reshape
    # Eager: the same cell on an array.
    x = np.arange(32.0).reshape(2, 16)
    np.testing.assert_array_equal(cell(x), x.reshape(32))
    # Lowered on 8 devices, the first Reshape still splits (4, 8) and the second (32,).
    prog = build_program(g, 8, SEMI)
    assert [prog.layouts[n.outputs[0].id].shape for n in g.nodes] == [(4, 8), (32,)]


def test_trace_does_not_nest_and_rejects_non_numeric_constants() -> None:
    with pytest.raises(RuntimeError, match="cannot nest"):
        graph.trace(lambda x: graph.trace(lambda y: y, [((1,), np.float64)]),
                    [((1,), np.float64)])
    with pytest.raises(TypeError, match="cannot use str 'a' as a tensor"):
        graph.trace(lambda x: ops.Add()(x, "a"), [((2,), np.float64)])
    assert not graph.tracing()


# ------------------------------------------------------------------ lowering is pure
MLP_MESHES = [(8, 2, 4), (64, 8, 8), (1024, 8, 128)]


@pytest.mark.parametrize(("device_num", "dp", "mp"), MLP_MESHES,
                         ids=[f"{n}dev" for n, _, _ in MLP_MESHES])
def test_lower_megatron_mlp_for_many_devices_in_one_process(device_num: int, dp: int,
                                                            mp: int) -> None:
    cell = _mlp_cell(32, 1024, 128)
    presets.megatron_mlp(cell._backbone, dp, mp)  # type: ignore[arg-type]
    prog = build_program(_trace_mlp(cell, 64, 32), device_num, SEMI, ((dp, 1), (dp,)), cell=cell)
    assert prog.device_num == device_num and len(prog.steps) == 6
    want = {"_backbone.fc1.weight": (1024 // mp, 32), "_backbone.fc1.bias": (1024 // mp,),
            "_backbone.fc2.weight": (128, 1024 // mp), "_backbone.fc2.bias": (128,)}
    assert {k: lay.local_shape() for k, lay in prog.param_layouts.items()} == want
    assert [lay.local_shape() for lay in prog.input_layouts()] == [(64 // dp, 32), (64 // dp,)]
    assert all(lay.device_num == device_num for lay in prog.layouts.values())
    # Column-parallel fc1 needs nothing; row-parallel fc2 completes its partial sum.
    fc1, fc2 = _step(prog, "fc1-Dense/MatMul"), _step(prog, "fc2-Dense/MatMul")
    assert [c.kind for c in fc1.sharding.forward_comm] == []
    assert [c.kind for c in fc2.sharding.forward_comm] == ["AllReduce"]
    assert all(not p.steps for s in prog.steps for p in s.in_plans)
    # Rank-dependent facts are computed without MPI, for the last rank too.
    last = device_num - 1
    # fc2.bias is added after fc2's AllReduce: its mp replicas compute the same gradient, so
    # its Mirror sums over the data-parallel ranks only, like every other parameter's.
    dp_group = tuple(range(last % mp, device_num, mp))
    for name in prog.param_layouts:
        assert prog.mirror_group(name, last) == dp_group, name
    bplan = prog.backward_plan()
    bias = bplan.frame.of(prog.param_layouts["_backbone.fc2.bias"])
    assert math.prod(bias.device_matrix[a] for a in bplan.params["_backbone.fc2.bias"]) == dp
    assert prog.param_layouts["_backbone.fc1.weight"].slice_of(last) == (
        (1024 - 1024 // mp, 1024), (0, 32))


@pytest.mark.parametrize(("device_num", "dp", "mp"), [(8, 2, 4), (64, 8, 8)])
def test_lower_megatron_gpt_shards_every_weight_and_propagates_without_moving(
        device_num: int, dp: int, mp: int) -> None:
    cell, gpt, loss = _gpt_cell()
    presets.megatron_gpt(gpt, dp, mp, loss)
    prog = build_program(_trace_gpt(cell), device_num, SEMI, ((dp, 1), (dp, 1)), cell=cell)
    local = {k.removeprefix("_backbone."): lay.local_shape()
             for k, lay in prog.param_layouts.items()}
    assert local["embedding.embedding_table"] == (128 // mp, 64)
    assert local["head.weight"] == (128 // mp, 64)
    assert local["block1.attn.q.weight"] == (64 // mp, 64)
    assert local["block1.attn.proj.weight"] == (64, 64 // mp)
    assert local["block0.ffn.fc1.weight"] == (256 // mp, 64)
    assert local["block0.ffn.fc2.weight"] == (64, 256 // mp)
    assert local["position"] == local["ln_f.gamma"][:0] + (32, 64)
    # The ops left unannotated (LayerNorms, Reshapes, Transposes, GeLU, residual Adds) take
    # the layout their producers give them: none of them redistributes.
    propagated = [s for s in prog.steps if s.chosen == "propagated"]
    assert len(propagated) > 40
    moved = [s.node.name for s in propagated if any(p.steps for p in s.in_plans)]
    assert moved == []
    ce = _step(prog, "SparseSoftmaxCrossEntropyWithLogits")
    assert ce.chosen == "annotated" and ce.sharding.strategy == ((dp, mp), (dp,))


def test_lowering_does_not_start_mpi() -> None:
    """Plan 8, 64 and 1024 devices in a fresh interpreter and check mpi4py never loaded."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from simpar import graph, nn
        from simpar.nn import presets
        from simpar.runtime import build_program
        for n, dp, mp in ((8, 2, 4), (64, 8, 8), (1024, 8, 128)):
            mlp = nn.MLP(32, 1024, 128, dtype=np.float64)
            presets.megatron_mlp(mlp, dp, mp)
            cell = nn.WithLossCell(mlp, nn.SoftmaxCrossEntropyWithLogits())
            cell.name_parameters()
            g = graph.trace(cell, [((64, 32), np.float64), ((64,), np.int32)])
            prog = build_program(g, n, "semi_auto_parallel", ((dp, 1), (dp,)), cell=cell)
            str(prog)
            prog.comm_table(n - 1)
        print("mpi4py loaded:", "mpi4py.MPI" in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_",
                                                                    "MPI_", "HYDRA_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "mpi4py loaded: False"


def test_print_program_lists_layouts_strategies_and_collectives() -> None:
    cell = _mlp_cell()
    presets.megatron_mlp(cell._backbone, 2, 4)  # type: ignore[arg-type]
    prog = build_program(_trace_mlp(cell), 8, SEMI, "data_parallel", cell=cell)
    text = str(prog)
    lines = text.splitlines()
    assert lines[0] == "ParallelProgram: semi_auto_parallel, 8 devices, 6 ops, 4 parameters"
    assert "  input data[8, 16]: [8]:[0,-1] [8, 16]" in lines
    assert ("  param _backbone.fc1.weight[32, 16]: [2, 1, 4]:[0,1] [32, 16]  Mirror AllReduce "
            "over 2 ranks") in lines
    assert any(line.startswith("  [0] MatMul [[2, 1], [4, 1]] (annotated) dev[2, 1, 4]  "
                               "Default/network-WithLossCell/_backbone-MLP/fc1-Dense/MatMul-op0")
               for line in lines)
    assert any(line.startswith("  [2] ReLU [[2, 4]] (propagated)") for line in lines)
    # The data arrive split 8 ways over the batch; fc1 wants them split 2 ways.
    assert any("redistribute input 0: [8]:[0,-1] [8, 16] -> [2, 1, 4]:[2,1] [8, 16]: AllGather"
               in line for line in lines)
    assert text.count("forward comm: AllReduce") >= 1
    assert sum(line.strip().startswith("out:") for line in lines) == 6
    rows = prog.comm_table()
    assert [r["forward"] for r in rows][3] == ["AllReduce"]
    assert rows[0]["redistribution"] == ["AllGather"]
    assert prog.strategies()[rows[0]["op"]] == [[2, 1], [4, 1]]


def test_a_search_mode_without_a_planner_is_not_implemented_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every MindSpore search_mode has a planner; a name registered without one (a search
    being written) fails clearly, before anything runs."""
    monkeypatch.setattr(context, "_SEARCH_MODES", list(context._SEARCH_MODES))
    context.register_search_mode("search_under_construction")
    g = _trace_mlp(_mlp_cell())
    with pytest.raises(NotImplementedError, match="auto_parallel.*not implemented.*"
                       "search_under_construction.*implemented: .*recursive_programming"):
        plan_strategies(g, 8, "auto_parallel", search_mode="search_under_construction")
    for mode in ("recursive_programming", "dynamic_programming", "sharding_propagation"):
        smap = plan_strategies(g, 8, "auto_parallel", search_mode=mode)
        assert set(smap.ops) == {n.name for n in g.nodes}


def test_lower_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match=r"mode must be one of .*'semi_auto_parallel'.* got "
                                         r"'hybrid_parallel'"):
        build_program(_trace_mlp(_mlp_cell()), 8, "hybrid_parallel")


# ------------------------------------------------------------------ propagation and modes
def test_op_after_a_column_parallel_matmul_keeps_its_layout() -> None:
    dense = nn.Dense(16, 32, has_bias=False, activation="relu", dtype=np.float64)
    dense.matmul.shard(((1, 1), (8, 1)))
    g = graph.trace(dense, [((BATCH, 16), np.float64)])
    prog = build_program(g, 8, SEMI, "full_batch")
    matmul, relu = prog.steps
    assert (matmul.chosen, relu.chosen) == ("annotated", "propagated")
    assert relu.sharding.strategy == ((1, 8),)
    assert [p.steps for p in relu.in_plans] == [()]
    # The same shard on every rank (the device matrices may be written differently).
    src, dst = matmul.sharding.out, relu.sharding.in_layouts[0]
    assert [src.slice_of(r) for r in range(8)] == [dst.slice_of(r) for r in range(8)]
    assert relu.sharding.out.cuts == (1, 8) and relu.sharding.out.local_shape() == (BATCH, 4)
    assert relu.sharding.forward_comm == [] and matmul.sharding.forward_comm == []


def test_data_parallel_mode_keeps_parameters_replicated_even_when_ops_are_sharded() -> None:
    cell, gpt, loss = _gpt_cell()
    presets.megatron_gpt(gpt, 2, 4, loss)  # ignored outside semi_auto_parallel
    prog = build_program(_trace_gpt(cell), 8, "data_parallel", cell=cell)
    assert {s.chosen for s in prog.steps} == {"data_parallel"}
    for name, lay in prog.param_layouts.items():
        assert lay.local_shape() == lay.shape, name
        assert prog.mirror_group(name, 3) == tuple(range(8)), name
    assert [lay.local_shape() for lay in prog.input_layouts()] == [(1, 32), (1, 32)]
    moved = [s.node.name for s in prog.steps if any(p.steps for p in s.in_plans)]
    assert moved == []
    for mode in ("stand_alone", "data_parallel"):
        mlp_prog = build_program(_trace_mlp(_mlp_cell()), 8, mode)
        assert all(lay.local_shape() == lay.shape for lay in mlp_prog.param_layouts.values())
    assert build_program(_trace_mlp(_mlp_cell()), 8, "stand_alone").device_num == 1


def test_cell_shard_in_strategy_inserts_a_redistribution() -> None:
    cell = _mlp_cell()
    mlp = cell._backbone
    mlp.fc2.shard(((1, 8),))  # type: ignore[attr-defined]
    g = _trace_mlp(cell)
    ident = [n for n in g.nodes if n.op.name == "Identity"]
    assert len(ident) == 1 and "fc2-Dense" in ident[0].name
    assert ident[0].op.in_strategy == ((1, 8),)
    prog = build_program(g, 8, SEMI, "data_parallel", True, cell=cell)
    step = next(s for s in prog.steps if s.node is ident[0])
    assert step.chosen == "annotated"
    assert step.sharding.out.cuts == (1, 8)
    # One AllToAll turns fc1's batch-split output into fc2's column split. Propagation runs
    # backward from the annotated Identity too, so fc1's ReLU already takes its layout and
    # the move sits at the ReLU's input: the same bytes, one edge earlier.
    moves = [(s.node.name.split("/")[-1], str(st.kind)) for s in prog.steps
             for p in s.in_plans for st in p.steps if not st.kind.local]
    assert moves == [("ReLU-op2", "AllToAll")], moves
    mlp.fc1.shard(((1, 8, 1),))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"Dense.shard: in_strategy \(1, 8, 1\) for input 0 "
                                         r"must have one cut per dimension of \(8, 16\)"):
        _trace_mlp(cell)


def test_parameter_plan_sets_the_layout_of_a_parameter() -> None:
    cell = _mlp_cell()
    cell._backbone.fc1.shard(None, parameter_plan={"weight": (4, 1)})  # type: ignore[attr-defined]
    prog = build_program(_trace_mlp(cell), 8, SEMI, "full_batch", cell=cell)
    lay = prog.param_layouts["_backbone.fc1.weight"]
    assert lay.cuts == (4, 1) and lay.local_shape() == (8, 16)
    matmul = _step(prog, "fc1-Dense/MatMul")
    assert matmul.chosen == "propagated" and matmul.sharding.strategy[1] == (4, 1)
    # Without the plan the same op lays the weight out otherwise.
    plain = _mlp_cell()
    free = build_program(_trace_mlp(plain), 8, SEMI, "full_batch", cell=plain)
    assert free.param_layouts["_backbone.fc1.weight"].cuts != (4, 1)


# ------------------------------------------------------------------ dataset layouts
def test_dataset_strategies() -> None:
    full = dataset_layouts([(8, 16), (8,)], 8, "full_batch")
    assert [lay.local_shape() for lay in full] == [(8, 16), (8,)]
    dp = dataset_layouts([(8, 16), (8,)], 8, "data_parallel")
    assert [lay.local_shape() for lay in dp] == [(1, 16), (1,)]
    two = dataset_layouts([(8, 16), (8,)], 8, ((2, 1), (2,)))
    assert [lay.local_shape() for lay in two] == [(4, 16), (4,)]
    assert two[0].replica_group(0) == (0, 1, 2, 3)  # repetition on the right


@pytest.mark.parametrize(("strategy", "match"), [
    (((2, 1),), "has no entry for input 1"),
    (((2, 1, 1), (2,)), r"entry \(2, 1, 1\) for input 0 of shape \(8, 16\) must have one cut "
                        "per dimension"),
    (((3, 1), (3,)), r"entry \(3, 1\) .* use a divisor of device_num 8"),
])
def test_bad_dataset_strategy_entries(strategy: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataset_layouts([(8, 16), (8,)], 8, strategy)


def test_data_parallel_batch_must_split_over_the_devices() -> None:
    with pytest.raises(ValueError, match=r"input 0 of shape \(6, 16\) has batch 6, which does "
                                         "not split over 8 devices"):
        build_program(_trace_mlp(_mlp_cell(), batch=6), 8, "data_parallel")


def test_context_rejects_bad_dataset_strategy_types() -> None:
    with pytest.raises(TypeError, match="dataset_strategy"):
        simpar.set_auto_parallel_context(dataset_strategy=[[2, 1], [2]])
    with pytest.raises(ValueError, match="dataset_strategy.*cut 0 is not positive"):
        simpar.set_auto_parallel_context(dataset_strategy=((0, 1), (2,)))
    with pytest.raises(ValueError, match="dataset_strategy"):
        simpar.set_auto_parallel_context(dataset_strategy="model_parallel")


# ------------------------------------------------------------------ the single-device runtime
def test_stand_alone_loss_equals_the_eager_forward_and_gradients_are_exact() -> None:
    """The traced, lowered program on one device computes what the eager Cell computes, and
    its backward matches central finite differences."""
    cell = _mlp_cell()
    x, y = random_classification(0, BATCH, 16, 8, dtype=np.float64)
    train = nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), 1e-12),
                                parallel_mode="stand_alone", seed=0)
    train.build(x, y)
    params = {k: v.copy() for k, v in train.params.items()}
    for p in cell.get_parameters():  # eager uses Parameter.data, the seed-0 value
        np.testing.assert_array_equal(p.data, params[p.name])
    eager = float(cell(x, y))
    outs, tape = train.program.forward([x, y], params)  # type: ignore[union-attr]
    assert float(outs[0]) == pytest.approx(eager, rel=1e-14)
    grads = train.program.backward(tape, [np.ones(())])  # type: ignore[union-attr]
    rng = np.random.default_rng(0)
    for name in ("_backbone.fc1.weight", "_backbone.fc2.bias"):
        for _ in range(3):
            idx = tuple(int(rng.integers(n)) for n in params[name].shape)
            h = 1e-6
            plus, minus = ({**params, name: params[name].copy()} for _ in range(2))
            plus[name][idx] += h
            minus[name][idx] -= h
            lp = float(train.program.forward([x, y], plus)[0][0])  # type: ignore[union-attr]
            lm = float(train.program.forward([x, y], minus)[0][0])  # type: ignore[union-attr]
            assert grads[name][idx] == pytest.approx((lp - lm) / (2 * h), rel=1e-6, abs=1e-10)


def test_stand_alone_training_lowers_the_loss_and_takes_local_slices() -> None:
    cell = _mlp_cell()
    train = nn.TrainOneStepCell(cell, nn.Momentum(cell.trainable_params(), 0.5),
                                parallel_mode="stand_alone", seed=3)
    losses = [train(*random_classification(k % 2, 32, 16, 8, dtype=np.float64))
              for k in range(30)]
    assert losses[-1] < 0.8 * losses[0]
    assert train.step_count == 30 and train.program is not None
    assert train.program.device_num == 1 and train.loss_seed() == 1.0
    assert set(train.global_parameters()) == set(train.params)
    with pytest.raises(ValueError, match=r"input of shape \(5, 16\) is neither the global batch "
                                         r"\(32, 16\) nor this rank's slice"):
        train(np.zeros((5, 16)), np.zeros(5, np.int32))


def test_initial_values_depend_on_seed_and_name_only() -> None:
    a, b = _mlp_cell(), _mlp_cell()
    pa, pb = dict(a.parameters_and_names()), dict(b.parameters_and_names())
    for name in pa:
        np.testing.assert_array_equal(pa[name].initial_value(5), pb[name].initial_value(5))
    w = pa["_backbone.fc1.weight"]
    assert not np.array_equal(w.initial_value(5), w.initial_value(6))
    other = nn.Parameter(nn.initializer("normal", w.shape, np.float64), name="other")
    assert not np.array_equal(w.initial_value(5), other.initial_value(5))
    assert np.all(pa["_backbone.fc1.bias"].initial_value(5) == 0)


def test_training_needs_every_trainable_parameter_in_the_optimizer() -> None:
    cell = _mlp_cell()
    some = [p for p in cell.trainable_params() if "fc1" in p.name]
    train = nn.TrainOneStepCell(cell, nn.SGD(some), parallel_mode="stand_alone")
    with pytest.raises(ValueError, match=r"parameter _backbone.fc2.weight is trainable but not "
                                         "in the optimizer's params"):
        train.build(np.zeros((BATCH, 16)), np.zeros(BATCH, np.int32))


# ------------------------------------------------------------------ bad input
def _params() -> list[nn.Parameter]:
    return nn.Dense(2, 2).trainable_params()


BadInput = tuple[Callable[[], object], type[Exception], str]

BAD_TRAIN: list[BadInput] = [
    (lambda: nn.TrainOneStepCell("net", nn.SGD(_params())), TypeError,  # type: ignore[arg-type]
     "TrainOneStepCell: network must be a Cell, got str"),
    (lambda: nn.TrainOneStepCell(nn.Dense(2, 2), "sgd"), TypeError,  # type: ignore[arg-type]
     "TrainOneStepCell: optimizer must be a simpar.nn Optimizer, got str"),
    (lambda: nn.TrainOneStepCell(nn.Dense(2, 2), nn.SGD(_params()), sens="1"), TypeError,  # type: ignore[arg-type]
     "TrainOneStepCell: sens must be a number, got '1'"),
    (lambda: nn.TrainOneStepCell(nn.Dense(2, 2), nn.SGD(_params()), parallel_mode="model"),
     ValueError, "TrainOneStepCell: parallel_mode must be None .* got 'model'"),
    (lambda: nn.TrainOneStepCell(nn.Dense(2, 2), nn.SGD(_params()), seed=-1), ValueError,
     "TrainOneStepCell: seed must be None .* an int >= 0, got -1"),
]

BAD_OPTIMIZER: list[BadInput] = [
    (lambda: nn.SGD([]), TypeError, "params must be a non-empty list of Parameters"),
    (lambda: nn.SGD(nn.Dense(2, 2)), TypeError,  # type: ignore[arg-type]
     r"params must be a non-empty list of Parameters \(cell.trainable_params\(\)\), got Dense"),
    (lambda: nn.SGD([np.zeros(2)]), TypeError, "params must be a non-empty list of Parameters"),  # type: ignore[list-item]
    (lambda: nn.SGD(_params(), learning_rate=0), ValueError, "learning_rate must be > 0, got 0"),
    (lambda: nn.SGD(_params(), learning_rate="0.1"), TypeError,  # type: ignore[arg-type]
     "learning_rate must be a number, got '0.1'"),
    (lambda: nn.SGD(_params(), learning_rate=True), TypeError, "learning_rate must be a number"),
    (lambda: nn.SGD(_params(), weight_decay=-0.1), ValueError,
     "weight_decay must be >= 0, got -0.1"),
    (lambda: nn.Momentum(_params(), momentum=-0.9), ValueError, "momentum must be >= 0"),
    (lambda: nn.Momentum(_params(), momentum=None), TypeError, "momentum must be a number"),  # type: ignore[arg-type]
    (lambda: nn.Adam(_params(), beta1=1.0), ValueError, r"Adam: beta1 must be in \[0, 1\), got"),
    (lambda: nn.Adam(_params(), beta2="x"), TypeError, "Adam: beta2 must be a number"),  # type: ignore[arg-type]
    (lambda: nn.Adam(_params(), eps=0), ValueError, "eps must be > 0, got 0"),
    (lambda: nn.AdamW(_params(), weight_decay=-1), ValueError, "weight_decay must be >= 0"),
]

BAD_LAYERS: list[BadInput] = [
    (lambda: nn.Dense(4, 4, activation="sigmoid"), ValueError,
     "Dense: activation must be None, 'relu', 'gelu' or 'tanh', got 'sigmoid'"),
    (lambda: nn.Dense(0, 4), ValueError, "Dense: in_channels must be an int >= 1, got 0"),
    (lambda: nn.Dense(4, 2.5), TypeError, "Dense: out_channels must be an int >= 1, got float"),  # type: ignore[arg-type]
    (lambda: nn.Dense(4, 4, has_bias="yes"), TypeError, "Dense: has_bias must be a bool"),  # type: ignore[arg-type]
    (lambda: nn.Embedding(0, 8), ValueError, "Embedding: vocab_size must be an int >= 1"),
    (lambda: nn.LayerNorm(8), TypeError, r"LayerNorm: normalized_shape must be a non-empty "  # type: ignore[arg-type]
                                         r"tuple of ints, e.g. \(d_model,\), got 8"),
    (lambda: nn.LayerNorm((8,), epsilon=-1.0), ValueError, "epsilon must be a finite float"),
    (lambda: nn.Dropout(0.0), ValueError, r"Dropout: keep_prob must be in \(0, 1\], got 0.0"),
    (lambda: nn.Dropout("0.5"), TypeError, "Dropout: keep_prob must be a float"),  # type: ignore[arg-type]
    (lambda: nn.MLP(4, 8, 2, n_hidden=0), ValueError, "MLP: n_hidden must be an int >= 1"),
    (lambda: nn.FeedForward(8, 0), ValueError, "FeedForward: d_ff must be an int >= 1"),
    (lambda: nn.MultiHeadAttention(64, 0, 8), ValueError,
     "MultiHeadAttention: n_heads must be an int >= 1, got 0"),
    (lambda: nn.MultiHeadAttention(64, 3, 8), ValueError,
     "MultiHeadAttention: d_model 64 must be divisible by n_heads 3"),
    (lambda: nn.GPT(n_layers=0), ValueError, "GPT: n_layers must be an int >= 1, got 0"),
    (lambda: nn.GPT(vocab_size="128"), TypeError, "GPT: vocab_size must be an int >= 1"),  # type: ignore[arg-type]
    (lambda: nn.SoftmaxCrossEntropyWithLogits(sparse=1), TypeError,  # type: ignore[arg-type]
     "sparse must be a bool, got 1"),
    (lambda: nn.SoftmaxCrossEntropyWithLogits(reduction="max"), ValueError,
     "reduction must be 'mean' or 'sum', got 'max'"),
    (lambda: nn.initializer("he", (2, 2)), ValueError,
     "initializer: kind must be normal, uniform, xavier_uniform, he_uniform, zeros or ones, "
     "got 'he'"),
    (lambda: nn.Parameter(np.zeros(3, np.int64)), TypeError,
     "Parameter: the value must be floating point"),
    (lambda: nn.Parameter(np.zeros(3), name="p").set_data(np.zeros(4)), ValueError,
     r"Parameter p: set_data got shape \(4,\), expected \(3,\)"),
    (lambda: nn.Dense(2, 2).shard(5), TypeError,  # type: ignore[arg-type]
     r"For 'Shard', the 'in_strategy' should be a tuple, but got int \(Dense.shard: 5\)"),
    (lambda: nn.Dense(2, 2).shard([(1, 1)]), TypeError,
     "For 'Shard', the 'in_strategy' should be a tuple, but got list"),
    (lambda: nn.Dense(2, 2).shard(([1, 1],)), TypeError,
     r"The 'in_strategy' should be a tuple\(tuple\(int\)\), but got list"),
    (lambda: nn.Dense(2, 2).shard(((1, "2"),)), TypeError,
     r"The tuple strategy for each dimension should be tuple\(int\)"),
    (lambda: nn.Dense(2, 2).shard(((1, 1),), out_strategy=[(1, 1)]), TypeError,
     "the 'out_strategy' should be None or tuple, but got list"),
    (lambda: nn.Dense(2, 2).shard(((1, 1),), parameter_plan=[("weight", (2, 1))]), TypeError,
     "the 'parameter_plan' should be a dict or None, but got list"),
    (lambda: nn.Dense(2, 2).shard(((1, 1),), parameter_plan={"weight": [2, 1]}), TypeError,
     "the type of each key and value in 'parameter_plan' must be str and tuple, but got str "
     "and list"),
    (lambda: presets.apply("pipeline", nn.MLP(2, 2, 2), 8), ValueError,
     r"strategy preset must be one of \['dp', 'mp', 'hybrid'\], got 'pipeline'"),
    (lambda: presets.apply("mp", nn.Dense(2, 2), 8), TypeError,
     "presets know GPT and MLP models, got Dense"),
]


def _bad_id(case: BadInput) -> str:
    return case[2].split(":")[0][:40].replace(" ", "_")


@pytest.mark.parametrize(("make", "error", "match"), BAD_TRAIN + BAD_OPTIMIZER + BAD_LAYERS,
                         ids=[_bad_id(c) for c in BAD_TRAIN + BAD_OPTIMIZER + BAD_LAYERS])
def test_bad_input_names_the_parameter_and_the_value(make: Any, error: type,
                                                     match: str) -> None:
    with pytest.raises(error, match=match):
        make()


class _NoSuper(nn.Cell):
    def __init__(self) -> None:
        self.w = nn.Parameter(np.zeros(2))


def test_cell_without_super_init_fails_clearly() -> None:
    with pytest.raises(RuntimeError, match=r"_NoSuper: call super\(\).__init__\(\) before"):
        _NoSuper()


BAD_STRATEGIES = [
    (((2, 1), (3, 1)), r"MatMul: strategy \(3, 1\) for input 1 cuts dimension 0 of shape "
                       r"\(32, 16\) into 3 parts, but 32 is not divisible by 3"),
    (((4, 1), (4, 1)), r"MatMul: strategy \(\(4, 1\), \(4, 1\)\) uses 16 devices, which does "
                       "not divide device_num 8"),
    (((2, 2), (4, 1)), "MatMul: Strategies of relevant dimensions are not equal: input 0 dim 1 "
                       "is cut 2 but input 1 dim 1 is cut 1"),
]


@pytest.mark.parametrize(("strategy", "match"), BAD_STRATEGIES,
                         ids=["indivisible", "too-many-devices", "k-cuts-differ"])
def test_strategy_that_does_not_fit_the_op_fails_at_lowering(strategy: Any, match: str) -> None:
    cell = _mlp_cell()
    cell._backbone.fc1.matmul.shard(strategy)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=match):
        build_program(_trace_mlp(cell), 8, SEMI, cell=cell)


def test_strategy_with_the_wrong_number_of_inputs_fails_at_shard() -> None:
    with pytest.raises(ValueError, match="MatMul: the strategy has 3 entries but the operator "
                                         "has 2 inputs"):
        ops.MatMul().shard(((2, 1), (4, 1), (1,)))


def test_tracing_a_cell_names_its_parameters_and_duplicate_names_are_refused() -> None:
    """Parameters are keyed by name from the strategy map to the program: tracing a Cell
    gives them their dotted paths; two parameters of one name would share a layout, so
    tracing refuses them, naming the name."""
    mlp = nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64)
    g = graph.trace(mlp, [((BATCH, 16), np.float64)])
    assert [v.name for v in g.params] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    a = nn.Parameter(np.ones((4, 4)), name="w")
    b = nn.Parameter(np.ones((4, 4)), name="w")
    with pytest.raises(ValueError, match="two Parameters are named 'w'"):
        graph.trace(lambda x: ops.MatMul()(ops.MatMul()(x, a), b), [((4, 4), np.float64)])


def test_a_cells_out_strategy_is_ignored_with_a_warning() -> None:
    from simpar.context import NotHonouredWarning

    with pytest.warns(NotHonouredWarning, match="out_strategy is not in use, and is ignored"):
        cell = nn.Dense(2, 2).shard(((1, 1),), out_strategy=((1, 1),))
    assert cell.in_strategy == ((1, 1),)


def test_a_cell_strategy_gives_one_entry_per_input() -> None:
    cell = nn.Dense(4, 4).shard(((2, 1), (2, 1)))
    with pytest.raises(ValueError, match="in_strategy has 2 entries but construct got 1 "
                                         "inputs: give one per input"):
        graph.trace(cell, [((8, 4), np.float32)])


def test_identical_layers_share_one_derived_sharding_each_with_its_own_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An op's sharding is derived once per (type, attributes, shapes, strategy) (the op's
    memo): the GPT's second block reuses the first's, and every step's sharding names its
    own op."""
    from simpar.ops import _base
    cell, gpt, loss = _gpt_cell()
    presets.megatron_gpt(gpt, 2, 4, loss)
    traced = _trace_gpt(cell)
    smap = plan_strategies(traced, 8, SEMI, ((2, 1), (2, 1)), False, parameter_plans(cell))
    monkeypatch.setattr(_base, "_SHARDINGS", {})
    prog = lower(traced, smap)
    derived = len(_base._SHARDINGS)
    monkeypatch.undo()
    assert all(s.sharding.op is s.node.op for s in prog.steps)
    assert derived < len(prog.steps) - 20
    again = {s.node.name: s.node.op._sharding(
        tuple(tuple(v.shape) for v in s.node.inputs), s.sharding.strategy,
        s.node.op.out_strategy, 8) for s in prog.steps}
    assert all(again[s.node.name] == s.sharding for s in prog.steps)
