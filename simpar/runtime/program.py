"""Lowering a traced graph into a per-rank :class:`ParallelProgram`, and running it.

Lowering walks the graph in order. Every node gets a strategy (its ``.shard()``, or for an
unannotated op the candidate that needs the least redistribution from its producers, ties
going to the most parallel one; data parallel where nothing constrains it), every value a
layout, and every edge whose producer layout differs from what the consumer's rule needs a
redistribution plan. Parameters take the layout their first consumer needs (or their
``parameter_plan``), and get their gradient completed by one AllReduce over the ranks that
replicate them (MindSpore's Mirror).

Execution is the per-rank program: forward runs each op's local kernel and collectives on
this rank's shards; backward runs every op's VJP and every collective's adjoint in reverse,
accumulating gradient *contributions* (see ``simpar/ops/_base.py``), then the Mirrors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpar import comm
from simpar.graph import Graph, Node, Value
from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding, StrategyError
from simpar.redistribution import (
    LOCAL_KINDS,
    RedistributionPlan,
    execute,
    execute_adjoint,
    plan,
)

__all__ = ["OpStep", "ParallelProgram", "lower"]

MODES = ("stand_alone", "data_parallel", "semi_auto_parallel")


@dataclass
class OpStep:
    """One node of the per-rank program: its sharding and the redistributions feeding it."""

    node: Node
    sharding: OpSharding
    in_plans: tuple[RedistributionPlan, ...]
    chosen: str  # "annotated", "propagated" or "data_parallel"


@dataclass
class ParallelProgram:
    """The per-rank program for one traced graph on ``device_num`` devices."""

    graph: Graph
    device_num: int
    mode: str
    steps: list[OpStep]
    layouts: dict[int, TensorLayout]            # value id -> layout of the value
    param_layouts: dict[str, TensorLayout]      # parameter name -> layout
    param_values: dict[str, Value]
    needs_grad: set[int] = field(default_factory=set)
    enable_alltoall: bool = True
    #: Nodes with an input on a path from a trainable parameter: the forward keeps their tape.
    grad_nodes: frozenset[int] = frozenset()

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
            lines.append(f"  [{s.node.id}] {s.node.op.name} {[list(c) for c in sh.strategy]}"
                         f" ({s.chosen}) dev{list(sh.device_matrix)}  {s.node.name}")
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
                         "chosen": s.chosen,
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
        with comm.validation_disabled():
            return self._forward(local_inputs, local_params, step)

    def _forward(self, local_inputs: Sequence[np.ndarray], local_params: dict[str, np.ndarray],
                 step: int) -> tuple[list[np.ndarray], dict[int, Any]]:
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
            if hasattr(node.op, "step"):
                node.op.step = step  # counter-based ops (Dropout) draw per step
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
def dataset_layouts(shapes: Sequence[Sequence[int]], device_num: int,
                    dataset_strategy: Any) -> list[TensorLayout]:
    """Layouts of the graph inputs: "full_batch" replicates, "data_parallel" splits dim 0 over
    every device, a tuple of cuts splits as given (remaining devices repeat, on the right)."""
    out = []
    for k, shape in enumerate(shapes):
        shape = tuple(shape)
        if dataset_strategy == "full_batch" or not shape:
            out.append(TensorLayout((device_num,), [-1] * len(shape), shape))
        elif dataset_strategy == "data_parallel":
            if shape[0] % device_num:
                raise ValueError(f"dataset_strategy 'data_parallel': input {k} of shape {shape} "
                                 f"has batch {shape[0]}, which does not split over "
                                 f"{device_num} devices; use full_batch or a tuple strategy")
            out.append(TensorLayout((device_num,), [0] + [-1] * (len(shape) - 1), shape))
        else:
            if k >= len(dataset_strategy):
                raise ValueError(f"dataset_strategy {dataset_strategy} has no entry for input "
                                 f"{k} of shape {shape}")
            cuts = tuple(dataset_strategy[k])
            used = math.prod(cuts)
            if len(cuts) != len(shape) or device_num % used:
                raise ValueError(f"dataset_strategy entry {cuts} for input {k} of shape "
                                 f"{shape} must have one cut per dimension and use a divisor "
                                 f"of device_num {device_num}")
            dm = tuple(c for c in cuts if c > 1) + ((device_num // used,)
                                                    if device_num > used else ())
            out.append(TensorLayout.from_strategy(dm or (1,), cuts, shape))
    return out


def _cost(p: RedistributionPlan) -> int:
    n = p.src.device_num
    ranks = range(n) if n <= 16 else sorted({0, n // 2, n - 1} | {(k * n) // 16 for k in
                                                                   range(16)})
    return max(p.recv_bytes(r, 1) + p.send_bytes(r, 1) for r in ranks) if p.steps else 0


def _follow_strategy(node: Node, known: dict[int, TensorLayout]) -> tuple[tuple[int, ...], ...]:
    """Cuts that keep every activation input where it already is (params and consts free)."""
    cuts = []
    for v in node.inputs:
        lay = known.get(v.id)
        cuts.append(lay.cuts if lay is not None and v.kind in ("op", "input") else
                    (1,) * v.ndim)
    return tuple(cuts)


def _param_cuts_ok(node: Node, strat: Sequence[Sequence[int]], mode: str,
                   plans: dict[str, tuple[int, ...]]) -> bool:
    for v, cuts in zip(node.inputs, strat):
        if v.kind != "param":
            continue
        if v.name in plans and tuple(cuts) != plans[v.name]:
            return False
        if mode == "data_parallel" and any(c != 1 for c in cuts):
            return False
    return True


def _choose(node: Node, shapes: list[tuple[int, ...]], device_num: int, mode: str,
            known: dict[int, TensorLayout], param_plans: dict[str, tuple[int, ...]],
            enable_alltoall: bool) -> tuple[OpSharding, str]:
    op = node.op
    if mode == "semi_auto_parallel" and op.in_strategy is not None:
        return op.sharding(shapes, device_num), "annotated"

    def score(sh: OpSharding) -> tuple[int, int, int, int]:
        cost = steps = 0
        for v, lay in zip(node.inputs, sh.in_layouts):
            src = known.get(v.id)
            if src is not None and v.kind in ("op", "input"):
                p = plan(src, lay, enable_alltoall)
                cost += _cost(p)
                steps += len(p.steps)
        cuts = sh.extra.get("cuts")
        repeat = device_num // math.prod(cuts.values()) if cuts else 1
        batch_cut = -sh.in_layouts[0].cuts[0] if sh.in_layouts and sh.in_layouts[0].ndim else 0
        # Bytes first; then keep activations exactly where they are (even a free slice now
        # can cost a gather later); then the most parallel; then the largest batch cut.
        return cost, steps, repeat, batch_cut

    chosen = "data_parallel" if mode == "data_parallel" else "propagated"
    follow = _follow_strategy(node, known)
    if _param_cuts_ok(node, follow, mode, param_plans):
        try:
            sh = op.sharding(shapes, device_num, follow)
            if score(sh)[:2] == (0, 0):  # no byte and no step to move: nothing can beat it
                return sh, chosen
        except (StrategyError, ValueError):
            pass
    best: tuple[tuple[int, int, int, int], OpSharding] | None = None
    for strat in op.candidate_strategies(shapes, device_num, fully_use_devices=False):
        if not _param_cuts_ok(node, strat, mode, param_plans):
            continue
        try:
            sh = op.sharding(shapes, device_num, strat)
        except (StrategyError, ValueError):
            continue
        key = score(sh)
        if best is None or key < best[0]:
            best = (key, sh)
    if best is None:
        raise StrategyError(f"{node.name}: no valid strategy for shapes {shapes} on "
                            f"{device_num} devices")
    return best[1], chosen


def _param_plans(cell: Any) -> dict[str, tuple[int, ...]]:
    """{full parameter name: cuts} from every Cell's parameter_plan."""
    out: dict[str, tuple[int, ...]] = {}
    if cell is None:
        return out
    for path, sub in cell.cells_and_names():
        for key, cuts in sub.parameter_plan.items():
            key = key.removeprefix("self.")
            out[f"{path}.{key}" if path else key] = cuts
    return out


def lower(graph: Graph, device_num: int, mode: str, dataset_strategy: Any = "full_batch",
          enable_alltoall: bool = True, cell: Any = None) -> ParallelProgram:
    """Plan ``graph`` for ``device_num`` devices in ``mode`` (pure: no MPI)."""
    if mode == "auto_parallel":
        raise NotImplementedError("parallel_mode='auto_parallel' needs the strategy search, "
                                  "which is not implemented yet; use semi_auto_parallel with "
                                  ".shard() strategies, or data_parallel")
    if mode not in MODES:
        raise ValueError(f"lower: mode must be one of {list(MODES)} or auto_parallel, got "
                         f"{mode!r}")
    if mode == "stand_alone":
        device_num = 1
    if mode == "data_parallel":
        dataset_strategy = "data_parallel"
    if device_num == 1:
        dataset_strategy = "full_batch"
    layouts: dict[int, TensorLayout] = {}
    for v, lay in zip(graph.inputs, dataset_layouts([v.shape for v in graph.inputs],
                                                    device_num, dataset_strategy)):
        layouts[v.id] = lay
    for v in graph.consts:
        layouts[v.id] = TensorLayout((device_num,), [-1] * v.ndim, v.shape)
    plans = _param_plans(cell)
    param_layouts: dict[str, TensorLayout] = {}
    param_values = {v.name: v for v in graph.params}
    steps: list[OpStep] = []
    for node in graph.nodes:
        shapes = [v.shape for v in node.inputs]
        sh, chosen = _choose(node, shapes, device_num, mode, layouts, plans, enable_alltoall)
        in_plans = []
        for v, need in zip(node.inputs, sh.in_layouts):
            if v.kind == "param" and v.id not in layouts:
                layouts[v.id] = need
                param_layouts[v.name] = need
            in_plans.append(plan(layouts[v.id], need, enable_alltoall))
        for v, (_, out, _) in zip(node.outputs, sh.outputs):
            layouts[v.id] = out
        steps.append(OpStep(node, sh, tuple(in_plans), chosen))
    for name, v in param_values.items():
        if name not in param_layouts:  # unused parameter: keep it replicated
            param_layouts[name] = TensorLayout((device_num,), [-1] * v.ndim, v.shape)
            layouts[v.id] = param_layouts[name]
    needs = {v.id for v in graph.params if v.param is not None and v.param.requires_grad}
    for node in graph.nodes:
        if any(v.id in needs for v in node.inputs):
            needs.update(v.id for v in node.outputs)
    grad_nodes = frozenset(n.id for n in graph.nodes if any(v.id in needs for v in n.inputs))
    return ParallelProgram(graph, device_num, mode, steps, layouts, param_layouts,
                           param_values, needs, enable_alltoall, grad_nodes)
