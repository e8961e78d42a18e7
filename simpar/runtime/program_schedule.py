"""The schedule: the flat list of what a rank runs for one forward and backward of a
lowered program, every local kernel and every collective, including those inside ops (split
Softmax/LayerNorm statistics, ReduceMax, Reshape's redistribution) and the Mirrors, each a
described :class:`ProgramStep`.

Execution is checked against it by :mod:`simpar.schedule`: a collective that is not the
schedule's next one raises, and every CommTrace event names the step that ran it. A cost
model reads the same list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from simpar._enums import StrEnum
from simpar.collective_kinds import KINDS, traffic
from simpar.ops.comm_spec import CommSpec, action_comm, plan_comm
from simpar.redistribution import StepKind
from simpar.runtime.backward_plan import BackwardPlan
from simpar.runtime.executor import backward_reads, mirror_announcement, sums_output_in_place
from simpar.runtime.lowered import LoweredGraph, OpStep

__all__ = ["ProgramStep", "Role", "rank_classes", "schedule"]


class Role(StrEnum):
    """What a :class:`ProgramStep` does."""

    COMPUTE = "compute"            # an op's local kernel on this rank's shards
    REDISTRIBUTE = "redistribute"  # moving an input to the layout its op needs (or Reshape's)
    OP_COLLECTIVE = "op-collective"  # the op's own: finishing partial outputs, split statistics
    MIRROR = "mirror"              # one fused AllReduce of parameters' gradients, or the
    #                                ReduceScatter of a sliced parameter's (optimizer parallel)
    GATHER = "weight-gather"       # a sliced parameter made whole before its use


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
    #: Run once per step, after the last micro-batch's backward, on the gradients summed
    #: over them (the Mirrors, level1's slicing); with one micro-batch, where it stands.
    deferred: bool = False
    #: The described collective it runs (None for a kernel and a Mirror): what makes the
    #: step differ from rank to rank (:func:`rank_classes`).
    comm: CommSpec | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        phase = "bwd" if self.backward else "fwd"
        if self.collective is None:
            return f"{self.index:>3} {phase} {self.role} {self.flops} flop  {self.op}"
        return (f"{self.index:>3} {phase} {self.role} {self.collective} group={list(self.group)}"
                f" recv={self.recv_bytes} B  {self.label}")


# ------------------------------------------------------------------ the schedule
class _Builder:
    def __init__(self, rank: int) -> None:
        self.rank, self.backward = rank, False
        self.steps: list[ProgramStep] = []

    def compute(self, op: str, flops: int, reason: str = "") -> None:
        self.steps.append(ProgramStep(len(self.steps), self.backward, Role.COMPUTE, op, op, None,
                                      flops=flops, reason=reason))

    def collectives(self, role: Role, op: str, label: str, specs: Sequence[CommSpec],
                    itemsize: int, first_in_place: bool = False, deferred: bool = False
                    ) -> None:
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
                spec.adjoint, deferred, spec))


def schedule(program: LoweredGraph, bplan: BackwardPlan, rank: int) -> tuple[ProgramStep, ...]:
    """Every step ``rank`` runs for one forward and, as ``bplan`` plans it, one backward, in
    order: kernels, redistribution collectives, ops' own collectives, Mirrors. It mirrors
    the executor's generated code step for step; :mod:`simpar.schedule` checks that they
    agree."""
    b = _Builder(rank)
    shards = program.param_shards
    gathered: set[str] = set()
    for i, s in enumerate(program.steps):
        # optimizer parallel: each weight's slices gathered before its first use
        first = [v.name for v in s.node.inputs if v.kind == "param" and v.name in shards
                 and v.name not in gathered]
        gathered.update(first)
        kept = s.node.id in program.grad_nodes and program.segment_of(i) is None
        _forward_op(b, program, s, first, True, kept)
    b.backward = True
    regathered: set[str] = set()
    # A sliced parameter's gradient is completed after the node whose backward adds its last
    # contribution; with micro-batches, level1's waits for the step's one synchronisation.
    accumulating = program.micro_batches > 1
    once = [name for name in program.param_values if name in bplan.shard_syncs and
            accumulating and not shards[name].level.per_micro_batch]
    last_add = {}
    for s in reversed(program.steps):
        nb = bplan.nodes.get(s.node.id)
        for k, v in enumerate(s.node.inputs):
            if nb is not None and nb.needs[k] and v.kind == "param" and v.name in shards \
                    and v.name not in once:
                last_add[v.name] = s.node.id
    # A recomputed Cell runs its forward again before the first of its ops' VJPs.
    first_vjp: dict[int, int] = {}
    for i in reversed(range(len(program.steps))):
        seg = program.segment_of(i)
        if seg is not None and program.steps[i].node.id in bplan.nodes \
                and id(seg) not in first_vjp:
            first_vjp[id(seg)] = i
    for i, s in reversed(list(enumerate(program.steps))):
        node, sh = s.node, s.sharding
        nb = bplan.nodes.get(node.id)
        if nb is None:
            continue
        seg = program.segment_of(i)
        if seg is not None and first_vjp.get(id(seg)) == i:
            again: set[str] = set()
            for k in range(seg.first, seg.last + 1):
                step = program.steps[k]
                weights = [v.name for v in step.node.inputs if v.kind == "param"
                           and v.name in shards and v.name not in again
                           and (seg.opt_comm or shards[v.name].level.regathers)]
                again.update(weights)
                _forward_op(b, program, step, weights, seg.mp_comm, False)
        for k, v in enumerate(node.inputs):   # level3: the dropped weight gathered again
            if v.kind == "param" and v.name in shards and shards[v.name].level.regathers \
                    and node.id in program.grad_nodes and sh.inner_plan is None \
                    and sh.op.keeps_input(k) and seg is None \
                    and backward_reads(sh, k, nb.needs):
                if v.name not in regathered:
                    regathered.add(v.name)
                    b.collectives(Role.GATHER, node.name, f"{v.name}:gather-again",
                                  plan_comm(program.weight_gathers[v.name], "gather the "
                                            "weight level3 dropped", False), v.dtype.itemsize)
                b.collectives(Role.REDISTRIBUTE, node.name, f"{node.name}:input{k}-again",
                              plan_comm(s.in_plans[k], f"input {k} again", False),
                              v.dtype.itemsize)
        in_size, out_size = node.inputs[0].dtype.itemsize, node.outputs[0].dtype.itemsize
        for k in reversed(range(len(sh.outputs))):
            b.collectives(Role.OP_COLLECTIVE, node.name,
                          f"{node.name}:backward/{sh.op.name}:output-adjoint",
                          action_comm(nb.op.out_actions[k], f"adjoint of output {k}", True),
                          node.outputs[k].dtype.itemsize)
        b.compute(node.name, 2 * sh.local_flops())
        b.collectives(Role.OP_COLLECTIVE, node.name, f"{node.name}:backward/{sh.op.name}",
                      sh.internal_backward, out_size if _on_output(sh.internal_backward)
                      else in_size)
        b.collectives(Role.REDISTRIBUTE, node.name,
                      f"{node.name}:backward/{sh.op.name}:redistribute-adjoint",
                      action_comm(nb.op.inner_actions, "adjoint of redistribution before "
                                    f"{sh.op.name.lower()}", False), in_size)
        for k, v in enumerate(node.inputs):
            if nb.needs[k]:
                b.collectives(Role.REDISTRIBUTE, node.name, f"{node.name}:input{k}-adjoint",
                              action_comm(nb.edges[k], f"adjoint of input {k}", False),
                              v.dtype.itemsize)
        done = sorted({v.name for v in node.inputs if last_add.get(v.name) == node.id},
                      key=[v.name for v in node.inputs].index)
        for name in done:   # a sliced parameter's gradient, complete: into its slice
            _slice_gradient(b, program, bplan, name, False)
    for v in program.graph.inputs:   # a stage's input from an earlier stage: summed whole
        if v.name in bplan.input_sums:
            reader = next((s.node.name for s in program.steps
                           if any(x.id == v.id for x in s.node.inputs)), "")
            b.collectives(Role.REDISTRIBUTE, reader, f"{v.name}:gradient-sum",
                          plan_comm(bplan.input_sums[v.name], f"gradient of input {v.name}",
                                    False), v.dtype.itemsize)
    for name in once:   # level1 under micro-batches: the summed gradient into its slice
        _slice_gradient(b, program, bplan, name, True)
    for group, dtype, names in bplan.mirror_buckets(program, rank):
        elements = sum(program.param_layouts[n].local_size() for n in names)
        nbytes = elements * np.dtype(dtype).itemsize
        # The bucket is packed afresh and summed in place: no result beside it.
        b.steps.append(ProgramStep(
            len(b.steps), True, Role.MIRROR, "", f"Mirror:{len(names)} params",
            StepKind.ALL_REDUCE, group, traffic(StepKind.ALL_REDUCE, len(group), nbytes), nbytes,
            0, 0, f"gradients of {', '.join(names)} (sum over their replicas)",
            mirror_announcement(group, names), deferred=accumulating))
    return tuple(b.steps)


def _slice_gradient(b: _Builder, program: LoweredGraph, bplan: BackwardPlan, name: str,
                    deferred: bool) -> None:
    """The collectives that complete sliced parameter ``name``'s gradient into its slice."""
    b.collectives(Role.MIRROR, "", f"Mirror:{name}",
                  plan_comm(bplan.shard_syncs[name], f"gradient of {name} into its optimizer "
                            "slice", False),
                  program.param_values[name].dtype.itemsize, deferred=deferred)


def _forward_op(b: _Builder, program: LoweredGraph, s: OpStep, gathers: Sequence[str],
                moves: bool, kept: bool) -> None:
    """One op's forward steps: the gathers of the sliced weights named in ``gathers``, its
    inputs' redistributions and its output plans (when ``moves``; a recomputed Cell with
    ``mp_comm_recompute=False`` keeps their results), its own collectives and its kernel.
    ``kept``: its tape is kept (an AllReduce may then not sum its product in place)."""
    node, sh = s.node, s.sharding
    for name in gathers:
        v = program.param_values[name]
        b.collectives(Role.GATHER, node.name, f"{name}:gather",
                      plan_comm(program.weight_gathers[name], "gather the weight's "
                                "optimizer slices", False), v.dtype.itemsize)
    if moves:
        for k, (v, p) in enumerate(zip(node.inputs, s.in_plans)):
            b.collectives(Role.REDISTRIBUTE, node.name, f"{node.name}:input{k}",
                          plan_comm(p, f"input {k}", False), v.dtype.itemsize)
    in_size, out_size = node.inputs[0].dtype.itemsize, node.outputs[0].dtype.itemsize
    b.collectives(Role.REDISTRIBUTE, node.name, f"{node.name}/{sh.op.name}:redistribute",
                  sh.inner_comm(), in_size)
    b.compute(node.name, sh.local_flops(), "recompute" if b.backward else "")
    b.collectives(Role.OP_COLLECTIVE, node.name, f"{node.name}/{sh.op.name}",
                  sh.internal_forward, out_size if _on_output(sh.internal_forward)
                  else in_size)
    if not moves:
        return
    in_place = sums_output_in_place(sh, kept)
    for k, (v, (_, _, p)) in enumerate(zip(node.outputs, sh.outputs)):
        b.collectives(Role.OP_COLLECTIVE, node.name,
                      f"{node.name}/{sh.op.name}:output{k if k else ''}",
                      plan_comm(p, "output", True), v.dtype.itemsize, in_place)


def _on_output(specs: Sequence[CommSpec]) -> bool:
    return bool(specs) and specs[0].on_output


# ------------------------------------------------------------------ ranks that price alike
def rank_classes(program: LoweredGraph, bplan: BackwardPlan, template: Sequence[ProgramStep],
                 ranks: Sequence[int], link: Callable[[tuple[int, ...]], Hashable]
                 ) -> tuple[tuple[int, ...], ...]:
    """``ranks`` split into classes whose schedules price alike, found without building them.

    ``template`` is the schedule of any rank. Ranks differ only in their groups and, in a
    direct exchange, in the bytes they receive; two ranks are in one class when every
    collective's group sits on the same ``link`` (a profile's
    :meth:`~simpar.cost.profile.DeviceProfile.link`, say) for both, a direct exchange brings
    both as many bytes, and their Mirrors bucket the same parameters. A regular plan on
    power-of-two servers is one class; a group that straddles a server boundary for some
    ranks only splits them. The classes are ordered by their first rank, each in rank order.
    """
    tables: dict[tuple[tuple[int, ...], tuple[int, ...]], _Groups] = {}

    def table(device_matrix: tuple[int, ...], axes: tuple[int, ...]) -> _Groups:
        key = (tuple(device_matrix), tuple(axes))
        if key not in tables:
            tables[key] = _Groups(*key, link)
        return tables[key]

    specs = [s.comm for s in template if s.comm is not None]
    # A collective's link depends only on its groups' table: one entry per table is enough.
    grouped = list({id(t): t for t in (table(c.device_matrix, c.device_axes)
                                       for c in specs)}.values())
    pieces = [c for c in specs if c.step is not None and KINDS[c.step.kind].by_pieces]
    # Per trainable parameter a Mirror sums: its groups and its dtype. Parameters of one
    # table and dtype share their bucket and link on every rank: each such kind counts once,
    # with the index of its first parameter.
    mirrored: dict[tuple[int, str], tuple[_Groups, str, int]] = {}
    k = 0
    for name, v in program.param_values.items():
        axes = bplan.params.get(name, frozenset())
        if v.param is not None and v.param.requires_grad and axes \
                and name not in bplan.shard_syncs:
            mesh = bplan.frame.of(program.param_layouts[name]).mesh
            t = table(mesh.device_matrix, tuple(sorted(axes)))
            mirrored.setdefault((id(t), v.dtype.str), (t, v.dtype.str, k))
            k += 1
    classes: dict[Hashable, list[int]] = {}
    for r in ranks:
        buckets: dict[tuple[tuple[int, ...], str], int] = {}
        mirrors = tuple((buckets.setdefault((t.group(r), dtype), first), t.link(r))
                        for t, dtype, first in mirrored.values())
        key = (tuple(t.link(r) for t in grouped), tuple(c.recv_bytes(r, 1) for c in pieces),
               mirrors)
        classes.setdefault(key, []).append(r)
    return tuple(tuple(members) for members in classes.values())


class _Groups:
    """Every rank's group along ``axes`` of ``device_matrix``, ordered as
    :meth:`~simpar.mesh.DeviceMesh.group_of` orders it, and the link each group sits on."""

    def __init__(self, device_matrix: tuple[int, ...], axes: tuple[int, ...],
                 link: Callable[[tuple[int, ...]], Hashable]) -> None:
        n = math.prod(device_matrix)
        if not axes:   # the whole world
            self.rows = np.arange(n)[None, :]
        else:
            rest = [a for a in range(len(device_matrix)) if a not in axes]
            self.rows = np.arange(n).reshape(device_matrix).transpose(rest + list(axes)) \
                .reshape(-1, math.prod(device_matrix[a] for a in axes))
        self.row_of = np.empty(n, dtype=np.int64)
        self.row_of[self.rows] = np.arange(len(self.rows))[:, None]
        self._link = link
        self._links: dict[int, Hashable] = {}

    def group(self, rank: int) -> tuple[int, ...]:
        return tuple(self.rows[self.row_of[rank]].tolist())

    def link(self, rank: int) -> Hashable:
        row = int(self.row_of[rank])
        if row not in self._links:
            self._links[row] = self._link(tuple(self.rows[row].tolist()))
        return self._links[row]
