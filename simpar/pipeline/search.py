"""Searching a GPT's pipeline plan (pure): the stage count, the layer ranges, each stage's
layout and memory dimensions, and the micro-batches, under the devices' memory cap.

In the manner of Alpa's inter-operator pass (Zheng et al. 2022), with the structure of a GPT
used the way Megatron-LM's analysis uses it (Narayanan et al. 2021): the network is a run of
units (the embedding, ``L`` identical blocks, the final LayerNorm and head with the loss),
and a stage is a contiguous range of them on a sub-mesh of ``D / S`` devices.

For each candidate ``S`` (a divisor of ``D`` with ``S <= L``) and each intra-stage choice
(:class:`StageChoice`: Megatron's ``dp x tp`` layout inside the stage with ``tp`` within a
server, the micro-batch size per data-parallel replica, the optimizer-parallel level and
whether blocks recompute), one embedding, one block and one head are planned and lowered on
the sub-mesh (:func:`~simpar.pipeline.runner.plan_pipeline`, a one-block GPT cut into three
virtual stages) and priced by the cost model: each unit's forward and backward per
micro-batch, its once-per-step synchronisation and update, and its memory (parameters,
gradients and optimizer state; the activations one micro-batch keeps). Then:

* the layer ranges: the fewest-seconds split of the ``L`` blocks over the ``S`` stages in
  which every stage fits the cap, with 1F1B's ``min(S - s, M)`` micro-batches in flight on
  stage ``s`` (a search over the slowest stage's time, each stage given the most blocks
  that fit under it); on the :data:`LADDER`'s ``"stages"`` rungs each stage also chooses
  whether its blocks recompute, with the split: under a limit on the slowest stage it takes
  the most blocks either choice fits, and keeps the faster choice that fits what it is
  given, so the early stages, holding more micro-batches in flight, recompute and take
  fewer blocks;
* the step: the stages' 1F1B tasks on a timeline (:func:`~simpar.pipeline.price.timeline`'s,
  in an order made once per schedule and shared by the candidates), messages between stages
  at the link's time, then each stage's synchronisation and update;
* a layout that fits is priced again under the interleaved 1F1B with two and four chunks
  per stage (:data:`CHUNKS`; :func:`price_interleaved`: the blocks split evenly over the
  virtual stages), from the same units.

The plan is the cheapest that fits. Each layout is tried twice: in Megatron's ``dp x tp``,
and with every op's cuts chosen by the operator-level search (``intra``, recursive
programming by default) on the stage's devices for a micro-batch of the same rows
(:attr:`StageChoice.search`). Dynamic programming may be named instead; on 128 devices it
takes 9.6 s for one GPT-3 block and on 1024 devices 149 s (``docs/pipeline.md``), too slow
for every candidate of GPT-3 within a minute.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from simpar import graph, nn
from simpar._enums import StrEnum
from simpar.cost import SimparCostModel
from simpar.cost.model import accumulation_seconds, evaluate, optimizer_seconds, phase_seconds
from simpar.cost.profile import DeviceProfile, load_profile
from simpar.nn import presets
from simpar.optimizer_parallel import OptimizerLevel, OptimizerParallel
from simpar.pipeline.price import TaskOrder, task_order
from simpar.pipeline.runner import plan_stages
from simpar.pipeline.schedules import in_flight, most_held, schedule
from simpar.pipeline.stages import split_stages
from simpar.runtime.lowering import NothingParallelWarning, lower
from simpar.search import plan_request, request_from_context
from simpar.search.planner import OptimizerShardWarning
from simpar.search.pricing import NoAvailableCost

__all__ = ["CHUNKS", "LADDER", "GPTShape", "PipelinePlan", "PipelineSearch", "Recompute",
           "StageChoice", "price_choice", "price_interleaved", "search_pipeline"]


@dataclass(frozen=True)
class GPTShape:
    """The GPT to plan: vocabulary, sequence, width, layers, heads, global batch, dtype."""

    vocab: int
    seq: int
    hidden: int
    layers: int
    heads: int
    batch: int
    dtype: str = "float16"


@dataclass(frozen=True)
class StageChoice:
    """Inside every stage: ``dp x tp`` devices (Megatron's layout), ``mbs`` rows per replica
    per micro-batch, the optimizer-parallel level (None: off), and whether blocks
    recompute. With ``search`` (an auto_parallel search mode), the operator-level search
    chooses every op's cuts on the stage's devices instead of Megatron's layout, for a
    micro-batch of the same ``dp x mbs`` rows."""

    tp: int
    dp: int
    mbs: int
    level: str | None
    recompute: bool
    search: str | None = None

    @property
    def rows(self) -> int:
        """Rows of the global batch per micro-batch."""
        return self.dp * self.mbs

    def describe(self) -> str:
        cuts = (f"tp {self.tp} x dp {self.dp}, micro-batch {self.mbs} per replica"
                if self.search is None else
                f"cuts searched by {self.search} on {self.tp * self.dp} devices, micro-batch "
                f"{self.rows} rows")
        return (f"{cuts}, optimizer {self.level or 'not sharded'}, "
                f"{'full' if self.recompute else 'no'} recomputation")


@dataclass(frozen=True)
class _Unit:
    """One unit priced: seconds of a micro-batch's forward and backward, once per step
    (synchronisation and update), and bytes (static: parameters, gradients, optimizer
    state; one micro-batch's activations; the transient peak on top); and seconds of adding
    a micro-batch's gradients into the step's sum (every backward but the first)."""

    forward: float
    backward: float
    once: float
    static: int
    activations: int
    transient: int
    summing: float = 0.0


@dataclass(frozen=True)
class PipelinePlan:
    """One candidate, priced."""

    stages: int
    devices_per_stage: int
    micro_batches: int
    choice: StageChoice
    blocks: tuple[int, ...]          # per (virtual) stage
    step_seconds: float
    stage_memory: tuple[int, ...]
    bubble: float
    fits: bool
    chunks: int = 1                  # virtual stages per stage (interleaved 1F1B when > 1)
    #: The stages whose blocks recompute, where the stages choose apart (``apart``; else
    #: ``choice.recompute`` says for every stage).
    recomputed: tuple[int, ...] = ()
    apart: bool = False

    @property
    def peak_memory(self) -> int:
        return max(self.stage_memory)

    def describe(self) -> str:
        where = ("blocks per stage" if self.chunks == 1 else
                 f"interleaved 1F1B, {self.chunks} chunks per stage, blocks per chunk")
        choice = self.choice.describe()
        if self.apart and len(self.recomputed) == self.stages:
            choice = choice.replace("no recomputation", "full recomputation")
        elif self.apart and self.recomputed:
            choice = choice.replace("no recomputation", f"recomputation on stages "
                                    f"{_ranges(self.recomputed)} of {self.stages}")
        return (f"pp {self.stages} x ({choice}), {self.micro_batches} "
                f"micro-batches, {where} {_runs(self.blocks)}")

    @property
    def rung(self) -> tuple[str | None, Recompute]:
        """Its rung of the :data:`LADDER`: the optimizer level, and which stages recompute."""
        return (self.choice.level, Recompute.STAGES if self.apart else
                Recompute.ALL if self.choice.recompute else Recompute.NONE)


def _ranges(stages: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for s in sorted(stages):
        if runs and runs[-1][1] == s - 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _runs(blocks: Sequence[int]) -> str:
    """``[6, 6, 6, 8]`` as ``"6 x3, 8"``: each run of equal counts once."""
    out: list[str] = []
    k = 0
    while k < len(blocks):
        j = k
        while j < len(blocks) and blocks[j] == blocks[k]:
            j += 1
        out.append(f"{blocks[k]} x{j - k}" if j - k > 1 else str(blocks[k]))
        k = j
    return "[" + ", ".join(out) + "]"


@dataclass
class PipelineSearch:
    """Every candidate priced, the best that fits (None: nothing fits), the seconds the
    search took, and how many layouts could not fit whatever their memory dimensions."""

    candidates: list[PipelinePlan]
    best: PipelinePlan | None
    seconds: float
    capacity: int
    #: Layouts left out unpriced: their blocks' weights and gradients alone exceed the cap.
    skipped: int = 0

    def table(self, top: int = 10) -> str:
        rows = sorted(self.candidates, key=lambda p: (not p.fits, p.step_seconds))[:top]
        lines = [f"{'pp':>3} {'V':>2} {'tp':>3} {'dp':>4} {'mbs':>3} {'M':>4} {'level':>7} "
                 f"{'recomp':>6} {'step s':>9} {'bubble':>7} {'peak GiB':>9}  fits"]
        for p in rows:
            c = p.choice
            tp, dp = (c.tp, c.dp) if c.search is None else ("-", f"{c.tp * c.dp}*")
            lines.append(f"{p.stages:>3} {p.chunks:>2} {tp:>3} {dp:>4} {c.mbs:>3} "
                         f"{p.micro_batches:>4} "
                         f"{c.level or 'off':>7} {_recomputes(p):>6} "
                         f"{p.step_seconds:>9.3f} {p.bubble:>7.1%} "
                         f"{p.peak_memory / 2**30:>9.2f}  {'yes' if p.fits else 'NO'}")
        if any(p.choice.search for p in rows):
            lines.append("(tp - , dp N*: every op's cuts searched on the stage's N devices, "
                         "for a micro-batch of dp x mbs rows of Megatron's layout beside it)")
        return "\n".join(lines)


def _recomputes(p: PipelinePlan) -> str:
    """Which stages recompute, for a table: yes, no, or how many of them."""
    if p.apart and 0 < len(p.recomputed) < p.stages:
        return f"{len(p.recomputed)}/{p.stages}"
    return "yes" if p.choice.recompute or p.recomputed else "no"


def _units(shape: GPTShape, n: int, choice: StageChoice, prof: DeviceProfile,
           optimizer: str, plans: dict[Any, Any] | None = None
           ) -> tuple[_Unit, _Unit, _Unit, int]:
    """The embedding, one block and the head on ``n`` devices under ``choice``, priced; and
    the bytes of the activation one stage sends the next per micro-batch (per rank).
    ``plans`` keeps the three units' programs per layout and level across calls: with and
    without recomputation they share their strategies, and are only lowered apart."""
    key = (n, choice.tp, choice.dp, choice.mbs, choice.level, choice.search)
    found = plans.get(key) if plans is not None else None
    if found is None:
        found = _plan_units(shape, n, choice, prof, optimizer)
        if plans is not None:
            plans[key] = found
    parts, programs = found
    if choice.recompute:   # the same strategies, with the block's ops run again backward
        programs = [lower(st.graph, replace(prog.strategy_map, recompute=tuple(
                        seg.name for seg in st.graph.segments)), prog.enable_alltoall)
                    for st, prog in zip(parts, programs)]
    units = []
    for prog in programs:
        report = evaluate(prog, prof, optimizer)
        f, bwd, once = phase_seconds(prog, prof, report.slowest_rank)
        row = max(report.memory, key=lambda m: m.peak)
        static = row.parameters + row.gradients + row.optimizer
        units.append(_Unit(f, bwd, once + optimizer_seconds(prog, optimizer, prof), static,
                           row.activations, row.peak - static - row.activations,
                           accumulation_seconds(prog, prof)))
    out = programs[0].graph.outputs[0]
    sent = programs[0].layouts[out.id].local_size() * out.dtype.itemsize
    return units[0], units[1], units[2], sent


def _plan_units(shape: GPTShape, n: int, choice: StageChoice, prof: DeviceProfile,
                optimizer: str) -> tuple[list[Any], list[Any]]:
    """A one-block GPT cut into its embedding, block and head, each planned on ``n`` devices
    without recomputation (its block marked recomputable): in Megatron's layout, or with
    ``choice.search`` by the operator-level search minimising the cost model on ``prof``."""
    b = choice.rows
    net = nn.GPT(shape.vocab, shape.seq, shape.hidden, 1, shape.heads,
                 dtype=np.dtype(shape.dtype))
    loss = nn.SoftmaxCrossEntropyWithLogits()
    if choice.search is None:
        presets.megatron_gpt(net, choice.dp, choice.tp, loss)
        mode, dataset = "semi_auto_parallel", ((choice.dp, 1), (choice.dp, 1))
    else:   # the batch split as far as its rows allow, every other cut searched
        g = math.gcd(b, n)
        mode, dataset = "auto_parallel", ((g, 1), (g, 1))
    net.embedding.pipeline_stage, net.blocks[0].pipeline_stage = 0, 1
    net.ln_f.pipeline_stage = net.head.pipeline_stage = 2
    net.blocks[0].recompute()
    cell = nn.WithLossCell(net, loss)
    ids = ((b, shape.seq), np.dtype(np.int32))
    parts = split_stages(graph.trace(cell, [ids, ids], ["data", "label"]), 3)
    level = OptimizerParallel(None if choice.level is None else OptimizerLevel(choice.level),
                              -1, 64)

    def planner(st: Any, strategy: Any) -> tuple[Any, Any]:
        request = request_from_context(st.graph, cell=cell, mode=mode, device_num=n,
                                       dataset_strategy=strategy, optimizer=level,
                                       micro_batches=2, recompute=(),
                                       search_mode=choice.search,
                                       cost_model=SimparCostModel(prof, optimizer))
        return request, plan_request(request)

    with warnings.catch_warnings():   # a candidate's, not the user's: nothing to act on
        warnings.simplefilter("ignore", NothingParallelWarning)
        warnings.simplefilter("ignore", OptimizerShardWarning)
        return parts, plan_stages(parts, n, planner, dataset)


def price_choice(shape: GPTShape, device_num: int, stages: int, choice: StageChoice,
                 profile: str | DeviceProfile = "ascend910b", optimizer: str = "adam",
                 capacity: int | None = None, plans: dict[Any, Any] | None = None,
                 apart: bool = False) -> PipelinePlan:
    """One candidate: ``stages`` stages under ``choice``, its blocks split as the module
    says, its 1F1B step on a timeline. ``apart``: each stage recomputes its blocks or not,
    chosen with the split (``choice.recompute`` is then ignored)."""
    prof = load_profile(profile)
    cap = prof.memory_capacity if capacity is None else capacity
    n = device_num // stages
    m = shape.batch // (choice.dp * choice.mbs)
    choice, options = _options(shape, n, choice, prof, optimizer, plans, apart)
    sent = options[0][3]
    flight = [in_flight(schedule("1f1b", s, stages, m)) for s in range(stages)]

    def seconds(s: int, k: int, o: int = 0) -> float:   # a micro-batch's share, summing in
        emb, block, head, _ = options[o]

        def each(u: _Unit) -> float:
            return u.forward + u.backward + u.summing * (m - 1) / m
        return (k * each(block) + (each(emb) if s == 0 else 0.0)
                + (each(head) if s == stages - 1 else 0.0))

    def memory(s: int, k: int, o: int = 0) -> int:
        emb, block, head, _ = options[o]
        units = [(block, k)] + ([(emb, 1)] if s == 0 else []) + (
            [(head, 1)] if s == stages - 1 else [])
        return int(sum(c * (u.static + flight[s] * u.activations) for u, c in units)
                   + max(u.transient for u, c in units if c))

    found = _split_apart(shape.layers, stages, seconds, memory, cap, len(options))
    fits = found is not None
    if found is None:   # nothing fits: the even split, priced anyway
        blocks = [shape.layers // stages + (s < shape.layers % stages) for s in range(stages)]
        picks = [len(options) - 1] * stages
    else:
        blocks, picks = found
    per_stage = [options[o][:3] for o in picks]
    step, bubble = _step(stages, m, blocks, *options[0][:3], sent, n, prof,
                         per_stage=per_stage if apart else None)
    mem = tuple(memory(s, k, o) for s, (k, o) in enumerate(zip(blocks, picks)))
    recomputed = tuple(s for s, o in enumerate(picks) if o) if apart else ()
    return PipelinePlan(stages, n, m, choice, tuple(blocks), step, mem, bubble,
                        fits and all(x <= cap for x in mem), recomputed=recomputed,
                        apart=apart)


def _options(shape: GPTShape, n: int, choice: StageChoice, prof: DeviceProfile,
             optimizer: str, plans: dict[Any, Any] | None, apart: bool
             ) -> tuple[StageChoice, list[tuple[_Unit, _Unit, _Unit, int]]]:
    """The units a stage may run (:func:`_units`): ``choice``'s, or with ``apart`` its blocks
    plain and recomputed (the choice then recomputes nothing itself: the stages say)."""
    if not apart:
        return choice, [_units(shape, n, choice, prof, optimizer, plans)]
    choice = replace(choice, recompute=False)
    return choice, [_units(shape, n, replace(choice, recompute=r), prof, optimizer, plans)
                    for r in (False, True)]


def _split(layers: int, stages: int, seconds: Any, memory: Any, cap: int
           ) -> list[int] | None:
    """The split of ``layers`` blocks over ``stages`` (each at least one) whose slowest
    stage is fastest, every stage under ``cap``; None when none fits."""
    found = _split_apart(layers, stages, lambda s, k, o: seconds(s, k),
                         lambda s, k, o: memory(s, k), cap, 1)
    return None if found is None else found[0]


def _split_apart(layers: int, stages: int, seconds: Callable[[int, int, int], float],
                 memory: Callable[[int, int, int], int], cap: int, options: int
                 ) -> tuple[list[int], list[int]] | None:
    """:func:`_split` where each stage also picks one of ``options`` (``seconds(s, k, o)``,
    ``memory(s, k, o)``): under a limit on the slowest stage, a stage takes the most blocks
    any option fits; the least limit under which the stages take every block is searched,
    blocks are given back from the stages with the most, and each stage keeps the fastest
    option that fits its blocks under the limit. None when nothing fits."""
    def fits(s: int, k: int, o: int, limit: float) -> bool:
        return seconds(s, k, o) <= limit and memory(s, k, o) <= cap

    def most(s: int, limit: float) -> int:
        best = 0
        for o in range(options):
            k = 0
            while k < layers and fits(s, k + 1, o, limit):
                k += 1
            best = max(best, k)
        return best

    limits = sorted({seconds(s, k, o) for s in range(stages) for k in range(1, layers + 1)
                     for o in range(options)})
    lo, hi = 0, len(limits) - 1
    found: list[int] | None = None
    limit = math.inf
    while lo <= hi:
        mid = (lo + hi) // 2
        ks = [most(s, limits[mid]) for s in range(stages)]
        if min(ks) >= 1 and sum(ks) >= layers:
            found, limit, hi = ks, limits[mid], mid - 1
        else:
            lo = mid + 1
    if found is None:
        return None
    extra = sum(found) - layers   # give back blocks from the stages with the most
    for s in sorted(range(stages), key=lambda s: -found[s]):
        take = min(extra, found[s] - 1)
        found[s] -= take
        extra -= take
    picks = [min((o for o in range(options) if fits(s, found[s], o, limit)),
                 key=lambda o: seconds(s, found[s], o)) for s in range(stages)]
    return found, picks


def _step(stages: int, m: int, blocks: Sequence[int], emb: _Unit, block: _Unit,
          head: _Unit, sent: int, n: int, prof: DeviceProfile, chunks: int = 1,
          per_stage: Sequence[tuple[_Unit, _Unit, _Unit]] | None = None
          ) -> tuple[float, float]:
    """(step seconds, bubble share) of the split (``blocks`` per virtual stage, ``chunks``
    per stage: interleaved when more than one) on a 1F1B timeline; ``per_stage``: each
    stage's own (embedding, block, head) units instead of the same for all."""
    last = stages * chunks - 1
    units = per_stage or [(emb, block, head)] * stages

    def cost(v: int, kind: str) -> float:
        pick = {"F": lambda u: u.forward, "B": lambda u: u.backward,
                "S": lambda u: u.summing}[kind]
        e, b, h = units[v % stages]
        return (blocks[v] * pick(b) + (pick(e) if v == 0 else 0.0)
                + (pick(h) if v == last else 0.0))

    hop = prof.link((0, n)).seconds(1, sent) if stages > 1 else 0.0
    forward = [cost(v, "F") for v in range(last + 1)]
    backward = [cost(v, "B") for v in range(last + 1)]
    summing = [cost(v, "S") for v in range(last + 1)]   # every backward but a chunk's first
    order, ends_at = _order(stages, m, chunks)
    spans = order.run([forward[c * stages + s] if kind == "F" else
                       backward[c * stages + s] + (summing[c * stages + s] if k else 0.0)
                       for s, kind, c, k in order.keys], hop)
    ends = [spans[i][1] for i in ends_at]
    mine = [[c * stages + s for c in range(chunks)] for s in range(stages)]
    once = [sum(blocks[v] * units[s][1].once + (units[s][0].once if v == 0 else 0.0)
                + (units[s][2].once if v == last else 0.0) for v in vs)
            for s, vs in enumerate(mine)]
    busy = [sum(m * (forward[v] + backward[v]) + (m - 1) * summing[v] for v in vs)
            for vs in mine]
    bubble = 1.0 - sum(busy) / sum(ends)
    bubble = 0.0 if bubble < 0 else bubble   # not -0.0 where rounding leaves none (NaN stays)
    return max(e + o for e, o in zip(ends, once)) + prof.step_overhead, bubble


@functools.lru_cache(maxsize=8)
def _order(stages: int, m: int, chunks: int) -> tuple[TaskOrder, tuple[int, ...]]:
    """The 1F1B tasks of ``stages`` stages (``chunks`` virtual ones each) and ``m``
    micro-batches in an order that runs, a message's latency 1 (a hop, scaled when run);
    and where each stage's last task is in it. Candidates share them: they depend on the
    schedule alone. A few are kept: the candidates of one schedule are priced one after
    another (a layout's rungs of the memory ladder), and a 1T schedule's order holds 262,144
    tasks (1T's search peaks at 530 MB with 8 kept, 627 MB with 256, as fast)."""
    last = stages * chunks - 1
    tasks = [schedule("1f1b", s, stages, m, chunks) for s in range(stages)]

    def needs(s: int, task: tuple[str, int, int]) -> list[tuple[int, Any, float]]:
        kind, c, k = task
        v = c * stages + s
        if kind == "F":
            return [] if v == 0 else [((v - 1) % stages, ("F", (v - 1) // stages, k), 1.0)]
        out: list[tuple[int, Any, float]] = [(s, ("F", c, k), 0.0)]
        return out if v == last else [*out, ((v + 1) % stages, ("B", (v + 1) // stages, k),
                                             1.0)]

    order = task_order(tasks, needs)
    ends = [0] * stages
    for i, key in enumerate(order.keys):   # each stage's tasks keep their order
        ends[key[0]] = i
    return order, tuple(ends)


def price_interleaved(shape: GPTShape, device_num: int, stages: int, choice: StageChoice,
                      profile: str | DeviceProfile = "ascend910b", optimizer: str = "adam",
                      capacity: int | None = None, plans: dict[Any, Any] | None = None,
                      chunks: int = 2, apart: bool = False) -> PipelinePlan | None:
    """One candidate under Megatron's interleaved 1F1B: ``chunks`` virtual stages per stage,
    the blocks split evenly over the virtual stages; None where the schedule cannot run it
    (micro-batches not a multiple of the stages, fewer blocks than virtual stages).
    ``apart``: a stage recomputes its blocks only where they do not fit otherwise."""
    prof = load_profile(profile)
    cap = prof.memory_capacity if capacity is None else capacity
    n = device_num // stages
    m = shape.batch // (choice.dp * choice.mbs)
    virtual = stages * chunks
    if stages < 2 or m % stages or shape.layers < virtual:
        return None
    choice, options = _options(shape, n, choice, prof, optimizer, plans, apart)
    sent = options[0][3]
    blocks = [shape.layers // virtual + (v < shape.layers % virtual) for v in range(virtual)]

    def memory(s: int, o: int) -> int:   # each chunk's micro-batches in flight, as held
        emb, block, head, _ = options[o]
        static, acts, transient = 0, [], 0
        for c in range(chunks):
            v = c * stages + s
            units = [(block, blocks[v])] + ([(emb, 1)] if v == 0 else []) \
                + ([(head, 1)] if v == virtual - 1 else [])
            static += sum(k * u.static for u, k in units)
            acts.append(sum(k * u.activations for u, k in units))
            transient = max([transient] + [u.transient for u, k in units if k])
        return int(static + most_held(schedule("1f1b", s, stages, m, chunks), acts)
                   + transient)

    picks = [next((o for o in range(len(options)) if memory(s, o) <= cap), len(options) - 1)
             for s in range(stages)]
    mem = tuple(memory(s, o) for s, o in enumerate(picks))
    step, bubble = _step(stages, m, blocks, *options[0][:3], sent, n, prof, chunks,
                         per_stage=[options[o][:3] for o in picks] if apart else None)
    recomputed = tuple(s for s, o in enumerate(picks) if o) if apart else ()
    return PipelinePlan(stages, n, m, choice, tuple(blocks), step, mem, bubble,
                        all(x <= cap for x in mem), chunks, recomputed, apart)


#: The virtual stages per stage tried under the interleaved 1F1B (each where the blocks and
#: the micro-batches allow it).
CHUNKS = (2, 4)

class Recompute(StrEnum):
    """Which stages' blocks recompute in a candidate: none, all, or those that need it,
    chosen per stage with the split (:func:`_split_apart`)."""

    NONE = "none"
    STAGES = "stages"
    ALL = "all"


#: The memory dimensions tried for each layout, cheapest in time first; the first that fits
#: is kept (each later one costs time and saves memory): nothing, then the blocks of the
#: stages that need it recomputed (each stage chooses with the split, so early stages, which
#: hold more micro-batches in flight under 1F1B, recompute and late ones need not), then the
#: same under optimizer parallel level1 (its weights gathered before every micro-batch's
#: forward). Every block recomputed (:attr:`Recompute.ALL`) is one of the assignments
#: :attr:`Recompute.STAGES` weighs: ``STAGES`` fits whenever ``ALL`` does, and is no slower.
LADDER: tuple[tuple[str | None, Recompute], ...] = (
    (None, Recompute.NONE), (None, Recompute.STAGES), ("level1", Recompute.NONE),
    ("level1", Recompute.STAGES))


def _layouts(shape: GPTShape, n: int, prof: DeviceProfile, mbs: Sequence[int]
             ) -> list[tuple[int, int, int]]:
    """(tp, dp, rows per replica) Megatron's layouts allow on ``n`` devices: tp within a
    server and dividing the heads and the vocabulary, the batch split evenly."""
    out = []
    for tp in (8, 4, 2, 1):   # the likeliest first: a budget may stop the search
        if n % tp or tp > prof.devices_per_server or shape.heads % tp or shape.vocab % tp:
            continue
        out += [(tp, n // tp, rows) for rows in mbs if shape.batch % (n // tp * rows) == 0]
    return out


def search_pipeline(shape: GPTShape, device_num: int, profile: str | DeviceProfile = "ascend910b",
                    optimizer: str = "adam", stages: int | None = None,
                    capacity: int | None = None,
                    ladder: Sequence[tuple[str | None, Recompute]] = LADDER,
                    mbs: Sequence[int] = (1,), budget: float | None = None,
                    intra: str | None = "recursive_programming") -> PipelineSearch:
    """The cheapest plan that fits (see the module): ``stages`` fixes S (None: every power
    of two dividing ``device_num`` up to the layers); ``capacity`` the memory cap (default
    the profile's); each layout climbs ``ladder`` until it fits; ``budget`` stops after
    that many seconds with the best found so far. ``intra`` (an auto_parallel search mode;
    None: Megatron's layouts only) also plans each layout's micro-batch with every op's cuts
    searched on the stage's devices."""
    rungs = []
    for level, which in ladder:
        if which not in [r.value for r in Recompute]:
            raise ValueError(f"search_pipeline: ladder's rungs recompute one of "
                             f"{[r.value for r in Recompute]}, got {which!r}")
        rungs.append((level, Recompute(which)))
    prof = load_profile(profile)
    cap = prof.memory_capacity if capacity is None else capacity
    started = time.perf_counter()
    counts = [stages] if stages is not None else [
        s for s in range(1, min(device_num, shape.layers) + 1)
        if device_num % s == 0 and s & (s - 1) == 0]
    plans: list[PipelinePlan] = []
    units: dict[Any, Any] = {}
    block = nn.TransformerBlock(shape.hidden, shape.heads, shape.seq,
                                dtype=np.dtype(shape.dtype))
    weights = sum(math.prod(w.shape) * w.dtype.itemsize for w in block.get_parameters())
    skipped = 0
    for s in sorted(counts, key=lambda s: abs(math.log2(s) - 3)):   # middling S first
        n = device_num // s
        layouts: list[tuple[int, int, int, str | None]] = [
            (tp, dp, rows, None) for tp, dp, rows in _layouts(shape, n, prof, mbs)]
        if intra is not None:
            layouts += [(tp, dp, rows, intra) for tp, dp, rows, _ in layouts]
        for tp, dp, rows, search in layouts:
            # A floor on every rung: a stage's blocks' weights and gradients, cut at most
            # tp ways (the searched cuts at most n ways).
            if 2 * math.ceil(shape.layers / s) * weights / (tp if search is None else n) > cap:
                skipped += 1
                continue
            for level, which in rungs:
                if budget is not None and time.perf_counter() - started > budget:
                    break
                choice = StageChoice(tp, dp, rows, level, which is Recompute.ALL, search)
                apart = which is Recompute.STAGES
                try:
                    plan = price_choice(shape, device_num, s, choice, prof, optimizer, cap,
                                        units, apart)
                except NoAvailableCost:   # a unit's own search found nothing under the cap
                    continue
                plans.append(plan)
                if plan.fits:   # the same layout interleaved: its units are planned already
                    for chunks in CHUNKS:
                        woven = price_interleaved(shape, device_num, s, choice, prof,
                                                  optimizer, cap, units, chunks, apart)
                        if woven is not None:
                            plans.append(woven)
                    break
    fitting = [p for p in plans if p.fits]
    best = min(fitting, key=lambda p: p.step_seconds) if fitting else None
    return PipelineSearch(plans, best, time.perf_counter() - started, cap, skipped)
