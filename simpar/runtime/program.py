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

:meth:`ParallelProgram.schedule` is the flat list of what a rank runs: every local kernel and
every collective, including those inside ops (split Softmax/LayerNorm statistics, ReduceMax,
Reshape's redistribution) and the Mirrors, each a described :class:`ProgramStep`. Execution is
checked against it by :mod:`simpar.schedule`: a collective that is not the schedule's next one
raises, and every CommTrace event names the step that ran it. A cost model reads the same list.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpar import comm, schedule
from simpar.collective_kinds import kind_of, traffic
from simpar.cost.model import CostReport, evaluate
from simpar.cost.profile import DeviceProfile
from simpar.cotangent import (
    Action,
    Frame,
    OpBackward,
    Pending,
    cotangent_actions,
    op_backward,
)
from simpar.graph import Graph, Node, Value
from simpar.layout import TensorLayout
from simpar.ops._base import CommSpec, OpSharding, Primitive, plan_comm
from simpar.redistribution import (
    LOCAL_KINDS,
    RedistributionPlan,
    StepKind,
    plan,
)
from simpar.runtime.executor import Executor, mirror_announcement, sums_output_in_place
from simpar.search import (
    Source,
    StrategyMap,
    dataset_layouts,
    parameter_plans,
    plan_strategies,
)
from simpar.seed import training_step

__all__ = ["MemoryWatch", "NothingParallelWarning", "OpStep", "ParallelProgram", "ProgramStep",
           "Role", "build_program", "dataset_layouts", "lower", "watching_memory"]


class Role(str, enum.Enum):
    """What a :class:`ProgramStep` does."""

    COMPUTE = "compute"            # an op's local kernel on this rank's shards
    REDISTRIBUTE = "redistribute"  # moving an input to the layout its op needs (or Reshape's)
    OP_COLLECTIVE = "op-collective"  # the op's own: finishing partial outputs, split statistics
    MIRROR = "mirror"              # one fused AllReduce of parameters' gradients

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ProgramStep:
    """One step of a rank's program: a local kernel or one collective, in execution order.

    ``group`` and ``recv_bytes`` are this rank's (CommTrace's byte convention); ``runs`` is
    the object the executor announces when it runs the collective (a redistribution step or
    an op's CommSpec), checked by :mod:`simpar.schedule`. On rank 0 of a dp=2 x mp=4 Megatron
    MLP (16 -> 32 -> 8, batch 8, float64), the Mirror of the three mp-split parameters reads
    ``16 bwd mirror AllReduce group=[0, 4] recv=1600 B  Mirror:3 params``.
    """

    index: int
    backward: bool
    role: Role
    op: str                        # the node's name ("" for a Mirror)
    label: str                     # the CommTrace label of its collective
    collective: StepKind | None    # None for a compute step
    group: tuple[int, ...] = ()
    recv_bytes: int = 0
    buffer_bytes: int = 0          # the collective's local input buffer
    result_bytes: int = 0          # and its local result beside it (0: summed in place)
    flops: int = 0
    reason: str = ""
    runs: object = field(default=None, compare=False, repr=False)
    adjoint: bool = False

    def __str__(self) -> str:
        phase = "bwd" if self.backward else "fwd"
        if self.collective is None:
            return f"{self.index:>3} {phase} {self.role} {self.flops} flop  {self.op}"
        return (f"{self.index:>3} {phase} {self.role} {self.collective} group={list(self.group)}"
                f" recv={self.recv_bytes} B  {self.label}")



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
    _schedules: dict[tuple[int, tuple[bool, ...]], tuple[ProgramStep, ...]] = field(
        default_factory=dict, init=False, compare=False, repr=False)  # a cache, per (rank, seeds)
    _guarded: dict[tuple[int, tuple[bool, ...] | None, bool], tuple[ProgramStep, ...]] = field(
        default_factory=dict, init=False, compare=False, repr=False)
    _backward_plans: dict[tuple[bool, ...], BackwardPlan] = field(
        default_factory=dict, init=False, compare=False, repr=False)
    _executors: dict[int, Executor] = field(
        default_factory=dict, init=False, compare=False, repr=False)  # compiled, per rank

    def backward_plan(self, seeded: Sequence[bool] | None = None) -> BackwardPlan:
        """Where every cotangent is pending and what the backward runs for it
        (:mod:`simpar.cotangent`), for the outputs ``seeded`` says get a cotangent
        (default: all), each seeded whole."""
        key = (tuple(bool(b) for b in seeded) if seeded is not None
               else (True,) * len(self.graph.outputs))
        found = self._backward_plans.get(key)
        if found is None:
            found = self._backward_plans[key] = min(
                (_plan_backward(self, key, eager) for eager in (True, False)),
                key=functools.partial(_backward_traffic, self))
        return found

    # ------------------------------------------------------------ the flat per-rank program
    def schedule(self, rank: int, seeded: Sequence[bool] | None = None
                 ) -> tuple[ProgramStep, ...]:
        """Every step ``rank`` runs for one forward and backward, in order: kernels,
        redistribution collectives, ops' own collectives, Mirrors. ``seeded`` says which
        outputs get a cotangent (default: all); the backward skips what they do not reach."""
        if not 0 <= rank < self.device_num:
            raise ValueError(f"schedule: rank must be in 0..{self.device_num - 1}, got {rank}")
        key = (rank, tuple(bool(b) for b in seeded) if seeded is not None
               else (True,) * len(self.graph.outputs))
        if key not in self._schedules:
            self._schedules[key] = _schedule(self, rank, key[1])
        return self._schedules[key]

    def cost(self, profile: str | DeviceProfile = "cpu-local", optimizer: str = "momentum"
             ) -> CostReport:
        """Predicted step time and per-rank peak memory on ``profile``
        (:func:`simpar.cost.evaluate`)."""
        return evaluate(self, profile, optimizer)

    def _collectives(self, rank: int, seeded: Sequence[bool] | None, backward: bool
                     ) -> tuple[ProgramStep, ...]:
        """The schedule's collectives of one direction (what the guard checks), built once
        per (rank, seeds, direction): every training step reuses them."""
        key = (rank, None if seeded is None else tuple(seeded), backward)
        found = self._guarded.get(key)
        if found is None:
            found = self._guarded[key] = tuple(
                s for s in self.schedule(rank, seeded)
                if s.backward == backward and s.collective is not None)
        return found

    def schedule_text(self, rank: int = 0) -> str:
        """The schedule of ``rank``, one step per line."""
        steps = self.schedule(rank)
        comm_steps = [s for s in steps if s.collective is not None]
        head = (f"rank {rank}: {len(steps)} steps, {len(comm_steps)} collectives, "
                f"{sum(s.recv_bytes for s in comm_steps)} bytes received")
        return "\n".join([head, *(str(s) for s in steps)])

    def repeated(self) -> dict[str, int]:
        """{op name: how many ranks compute each of its shards}, for every op computed on more
        than one rank alike (MindSpore's repeated calculation)."""
        return {s.node.name: s.repeat for s in self.steps if s.repeat > 1}

    # ------------------------------------------------------------ description
    def input_layouts(self) -> list[TensorLayout]:
        return [self.layouts[v.id] for v in self.graph.inputs]

    def output_layouts(self) -> list[TensorLayout]:
        return [self.layouts[v.id] for v in self.graph.outputs]

    @functools.cached_property
    def index_limits(self) -> tuple[tuple[tuple[Primitive, int, int], ...], ...]:
        """Per graph input, the ops that read it as indices, directly or through ops that
        only move values (Reshape, Transpose, Split): ``(op, position, limit)``."""
        readers: dict[int, list[tuple[OpStep, int]]] = {}
        for s in self.steps:
            for k, v in enumerate(s.node.inputs):
                readers.setdefault(v.id, []).append((s, k))
        out = []
        for v in self.graph.inputs:
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

    def refused_input(self, local_inputs: Sequence[np.ndarray]) -> ValueError | None:
        """The error for the first index in this rank's input shards outside the range an
        op reading it allows (:meth:`index_limits`), else None."""
        for x, limits in zip(local_inputs, self.index_limits):
            if not limits or not x.size or x.dtype.kind not in "iu":
                continue
            lo, hi = int(x.min()), int(x.max())
            for op, k, limit in limits:
                if lo < 0 or hi >= limit:
                    return ValueError(op.index_error(k, lo if lo < 0 else hi, limit))
        return None

    def mirror_group(self, name: str, rank: int) -> tuple[int, ...]:
        """The ranks whose gradients of parameter ``name`` are summed (size 1: no Mirror):
        its replicas over which the gradient is pending. Replicas that computed the same
        gradient (a bias after a row-parallel MatMul, over the model-parallel ranks) are not
        among them."""
        return _mirror_group(self, self.backward_plan(), name, rank)

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
        bplan = self.backward_plan()
        for s in self.steps:
            redis = [st.kind for p in s.in_plans for st in p.steps if st.kind not in LOCAL_KINDS]
            # The planned backward: the outputs' adjoints, the op's own, its inner move's.
            nb = bplan.nodes.get(s.node.id)
            backward: list[StepKind] = []
            if nb is not None:
                outs = [a for acts in nb.op.out_actions for a in acts]
                backward = [*_kinds(outs), *(c.kind for c in s.sharding.internal_backward),
                            *_kinds(nb.op.inner_actions)]
            rows.append({"op": s.node.name, "type": s.node.op.name,
                         "strategy": [list(c) for c in s.sharding.strategy],
                         "chosen": s.chosen, "repeat": s.repeat,
                         "out_tensor_map": [list(e) if isinstance(e, tuple) else e
                                            for e in s.sharding.out.tensor_map],
                         "redistribution": redis,
                         "forward": [c.kind for c in s.sharding.forward_comm],
                         "backward": backward})
        return rows

    # ------------------------------------------------------------ execution
    def forward(self, local_inputs: Sequence[np.ndarray], local_params: dict[str, np.ndarray],
                step: int = 0) -> tuple[list[np.ndarray], list[Any]]:
        """Run the forward on this rank's shards; returns output shards and the tape (what
        :meth:`backward` takes).

        Collectives run without simpar.comm's cross-rank agreement check: every rank runs
        the same plan, so shapes agree by construction (and the check would double the
        number of collectives)."""
        rank = comm.get_rank() if self.device_num > 1 else 0
        expected = self._collectives(rank, None, backward=False)
        with comm.validation_disabled(), training_step(step), \
                schedule.following(expected, "forward"):
            return self.executor(rank).forward(local_inputs, local_params, _WATCH.get())

    def executor(self, rank: int) -> Executor:
        """``rank``'s compiled program (:mod:`simpar.runtime.executor`), built once."""
        found = self._executors.get(rank)
        if found is None:
            found = self._executors[rank] = Executor(self, rank)
        return found

    def backward(self, tape: list[Any], output_grads: Sequence[np.ndarray | None]
                 ) -> dict[str, np.ndarray]:
        """Reverse pass from the outputs' cotangents; returns each trainable parameter's
        gradient shard, completed by its Mirror AllReduce."""
        rank = comm.get_rank() if self.device_num > 1 else 0
        seeded = [g is not None for g in output_grads]
        expected = self._collectives(rank, seeded, backward=True)
        with comm.validation_disabled(), schedule.following(expected, "backward"):
            return self.executor(rank).backward(self.backward_plan(seeded), tape,
                                                output_grads, _WATCH.get())


def _kinds(actions: Sequence[Action]) -> list[StepKind]:
    """The collectives planned backward actions run."""
    return [a.kind for a in actions if not a.local]


def _mirror_group(program: ParallelProgram, bplan: BackwardPlan, name: str, rank: int
                  ) -> tuple[int, ...]:
    axes = bplan.params.get(name, frozenset())
    lay = bplan.frame.of(program.param_layouts[name])
    return lay.mesh.group_of(rank, tuple(sorted(axes))) if axes else (rank,)


@dataclass(frozen=True)
class NodeBackward:
    """One op's planned backward: its own (:class:`~simpar.cotangent.OpBackward`),
    which inputs get a gradient, the actions moving each input's gradient back to its
    producer's layout, and the zeroing that aligns it with what is already accumulated there
    (``align_sum`` on the running sum, ``align_new`` on this contribution)."""

    op: OpBackward
    needs: tuple[bool, ...]
    edges: dict[int, tuple[Action, ...]]
    align_sum: dict[int, tuple[Action, ...]]
    align_new: dict[int, tuple[Action, ...]]


@dataclass(frozen=True)
class BackwardPlan:
    """The planned backward of a program: per node that runs backward its
    :class:`NodeBackward`, and per trainable parameter the axes (of its layout) over which its
    gradient is pending: its Mirror's."""

    nodes: dict[int, NodeBackward]
    params: dict[str, Pending]
    frame: Frame
    _buckets: dict[int, tuple[tuple[tuple[int, ...], str, tuple[str, ...]], ...]] = field(
        default_factory=dict, compare=False, repr=False)  # a cache, per rank

    def mirror_buckets(self, program: ParallelProgram, rank: int
                       ) -> tuple[tuple[tuple[int, ...], str, tuple[str, ...]], ...]:
        """``rank``'s Mirrors: per group of ranks and dtype, the trainable parameters whose
        gradients one AllReduce sums over that group, in the program's parameter order."""
        found = self._buckets.get(rank)
        if found is None:
            buckets: dict[tuple[tuple[int, ...], str], list[str]] = {}
            for name, v in program.param_values.items():
                if v.param is None or not v.param.requires_grad:
                    continue
                group = _mirror_group(program, self, name, rank)
                if len(group) > 1:
                    buckets.setdefault((group, v.dtype.str), []).append(name)
            found = self._buckets[rank] = tuple((group, dtype, tuple(names))
                                                for (group, dtype), names in buckets.items())
        return found


def _plan_backward(program: ParallelProgram, seeded: tuple[bool, ...], eager: bool
                   ) -> BackwardPlan:
    """Walk the program backwards as :meth:`ParallelProgram.backward` does, deciding every
    cotangent's pending axes and the actions between them. ``eager`` sums a pending
    cotangent before an op with trainable parameters whose other inputs need a gradient (a
    LayerNorm after a column-parallel MatMul: Megatron's backward AllReduce), so that the
    parameters' gradients come out whole; otherwise it stays pending until it meets a forward
    AllReduce over its axes, an AllGather's adjoint or a parameter's Mirror (fused with the
    other gradients). Neither is always cheaper: Megatron's layers favour the first, a
    program whose blocks split differently the second, and :meth:`ParallelProgram.backward_plan`
    takes the one that moves fewer bytes."""
    frame = Frame.for_devices(program.device_num)
    pending: dict[int, Pending] = {v.id: frozenset()
                                   for v, seed in zip(program.graph.outputs, seeded) if seed}
    nodes: dict[int, NodeBackward] = {}
    for s in reversed(program.steps):
        node, sh = s.node, s.sharding
        outs = [pending.pop(v.id, None) for v in node.outputs]
        if node.id not in program.grad_nodes or all(o is None for o in outs):
            continue
        needs = tuple(v.id in program.needs_grad and node.op.gives_gradient(k, v.dtype)
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
        ob = op_backward(sh, outs, frame)
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
            lay = program.layouts[v.id]
            align_sum[k] = (frame.zero(lay, sorted(both - old)),) if both - old else ()
            align_new[k] = (frame.zero(lay, sorted(both - pend)),) if both - pend else ()
            pending[v.id] = both
        nodes[node.id] = NodeBackward(ob, needs, edges, align_sum, align_new)
    params = {name: pending.get(v.id, frozenset()) for name, v in program.param_values.items()
              if v.param is not None and v.param.requires_grad}
    return BackwardPlan(nodes, params, frame)


def _backward_traffic(program: ParallelProgram, bplan: BackwardPlan) -> tuple[int, int]:
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
    for name, axes in bplan.params.items():
        if not axes:
            continue
        lay = bplan.frame.of(program.param_layouts[name])
        group = math.prod(lay.device_matrix[x] for x in axes)
        sent += traffic("AllReduce", group, lay.local_size())
        groups.add(tuple(sorted(axes)))
    return sent, calls + len(groups)


class MemoryWatch:
    """The peak bytes of the arrays the executor holds (parameters passed in, every value of
    the forward, the tapes, the backward's cotangents), sampled after every op; arrays that
    share memory (views) count once. Use :func:`watching_memory`."""

    def __init__(self) -> None:
        self.peak = 0
        self.params: Any = {}  # the parameter shards of the last forward, held throughout

    def sample(self, *holders: Any) -> None:
        seen: dict[int, int] = {}
        for holder in (self.params, *holders):
            _arrays(holder, seen)
        self.peak = max(self.peak, sum(seen.values()))


_WATCH: ContextVar[MemoryWatch | None] = ContextVar("simpar_memory_watch", default=None)


@contextmanager
def watching_memory() -> Iterator[MemoryWatch]:
    """Inside the block, the executor records the peak bytes it holds (costly: for the cost
    model's fidelity benchmark, not for training).

    >>> with watching_memory() as watch:        # doctest: +SKIP
    ...     train(data, label)
    >>> watch.peak                              # doctest: +SKIP
    """
    watch = MemoryWatch()
    token = _WATCH.set(watch)
    try:
        yield watch
    finally:
        _WATCH.reset(token)


def _arrays(x: Any, seen: dict[int, int]) -> None:
    """Every array inside ``x`` (dicts, tuples, lists), by the memory block it lives in."""
    if isinstance(x, np.ndarray):
        base = x
        while isinstance(base.base, np.ndarray):
            base = base.base
        seen[id(base)] = base.nbytes
    elif isinstance(x, dict):
        for item in x.values():
            _arrays(item, seen)
    elif isinstance(x, (tuple, list)):
        for item in x:
            _arrays(item, seen)


@functools.lru_cache(maxsize=65536)
def _replica_group(lay: TensorLayout, rank: int) -> tuple[int, ...]:
    """The ranks holding what ``rank`` holds of ``lay`` (computed once per layout and rank:
    the backward asks for every parameter's group on every step)."""
    axes = tuple(a for a in lay.replica_axes if lay.device_matrix[a] > 1)
    return lay.mesh.group_of(rank, axes) if axes else (rank,)


# ------------------------------------------------------------------ the schedule
class _Builder:
    def __init__(self, rank: int) -> None:
        self.rank, self.backward = rank, False
        self.steps: list[ProgramStep] = []

    def compute(self, op: str, flops: int) -> None:
        self.steps.append(ProgramStep(len(self.steps), self.backward, Role.COMPUTE, op, op, None,
                                      flops=flops))

    def collectives(self, role: Role, op: str, label: str, specs: Sequence[CommSpec],
                    itemsize: int, first_in_place: bool = False) -> None:
        """``first_in_place``: the first collective writes into its input (an AllReduce the
        executor hands the op's fresh product to): no result beside it."""
        for k, spec in enumerate(specs):
            where = f"{label}/{spec.reason}" if spec.step is None else (
                f"{label}/redistribute{'-adjoint' if spec.adjoint else ''}:{spec.step.kind}")
            if k == 0 and first_in_place and spec.kind == StepKind.ALL_REDUCE:
                result = 0
            elif spec.step is None:   # an op's own AllReduce: the result is the buffer's size
                result = spec.elements
            else:
                result = (spec.step.src if spec.adjoint else spec.step.dst).local_size()
            self.steps.append(ProgramStep(
                len(self.steps), self.backward, role, op, where, spec.kind,
                spec.group(self.rank), spec.recv_bytes(self.rank, itemsize),
                spec.elements * itemsize, result * itemsize, 0, spec.reason, spec.runs,
                spec.adjoint))


def _schedule(program: ParallelProgram, rank: int, seeded: tuple[bool, ...]
              ) -> tuple[ProgramStep, ...]:
    """The flat program of ``rank`` (see :meth:`ParallelProgram.schedule`). It mirrors
    ``_forward``/``_backward`` step for step; :mod:`simpar.schedule` checks that they agree."""
    b = _Builder(rank)
    for s in program.steps:
        node, sh = s.node, s.sharding
        for k, (v, p) in enumerate(zip(node.inputs, s.in_plans)):
            b.collectives(Role.REDISTRIBUTE, node.name, f"{node.name}:input{k}",
                          plan_comm(p, f"input {k}", False), v.dtype.itemsize)
        in_size, out_size = node.inputs[0].dtype.itemsize, node.outputs[0].dtype.itemsize
        b.collectives(Role.REDISTRIBUTE, node.name, f"{node.name}/{sh.op.name}:redistribute",
                      sh.inner_comm(), in_size)
        b.compute(node.name, sh.local_flops())
        b.collectives(Role.OP_COLLECTIVE, node.name, f"{node.name}/{sh.op.name}",
                      sh.internal_forward, out_size if _on_output(sh.internal_forward)
                      else in_size)
        in_place = sums_output_in_place(sh, node.id in program.grad_nodes)
        for k, (v, (_, _, p)) in enumerate(zip(node.outputs, sh.outputs)):
            b.collectives(Role.OP_COLLECTIVE, node.name,
                          f"{node.name}/{sh.op.name}:output{k if k else ''}",
                          plan_comm(p, "output", True), v.dtype.itemsize, in_place)
    b.backward = True
    bplan = program.backward_plan(seeded)
    for s in reversed(program.steps):
        node, sh = s.node, s.sharding
        nb = bplan.nodes.get(node.id)
        if nb is None:
            continue
        in_size, out_size = node.inputs[0].dtype.itemsize, node.outputs[0].dtype.itemsize
        for k in reversed(range(len(sh.outputs))):
            b.collectives(Role.OP_COLLECTIVE, node.name,
                          f"{node.name}:backward/{sh.op.name}:output-adjoint",
                          _action_specs(nb.op.out_actions[k], f"adjoint of output {k}", True),
                          node.outputs[k].dtype.itemsize)
        b.compute(node.name, 2 * sh.local_flops())
        b.collectives(Role.OP_COLLECTIVE, node.name, f"{node.name}:backward/{sh.op.name}",
                      sh.internal_backward, out_size if _on_output(sh.internal_backward)
                      else in_size)
        b.collectives(Role.REDISTRIBUTE, node.name,
                      f"{node.name}:backward/{sh.op.name}:redistribute-adjoint",
                      _action_specs(nb.op.inner_actions, "adjoint of redistribution before "
                                    f"{sh.op.name.lower()}", False), in_size)
        for k, v in enumerate(node.inputs):
            if nb.needs[k]:
                b.collectives(Role.REDISTRIBUTE, node.name, f"{node.name}:input{k}-adjoint",
                              _action_specs(nb.edges[k], f"adjoint of input {k}", False),
                              v.dtype.itemsize)
    for group, dtype, names in bplan.mirror_buckets(program, rank):
        elements = sum(program.param_layouts[n].local_size() for n in names)
        nbytes = elements * np.dtype(dtype).itemsize
        # The bucket is packed afresh and summed in place: no result beside it.
        b.steps.append(ProgramStep(
            len(b.steps), True, Role.MIRROR, "", f"Mirror:{len(names)} params",
            StepKind.ALL_REDUCE, group, traffic(StepKind.ALL_REDUCE, len(group), nbytes), nbytes,
            0, 0, f"gradients of {', '.join(names)} (sum over their replicas)",
            mirror_announcement(group, names)))
    return tuple(b.steps)


def _action_specs(actions: Sequence[Action], reason: str, on_output: bool) -> list[CommSpec]:
    """The collectives of planned backward actions, as the schedule lists them."""
    return [CommSpec.adjoint_of(a.step, reason, on_output) if a.adjoint
            else CommSpec.from_step(a.step, reason, on_output)
            for a in actions if not a.local]


def _on_output(specs: Sequence[CommSpec]) -> bool:
    return bool(specs) and specs[0].on_output


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
