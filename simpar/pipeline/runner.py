"""A pipelined training step over MPI: every stage on its own sub-mesh, the micro-batches
scheduled across them, activations and cotangents sent between them point to point.

With ``S`` stages over ``D`` ranks, stage ``s`` runs on world ranks ``s * n .. s * n + n - 1``
(``n = D / S``, MindSpore's order), under :func:`simpar.comm.stage_world`: its program is
planned and lowered for ``n`` devices (its operator strategies are per stage, as MindSpore's
are) and runs unchanged there. Stage rank ``i`` exchanges with stage rank ``i`` of the other
stages: a boundary value's receiver takes it in its producer's layout (the stage's program
moves it to the layout its first reader needs), so both sides hold shards of one shape.

Each micro-batch's forward receives its boundaries, runs, and sends its outputs on, every
message nonblocking (a task's receives are posted before the task before it runs, so they
arrive while the rank computes; a send's array is let go once it has gone; where ranks
outnumber the cores a receive sleeps while it waits, leaving the cores to the stages that
compute); its backward
receives the cotangents of the boundaries it sent (summed over their readers), runs, and
sends each received boundary's cotangent back, summed whole first. The gradients are
summed over the micro-batches and synchronised once per step inside each stage (the
programs' deferred Mirrors), then a parameter held by several stages has its gradient summed
between them (a tied embedding and output head), and the loss, the mean over the
micro-batches, reaches every rank from the last stage.

Messages between two ranks are tagged ``2 * boundary`` (forward) and ``2 * boundary + 1``
(backward); both sides run the micro-batches in the same order, so they match in order.
Every stage's task order is run on paper when the runner is built (:func:`~simpar.pipeline.
price.timeline` over the stages' dependencies): an order that would wait forever raises
there, on every rank alike, before any message. Then the ranks exchange the lists of the
messages their tasks will send and receive (:meth:`PipelineRunner.messages`: peer, tag,
micro-batch, bytes, in order), and every rank checks that each rank's sends to another are,
tag by tag, that rank's receives from it: ranks that disagree on the pipeline (its stages,
micro-batches, schedule or plan) raise there, all of them, with the first message that
differs, instead of one waiting forever in a receive. Each rank's sends and receives are
recorded in :attr:`PipelineRunner.trace` (the step's point-to-point schedule, as the
schedule guard lists collectives); a receive of the wrong size raises on its rank instead of
mismatching silently. Inside a task, the stage's own collectives run under its program's
schedule guard.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any

import numpy as np

from simpar import comm, graph
from simpar._env import SETTINGS
from simpar.cost import SimparCostModel
from simpar.layout import TensorLayout, shard_index, take_shard
from simpar.pipeline.price import dependencies, timeline
from simpar.pipeline.schedules import chunk_in_flight, schedule
from simpar.pipeline.stages import Stage, balance_stages, split_stages
from simpar.pipeline.strategy_files import stage_strategy_maps
from simpar.redistribution import execute, plan
from simpar.runtime.executor import input_gradient
from simpar.runtime.lowering import lower
from simpar.runtime.program import ParallelProgram
from simpar.search import (
    PlanRequest,
    StrategyMap,
    complete_plan,
    dataset_layouts,
    plan_request,
    request_from_context,
)

__all__ = ["PipelineRunner", "Transfer", "plan_pipeline", "plan_stages"]


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message of a step: ``kind`` "send" or "recv", of micro-batch
    ``micro``'s boundary ``name`` (a value or, ``backward``, its cotangent) with world rank
    ``peer``, ``nbytes`` long."""

    kind: str
    micro: int
    name: str
    backward: bool
    peer: int
    nbytes: int


def plan_stages(stages: Sequence[Stage], per_stage: int, planner: Any, dataset: Any
                ) -> list[ParallelProgram]:
    """Every stage's program, in stage order: ``planner(stage, dataset_strategy)`` gives the
    stage's (request, strategy map) for ``per_stage`` devices; a received boundary then takes
    the layout its producer's program gives it (pure: every rank plans every stage, so each
    knows its neighbours' layouts)."""
    programs: list[ParallelProgram] = []
    for st in stages:
        # One strategy per input: a batch input's is the dataset's; a boundary's cuts its
        # producer's layout, so that the stage plans for what it receives.
        strategy = tuple(
            tuple(programs[b.producer].layouts[v.id].cuts) if b is not None
            else _dataset_cuts(dataset, k, v.ndim, v.shape, per_stage)
            for k, v, b in zip(st.batch, st.graph.inputs, st.received))
        request, smap = planner(st, strategy)
        fixed = {}
        for v, b in zip(st.graph.inputs, st.received):
            if b is not None:
                lay = programs[b.producer].layouts[v.id]
                if lay.partial:
                    raise ValueError(f"pipeline: stage {b.producer} leaves {b.name} a pending "
                                     f"sum ({lay}); stage {st.index} needs it complete")
                fixed[v.name] = lay
        smap = replace(smap, inputs={**smap.inputs, **fixed})
        programs.append(lower(st.graph, smap, request.enable_alltoall))
    return programs


def plan_pipeline(network: Any, specs: Sequence[tuple[tuple[int, ...], Any]], stages: int,
                  device_num: int, mode: str, dataset: Any, micro_batches: int = 1,
                  interleave: bool = False, load_file: str | None = None,
                  scheduler: str = "1f1b", auto_split: bool = False,
                  plan: Callable[[PlanRequest], StrategyMap] = plan_request
                  ) -> tuple[list[Stage], list[ParallelProgram]]:
    """Trace ``network`` for one micro-batch of inputs ``specs`` ((shape, dtype) of the data
    and the label), cut it into ``stages`` stages (chunks by ``pipeline_segment`` when
    ``interleave``) and plan each for ``device_num / stages`` devices (pure): searched, or
    read from the pipelined strategy file ``load_file``
    (:func:`~simpar.pipeline.strategy_files.stage_strategy_maps`). A stage's search counts
    its activations once per micro-batch ``scheduler`` keeps in flight on it, so that the
    memory cap (and the memory dimensions, under ``memory_dimensions``) see what it holds.
    ``auto_split`` cuts the network where :func:`~simpar.pipeline.stages.balance_stages`
    says, whatever the Cells' ``pipeline_stage`` (``auto_pipeline``). ``plan`` searches
    each stage's request: under MPI, :func:`~simpar.search.plan_once` with ``together``
    (each stage searched once for every rank: by rank 0, or the memory dimensions'
    combinations shared among the ranks)."""
    g = graph.trace(network, list(specs), ["data", "label"])
    if auto_split:
        for node, stage in zip(g.nodes, balance_stages(g, stages)):
            node.stage, node.chunk = stage, -1
    chunks = 1 + max((n.chunk for n in g.nodes), default=0) if interleave else 1
    parts = split_stages(g, stages, chunks)
    loaded = None if not load_file else stage_strategy_maps(
        load_file, [st.graph for st in parts], stages, device_num // stages, mode)

    def planner(st: Stage, strategy: Any) -> tuple[Any, Any]:
        request = request_from_context(st.graph, cell=network, mode=mode,
                                       device_num=device_num // stages,
                                       dataset_strategy=strategy,
                                       micro_batches=micro_batches)
        chunk, stage = divmod(st.index, stages)
        live = chunk_in_flight(schedule(scheduler, stage, stages, micro_batches, chunks),
                               chunks)[chunk]
        if isinstance(request.cost_model, SimparCostModel) and live > 1:
            request = replace(request, cost_model=replace(request.cost_model,
                                                          activation_copies=live))
        if loaded is None:
            return request, plan(request)
        smap = loaded[st.index]
        if not smap.inputs:   # a plain MindSpore file: the inputs as the stage receives them
            lays = dataset_layouts([v.shape for v in st.graph.inputs], smap.device_num,
                                   strategy)
            smap = replace(smap, inputs={v.name: lay for v, lay in zip(st.graph.inputs, lays)})
        return request, complete_plan(request, smap)

    return parts, plan_stages(parts, device_num // stages, planner, dataset)


def _dataset_cuts(dataset: Any, k: int | None, ndim: int, shape: tuple[int, ...],
                  devices: int) -> tuple[int, ...]:
    """Batch input ``k``'s cuts under ``dataset`` (a tuple of strategies, "full_batch", or
    "data_parallel": the batch over every device that divides it)."""
    if isinstance(dataset, tuple):
        assert k is not None
        return tuple(dataset[k])
    if dataset == "data_parallel" and ndim and shape[0] % devices == 0:
        return (devices,) + (1,) * (ndim - 1)
    return (1,) * ndim


class PipelineRunner:
    """This rank's part of a pipelined step: its stage's programs (one per chunk with
    interleaved virtual stages), the schedule, and the peers of its stage rank in the other
    stages. ``stages`` and ``programs`` are per virtual stage (chunk ``v`` of stage ``s`` is
    ``v * pipeline_stages + s``)."""

    def __init__(self, stages: Sequence[Stage], programs: Sequence[ParallelProgram],
                 world_rank: int, pipeline_stages: int, scheduler: str, micro_batches: int,
                 loss_seed: float) -> None:
        self.stages, self.programs = list(stages), list(programs)
        self.count = pipeline_stages
        chunks = len(stages) // pipeline_stages
        self.per_stage = programs[0].device_num
        self.stage, self.local = divmod(world_rank, self.per_stage)
        self.ranks = tuple(range(self.stage * self.per_stage, (self.stage + 1) * self.per_stage))
        #: This rank's virtual stages, chunk by chunk.
        self.chunks = tuple(v * pipeline_stages + self.stage for v in range(chunks))
        self.program = programs[self.stage]
        self.micro_batches = micro_batches
        self.loss_seed = loss_seed
        self.trace: list[Transfer] = []
        self._posted: dict[tuple[int, int, bool, int], comm.RecvRequest] = {}
        #: The last step's seconds from its start to the end of its last task (``span``),
        #: blocked in receives (``waiting``: the bubble), and the rest (``busy``).
        self.busy = self.span = self.waiting = 0.0
        self.tasks: tuple[tuple[str, int, int], ...] = ()
        self._incoming: dict[tuple[str, int, int], list[Any]] = {}
        self.shared: dict[str, tuple[int, ...]] = {}
        settings = (scheduler, micro_batches, pipeline_stages, chunks)
        try:   # what a rank may refuse alone: every rank hears of it in the exchange below
            self.tasks = schedule(scheduler, self.stage, pipeline_stages, micro_batches,
                                  chunks)
            # Every stage's order, run on paper first: one that would wait forever raises
            # here, before any message is sent.
            timeline([schedule(scheduler, s, pipeline_stages, micro_batches, chunks)
                      for s in range(pipeline_stages)], lambda s, task: 1.0,
                     dependencies(self.stages, pipeline_stages))
            #: Per task, the messages it receives (worked out once, not on every step).
            self._incoming = {task: self._receives(task) for task in self.tasks}
            self.shared = self._shared()
            refused = None
        except ValueError as e:
            refused = str(e)
        self._agree(settings, refused)
        #: Whether a receive sleeps while it waits (where ranks outnumber the cores, as the
        #: MPI wait policy "yield" says), so that a stage in its bubble leaves the cores to
        #: the stages that compute.
        self.sleep = SETTINGS.get("wait_policy") == "yield"

    def messages(self) -> list[tuple[str, int, int, int, int]]:
        """Every point-to-point message of this rank's step, in the order its tasks make
        them: (``"send"`` or ``"recv"``, the world rank at the other end, the tag,
        the micro-batch, the bytes)."""
        out = []
        for task in self.tasks:
            kind, chunk, k = task
            vs = chunk * self.count + self.stage
            st, prog = self.stages[vs], self.programs[vs]
            out += [("recv", self.peer(other), 2 * b.index + backward, k,
                     math.prod(shape) * np.dtype(dtype).itemsize)
                    for other, shape, dtype, b, backward in self._incoming[task]]
            if kind == "F":
                sent = [(v, b, b.consumers) for v, b in zip(prog.graph.outputs, st.sent)
                        if b is not None]
            else:
                sent = [(v, b, (b.producer,)) for v, b in zip(st.graph.inputs, st.received)
                        if b is not None and v.id in st.graph.grad_inputs]
            out += [("send", self.peer(to), 2 * b.index + (kind == "B"), k,
                     prog.layouts[v.id].local_size() * v.dtype.itemsize)
                    for v, b, ends in sent for to in ends]
        return out

    def _agree(self, settings: tuple[str, int, int, int], refused: str | None) -> None:
        """The schedule guard of the messages between stages, one exchange when the runner
        is built: every rank's pipeline settings (scheduler, micro-batches, stages, chunks),
        the error that made it refuse its part, if any, and the messages its tasks will make.
        Every rank raises alike when any rank refused, when the settings differ, or when a
        rank's sends to another are not, tag by tag and in order, that rank's receives from
        it, instead of one waiting forever in a receive."""
        mine = {"settings": list(settings), "refused": refused,
                "messages": [] if refused else self.messages()}
        ranks = [json.loads(t) for t in comm.allgather_text(json.dumps(mine))]
        failed = [(r, got["refused"]) for r, got in enumerate(ranks) if got["refused"]]
        if failed:
            raise ValueError(failed[0][1] if all(e == failed[0][1] for _, e in failed) else
                             f"pipeline: rank {failed[0][0]} refused its part: {failed[0][1]}")
        apart = [r for r, got in enumerate(ranks) if got["settings"] != list(settings)]
        if apart:
            raise ValueError(f"pipeline: ranks disagree on (scheduler, micro-batches, stages, "
                             f"chunks): rank {comm.get_rank()} has {list(settings)}, rank "
                             f"{apart[0]} {ranks[apart[0]]['settings']}; every rank must run "
                             "the same pipeline")
        flows: dict[str, dict[tuple[int, int, int], list[tuple[int, int]]]] = {
            "send": {}, "recv": {}}
        for me, got in enumerate(ranks):
            for kind, peer, tag, k, nbytes in got["messages"]:
                ends = (me, peer) if kind == "send" else (peer, me)
                flows[kind].setdefault((*ends, tag), []).append((k, nbytes))
        for src, dst, tag in sorted(set(flows["send"]) | set(flows["recv"])):
            sent = flows["send"].get((src, dst, tag), [])
            taken = flows["recv"].get((src, dst, tag), [])
            if sent == taken:
                continue
            i = next((i for i, (a, b) in enumerate(zip(sent, taken)) if a != b),
                     min(len(sent), len(taken)))
            raise ValueError(
                f"pipeline: rank {src} sends rank {dst} {len(sent)} message(s) tagged {tag} "
                f"but rank {dst} receives {len(taken)} from it, message {i} (micro-batch, "
                f"bytes) {tuple(sent[i]) if i < len(sent) else 'none'} sent and "
                f"{tuple(taken[i]) if i < len(taken) else 'none'} received: every rank must "
                "run the same pipeline (stages, micro-batches, schedule, plan)")

    def peer(self, virtual: int) -> int:
        """The world rank of this rank's stage rank on (virtual) stage ``virtual``'s ranks."""
        return virtual % self.count * self.per_stage + self.local

    def params(self) -> dict[str, tuple[ParallelProgram, str]]:
        """Every parameter this rank holds: the program (of its first chunk that reads it)
        whose layouts it is stored in."""
        out: dict[str, tuple[ParallelProgram, str]] = {}
        for vs in self.chunks:
            for name in self.programs[vs].param_layouts:
                out.setdefault(name, (self.programs[vs], name))
        return out

    def _shared(self) -> dict[str, tuple[int, ...]]:
        """Per parameter this rank holds that other stages hold too, the world ranks that
        sum its gradient (this stage rank in each), after checking they store it alike."""
        out = {}
        for name in self.params():
            holders = [s for s, p in enumerate(self.programs) if name in p.param_layouts]
            first = self.programs[holders[0]].storage_layout(name)
            blocks = [first.slice_of(r) for r in range(self.per_stage)]
            for s in holders[1:]:   # every stage rank must store the same block of it
                other = self.programs[s].storage_layout(name)
                if other.partial or first.partial or \
                        [other.slice_of(r) for r in range(self.per_stage)] != blocks:
                    raise ValueError(f"pipeline: parameter {name} is read on virtual stages "
                                     f"{holders}, stored as {first} on {holders[0]} but "
                                     f"{other} on {s}; shard it alike on every stage that "
                                     "reads it")
            mine_too = [s for s in holders if s in self.chunks]
            if len(mine_too) > 1:
                raise ValueError(f"pipeline: parameter {name} is read by chunks {mine_too} of "
                                 f"stage {self.stage}; simpar keeps a parameter in one chunk "
                                 "per stage")
            group = tuple(sorted({self.peer(s) for s in holders}))
            if len(group) > 1:
                out[name] = group
        return out

    # ------------------------------------------------------------ one step
    def step(self, data: np.ndarray, label: np.ndarray, params: dict[str, np.ndarray],
             step: int) -> tuple[float, dict[str, np.ndarray]]:
        """The loss (every rank) and this rank's gradients of one step on the global batch."""
        m, count = self.micro_batches, self.count
        batch = [np.split(x, m, axis=0) for x in (data, label)]
        tapes: dict[tuple[int, int], Any] = {}
        total: dict[str, np.ndarray] = {}
        losses: list[float] = []
        pending: list[comm.SendRequest] = []
        self.trace = []
        started, self.waiting = perf_counter(), 0.0
        self._posted = {}
        for t, (kind, chunk, k) in enumerate(self.tasks):
            pending = [r for r in pending if not r.done()]   # let the sent arrays go
            for ahead in self.tasks[t:t + 2]:   # this task's receives, and the next one's
                self._post(ahead)
            vs = chunk * count + self.stage
            st, prog = self.stages[vs], self.programs[vs]
            if kind == "F":
                inputs = [self._input(batch, st, prog, j, k) for j in range(len(st.batch))]
                with comm.stage_world(self.ranks):
                    outs, tapes[vs, k] = prog.forward(inputs, params, step=m * step + k)
                    prog.write_states(params, tapes[vs, k].states)
                for out, b, loss in zip(outs, st.sent, st.loss):
                    if b is None:
                        if loss == 0:
                            losses.append(float(out))
                        continue
                    for c in b.consumers:
                        pending.append(self._send(out, c, b, k, False))
                continue
            seeds = [self._seed(prog, out, b, k) for out, b in zip(prog.graph.outputs, st.sent)]
            with comm.stage_world(self.ranks):
                grads = prog.backward(tapes.pop((vs, k)), seeds)
            for v, b in zip(st.graph.inputs, st.received):
                if b is not None and v.id in st.graph.grad_inputs:
                    pending.append(self._send(grads.pop(input_gradient(v.name)), b.producer,
                                              b, k, True))
            _accumulate(total, grads)
            del grads   # (held until the next backward: a micro-batch's gradients twice)
        self.span = perf_counter() - started
        self.busy = self.span - self.waiting
        if m > 1:   # the step's one synchronisation, chunk by chunk
            for vs in self.chunks:
                prog = self.programs[vs]
                mine = {n: total[n] for n in prog.param_layouts if n in total}
                with comm.stage_world(self.ranks):
                    total.update(prog.sync(mine))
        for name, group in self.shared.items():   # a parameter several stages read
            total[name] = comm.all_reduce(total[name], group=group)
        for request in pending:
            request.wait()
        last = self.peer(len(self.stages) - 1) - self.local
        mean = np.array([np.mean(losses) if losses else 0.0])
        return float(comm.broadcast(mean, root=last)[0]), total

    def global_parameters(self, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every stage's parameters assembled whole on every rank (collective: every rank
        calls): each stage gathers its own, and its stage rank 0 broadcasts them."""
        out: dict[str, np.ndarray] = {}
        for vs, prog in enumerate(self.programs):
            for name in prog.param_layouts:
                if name in out:
                    continue
                v = prog.param_values[name]
                whole = np.empty(v.shape, v.dtype)
                if vs in self.chunks:
                    lay = prog.storage_layout(name)
                    with comm.stage_world(self.ranks), comm.label("assemble"):
                        whole = (params[name].copy() if lay.replicated() == lay else
                                 execute(plan(lay, lay.replicated()), params[name]))
                out[name] = comm.broadcast(whole, root=self.peer(vs) - self.local)
        return out

    def _input(self, batch: list[list[np.ndarray]], st: Stage, prog: ParallelProgram,
               j: int, k: int) -> np.ndarray:
        """Input ``j`` of micro-batch ``k`` of a virtual stage: this rank's shard of a batch
        input, or a boundary received from its producer."""
        v, b = st.graph.inputs[j], st.received[j]
        lay: TensorLayout = prog.layouts[v.id]
        if b is None:
            source = st.batch[j]
            assert source is not None
            return take_shard(batch[source][k], *shard_index(lay, self.local))
        return self._recv(b.producer, b, k, False)

    def _seed(self, prog: ParallelProgram, out: Any, b: Any, k: int) -> np.ndarray | None:
        """The cotangent output ``out`` starts the backward with: the loss's seed, or the sum
        of the cotangents the boundary's readers sent back (None: an integer boundary)."""
        if b is None:
            return np.full(prog.layouts[out.id].local_shape(),
                           self.loss_seed / self.micro_batches, dtype=out.dtype)
        if out.dtype.kind != "f":
            return None
        parts = [self._recv(c, b, k, True) for c in b.consumers]
        return parts[0] if len(parts) == 1 else np.sum(parts, axis=0)

    def _send(self, x: np.ndarray, virtual: int, b: Any, k: int, backward: bool
              ) -> comm.SendRequest:
        peer = self.peer(virtual)
        self.trace.append(Transfer("send", k, b.name, backward, peer, x.nbytes))
        return comm.isend(x, peer, tag=2 * b.index + backward)

    def _receives(self, task: tuple[str, int, int]
                  ) -> list[tuple[int, tuple[int, ...], Any, Any, bool]]:
        """(the virtual stage at the other end, shape, dtype, boundary, backward) of every
        message ``task`` receives, in the order it takes them."""
        kind, chunk, _ = task
        vs = chunk * self.count + self.stage
        st, prog = self.stages[vs], self.programs[vs]
        if kind == "F":
            return [(b.producer, prog.layouts[v.id].local_shape(), v.dtype, b, False)
                    for v, b in zip(st.graph.inputs, st.received) if b is not None]
        return [(c, prog.layouts[out.id].local_shape(), out.dtype, b, True)
                for out, b in zip(prog.graph.outputs, st.sent)
                if b is not None and out.dtype.kind == "f" for c in b.consumers]

    def _post(self, task: tuple[str, int, int]) -> None:
        """Post ``task``'s receives (once): they arrive while this rank computes."""
        for other, shape, dtype, b, backward in self._incoming[task]:
            key = (other, b.index, backward, task[2])
            if key not in self._posted:
                self._posted[key] = comm.irecv(self.peer(other), shape, dtype,
                                               tag=2 * b.index + backward)

    def _recv(self, other: int, b: Any, k: int, backward: bool) -> np.ndarray:
        """Micro-batch ``k``'s message from virtual stage ``other`` (posted before)."""
        t0 = perf_counter()
        x = self._posted.pop((other, b.index, backward, k)).wait(sleep=self.sleep)
        self.waiting += perf_counter() - t0
        self.trace.append(Transfer("recv", k, b.name, backward, self.peer(other), x.nbytes))
        return x


def _accumulate(total: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
    """Add a micro-batch's gradients into ``total`` (the first ones taken as they are)."""
    for name, g in grads.items():
        if name not in total:
            total[name] = g if g.flags.writeable else g.copy()
        else:
            total[name] += g
