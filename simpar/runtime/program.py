"""Lowering a traced graph and its :class:`~simpar.search.StrategyMap` into a per-rank
:class:`ParallelProgram`, and running it.

Lowering chooses nothing: every op's strategy, every parameter's and graph input's layout come
from the strategy map (``simpar.search`` plans it). Lowering derives every value's layout from
them, and plans a redistribution on every edge whose producer layout differs from what the
consumer's rule needs. Every trainable parameter gets its gradient completed by one AllReduce
over the ranks that replicate it (MindSpore's Mirror).

Execution is the per-rank program: forward runs each op's local kernel and collectives on
this rank's shards; backward runs every op's VJP and every collective's adjoint in reverse,
accumulating gradient *contributions* (see ``simpar/ops/_base.py``), then the Mirrors.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpar import comm
from simpar.graph import Graph, Node, Value
from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding
from simpar.redistribution import (
    LOCAL_KINDS,
    RedistributionPlan,
    execute,
    execute_adjoint,
    plan,
)
from simpar.search import (
    Source,
    StrategyMap,
    dataset_layouts,
    parameter_plans,
    plan_strategies,
)
from simpar.seed import training_step

__all__ = ["NothingParallelWarning", "OpStep", "ParallelProgram", "build_program",
           "dataset_layouts", "lower"]



@dataclass(frozen=True, slots=True)
class OpStep:
    """One node of the per-rank program: its sharding, the redistributions feeding it, where
    its strategy came from, and how many ranks compute each of its shards."""

    node: Node
    sharding: OpSharding
    in_plans: tuple[RedistributionPlan, ...]
    chosen: Source
    repeat: int = 1


@dataclass(frozen=True)
class ParallelProgram:
    """The per-rank program for one traced graph on ``device_num`` devices, lowered from
    ``strategy_map``. Nothing reassigns its fields once lowered."""

    graph: Graph
    device_num: int
    mode: str
    steps: tuple[OpStep, ...]
    layouts: dict[int, TensorLayout]            # value id -> layout of the value
    param_layouts: dict[str, TensorLayout]      # parameter name -> layout
    param_values: dict[str, Value]
    needs_grad: set[int] = field(default_factory=set)
    enable_alltoall: bool = False
    #: Nodes with an input on a path from a trainable parameter: the forward keeps their tape.
    grad_nodes: frozenset[int] = frozenset()
    strategy_map: StrategyMap | None = None

    def repeated(self) -> dict[str, int]:
        """{op name: how many ranks compute each of its shards}, for every op computed on more
        than one rank alike (MindSpore's repeated calculation)."""
        return {s.node.name: s.repeat for s in self.steps if s.repeat > 1}

    # ------------------------------------------------------------ description
    def input_layouts(self) -> list[TensorLayout]:
        return [self.layouts[v.id] for v in self.graph.inputs]

    def output_layouts(self) -> list[TensorLayout]:
        return [self.layouts[v.id] for v in self.graph.outputs]

    def mirror_group(self, name: str, rank: int) -> tuple[int, ...]:
        """The ranks whose gradients of parameter ``name`` are summed (size 1: no Mirror)."""
        return _replica_group(self.param_layouts[name], rank)

    def loss_batch_cut(self) -> int:
        """How many ways the batch (dim 0 of its first input) is cut at the op producing the
        first output: the data-parallel degree ``D`` that summed gradients scale with."""
        out = self.graph.outputs[0]
        step = next(s for s in self.steps if s.node is out.producer)
        first = step.sharding.in_layouts[0]
        return first.cuts[0] if first.ndim else 1

    def strategies(self) -> dict[str, list[list[int]]]:
        """{op name: strategy} for every node (what a strategy file records)."""
        return {s.node.name: [list(c) for c in s.sharding.strategy] for s in self.steps}

    def __str__(self) -> str:
        lines = [f"ParallelProgram: {self.mode}, {self.device_num} devices, "
                 f"{len(self.steps)} ops, {len(self.param_layouts)} parameters"]
        for v in self.graph.inputs:
            lines.append(f"  input {v.name}{list(v.shape)}: {self.layouts[v.id]}")
        for name, lay in self.param_layouts.items():
            g = self.mirror_group(name, 0)
            mirror = f"  Mirror AllReduce over {len(g)} ranks" if len(g) > 1 else ""
            lines.append(f"  param {name}{list(lay.shape)}: {lay}{mirror}")
        for s in self.steps:
            sh = s.sharding
            repeat = f", computed alike on {s.repeat} ranks" if s.repeat > 1 else ""
            lines.append(f"  [{s.node.id}] {s.node.op.name} {[list(c) for c in sh.strategy]}"
                         f" ({s.chosen}{repeat}) dev{list(sh.device_matrix)}  {s.node.name}")
            for k, p in enumerate(s.in_plans):
                if p.steps:
                    kinds = ", ".join(st.kind + (f"{list(st.device_axes)}" if st.device_axes
                                                 else "") for st in p.steps)
                    lines.append(f"      redistribute input {k}: {p.src} -> {p.dst}: {kinds}")
            fwd = [c.kind for c in sh.forward_comm]
            if fwd:
                lines.append(f"      forward comm: {', '.join(fwd)}")
            lines.append(f"      out: {sh.out}")
        return "\n".join(lines)

    def comm_table(self, rank: int = 0) -> list[dict[str, Any]]:
        """One row per op: name, strategy, collectives forward and backward (for printing)."""
        rows = []
        for s in self.steps:
            redis = [st.kind for p in s.in_plans for st in p.steps if st.kind not in LOCAL_KINDS]
            rows.append({"op": s.node.name, "type": s.node.op.name,
                         "strategy": [list(c) for c in s.sharding.strategy],
                         "chosen": s.chosen, "repeat": s.repeat,
                         "out_tensor_map": [list(e) if isinstance(e, tuple) else e
                                            for e in s.sharding.out.tensor_map],
                         "redistribution": redis,
                         "forward": [c.kind for c in s.sharding.forward_comm],
                         "backward": [c.kind for c in s.sharding.backward_comm
                                      if not c.reason.startswith("gradient of input")]})
        return rows

    # ------------------------------------------------------------ execution
    def forward(self, local_inputs: Sequence[np.ndarray], local_params: dict[str, np.ndarray],
                step: int = 0) -> tuple[list[np.ndarray], dict[int, Any]]:
        """Run the forward on this rank's shards; returns output shards and the tape.

        Collectives run without simpar.comm's cross-rank agreement check: every rank runs
        the same plan, so shapes agree by construction (and the check would double the
        number of collectives)."""
        with comm.validation_disabled(), training_step(step):
            return self._forward(local_inputs, local_params)

    def _forward(self, local_inputs: Sequence[np.ndarray], local_params: dict[str, np.ndarray]
                 ) -> tuple[list[np.ndarray], dict[int, Any]]:
        vals: dict[int, np.ndarray] = {}
        for v, x in zip(self.graph.inputs, local_inputs):
            vals[v.id] = x
        for v in self.graph.params:
            vals[v.id] = local_params[v.name]
        for v in self.graph.consts:
            assert v.const is not None
            vals[v.id] = v.const
        tape: dict[int, Any] = {}
        for s in self.steps:
            node = s.node
            ins = []
            for k, (v, p) in enumerate(zip(node.inputs, s.in_plans)):
                x = vals[v.id]
                if p.steps:
                    with comm.label(f"{node.name}:input{k}"):
                        x = execute(p, x)
                ins.append(x)
            with comm.label(node.name):
                out, saved = s.sharding.forward(*ins)
            outs = out if len(node.outputs) > 1 else (out,)
            for v, o in zip(node.outputs, outs):
                vals[v.id] = o
            if node.id in self.grad_nodes:
                tape[node.id] = saved
        return [vals[v.id] for v in self.graph.outputs], tape

    def backward(self, tape: dict[int, Any], output_grads: Sequence[np.ndarray | None]
                 ) -> dict[str, np.ndarray]:
        """Reverse pass from the outputs' cotangents; returns each trainable parameter's
        gradient shard, completed by its Mirror AllReduce."""
        with comm.validation_disabled():
            return self._backward(tape, output_grads)

    def _backward(self, tape: dict[int, Any], output_grads: Sequence[np.ndarray | None]
                  ) -> dict[str, np.ndarray]:
        grads: dict[int, np.ndarray] = {}
        for v, g in zip(self.graph.outputs, output_grads):
            if g is not None:
                grads[v.id] = g
        for s in reversed(self.steps):
            node = s.node
            if node.id not in tape:
                continue
            douts = [grads.pop(v.id, None) for v in node.outputs]
            if all(d is None for d in douts):
                continue
            d: Any = tuple(douts) if len(node.outputs) > 1 else douts[0]
            with comm.label(f"{node.name}:backward"):
                contribs = s.sharding.backward(tape[node.id], d)
            for k, (v, c) in enumerate(zip(node.inputs, contribs)):
                if c is None or v.id not in self.needs_grad:
                    continue
                p = s.in_plans[k]
                if p.steps:
                    with comm.label(f"{node.name}:input{k}-adjoint"):
                        c = execute_adjoint(p, c)
                grads[v.id] = grads[v.id] + c if v.id in grads else c
        rank = comm.get_rank() if self.device_num > 1 else 0
        out: dict[str, np.ndarray] = {}
        buckets: dict[tuple[tuple[int, ...], str], list[str]] = {}
        for name, v in self.param_values.items():
            if v.param is None or not v.param.requires_grad:
                continue
            g = grads.get(v.id)
            if g is None:
                g = np.zeros(self.param_layouts[name].local_shape(), dtype=v.dtype)
            out[name] = g
            group = self.mirror_group(name, rank)
            if len(group) > 1:
                buckets.setdefault((group, g.dtype.str), []).append(name)
        # Mirror: one AllReduce per group of ranks, on all its parameters' gradients at once
        # (MindSpore fuses these AllReduces too); the sum completes every contribution.
        for (group, _), names in buckets.items():
            flat = np.concatenate([out[n].ravel() for n in names])
            with comm.label(f"Mirror:{len(names)} params"):
                flat = comm.all_reduce(flat, group=group)
            offset = 0
            for n in names:
                size = out[n].size
                out[n] = flat[offset:offset + size].reshape(out[n].shape)
                offset += size
        return out


@functools.lru_cache(maxsize=65536)
def _replica_group(lay: TensorLayout, rank: int) -> tuple[int, ...]:
    """The ranks holding what ``rank`` holds of ``lay`` (computed once per layout and rank:
    the backward asks for every parameter's group on every step)."""
    axes = tuple(a for a in lay.replica_axes if lay.device_matrix[a] > 1)
    return lay.mesh.group_of(rank, axes) if axes else (rank,)


# ------------------------------------------------------------------ lowering
def lower(graph: Graph, strategy_map: StrategyMap, enable_alltoall: bool = False
          ) -> ParallelProgram:
    """The per-rank program of ``graph`` under ``strategy_map`` (pure: no MPI).

    Every node must have a strategy in the map. A parameter the map gives no layout takes
    the layout its first consumer's strategy needs (as in MindSpore, where a weight is laid
    out by the op that reads it); a graph input without one is held whole by every rank
    (``full_batch``). Nothing else is decided here."""
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
    params = dict(smap.params)
    layouts: dict[int, TensorLayout] = {
        v.id: smap.inputs.get(v.name) or TensorLayout((device_num,), [-1] * v.ndim, v.shape)
        for v in graph.inputs}
    layouts.update((v.id, params[v.name]) for v in graph.params if v.name in params)
    for v in graph.consts:
        layouts[v.id] = TensorLayout((device_num,), [-1] * v.ndim, v.shape)
    steps: list[OpStep] = []
    for node in graph.nodes:
        chosen = smap.ops[node.name]
        if chosen.op_type != node.op.name:
            raise ValueError(f"lower: {node.name} is a {node.op.name}, but the strategy map "
                             f"holds a {chosen.op_type} strategy for it")
        sh = node.op.sharding([v.shape for v in node.inputs], device_num, chosen.in_strategy,
                              chosen.out_strategy, enable_alltoall)
        for v, need in zip(node.inputs, sh.in_layouts):
            if v.kind == "param" and v.id not in layouts:
                layouts[v.id] = params[v.name] = need
        in_plans = tuple(plan(layouts[v.id], need, enable_alltoall)
                         for v, need in zip(node.inputs, sh.in_layouts))
        for v, (_, out, _) in zip(node.outputs, sh.outputs):
            layouts[v.id] = out
        steps.append(OpStep(node, sh, in_plans, chosen.source, sh.repeat))
    needs = {v.id for v in graph.params if v.param is not None and v.param.requires_grad}
    for node in graph.nodes:
        if any(v.id in needs for v in node.inputs):
            needs.update(v.id for v in node.outputs)
    grad_nodes = frozenset(n.id for n in graph.nodes if any(v.id in needs for v in n.inputs))
    for v in graph.params:
        if v.name not in params:  # read by no op: keep it whole
            layouts[v.id] = params[v.name] = TensorLayout((device_num,), [-1] * v.ndim, v.shape)
    program = ParallelProgram(graph, device_num, smap.mode, tuple(steps), layouts,
                              params, {v.name: v for v in graph.params}, needs,
                              enable_alltoall, grad_nodes, smap)
    _warn_if_nothing_is_parallel(program)
    return program


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
