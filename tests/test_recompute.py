"""Recomputation (MindSpore's ``Cell.recompute()``) in one process: what tracing records, the
gradients (bitwise those without), what the forward keeps (a recomputed block's input only),
the backward's schedule (the Cell's forward collectives again, before its VJPs) and the cost
model's activation memory. The runs on 2, 4 and 8 ranks are in
tests/test_optimizer_parallel_mpi.py.

    python -m pytest -q -p no:cacheprovider tests/test_recompute.py
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from simpar import context, graph, nn
from simpar.dataset import CharCorpus
from simpar.nn import presets
from simpar.runtime import lower
from simpar.runtime.program_schedule import Role
from simpar.search import plan_request, request_from_context

B, T, D = 4, 8, 16


@pytest.fixture(autouse=True)
def _fresh_context() -> Any:
    context.reset_auto_parallel_context()
    yield
    context.reset_auto_parallel_context()


def _gpt(recompute: bool = False, dropout: float = 0.0, **kwargs: bool) -> nn.Cell:
    gpt = nn.GPT(128, T, D, 2, 2, dtype=np.float64, dropout=dropout)
    if recompute:
        for block in gpt.blocks:
            block.recompute(**kwargs)
    return nn.WithLossCell(gpt, nn.SoftmaxCrossEntropyWithLogits())


def _trace(net: nn.Cell, batch: int = B) -> graph.Graph:
    return graph.trace(net, [((batch, T), np.int32), ((batch, T), np.int32)], ["ids", "labels"])


# ------------------------------------------------------------------ the API and tracing
def test_recompute_checks_its_arguments_as_mindspore_does() -> None:
    cell = nn.Dense(4, 4)
    with pytest.raises(ValueError, match="For 'recompute', keyword 'mp_comm' is not "
                                         "recognized!"):
        cell.recompute(mp_comm=True)
    with pytest.raises(TypeError, match="'mp_comm_recompute' must be bool, but got 1"):
        cell.recompute(mp_comm_recompute=1)
    assert cell.recompute_settings is None
    cell.recompute(mp_comm_recompute=False)
    cell.recompute(parallel_optimizer_comm_recompute=True)   # a second call changes nothing
    assert cell.recompute_settings == (False, False)


def test_tracing_records_each_recomputed_cell_as_a_run_of_its_ops() -> None:
    net = _gpt(recompute=True)
    g = _trace(net)
    names = [seg.name.rsplit("/", 1)[-1] for seg in g.segments]
    assert names == ["block0-TransformerBlock", "block1-TransformerBlock"]
    for seg in g.segments:
        assert seg.nodes == tuple(range(seg.nodes[0], seg.nodes[-1] + 1))
        assert all(g.nodes[i].name.startswith(seg.name + "/") for i in seg.nodes)
        assert seg.mp_comm and not seg.opt_comm
    outside = [n for n in g.nodes if n.segment < 0]
    assert outside and all("block" not in n.name for n in outside)


def test_a_cell_inside_a_recomputed_cell_is_recomputed_with_it() -> None:
    gpt = nn.GPT(128, T, D, 1, 2, dtype=np.float64)
    gpt.blocks[0].recompute()
    gpt.blocks[0].attn.recompute(mp_comm_recompute=False)   # inside: the outer one holds it
    g = _trace(nn.WithLossCell(gpt, nn.SoftmaxCrossEntropyWithLogits()))
    assert len(g.segments) == 1 and g.segments[0].mp_comm


def test_recompute_on_a_cell_the_network_does_not_run_is_refused() -> None:
    gpt = nn.GPT(128, T, D, 1, 2, dtype=np.float64)
    gpt.spare = nn.Dense(4, 4)   # held, never called
    gpt.spare.recompute()
    with pytest.raises(ValueError, match="recompute: the Cell '_backbone.spare' is marked with "
                                         "Cell.recompute\\(\\), but its construct never ran"):
        _trace(nn.WithLossCell(gpt, nn.SoftmaxCrossEntropyWithLogits()))


# ------------------------------------------------------------------ values and memory
def _train(net: nn.Cell) -> nn.TrainOneStepCell:
    return nn.TrainOneStepCell(net, nn.Adam(net.trainable_params(), 1e-3),
                               parallel_mode="stand_alone", seed=2)


@pytest.mark.parametrize("mp_comm", [True, False])
def test_gradients_are_bitwise_those_without_recomputation(mp_comm: bool) -> None:
    corpus = CharCorpus(seed=4)
    plain, again = _train(_gpt(dropout=0.2)), _train(_gpt(True, 0.2, mp_comm_recompute=mp_comm))
    for k in range(3):
        batch = corpus.batch(k, B, T)
        loss, grads = plain.value_and_grad(*batch)
        loss_r, grads_r = again.value_and_grad(*batch)
        assert loss == loss_r
        assert all(np.array_equal(grads[n], grads_r[n]) for n in grads)
        plain.optimizer.step(plain.params, grads)
        again.optimizer.step(again.params, grads_r)


def _held(tape: list[Any], params: dict[str, np.ndarray], consts: list[Any]
          ) -> list[np.ndarray]:
    """The distinct arrays a tape holds that are neither parameters nor the graph's
    constants (the attention mask)."""
    own = {id(p) for p in params.values()} | {id(v.const) for v in consts}
    seen: dict[int, np.ndarray] = {}

    def walk(x: Any) -> None:
        if isinstance(x, np.ndarray):
            base = x if x.base is None else x.base
            if id(x) not in own and id(base) not in own and base.size > 1:
                seen.setdefault(id(base), base)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
    walk(tape)
    return list(seen.values())


def test_a_recomputed_block_keeps_only_its_input() -> None:
    corpus = CharCorpus(seed=4)
    batch = corpus.batch(0, B, T)
    sizes = {}
    for recompute in (False, True):
        train = _train(_gpt(recompute))
        train.build(*batch)
        prog = train.program
        assert prog is not None
        _, tape = prog.forward([np.asarray(x) for x in batch], train.params)
        held = _held(tape, train.params, prog.graph.consts)
        sizes[recompute] = sum(a.nbytes for a in held)
        if recompute:
            kept = tape[len(tape) - len(prog.segments):]   # each block's kept inputs
            for block in kept:
                arrays = _held([block], train.params, prog.graph.consts)
                # The residual stream entering the block: one (B, T, D) array, nothing else.
                assert [a.shape for a in arrays] == [(B, T, D)], [a.shape for a in arrays]
        predicted = prog.cost("cpu-local", "adam").memory[0].activations
        sizes[recompute, "predicted"] = predicted
    assert sizes[True] < sizes[False] / 3
    assert sizes[True, "predicted"] < sizes[False, "predicted"] / 3
    assert abs(sizes[True, "predicted"] / sizes[True] - 1) < 0.15, sizes


# ------------------------------------------------------------------ the schedule
def _hybrid_program(recompute: bool, mp_comm: bool = True) -> Any:
    net = nn.GPT(128, T, D, 2, 2, dtype=np.float64)
    loss = nn.SoftmaxCrossEntropyWithLogits()
    presets.megatron_gpt(net, 2, 2, loss)
    if recompute:
        for block in net.blocks:
            block.recompute(mp_comm_recompute=mp_comm)
    g = _trace(nn.WithLossCell(net, loss), 8)
    context.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                      dataset_strategy=((2, 1), (2, 1)))
    return lower(g, plan_request(request_from_context(g, device_num=4)))


@pytest.mark.parametrize("mp_comm", [True, False])
def test_the_backward_runs_each_blocks_forward_collectives_again_first(mp_comm: bool) -> None:
    plain, again = _hybrid_program(False), _hybrid_program(True, mp_comm)
    for rank in (0, 3):
        fwd = [s for s in plain.schedule(rank) if not s.backward and s.collective]
        bwd_plain = [s for s in plain.schedule(rank) if s.backward and s.collective]
        bwd = [s for s in again.schedule(rank) if s.backward and s.collective]
        in_blocks = [s for s in fwd if "block" in s.op]
        # The recomputation: each block's forward collectives (without its redistributions
        # and output AllReduces when mp_comm_recompute=False), in the backward.
        rerun = [s for s in in_blocks if mp_comm or s.role == Role.OP_COLLECTIVE
                 and "output" not in s.label]
        assert len(bwd) == len(bwd_plain) + len(rerun)
        added = Counter((s.op, s.collective, s.label) for s in bwd)
        added.subtract(Counter((s.op, s.collective, s.label) for s in bwd_plain))
        assert +added == Counter((s.op, s.collective, s.label) for s in rerun)
        # Block 1's forward runs again before any of its VJPs' collectives.
        first = next(s for s in bwd if "block1" in s.op)
        if rerun:
            assert "backward" not in first.label and first.label == next(
                s.label for s in rerun if "block1" in s.op)
