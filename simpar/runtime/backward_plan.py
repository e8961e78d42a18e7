"""The planned backward of a lowered program: where every cotangent is pending and what the
backward runs for it (:mod:`simpar.cotangent`), per set of seeded outputs.

Two ways of planning compete (:func:`plan_backward`): *eager* sums a pending cotangent before
an op with trainable parameters whose other inputs need a gradient (Megatron's backward
AllReduce after a column-parallel MatMul), *lazy* keeps it pending until a forward AllReduce,
an AllGather's adjoint or a parameter's Mirror sums it. Neither is always cheaper; lowering
keeps the one that moves fewer bytes (:func:`backward_traffic`), once per program.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpar.collective_kinds import kind_of, traffic
from simpar.cotangent import (
    Action,
    Frame,
    OpBackward,
    Pending,
    cotangent_actions,
    op_backward,
)
from simpar.redistribution import RedistributionPlan, plan
from simpar.runtime.lowered import LoweredGraph

__all__ = ["BackwardPlan", "BackwardPlans", "NodeBackward", "backward_traffic", "plan_backward"]


@dataclass(frozen=True)
class NodeBackward:
    """One op's planned backward: its own (:class:`~simpar.cotangent.OpBackward`),
    which inputs get a gradient, the actions moving each input's gradient back to its
    producer's layout, and the zeroing that aligns it with what is already accumulated there
    (``align_sum`` on the running sum, ``align_new`` on this contribution)."""

    op: OpBackward
    needs: tuple[bool, ...]
    edges: Mapping[int, tuple[Action, ...]]
    align_sum: Mapping[int, tuple[Action, ...]]
    align_new: Mapping[int, tuple[Action, ...]]


@dataclass(frozen=True)
class BackwardPlan:
    """The planned backward of a program: per node that runs backward its
    :class:`NodeBackward`, and per trainable parameter the axes (of its layout, as ``frame``
    writes it) over which its gradient is pending: its Mirror's. A parameter optimizer
    parallel slices has its gradient completed by ``shard_syncs[name]`` instead: from pending
    over those axes to its shard (a ReduceScatter over the shard's ranks, and an AllReduce
    over the rest of its pending axes when the shard covers fewer). A pipeline stage's input
    from an earlier stage gets its cotangent summed whole by ``input_sums``, to be sent
    back."""

    nodes: Mapping[int, NodeBackward]
    params: Mapping[str, Pending]
    frame: Frame
    shard_syncs: Mapping[str, RedistributionPlan] = field(default_factory=dict)
    #: Per graph input that gets a gradient (``Graph.grad_inputs``, by name): the sum that
    #: makes its cotangent whole in the input's layout (an AllReduce over the axes where it
    #: is pending; no steps where it is whole already).
    input_sums: Mapping[str, RedistributionPlan] = field(default_factory=dict)

    def mirror_group(self, lowered: LoweredGraph, name: str, rank: int) -> tuple[int, ...]:
        """The ranks whose gradients of parameter ``name`` its Mirror sums (``(rank,)``: no
        Mirror)."""
        axes = self.params.get(name, frozenset())
        lay = self.frame.of(lowered.param_layouts[name])
        return lay.mesh.group_of(rank, tuple(sorted(axes))) if axes else (rank,)

    def mirror_buckets(self, lowered: LoweredGraph, rank: int
                       ) -> tuple[tuple[tuple[int, ...], str, tuple[str, ...]], ...]:
        """``rank``'s Mirrors: per group of ranks and dtype, the trainable parameters whose
        gradients one AllReduce sums over that group, in the program's parameter order; the
        gradients of one group and dtype go into as many buckets as ``lowered.comm_fusion``
        says (one by default)."""
        groups: dict[tuple[tuple[int, ...], str], list[str]] = {}
        for name, v in lowered.param_values.items():
            if v.param is None or not v.param.requires_grad or name in self.shard_syncs:
                continue
            group = self.mirror_group(lowered, name, rank)
            if len(group) > 1:
                groups.setdefault((group, v.dtype.str), []).append(name)
        out = []
        for (group, dtype), names in groups.items():
            sizes = [lowered.param_layouts[n].local_size() * np.dtype(dtype).itemsize
                     for n in names]
            out += [(group, dtype, tuple(names[k] for k in bucket))
                    for bucket in lowered.comm_fusion.buckets(sizes)]
        return tuple(out)


def plan_backward(lowered: LoweredGraph, seeded: Sequence[bool]) -> BackwardPlan:
    """The backward of ``lowered`` for the outputs ``seeded`` says get a cotangent (each
    seeded whole), planned eagerly and lazily (:func:`_plan`): the one that moves fewer
    bytes (:func:`backward_traffic`), the eager one on a tie."""
    seeds = tuple(bool(b) for b in seeded)
    return min((_plan(lowered, seeds, eager) for eager in (True, False)),
               key=lambda bplan: backward_traffic(lowered, bplan))


class BackwardPlans(Mapping[tuple[bool, ...], BackwardPlan]):
    """The backward plans of ``lowered`` for the sets of seeded outputs ``keys``
    (:func:`plan_backward`), each planned when first read and kept: a pipeline's rank lowers
    every stage, for the layouts its neighbours send and receive, and runs the backward of
    its own stage's programs only."""

    def __init__(self, lowered: LoweredGraph, keys: Iterable[tuple[bool, ...]]) -> None:
        self._lowered, self._keys = lowered, tuple(keys)
        self._plans: dict[tuple[bool, ...], BackwardPlan] = {}

    def __getitem__(self, key: tuple[bool, ...]) -> BackwardPlan:
        found = self._plans.get(key)
        if found is None:
            if key not in self._keys:
                raise KeyError(key)
            found = self._plans[key] = plan_backward(self._lowered, key)
        return found

    def __iter__(self) -> Iterator[tuple[bool, ...]]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _plan(lowered: LoweredGraph, seeded: tuple[bool, ...], eager: bool) -> BackwardPlan:
    """Walk the program backwards as the executor does, deciding every cotangent's pending
    axes and the actions between them. ``eager`` sums a pending cotangent before an op with
    trainable parameters whose other inputs need a gradient (a LayerNorm after a
    column-parallel MatMul: Megatron's backward AllReduce), so that the parameters'
    gradients come out whole; otherwise it stays pending until it meets a forward
    AllReduce over its axes, an AllGather's adjoint or a parameter's Mirror (fused with the
    other gradients)."""
    frame = Frame.for_devices(lowered.device_num)
    pending: dict[int, Pending] = {v.id: frozenset()
                                   for v, seed in zip(lowered.graph.outputs, seeded) if seed}
    nodes: dict[int, NodeBackward] = {}
    # An op's backward is a function of its layouts and its cotangents' pending axes: the
    # ops of identical layers share their shardings' layouts (the ops' memo of derived
    # shardings), so each is planned once per walk. Keyed by the layouts' identities,
    # which the lowered steps keep alive.
    planned: dict[tuple[Any, ...], OpBackward] = {}
    for s in reversed(lowered.steps):
        node, sh = s.node, s.sharding
        outs = [pending.pop(v.id, None) for v in node.outputs]
        if node.id not in lowered.grad_nodes or all(o is None for o in outs):
            continue
        needs = tuple(v.id in lowered.needs_grad and node.op.gives_gradient(k, v.dtype)
                      for k, v in enumerate(node.inputs))
        # Eager: a pending cotangent is summed here, before an op whose parameters and other
        # inputs both need a gradient. Otherwise it stays pending, and is summed where it
        # meets a forward AllReduce, by the Mirror of a parameter it reaches, or never.
        trains = eager and any(needs[k] and v.kind == "param"
                               for k, v in enumerate(node.inputs)) and \
            any(needs[k] and v.kind != "param" for k, v in enumerate(node.inputs))
        resolve: list[tuple[Action, ...]] = []
        for k, out in enumerate(outs):
            if trains and out:
                resolve.append((frame.summed(sh.outputs[k][1], sorted(out)),))
                outs[k] = frozenset()
            else:
                resolve.append(())
        key = (id(sh.raw_out), id(sh.out), id(sh.out_plan), id(sh.more_outs),
               id(sh.in_layouts), id(sh.inner_plan), tuple(outs))
        ob = planned.get(key)
        if ob is None:
            ob = planned[key] = op_backward(sh, outs, frame)
        if any(resolve):
            ob = dataclasses.replace(ob, out_actions=tuple(
                r + a for r, a in zip(resolve, ob.out_actions)))
        edges: dict[int, tuple[Action, ...]] = {}
        align_sum: dict[int, tuple[Action, ...]] = {}
        align_new: dict[int, tuple[Action, ...]] = {}
        for k, v in enumerate(node.inputs):
            if not needs[k]:
                continue
            edges[k], pend = cotangent_actions(s.in_plans[k], ob.in_pending[k], frame)
            old = pending.get(v.id)
            if old is None:
                pending[v.id] = pend
                continue
            both = old | pend
            lay = lowered.layouts[v.id]
            align_sum[k] = (frame.zero(lay, sorted(both - old)),) if both - old else ()
            align_new[k] = (frame.zero(lay, sorted(both - pend)),) if both - pend else ()
            pending[v.id] = both
        nodes[node.id] = NodeBackward(ob, needs, edges, align_sum, align_new)
    params = {name: pending.get(v.id, frozenset()) for name, v in lowered.param_values.items()
              if v.param is not None and v.param.requires_grad}
    syncs = {name: plan(frame.of(lowered.param_layouts[name]).with_partial_axes(
                 sorted(params[name])), shard.layout, lowered.enable_alltoall)
             for name, shard in lowered.param_shards.items() if name in params}
    grad_inputs = set(lowered.graph.grad_inputs)
    sums = {v.name: plan(frame.of(lowered.layouts[v.id]).with_partial_axes(
                sorted(pending.get(v.id, frozenset()))), lowered.layouts[v.id],
                lowered.enable_alltoall)
            for v in lowered.graph.inputs if v.id in grad_inputs}
    return BackwardPlan(nodes, params, frame, syncs, sums)


def backward_traffic(lowered: LoweredGraph, bplan: BackwardPlan) -> tuple[int, int]:
    """(elements rank 0 sends, collective calls) of a backward plan's reductions and moves,
    its Mirrors included (one call per group); what both ways of planning share (an op's own
    backward collectives) is left out."""
    sent, calls, groups = 0, 0, set()
    for nb in bplan.nodes.values():
        acts = [*(a for acts in nb.op.out_actions for a in acts), *nb.op.inner_actions,
                *(a for acts in nb.edges.values() for a in acts)]
        for a in acts:
            if a.local:
                continue
            step = a.step
            kind = str(a.kind)
            size = (step.dst if a.adjoint else step.src).local_size()
            group = math.prod(step.src.device_matrix[x] for x in step.device_axes) \
                if step.device_axes else step.src.device_num
            sent += kind_of(kind).traffic(group, size)  # a direct exchange: its size
            calls += 1
    for summed in bplan.input_sums.values():
        sent += sum(st.send_bytes(0, 1) for st in summed.steps if not st.kind.local)
        calls += sum(1 for st in summed.steps if not st.kind.local)
    for name, axes in bplan.params.items():
        sync = bplan.shard_syncs.get(name)
        if sync is not None:   # a direct exchange's bytes are its size, as above
            sent += sum(st.send_bytes(0, 1) for st in sync.steps if not st.kind.local)
            calls += sum(1 for st in sync.steps if not st.kind.local)
            continue
        if not axes:
            continue
        lay = bplan.frame.of(lowered.param_layouts[name])
        group = math.prod(lay.device_matrix[x] for x in axes)
        sent += traffic("AllReduce", group, lay.local_size())
        groups.add(tuple(sorted(axes)))
    return sent, calls + len(groups)
