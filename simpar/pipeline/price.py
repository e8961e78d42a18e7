"""What a pipelined step costs (pure): the stages' tasks laid on a timeline.

Each virtual stage's program is priced by the cost model (:func:`simpar.cost.model.
phase_seconds`): one micro-batch's forward ``F``, its backward ``B`` (after a chunk's first,
plus adding its gradients into the step's sum, :func:`~simpar.cost.model.
accumulation_seconds`), and what runs once per step (the deferred Mirrors). :func:`timeline`
then runs every stage's task list in order, a task starting when its stage is free and the
messages it needs have arrived: a forward needs its boundaries' forwards on their producers,
a backward the backwards of its boundaries' readers, each plus the message's time on the
link between the two ranks (one round and its bytes, :meth:`DeviceProfile.link`). A schedule
whose order cannot run (a stage waiting for a message that can only come after it) raises,
which is how the tests prove each schedule free of deadlock.

The step is the slowest stage's: its last task's end, then its once-per-step
synchronisation, its optimizer's update, the sum of shared parameters' gradients between
stages, and the profile's fixed costs. A stage's idle time is its span's time not spent in
tasks: the bubble, ``(S - 1) / (M + S - 1)`` of it for equal stages. A stage holds its
parameters, gradients and optimizer state, and the activations of every micro-batch in
flight (:func:`~simpar.pipeline.schedules.in_flight`, per chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simpar.cost.model import (
    MemoryRow,
    accumulation_seconds,
    evaluate,
    optimizer_seconds,
    phase_seconds,
)
from simpar.cost.profile import DeviceProfile, load_profile
from simpar.pipeline.schedules import Task, chunk_in_flight, most_held, schedule
from simpar.pipeline.stages import Stage
from simpar.runtime.program import ParallelProgram

__all__ = ["PipelineCost", "StageCost", "TaskOrder", "dependencies", "price_pipeline",
           "task_order", "timeline"]

Key = tuple[int, str, int, int]   # (stage, kind, chunk, micro-batch)


@dataclass(frozen=True)
class TaskOrder:
    """A schedule's tasks in an order in which each comes after everything it waits for
    (:func:`task_order`): per task, its key ``(stage, kind, chunk, micro-batch)``, the index
    of its stage's previous task (-1: none) and the ``(index, latency)`` of every task whose
    message it needs. It depends on the schedule alone, so one order serves every set of
    durations (:meth:`run`)."""

    keys: tuple[Key, ...]
    before: tuple[int, ...]
    waits: tuple[tuple[tuple[int, float], ...], ...]

    def run(self, seconds: Sequence[float], latency_scale: float = 1.0
            ) -> list[tuple[float, float]]:
        """(start, end) of every task, in this order, taking ``seconds[i]`` each: a task
        starts once its stage's previous task has ended and every message it needs has
        arrived (``latency_scale`` times the latency after its sender's end)."""
        out: list[tuple[float, float]] = []
        for b, waits, d in zip(self.before, self.waits, seconds):
            start = out[b][1] if b >= 0 else 0.0
            for j, latency in waits:
                arrives = out[j][1] + latency * latency_scale
                if arrives > start:
                    start = arrives
            out.append((start, start + d))
        return out


def task_order(tasks: Sequence[Sequence[Task]],
               needs: Callable[[int, Task], Sequence[tuple[int, Task, float]]]) -> TaskOrder:
    """``tasks[s]``, stage ``s``'s tasks in the order it runs them, merged into one order
    in which every ``(stage, task, latency)`` of ``needs(s, task)`` comes first. Raises
    ``ValueError`` when no stage can go on (the schedule deadlocks)."""
    index: dict[Key, int] = {}
    keys: list[Key] = []
    before: list[int] = []
    waits: list[tuple[tuple[int, float], ...]] = []
    at = [0] * len(tasks)
    last = [-1] * len(tasks)
    remaining = sum(len(t) for t in tasks)
    while remaining:
        moved = False
        for s, own in enumerate(tasks):
            while at[s] < len(own):
                task = own[at[s]]
                found = []
                for other, dep, latency in needs(s, task):
                    j = index.get((other, *dep))
                    if j is None:
                        break
                    found.append((j, latency))
                else:
                    key = (s, *task)
                    before.append(last[s])
                    index[key] = last[s] = len(keys)
                    keys.append(key)
                    waits.append(tuple(found))
                    at[s] += 1
                    remaining -= 1
                    moved = True
                    continue
                break
        if not moved:
            stuck = {s: own[at[s]] for s, own in enumerate(tasks) if at[s] < len(own)}
            raise ValueError(f"pipeline: the schedule deadlocks: every stage waits ({stuck})")
    return TaskOrder(tuple(keys), tuple(before), tuple(waits))


def timeline(tasks: Sequence[Sequence[Task]], seconds: Callable[[int, Task], float],
             needs: Callable[[int, Task], Sequence[tuple[int, Task, float]]]
             ) -> dict[Key, tuple[float, float]]:
    """(start, end) of every stage's every task: ``tasks[s]`` in order on stage ``s``, each
    taking ``seconds(s, task)`` and starting once stage ``s`` is free and every ``(stage,
    task, latency)`` of ``needs(s, task)`` has ended ``latency`` before. Raises
    ``ValueError`` when no stage can go on (the schedule deadlocks)."""
    order = task_order(tasks, needs)
    spans = order.run([seconds(k[0], k[1:]) for k in order.keys])
    return dict(zip(order.keys, spans))


def dependencies(stages: Sequence[Stage], count: int,
                 latency: Callable[[int, int, Any], float] = lambda a, b, boundary: 0.0
                 ) -> Callable[[int, Task], list[tuple[int, Task, float]]]:
    """What each task of a pipeline of ``stages`` (per virtual stage, ``count`` real ones)
    waits for, as :func:`timeline` takes it: a forward, its boundaries' forwards on their
    producers; a backward, its own forward and the backwards of the readers of every float
    boundary it sent; each message taking ``latency(from, to, boundary)``."""
    def needs(s: int, task: Task) -> list[tuple[int, Task, float]]:
        kind, c, k = task
        vs = c * count + s
        st = stages[vs]
        if kind == "F":
            return [(b.producer % count, ("F", b.producer // count, k),
                     latency(b.producer, vs, b)) for b in st.received if b is not None]
        out = [(s, ("F", c, k), 0.0)]
        for v, b in zip(st.graph.outputs, st.sent):
            if b is not None and v.dtype.kind == "f":
                out += [(r % count, ("B", r // count, k), latency(r, vs, b))
                        for r in b.consumers]
        return out

    return needs


@dataclass(frozen=True)
class StageCost:
    """One stage's predicted part of a step (seconds and bytes; the slowest rank's)."""

    stage: int
    forward: float          # one micro-batch, all its chunks
    backward: float
    busy: float             # every task of the step
    idle: float             # waiting inside its span: the bubble
    sync: float             # once per step: Mirrors, the optimizer, shared parameters
    end: float              # when its step ends
    in_flight: int
    peak_memory: int


@dataclass(frozen=True)
class PipelineCost:
    """A pipelined step's prediction: ``step_seconds`` the slowest stage's end plus the
    fixed costs; ``bubble`` the mean stage's idle share of the tasks' span."""

    profile: str
    scheduler: str
    stages: tuple[StageCost, ...]
    micro_batches: int
    chunks: int
    step_seconds: float
    bubble: float
    p2p_seconds: float      # every message of the step, summed over the stages
    #: Every task of the step: (stage, "F" or "B", chunk, micro-batch, start, end) seconds.
    tasks: tuple[tuple[int, str, int, int, float, float], ...] = ()

    @property
    def peak_memory(self) -> int:
        return max(s.peak_memory for s in self.stages)

    def table(self) -> str:
        """A line per stage."""
        bubble = 0.0 if self.bubble < 0 else self.bubble   # not -0.0 (a NaN shows)
        lines = [f"predicted step {self.step_seconds * 1e3:.3f} ms ({self.scheduler}, "
                 f"{self.micro_batches} micro-batches, bubble {bubble:.1%})"]
        for s in self.stages:
            lines.append(f"stage {s.stage}: forward {s.forward * 1e3:.3f} ms + backward "
                         f"{s.backward * 1e3:.3f} ms per micro-batch, busy "
                         f"{s.busy * 1e3:.3f} ms, idle {s.idle * 1e3:.3f} ms, "
                         f"{s.in_flight} micro-batch(es) in flight, peak "
                         f"{s.peak_memory / 2**20:.2f} MiB")
        return "\n".join(lines)


def price_pipeline(stages: Sequence[Stage], programs: Sequence[ParallelProgram],
                   pipeline_stages: int, scheduler: str, micro_batches: int,
                   profile: str | DeviceProfile = "cpu-local", optimizer: str = "momentum"
                   ) -> PipelineCost:
    """The step of ``programs`` (one per virtual stage, as :func:`plan_stages` makes them)
    under ``scheduler`` with ``micro_batches``, on ``profile``."""
    prof = load_profile(profile)
    count = pipeline_stages
    chunks = len(programs) // count
    per = programs[0].device_num
    phases = [phase_seconds(p, prof) for p in programs]
    # A chunk's backwards run in micro-batch order; each after its first adds its gradients
    # into the step's sum.
    summing = [accumulation_seconds(p, prof) for p in programs]
    tasks = [schedule(scheduler, s, count, micro_batches, chunks) for s in range(count)]

    def link(a: int, b: int, nbytes: int) -> float:
        """A message from virtual stage a's rank 0 to virtual stage b's."""
        ra, rb = a % count * per, b % count * per
        return 0.0 if ra == rb else prof.link((ra, rb)).seconds(1, nbytes)

    sizes = {b.index: programs[vs].layouts[v.id].local_size() * v.dtype.itemsize
             for vs, st in enumerate(stages)
             for v, b in zip(st.graph.outputs, st.sent) if b is not None}

    def seconds(s: int, task: Task) -> float:
        kind, c, k = task
        f, b, _ = phases[c * count + s]
        return f if kind == "F" else b + (summing[c * count + s] if k else 0.0)

    spans = timeline(tasks, seconds, dependencies(
        stages, count, lambda a, b, boundary: link(a, b, sizes[boundary.index])))
    p2p = sum(link(b.producer, vs, sizes[b.index]) * micro_batches * 2
              for vs, st in enumerate(stages) for b in st.received if b is not None)
    shared = _shared_sync(programs, count, per, prof)
    rows = []
    last_step = 0.0
    for s in range(count):
        mine = [c * count + s for c in range(chunks)]
        own = [spans[(s, *t)] for t in tasks[s]]
        busy = sum(e - b for b, e in own)
        first, end = min(b for b, _ in own), max(e for _, e in own)
        sync = sum(phases[v][2] + optimizer_seconds(programs[v], optimizer, prof)
                   for v in mine) + shared.get(s, 0.0)
        flight = chunk_in_flight(tasks[s], chunks)
        reports = [evaluate(programs[v], prof, optimizer) for v in mine]
        peak = _stage_peak(tasks[s], [max(r.memory, key=lambda m: m.peak) for r in reports])
        rows.append(StageCost(s, sum(phases[v][0] for v in mine),
                              sum(phases[v][1] for v in mine), busy,
                              end - first - busy, sync, end + sync, max(flight), peak))
        last_step = max(last_step, end + sync)
    fixed = prof.step_overhead + prof.step_collective_seconds(
        "AllReduce", range(count * per), 8, 0) + prof.step_collective_seconds(
        "Broadcast", range(count * per), 8, 8)
    spans_total = [r.busy + r.idle for r in rows]
    bubble = sum(r.idle for r in rows) / sum(spans_total) if sum(spans_total) else 0.0
    placed = tuple((st, kind, c, m, b, e) for (st, kind, c, m), (b, e)
                   in sorted(spans.items(), key=lambda item: item[1]))
    return PipelineCost(prof.name, scheduler, tuple(rows), micro_batches, chunks,
                        last_step + fixed, bubble, p2p, placed)


def _stage_peak(tasks: Sequence[Task], rows: Sequence[MemoryRow]) -> int:
    """A stage's peak over its ``tasks`` in order, ``rows`` the fullest rank's memory of each
    chunk's program: every chunk's parameters, gradients and optimizer state, plus the most
    held at once of the activations of the micro-batches in flight (each chunk's, as the
    schedule runs them), with the running task's transient (its collective buffer or
    backward), or the optimizer's update after the last backward."""
    held = most_held(tuple(tasks), [r.activations for r in rows],
                     [max(r.comm_buffer, r.backward) for r in rows])
    static = sum(r.parameters + r.gradients + r.optimizer for r in rows)
    return int(static + max(held, max(r.update for r in rows)))


def _shared_sync(programs: Sequence[ParallelProgram], count: int, per: int,
                 prof: DeviceProfile) -> Mapping[int, float]:
    """Per stage, the AllReduces that sum shared parameters' gradients between stages."""
    out: dict[int, float] = {}
    names: dict[str, set[int]] = {}
    for vs, p in enumerate(programs):
        for name in p.param_layouts:
            names.setdefault(name, set()).add(vs % count)
    for name, holders in names.items():
        if len(holders) < 2:
            continue
        vs = next(v for v, p in enumerate(programs) if name in p.param_layouts)
        nbytes = programs[vs].storage_layout(name).local_size() * \
            programs[vs].param_values[name].dtype.itemsize
        group = [s * per for s in sorted(holders)]
        for s in holders:
            out[s] = out.get(s, 0.0) + prof.step_collective_seconds("AllReduce", group,
                                                                    nbytes, 0)
    return out
