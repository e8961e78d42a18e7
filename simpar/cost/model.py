"""simpar's cost model: step time and per-rank memory of a lowered program on a device profile.

It reads the program's flat schedule (``program.schedule(rank)``, the same list that runs and
that CommTrace records) and prices every step on a :class:`~simpar.cost.profile.DeviceProfile`:

* a kernel (forward, or backward at twice its FLOPs and bytes): the roofline
  ``max(FLOPs / peak, bytes of its shards / memory bandwidth)`` times the profile's
  ``compute_scale``;
* a collective: alpha-beta with ring algorithms over the link its group crosses
  (:meth:`DeviceProfile.collective_seconds`);
* the optimizer's update of every trainable shard (:data:`OPTIMIZER_KERNELS` memory-bound
  kernels, ``array_op_overhead`` each), and the profile's fixed costs: ``kernel_overhead``
  per executor kernel call, ``sync_overhead`` per collective (waiting for the slowest rank),
  ``step_overhead`` per step (plus, on several devices, the 8-byte AllReduce with which every
  step checks that the ranks were given the same batch).

Each collective is charged to one of three buckets: the op's own communication (the
collectives that finish its partial results, its split statistics), redistribution (moving an
input to the layout the op needs, Reshape's own move) and gradient synchronisation (the
Mirrors). A rank's step time is the sum of its steps (no overlap is assumed); the program's
step time is its slowest rank's.

Memory is the peak over one training step of a rank: parameters, their gradients, the
optimizer's state (:data:`OPTIMIZER_STATE`), the activations the forward keeps for the
backward (every value a node on the gradient path saves, counted once per layout, all alive at
the end of the forward), and the largest communication buffer.

Everything is pure: shapes and layouts only, no MPI, so it plans for thousands of devices
(ranks are sampled with :func:`~simpar.collective_kinds.sample_ranks` beyond 64, and one
rank is priced per class of ranks whose schedules price alike: ``program.rank_classes``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from simpar.collective_kinds import sample_ranks
from simpar.cost.profile import DeviceProfile, load_profile

__all__ = ["ACCUMULATE_PASSES", "OPTIMIZER_KERNELS", "OPTIMIZER_PASSES", "OPTIMIZER_STATE",
           "OPTIMIZER_TEMPORARIES", "CostReport", "MemoryRow", "OpCostRow",
           "accumulation_seconds", "evaluate", "gradient_add_seconds", "optimizer_seconds",
           "phase_seconds", "predicted_timeline"]

#: Optimizer state per trainable parameter element, in parameter-sized copies.
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}
#: Per trainable parameter and step: the optimizer's numpy kernels (simpar/nn/optim.py), and
#: the parameter-sized arrays they read or write in all.
OPTIMIZER_KERNELS = {"sgd": 3, "momentum": 5, "adam": 14}
OPTIMIZER_PASSES = {"sgd": 4, "momentum": 8, "adam": 24}
#: Parameter-sized temporaries an update holds at once (``lr * v``: one; Adam's direction: four).
OPTIMIZER_TEMPORARIES = {"sgd": 1, "momentum": 1, "adam": 4}
#: Gradient accumulation: each micro-batch after the first adds its gradient into the step's
#: sum in place, one numpy call per parameter that reads two gradient-sized arrays and writes
#: one.
ACCUMULATE_PASSES = 3


class _Program(Protocol):  # simpar.runtime.ParallelProgram, as this module reads it
    @property
    def device_num(self) -> int: ...

    @property
    def steps(self) -> Sequence[Any]: ...

    @property
    def param_layouts(self) -> Mapping[str, Any]: ...

    @property
    def param_values(self) -> Mapping[str, Any]: ...

    @property
    def param_shards(self) -> Mapping[str, Any]: ...

    @property
    def segments(self) -> Sequence[Any]: ...

    @property
    def layouts(self) -> Mapping[int, Any]: ...

    @property
    def micro_batches(self) -> int: ...

    def storage_layout(self, name: str) -> Any: ...

    @property
    def grad_nodes(self) -> frozenset[int]: ...

    def schedule(self, rank: int) -> Sequence[Any]: ...

    def rank_classes(self, ranks: Sequence[int], link: Callable[[tuple[int, ...]], Hashable]
                     ) -> tuple[tuple[int, ...], ...]: ...


@dataclass(frozen=True, slots=True)
class OpCostRow:
    """One op's predicted seconds on the slowest rank: compute (forward + backward), its own
    communication, and the redistribution of its inputs."""

    op: str
    op_type: str
    strategy: tuple[tuple[int, ...], ...]
    compute: float
    op_comm: float
    redistribution: float

    @property
    def total(self) -> float:
        return self.compute + self.op_comm + self.redistribution


@dataclass(frozen=True, slots=True)
class MemoryRow:
    """One rank's peak memory in bytes, by part, against the device's capacity."""

    rank: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    comm_buffer: int
    capacity: int
    backward: int = 0      # the largest op backward's cotangent, input gradients, workspace
    update: int = 0        # the optimizer's temporaries (after the backward: no activations)

    @property
    def peak(self) -> int:
        return (self.parameters + self.gradients + self.optimizer
                + max(self.activations + max(self.comm_buffer, self.backward), self.update))

    @property
    def over(self) -> int:
        """Bytes over capacity (0 when it fits)."""
        return max(0, self.peak - self.capacity)


@dataclass(frozen=True)
class CostReport:
    """The prediction for one program on one profile (seconds and bytes)."""

    profile: str
    device_num: int
    step_seconds: float
    slowest_rank: int
    compute: float
    op_comm: float
    redistribution: float
    grad_sync: float
    optimizer: float
    overhead: float                 # the profile's fixed cost per step
    ops: tuple[OpCostRow, ...]
    memory: tuple[MemoryRow, ...]   # per rank priced
    rank_classes: int = 1           # how many of them were priced: one per class
    accumulation: float = 0.0       # adding the micro-batches' gradients up

    @property
    def peak_memory(self) -> int:
        return max(m.peak for m in self.memory)

    @property
    def fits(self) -> bool:
        return all(m.over == 0 for m in self.memory)

    def over_capacity(self) -> list[str]:
        """One line per rank over the device's memory, saying by how much."""
        return [f"rank {m.rank}: peak {_mib(m.peak)} exceeds the capacity {_mib(m.capacity)} "
                f"by {_mib(m.over)}" for m in self.memory if m.over]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["peak_memory"], d["fits"] = self.peak_memory, self.fits
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def __str__(self) -> str:
        head = (f"predicted step {self.step_seconds * 1e3:.3f} ms on {self.profile} x "
                f"{self.device_num} (rank {self.slowest_rank} slowest): compute "
                f"{self.compute * 1e3:.3f} ms, op communication {self.op_comm * 1e3:.3f} ms, "
                f"redistribution {self.redistribution * 1e3:.3f} ms, gradient sync "
                f"{self.grad_sync * 1e3:.3f} ms, "
                + (f"gradient accumulation {self.accumulation * 1e3:.3f} ms, "
                   if self.accumulation else "")
                + f"optimizer {self.optimizer * 1e3:.3f} ms, fixed {self.overhead * 1e3:.3f} ms")
        table = [["op", "type", "strategy", "compute ms", "op comm ms", "redistr. ms"]]
        for r in self.ops:
            table.append([r.op.rsplit("/", 2)[-2] + "/" + r.op.rsplit("/", 1)[-1]
                          if r.op.count("/") >= 2 else r.op, r.op_type,
                          str([list(c) for c in r.strategy]).replace(" ", ""),
                          f"{r.compute * 1e3:.4f}", f"{r.op_comm * 1e3:.4f}",
                          f"{r.redistribution * 1e3:.4f}"])
        widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
        lines = [head, ""] + ["  ".join(c.ljust(w) if k < 3 else c.rjust(w)
                                        for k, (c, w) in enumerate(zip(row, widths)))
                              for row in table]
        worst = max(self.memory, key=lambda m: m.peak)
        lines += ["", f"peak memory {_mib(worst.peak)} on rank {worst.rank} (parameters "
                      f"{_mib(worst.parameters)}, gradients {_mib(worst.gradients)}, optimizer "
                      f"{_mib(worst.optimizer)}, activations {_mib(worst.activations)}, "
                      f"communication buffer {_mib(worst.comm_buffer)} or backward transient "
                      f"{_mib(worst.backward)}, the larger) of "
                      f"{_mib(worst.capacity)}: " + ("fits" if self.fits else "OVER")]
        lines += self.over_capacity()
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def evaluate(program: _Program, profile: str | DeviceProfile = "cpu-local",
             optimizer: str = "momentum") -> CostReport:
    """Predicted step time and per-rank peak memory of ``program`` on ``profile`` (a shipped
    name, a path or a :class:`DeviceProfile`), training with ``optimizer`` ("sgd",
    "momentum" or "adam")."""
    prof = load_profile(profile)
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"evaluate: optimizer must be one of {list(OPTIMIZER_STATE)}, got "
                         f"{optimizer!r}")
    by_name = {s.node.name: s for s in program.steps}
    per_rank: dict[int, tuple[float, dict[str, list[float]], float]] = {}
    memory = []
    classes = program.rank_classes(sample_ranks(program.device_num), prof.link)
    for members in classes:   # one rank priced per class: its first
        rank = members[0]
        per_rank[rank] = _time_of(program.schedule(rank), by_name, prof,
                                  program.micro_batches)
        row = _memory_of(program, rank, optimizer, prof)
        memory += [replace(row, rank=r) for r in members]
    memory.sort(key=lambda m: m.rank)
    slowest = max(per_rank, key=lambda r: (per_rank[r][0], -r))
    total, ops, grad_sync = per_rank[slowest]
    rows = tuple(OpCostRow(name, by_name[name].node.op.name, by_name[name].sharding.strategy,
                           *ops[name]) for name in by_name)
    update = optimizer_seconds(program, optimizer, prof)
    summing = (program.micro_batches - 1) * accumulation_seconds(program, prof)
    fixed = prof.step_overhead
    if program.device_num > 1:  # the per-step agreement check of the inputs: 8 bytes
        fixed += prof.step_collective_seconds("AllReduce", range(program.device_num), 8, 0)
    return CostReport(prof.name, program.device_num, total + summing + update + fixed,
                      slowest, sum(r.compute for r in rows), sum(r.op_comm for r in rows),
                      sum(r.redistribution for r in rows), grad_sync, update, fixed, rows,
                      tuple(memory), len(classes), summing)


def optimizer_seconds(program: _Program, optimizer: str, prof: DeviceProfile) -> float:
    """The update of every trainable parameter's shard: a few memory-bound numpy kernels."""
    seconds = 0.0
    for name in program.param_layouts:
        v = program.param_values[name]
        if v.param is None or not v.param.requires_grad:
            continue
        nbytes = program.storage_layout(name).local_size() * v.dtype.itemsize
        seconds += (OPTIMIZER_KERNELS[optimizer] * prof.array_op_overhead
                    + OPTIMIZER_PASSES[optimizer] * nbytes / prof.memory_bandwidth)
    return seconds


def accumulation_seconds(program: _Program, prof: DeviceProfile) -> float:
    """One micro-batch's gradients added into the step's sum (every micro-batch's but the
    first): per trainable parameter, an in-place add of the gradient the backward hands
    over, the parameter's shard, or its optimizer slice where the level reduce-scatters
    every micro-batch (:data:`ACCUMULATE_PASSES` memory-bound passes)."""
    seconds = 0.0
    for name, lay in program.param_layouts.items():
        v = program.param_values[name]
        if v.param is None or not v.param.requires_grad:
            continue
        shard = program.param_shards.get(name)
        held = program.storage_layout(name) if shard is not None and \
            shard.level.per_micro_batch else lay
        seconds += gradient_add_seconds(held.local_size() * v.dtype.itemsize, prof)
    return seconds


def gradient_add_seconds(nbytes: float, prof: DeviceProfile) -> float:
    """One gradient of ``nbytes`` added in place into the step's sum: a numpy call and
    :data:`ACCUMULATE_PASSES` memory-bound passes (what every price of accumulation
    charges)."""
    return prof.array_op_overhead + ACCUMULATE_PASSES * nbytes / prof.memory_bandwidth


def _time_of(steps: Sequence[Any], by_name: Mapping[str, Any], prof: DeviceProfile,
             micro_batches: int = 1) -> tuple[float, dict[str, list[float]], float]:
    """(step seconds, {op: [compute, op comm, redistribution]}, gradient-sync seconds): every
    step once per micro-batch, but the ``deferred`` ones once per step."""
    ops = {name: [0.0, 0.0, 0.0] for name in by_name}
    grad_sync = 0.0
    for s in steps:
        times = 1 if s.deferred else micro_batches
        bucket, seconds = _step_seconds(s, by_name, prof)
        if bucket < 0:
            grad_sync += times * seconds
        else:
            ops[s.op][bucket] += times * seconds
    return sum(sum(v) for v in ops.values()) + grad_sync, ops, grad_sync


def _step_seconds(s: Any, by_name: Mapping[str, Any], prof: DeviceProfile
                  ) -> tuple[int, float]:
    """(bucket, seconds) of one schedule step: 0 compute, 1 op communication, 2
    redistribution, -1 gradient synchronisation (a Mirror)."""
    if s.collective is None:
        op = by_name[s.op]
        # A backward kernel moves twice the bytes; a recomputed forward's, once.
        scale = 2 if s.backward and s.reason != "recompute" else 1
        return 0, prof.compute_seconds(s.flops, scale * _kernel_bytes(op),
                                       op.node.outputs[0].dtype)
    seconds = prof.step_collective_seconds(str(s.collective), s.group, s.buffer_bytes,
                                           s.recv_bytes)
    if s.role == "mirror":
        return -1, seconds
    return (1 if s.role == "op-collective" else 2), seconds


#: What each bucket of :func:`_step_seconds` is, for a timeline.
_BUCKETS = {0: "compute", 1: "op collective", 2: "redistribution", -1: "gradient sync"}


def predicted_timeline(program: _Program, profile: str | DeviceProfile = "cpu-local",
                       rank: int = 0) -> list[tuple[str, str, float]]:
    """Every step ``rank`` runs for one forward and backward, in order, as the model prices
    it: ``(name, kind, seconds)``, the kind one of compute, op collective, redistribution and
    gradient sync (the Mirrors). What ``--trace`` draws beside the measured timeline; the
    optimizer's update and the fixed costs are left out."""
    prof = load_profile(profile)
    by_name = {s.node.name: s for s in program.steps}
    out = []
    for st in program.schedule(rank):
        bucket, seconds = _step_seconds(st, by_name, prof)
        name = (f"{st.op.rsplit('/', 1)[-1]}{' backward' if st.backward else ''}"
                if st.collective is None else f"{st.collective} {st.label}")
        out.append((name, _BUCKETS[bucket], seconds))
    return out


def phase_seconds(program: _Program, profile: str | DeviceProfile = "cpu-local",
                  rank: int | None = None) -> tuple[float, float, float]:
    """(forward, backward, once per step) seconds of ``program`` on its slowest rank (or on
    ``rank``: :func:`evaluate`'s ``slowest_rank``, say): one micro-batch's forward and
    backward (a pipeline stage runs them as separate tasks), and the steps that run once per
    step after the last micro-batch (the deferred Mirrors and level1's slicing). The
    optimizer's update and the fixed costs are left out."""
    prof = load_profile(profile)
    by_name = {s.node.name: s for s in program.steps}
    best: tuple[float, float, float] | None = None
    ranks = [rank] if rank is not None else [
        members[0] for members in program.rank_classes(sample_ranks(program.device_num),
                                                       prof.link)]
    for r in ranks:
        parts = [0.0, 0.0, 0.0]
        for s in program.schedule(r):
            parts[2 if s.deferred else 1 if s.backward else 0] += \
                _step_seconds(s, by_name, prof)[1]
        if best is None or sum(parts) > sum(best):
            best = (parts[0], parts[1], parts[2])
    assert best is not None
    return best


def _kernel_bytes(op: Any) -> int:
    """Bytes a kernel reads and writes: its input shards and its raw outputs, each in its
    own dtype; a view (Reshape, Identity) moves nothing."""
    sh, node = op.sharding, op.node
    if node.op.output_aliases_input and sh.inner_plan is None:
        return 0
    return (sum(lay.local_size() * v.dtype.itemsize for v, lay in zip(node.inputs, sh.in_layouts))
            + sum(raw.local_size() * v.dtype.itemsize
                  for v, (raw, _, _) in zip(node.outputs, sh.outputs)))


def _memory_of(program: _Program, rank: int, optimizer: str, prof: DeviceProfile) -> MemoryRow:
    params = grads = 0
    for name in program.param_layouts:   # stored as their optimizer slices, if sliced
        v = program.param_values[name]
        nbytes = program.storage_layout(name).local_size() * v.dtype.itemsize
        params += nbytes
        if v.param is not None and v.param.requires_grad:
            grads += nbytes
    # Activations: the arrays the tapes hold at the end of the forward, each counted once.
    # An array is named by where it was made: an op's raw output, its output after the op's
    # own collectives (a new array when there are any), a consumer's redistributed input; a
    # view (Reshape, Identity) names its input's.
    storage: dict[int, tuple[Any, ...]] = {}
    sizes: dict[tuple[Any, ...], int] = {}
    kept: set[tuple[Any, ...]] = set()
    # A recomputed Cell keeps only its inputs; its ops' tapes live again, one Cell at a
    # time, while the backward runs through it.
    segment_of = {i: n for n, seg in enumerate(program.segments)
                  for i in range(seg.first, seg.last + 1)}
    made_in: dict[int, int] = {}          # value id -> the segment that made it
    again: dict[int, set[tuple[Any, ...]]] = {}   # segment -> the arrays its tapes hold
    for i, s in enumerate(program.steps):
        node, sh = s.node, s.sharding
        ins = []
        for k, (v, lay) in enumerate(zip(node.inputs, sh.in_layouts)):
            key = storage.get(v.id, ("value", v.id))
            shard = program.param_shards.get(v.name) if v.kind == "param" else None
            if shard is not None:
                # A sliced weight, gathered whole for the forward: a tape that keeps it
                # keeps the gathered copy, unless level3 drops it (gathered again later).
                key = ("gathered", v.id) if not shard.level.regathers else ("dropped", v.id)
                sizes.setdefault(("dropped", v.id), 0)
            if s.in_plans[k].steps:
                key = ("redistributed", node.id, k)
            sizes.setdefault(key, lay.local_size() * v.dtype.itemsize)
            ins.append((v, key))
        raws = []
        for k, (v, (raw, out, out_plan)) in enumerate(zip(node.outputs, sh.outputs)):
            aliases = node.op.output_aliases_input and sh.inner_plan is None and k == 0
            raw_key = ins[0][1] if aliases else ("raw", node.id, k)
            sizes.setdefault(raw_key, raw.local_size() * v.dtype.itemsize)
            raws.append(raw_key)
            storage[v.id] = ("value", v.id) if out_plan.steps else raw_key
            sizes.setdefault(storage[v.id], out.local_size() * v.dtype.itemsize)
        seg = segment_of.get(i)
        if seg is not None:
            _segment_keeps(program, program.segments[seg], node, s, ins,
                           [v for v in node.inputs if made_in.get(v.id) != seg],
                           storage, sizes, kept)
            made_in.update((v.id, seg) for v in node.outputs)
        if node.id not in program.grad_nodes:
            continue
        if seg is None:
            kept.update(_kept(node.op.tape, node, sh, ins, raws, sizes))
        else:   # recomputed: a level3 weight is gathered again, and its tape holds the copy
            regathered = []
            for v, key in ins:
                if key[0] == "dropped":
                    key = ("gathered", v.id)
                    sizes[key] = program.param_layouts[v.name].local_size() * v.dtype.itemsize
                regathered.append((v, key))
            again.setdefault(seg, set()).update(
                _kept(node.op.tape, node, sh, regathered, raws, sizes))
    activations = sum(sizes[key] for key in kept)
    rerun = max((sum(sizes[key] for key in keys - kept) for keys in again.values()),
                default=0)
    # A collective holds its input and its result at once; a Mirror packs its gradients into
    # a bucket (a copy) and sums it in place, so it holds the bucket only.
    buffer = max((s.buffer_bytes + s.result_bytes for s in program.schedule(rank)
                  if s.collective is not None), default=0)
    # While an op's backward runs, the tapes are all still alive; beside them it holds its
    # output's cotangent and the gradients it computes for its float inputs, but for a
    # parameter's own shard: that gradient is already counted among the gradients (a sliced
    # one's is whole until it is reduce-scattered: its block beyond the counted slice), and
    # its kernels' workspace (a convolution's unrolled windows).
    # The ops before whose backward level3 gathers a dropped weight again (the schedule's).
    regather_at = {st.op for st in program.schedule(rank) if st.backward
                   and st.role == "weight-gather"}   # Role.GATHER
    backward = max((sum(raw.local_size() * v.dtype.itemsize
                        for v, (raw, _, _) in zip(s.node.outputs, s.sharding.outputs))
                    + sum(lay.local_size() * v.dtype.itemsize - _stored(program, v)
                          for k, (v, lay) in enumerate(zip(s.node.inputs, s.sharding.in_layouts))
                          if s.node.op.gives_gradient(k, v.dtype)
                          and (v.kind != "param" or s.in_plans[k].steps
                               or v.name in program.param_shards))
                    + (_regathered(program, s) if i not in segment_of
                       and s.node.name in regather_at else 0)
                    + _workspace(s)
                    for i, s in enumerate(program.steps) if s.node.id in program.grad_nodes),
                   default=0) + rerun
    largest = max((program.storage_layout(n).local_size()   # the update runs on the slice
                   * program.param_values[n].dtype.itemsize
                   for n in program.param_layouts), default=0)
    return MemoryRow(rank, params, grads, OPTIMIZER_STATE[optimizer] * grads, activations,
                     buffer, prof.memory_capacity, backward,
                     OPTIMIZER_TEMPORARIES[optimizer] * largest)


def _workspace(step: Any) -> int:
    """Bytes ``step``'s kernels hold beside the arrays counted above (a convolution's
    unrolled windows: :meth:`simpar.ops.Primitive.workspace`)."""
    sh, node = step.sharding, step.node
    return node.op.workspace(tuple(lay.local_shape() for lay in sh.in_layouts),
                             sh.outputs[0][0].local_shape()) * node.outputs[0].dtype.itemsize


def _regathered(program: _Program, step: Any) -> int:
    """The weights level3 gathers again for ``step``'s backward (it dropped them after the
    forward), alive while its VJP runs."""
    total = 0
    for k, (v, lay) in enumerate(zip(step.node.inputs, step.sharding.in_layouts)):
        shard = program.param_shards.get(v.name) if v.kind == "param" else None
        if shard is not None and shard.level.regathers and step.node.op.keeps_input(k):
            total += lay.local_size() * v.dtype.itemsize
    return total


def _stored(program: _Program, v: Any) -> int:
    """The bytes of ``v``'s gradient already counted among the gradients: a sliced
    parameter's slice (its whole block is made before it is reduce-scattered), else none."""
    if v.kind != "param" or v.name not in program.param_shards:
        return 0
    return program.storage_layout(v.name).local_size() * v.dtype.itemsize


def _segment_keeps(program: _Program, seg: Any, node: Any, step: Any,
                   ins: list[tuple[Any, tuple[Any, ...]]], outside: list[Any],
                   storage: dict[int, tuple[Any, ...]], sizes: dict[tuple[Any, ...], int],
                   kept: set[tuple[Any, ...]]) -> None:
    """What a recomputed Cell keeps through the forward for one of its ops: each input made
    outside the Cell (a sliced weight's gathered copy unless it is gathered again; a
    parameter's own shard is counted as a parameter), and without ``mp_comm`` the moved
    copies of its inputs."""
    for k, (v, key) in enumerate(ins):
        if v in outside:
            if v.kind == "param":
                shard = program.param_shards.get(v.name)
                if shard is not None and not (seg.opt_comm or shard.level.regathers):
                    kept.add(("gathered", v.id))
                    sizes.setdefault(("gathered", v.id), program.param_layouts[
                        v.name].local_size() * v.dtype.itemsize)
                continue
            orig = storage.get(v.id, ("value", v.id))
            sizes.setdefault(orig, program.layouts[v.id].local_size() * v.dtype.itemsize)
            kept.add(orig)
        if not seg.mp_comm and step.in_plans[k].steps:
            kept.add(key)


def _kept(tape: str, node: Any, sh: Any, ins: list[tuple[Any, tuple[Any, ...]]],
          raws: list[tuple[Any, ...]], sizes: dict[tuple[Any, ...], int]
          ) -> list[tuple[Any, ...]]:
    """The arrays ``node``'s tape holds (naming new ones in ``sizes``). ``tape`` is the op's
    :class:`simpar.ops.kernels.Tape` (a str enum, compared by value: this module reads the
    program's records and imports no op)."""
    if tape in ("inputs+output", "inputs"):
        # A parameter's own shard is counted as a parameter; a redistributed copy is not it.
        kept = [key for v, key in ins
                if v.kind != "param" or key[0] in ("redistributed", "gathered")]
        return kept + raws if tape == "inputs+output" else kept
    if tape == "output":
        return raws
    if tape == "nothing":
        return []
    if tape == "indices":
        return [ins[1][1]]
    first = sh.in_layouts[0].local_size()
    if tape == "input+new":
        sizes[("new", node.id)] = first * node.inputs[0].dtype.itemsize
        return [key for v, key in ins[:1]
                if v.kind != "param" or key[0] in ("redistributed", "gathered")
                ] + [("new", node.id)]
    if tape == "new-like-input":
        sizes[("new", node.id)] = first * node.inputs[0].dtype.itemsize
    elif tape == "mask":
        sizes[("new", node.id)] = first
    else:
        raise AssertionError(f"{node.op.name}: unknown tape kind {tape!r}")
    return [("new", node.id)]
