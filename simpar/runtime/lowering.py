"""Lowering a traced graph and its :class:`~simpar.search.StrategyMap` into a per-rank
:class:`~simpar.runtime.program.ParallelProgram`.

Lowering chooses no strategy: every op's strategy, every parameter's and graph input's
layout come from the strategy map (``simpar.search`` plans it;
:meth:`~simpar.search.StrategyMap.complete` lays out the parameters it leaves open).
Lowering derives every value's layout from them, plans a redistribution on every edge whose
producer layout differs from what the consumer's rule needs, and plans the backward once,
when it is first read (:func:`~simpar.runtime.backward_plan.plan_backward`): every
trainable parameter gets its gradient completed by one AllReduce over the ranks its
gradient is pending on (MindSpore's Mirror).
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from simpar.graph import Graph
from simpar.layout import TensorLayout
from simpar.optimizer_parallel import ParamShard, slice_layout
from simpar.redistribution import plan
from simpar.runtime.backward_plan import BackwardPlans
from simpar.runtime.lowered import LoweredGraph, OpStep, Segment
from simpar.runtime.program import IndexLimits, ParallelProgram
from simpar.runtime.runner import ProgramRunner, Seeds, seeds_of
from simpar.search import StrategyMap, parameter_plans, plan_strategies

__all__ = ["NothingParallelWarning", "build_program", "lower"]

#: Up to this many graph outputs, lowering plans the backward of every set of seeded
#: outputs; beyond, of all outputs seeded only (unless ``seeds`` names others).
EVERY_SEED_SET_UP_TO = 4


def lower(graph: Graph, strategy_map: StrategyMap, enable_alltoall: bool = False,
          seeds: Iterable[Sequence[bool]] | None = None) -> ParallelProgram:
    """The per-rank program of ``graph`` under ``strategy_map`` (pure: no MPI).

    Every node must have a strategy in the map. A parameter the map gives no layout takes
    the layout its first consumer's strategy needs, one no op reads stays whole
    (:meth:`StrategyMap.complete`); a graph input without one is held whole by every rank
    (``full_batch``). The backward is planned for each set of seeded outputs in ``seeds``,
    the first time the program reads it (one flag per graph output; default: every set when
    the graph has at most :data:`EVERY_SEED_SET_UP_TO` outputs, else all outputs seeded)."""
    if not isinstance(strategy_map, StrategyMap):
        raise TypeError(f"lower: strategy_map must be a simpar.search.StrategyMap, got "
                        f"{type(strategy_map).__name__}")
    smap, device_num = strategy_map, strategy_map.device_num
    missing = [n.name for n in graph.nodes if n.name not in smap.ops]
    if missing:
        raise ValueError(f"lower: the strategy map has no strategy for {len(missing)} ops, "
                         f"e.g. {missing[:2]} (planned for another graph?); plan this graph "
                         "with simpar.search.plan_strategies")
    names = {n.name for n in graph.nodes}
    stray = [name for name in smap.ops if name not in names]
    if stray:
        raise ValueError(f"lower: the strategy map names {len(stray)} ops this graph does not "
                         f"have, e.g. {stray[:2]} (planned for another graph?)")
    shardings = []
    for node in graph.nodes:
        chosen = smap.ops[node.name]
        if chosen.op_type != node.op.name:
            raise ValueError(f"lower: {node.name} is a {node.op.name}, but the strategy map "
                             f"holds a {chosen.op_type} strategy for it")
        # (equal ops on equal shapes under equal strategies are derived once: the op's memo)
        shardings.append(node.op.sharding([v.shape for v in node.inputs], device_num,
                                          chosen.in_strategy, chosen.out_strategy,
                                          enable_alltoall))
    params = dict(smap.complete(graph, [sh.in_layouts for sh in shardings]).params)
    layouts: dict[int, TensorLayout] = {
        v.id: smap.inputs.get(v.name) or TensorLayout((device_num,), [-1] * v.ndim, v.shape)
        for v in graph.inputs}
    layouts.update((v.id, params[v.name]) for v in graph.params)
    for v in graph.consts:
        layouts[v.id] = TensorLayout((device_num,), [-1] * v.ndim, v.shape)
    steps: list[OpStep] = []
    for node, sh in zip(graph.nodes, shardings):
        in_plans = tuple(plan(layouts[v.id], need, enable_alltoall)
                         for v, need in zip(node.inputs, sh.in_layouts))
        for v, (_, out, _) in zip(node.outputs, sh.outputs):
            layouts[v.id] = out
        steps.append(OpStep(node, sh, in_plans, smap.ops[node.name].source, sh.repeat))
    needs = {v.id for v in graph.params if v.param is not None and v.param.requires_grad}
    needs.update(graph.grad_inputs)
    for node in graph.nodes:
        if any(v.id in needs for v in node.inputs):
            needs.update(v.id for v in node.outputs)
    grad_nodes = frozenset(n.id for n in graph.nodes if any(v.id in needs for v in n.inputs))
    shards = _check_shards(smap, params)
    gathers = {name: plan(shard.layout, params[name], enable_alltoall)
               for name, shard in shards.items()}
    lowered = LoweredGraph(graph, device_num, tuple(steps), layouts, params,
                           {v.name: v for v in graph.params}, frozenset(needs),
                           enable_alltoall, grad_nodes, shards, gathers, smap.micro_batches,
                           _segments(graph, smap), smap.comm_fusion)
    _check_updates(lowered)
    plans = _backward_plans(lowered, seeds)
    program = ParallelProgram(
        **{f.name: getattr(lowered, f.name) for f in dataclasses.fields(lowered)},
        mode=smap.mode, strategy_map=smap, backward_plans=plans,
        index_limits=_index_limits(lowered), runner=ProgramRunner(lowered, plans))
    _warn_if_nothing_is_parallel(program)
    return program


def _check_updates(lowered: LoweredGraph) -> None:
    """Each value the forward writes into a parameter (``graph.updates``) is laid out as the
    parameter is stored, so every rank folds its own shard in with nothing moved: a
    BatchNorm's statistics are cut as its scale, which is how its moving statistics, read by
    it alone and never sliced for the optimizer (they are not trained), are stored."""
    for update in lowered.graph.updates:
        have = lowered.layouts[update.value]
        want = lowered.storage_layout(update.param)
        if have != want:
            raise ValueError(f"lower: {update.param} is stored as {want}, but the value the "
                             f"forward writes into it is laid out as {have}; the op that "
                             "writes it must read it as it is stored")


def _segments(graph: Graph, smap: StrategyMap) -> tuple[Segment, ...]:
    """The map's recomputed Cells as runs of the program's steps (a node's step is its
    index: the steps are the nodes in trace order)."""
    by_name = {seg.name: seg for seg in graph.segments}
    out = []
    for name in smap.recompute:
        seg = by_name.get(name)
        if seg is None:
            raise ValueError(f"lower: the strategy map recomputes {name!r}, which is no "
                             f"recomputed Cell of this graph ({sorted(by_name) or 'none'})")
        if not seg.nodes:
            continue   # a Cell that recorded no op: nothing to run again
        first, last = seg.nodes[0], seg.nodes[-1]
        assert seg.nodes == tuple(range(first, last + 1)), name   # a Cell's ops are a run
        out.append(Segment(name, first, last, seg.mp_comm, seg.opt_comm))
    return tuple(out)


def _check_shards(smap: StrategyMap, params: Mapping[str, TensorLayout]
                  ) -> dict[str, ParamShard]:
    """The map's optimizer shards, each checked to slice its parameter's layout as
    :func:`~simpar.optimizer_parallel.slice_layout` does."""
    for name, shard in smap.shards.items():
        if name not in params:
            raise ValueError(f"lower: the strategy map slices parameter {name!r} for the "
                             "optimizer, but the graph has no such parameter")
        expected = slice_layout(params[name], shard.size)
        if shard.layout != expected:
            raise ValueError(f"lower: parameter {name}'s optimizer shard {shard.layout} is not "
                             f"its layout {params[name]} sliced over {shard.size} ranks "
                             f"({expected}); plan it with simpar.search.shard_optimizer")
    return dict(smap.shards)


def _backward_plans(lowered: LoweredGraph, seeds: Iterable[Sequence[bool]] | None
                    ) -> BackwardPlans:
    """The backward plan of each set of seeded outputs (:func:`lower`'s ``seeds``), each
    planned when first read."""
    n = len(lowered.graph.outputs)
    if seeds is None:
        keys: list[Seeds] = (list(itertools.product((True, False), repeat=n))
                             if n <= EVERY_SEED_SET_UP_TO else [seeds_of(None, n)])
    else:
        keys = [seeds_of(s, n) for s in seeds]
        bad = [list(k) for k in keys if len(k) != n]
        if bad:
            raise ValueError(f"lower: each entry of seeds needs one flag per graph output "
                             f"({n}), got {bad[0]}")
    return BackwardPlans(lowered, keys)


def _index_limits(lowered: LoweredGraph) -> IndexLimits:
    """Per graph input, the ops that read it as indices, directly or through ops that only
    move values (Reshape, Transpose, Split): ``(op, position, limit)``."""
    readers: dict[int, list[tuple[OpStep, int]]] = {}
    for s in lowered.steps:
        for k, v in enumerate(s.node.inputs):
            readers.setdefault(v.id, []).append((s, k))
    out = []
    for v in lowered.graph.inputs:
        found, todo, seen = [], [v.id], set()
        while todo:
            vid = todo.pop()
            seen.add(vid)
            for s, k in readers.get(vid, []):
                limit = s.node.op.index_limit(k, s.sharding.input_shapes)
                if limit is not None:
                    found.append((s.node.op, k, limit))
                elif s.node.op.moves_values:
                    todo += [o.id for o in s.node.outputs if o.id not in seen]
        out.append(tuple(found))
    return tuple(out)


def build_program(graph: Graph, device_num: int, mode: str, dataset_strategy: Any = "full_batch",
                  enable_alltoall: bool = False, cell: Any = None) -> ParallelProgram:
    """Plan (``simpar.search.plan_strategies``, with ``cell``'s parameter plans) and lower."""
    smap = plan_strategies(graph, device_num, mode, dataset_strategy, enable_alltoall,
                           parameter_plans(cell))
    return lower(graph, smap, enable_alltoall)


class NothingParallelWarning(UserWarning):
    """Every op of a program computes the same values on every rank."""


def _warn_if_nothing_is_parallel(program: ParallelProgram) -> None:
    n = program.device_num
    if n > 1 and program.steps and all(s.repeat == n for s in program.steps):
        warnings.warn(f"every op of this program computes the whole tensor on all {n} ranks: "
                      "nothing is parallel. Set .shard() strategies, a dataset_strategy that "
                      "cuts the batch, or use parallel_mode='data_parallel'",
                      NothingParallelWarning, stacklevel=3)
