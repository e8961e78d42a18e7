"""Pipeline stages on real MPI ranks against the single-device run (mpirun -n 2, 4 or 8).

A small float64 GPT (embedding, 6 blocks, head; the loss after the last) is cut into ``S``
stages of contiguous Cells and trained ``STEPS`` Adam steps on the same global batch:

* ``pp2``: 2 stages, each a Megatron dp x mp hybrid of the rest (8 ranks: pp 2 x dp 2 x mp 2);
* ``ppdp``: ``n / 2`` stages (at least 2), each data parallel over the rest (pp 4 x dp 2);
* ``pp``: one rank per stage (pp 8);

with 1, 2, 4 and 8 micro-batches under GPipe and 1F1B, interleaved with two chunks per stage
(``pipeline_segment``; on pp 8 a GPT of 14 blocks, whose 16 units give each virtual stage
one), and with optimizer parallel (each level, threshold 0) or recomputation of every block:
GPipe, 1F1B and interleaved 1F1B each on every layout without them and with one of them at
least (pp 8 has one rank per stage: nothing for optimizer parallel to shard). On every rank
the losses and every
stored parameter slice must equal one device's (relative 1e-10), and the step's point-to-point
messages, read from the trace, must be the ones the runner lists: each boundary once per
micro-batch forward and (a float) once backward, of its shard's bytes; and every collective
traced inside the stages' programs (kind, world group, bytes) must be one their schedules
list for the tasks the rank ran, each as often.

    mpirun -n 8 python -m pytest tests/test_pipeline_mpi.py -q --with-mpi -m mpi
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cache, partial
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn
from simpar.check import relative_error
from simpar.comm import CommTrace
from simpar.layout import distribute
from simpar.nn import presets
from simpar.pipeline import schedule
from simpar.pipeline.runner import PipelineRunner
from simpar.search import plan_once
from tests.mpi_guard import abort_job_on_error, raised_everywhere, shared_dir
from tests.small_models import small_batch

pytestmark = pytest.mark.mpi(min_size=2)

STEPS = 2
SEED = 3
BATCH = 16
GPT = {"vocab_size": 32, "seq_length": 8, "d_model": 16, "n_layers": 6, "n_heads": 2}
LR = 3e-3


def _layout(kind: str, n: int) -> tuple[int, int, int]:
    """(stages, dp, mp) of a kind on ``n`` ranks."""
    if kind == "pp2":
        per = n // 2
        dp = 2 if per >= 4 else 1
        return 2, dp, per // dp
    if kind == "ppdp":
        stages = max(2, n // 2)
        return stages, n // stages, 1
    return n, 1, 1


#: Blocks of the GPT interleaved over pp 8: its 16 units make two chunks of 8 stages.
DEEP = 14


def _gpt(stages: int = 1, chunks: int = 1, layers: int = GPT["n_layers"]) -> nn.GPT:
    net = nn.GPT(**{**GPT, "n_layers": layers}, dtype=np.float64)
    units = [net.embedding, *net.blocks, net.head]
    if stages > 1:
        for k, unit in enumerate(units):   # contiguous, as even as the units allow
            virtual = k * stages * chunks // len(units)
            unit.pipeline_stage = virtual % stages
            if chunks > 1:
                unit.pipeline_segment = virtual // stages
        net.ln_f.pipeline_stage = stages - 1
        if chunks > 1:
            net.ln_f.pipeline_segment = chunks - 1
    return net


def _batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    ids, labels = small_batch("gpt", step, BATCH, (), GPT, SEED)
    return ids % GPT["vocab_size"], labels % GPT["vocab_size"]


@cache
def _reference(layers: int = GPT["n_layers"]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    cell = nn.WithLossCell(_gpt(layers=layers), nn.SoftmaxCrossEntropyWithLogits())
    train = nn.TrainOneStepCell(cell, nn.Adam(cell.trainable_params(), LR),
                                parallel_mode="stand_alone", seed=SEED)
    losses = np.array([train(*_batch(k)) for k in range(STEPS)])
    return losses, {k: v.copy() for k, v in train.params.items()}


def _train(kind: str, micro: int, scheduler: str, level: str | None = None,
           recompute: bool = False) -> tuple[nn.TrainOneStepCell, list[float], list[Any]]:
    train = _cell(kind, micro, scheduler, level, recompute)
    losses, events = [], []
    for k in range(STEPS):
        with CommTrace() as trace:
            losses.append(train(*_batch(k)))
        events = list(trace.events)
    simpar.reset_auto_parallel_context()
    return train, losses, events


def _cell(kind: str, micro: int, scheduler: str, level: str | None = None,
          recompute: bool = False) -> nn.TrainOneStepCell:
    """The training cell of a kind of pipeline (the context set for it), not yet run."""
    n = comm.get_group_size()
    stages, dp, mp = _layout(kind, n)
    simpar.reset_auto_parallel_context()
    chunks = 2 if scheduler.startswith("interleaved") else 1
    net, loss = _gpt(stages, chunks, _layers(stages, chunks)), nn.SoftmaxCrossEntropyWithLogits()
    if mp > 1:
        presets.megatron_gpt(net, dp, mp, loss)
        mode: dict[str, Any] = {"parallel_mode": "semi_auto_parallel",
                                "dataset_strategy": ((dp, 1), (dp, 1))}
    else:
        mode = {"parallel_mode": "data_parallel"}
    simpar.set_auto_parallel_context(**mode, gradients_mean=True, pipeline_stages=stages,
                                     pipeline_config={
                                         "pipeline_scheduler": scheduler.split("-")[-1],
                                         "pipeline_interleave": chunks > 1})
    if level is not None:
        simpar.set_auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config={
            "optimizer_level": level, "parallel_optimizer_threshold": 0})
    if recompute:
        for block in net.blocks:
            block.recompute()
    cell: nn.Cell = nn.WithLossCell(net, loss)
    params = cell.trainable_params()
    if micro > 1:
        cell = nn.PipelineCell(cell, micro)
    return nn.TrainOneStepCell(cell, nn.Adam(params, LR), seed=SEED)


def _layers(stages: int, chunks: int) -> int:
    """The GPT's blocks for ``stages`` x ``chunks`` virtual stages: the deeper one where its
    6 blocks and 2 other units are too few to give each a unit."""
    return DEEP if stages * chunks > GPT["n_layers"] + 2 else GPT["n_layers"]


def _agreed(problems: list[str]) -> list[str]:
    """Every rank fails if any does."""
    count = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
    return problems or ([f"rank {comm.get_rank()}: another rank failed"] if count else [])


STAGES = {"pp2": 2, "ppdp": 4, "pp": 8}
# 1F1B needs at least as many micro-batches as stages (MindSpore's rule); GPipe runs fewer.
CASES = ([(kind, micro, sched, None, False) for kind in ("pp2", "ppdp", "pp")
          for micro in (1, 2, 4, 8) for sched in ("1f1b", "gpipe")
          if sched == "gpipe" or micro >= STAGES[kind]]
         + [("pp2", micro, "interleaved-1f1b", None, False) for micro in (2, 4, 8)]
         + [("ppdp", micro, "interleaved-1f1b", None, False) for micro in (4, 8)]
         + [("pp2", 4, "interleaved-gpipe", None, False),
            ("ppdp", 4, "interleaved-1f1b", "level2", True)]
         + [(kind, STAGES[kind], "1f1b", level, False) for kind in ("pp2", "ppdp")
            for level in ("level1", "level2", "level3")]
         + [(kind, max(4, STAGES[kind]), "1f1b", None, True) for kind in ("pp2", "ppdp", "pp")]
         + [("pp2", 2, "gpipe", "level3", True)]
         # each schedule on every layout with a memory dimension too (pp 8 has one rank
         # per stage: nothing for optimizer parallel to shard)
         + [("pp", 8, "interleaved-1f1b", None, False), ("pp", 8, "interleaved-1f1b", None, True),
            ("ppdp", 4, "gpipe", "level1", True), ("pp", 8, "gpipe", None, True),
            ("pp2", 4, "interleaved-1f1b", "level3", False)])


@pytest.mark.parametrize(("kind", "micro", "scheduler", "level", "recompute"), CASES,
                         ids=[f"{k}-micro{m}-{s}{'-' + lv if lv else ''}"
                              f"{'-recompute' if rc else ''}" for k, m, s, lv, rc in CASES])
def test_pipelined_training_matches_one_device_on_every_rank(
        kind: str, micro: int, scheduler: str, level: str | None, recompute: bool) -> None:
    rank = comm.get_rank()
    with abort_job_on_error(f"{kind} micro {micro} {scheduler} {level} {recompute}"):
        stages = _layout(kind, comm.get_group_size())[0]
        chunks = 2 if scheduler.startswith("interleaved") else 1
        ref_losses, ref_params = _reference(_layers(stages, chunks))
        train, losses, events = _train(kind, micro, scheduler, level, recompute)
    runner, prog = train.pipeline, train.program
    assert runner is not None and prog is not None
    problems = []
    err = float(np.max([relative_error(np.float64(a), b) for a, b in zip(losses, ref_losses)]))
    if not err <= 1e-10:
        problems.append(f"rank {rank}: losses {losses} differ from one device's "
                        f"{list(ref_losses)} by {err:.2e}")
    for name, (owner, _) in runner.params().items():
        lay = owner.storage_layout(name)
        e = relative_error(train.params[name], distribute(ref_params[name], lay, runner.local))
        if not e <= 1e-10:
            problems.append(f"rank {rank} (stage {runner.stage}): {name} differs from its "
                            f"slice of one device's by {e:.2e}")
    held = set(runner.params())
    missing = [k for k in ref_params if not any(k in p.param_layouts for p in runner.programs)]
    if missing:
        problems.append(f"rank {rank}: no stage holds {missing}")
    if set(train.optimizer.names()) != held:
        problems.append(f"rank {rank}: the optimizer updates {sorted(train.optimizer.names())}, "
                        f"not this stage's {sorted(held)}")
    # The point-to-point messages of the last step: as the runner lists them, and as the
    # schedule orders the micro-batches.
    sent = [(e.group[1], e.bytes_sent) for e in events if e.kind == "Send"]
    got = [(e.group[0], e.bytes_recv) for e in events if e.kind == "Receive"]
    listed = runner.trace
    if sorted((m[0], m[1], m[2] % 2, m[3], m[4]) for m in runner.messages()) != sorted(
            (t.kind, t.peer, int(t.backward), t.micro, t.nbytes) for t in listed):
        problems.append(f"rank {rank}: the messages the schedule guard exchanged are not the "
                        f"step's {listed}")
    if sorted(sent) != sorted((t.peer, t.nbytes) for t in listed if t.kind == "send") or \
            got != [(t.peer, t.nbytes) for t in listed if t.kind == "recv"]:
        problems.append(f"rank {rank}: traced sends {sent} / receives {got} are not the "
                        f"runner's {listed}")
    mine = [runner.stages[vs] for vs in runner.chunks]
    forward = sum(len(b.consumers) for st in mine for b in st.sent if b is not None) * micro
    backward = sum(1 for st in mine for v, b in zip(st.graph.inputs, st.received)
                   if b is not None and v.id in st.graph.grad_inputs) * micro
    sends = [t for t in listed if t.kind == "send"]
    if len(sends) != forward + backward:
        problems.append(f"rank {rank}: {len(sends)} sends, expected {forward} forward + "
                        f"{backward} backward")
    for name in {t.name for t in listed}:   # each boundary's messages in micro-batch order
        for kind in ("send", "recv"):
            order = [t.micro for t in listed if t.kind == kind and t.name == name
                     and not t.backward]
            if order != sorted(order):
                problems.append(f"rank {rank}: {name}'s forward {kind}s out of micro-batch "
                                f"order: {order}")
    tasks = schedule(scheduler.split("-")[-1], runner.stage, runner.count, micro,
                     len(runner.chunks))
    if runner.tasks != tasks:
        problems.append(f"rank {rank}: ran {runner.tasks}, the schedule says {tasks}")
    traced = Counter((e.kind, e.group, e.bytes_recv) for e in events if e.step is not None)
    expected = _stage_collectives(runner)
    if traced != expected:
        problems.append(f"rank {rank}: the collectives inside its stage's programs differ "
                        f"from their schedules': traced but not scheduled "
                        f"{dict(traced - expected)}, scheduled but not traced "
                        f"{dict(expected - traced)}")
    assert not _agreed(problems), "\n".join(problems)


def _stage_collectives(runner: Any) -> Counter[tuple[str, tuple[int, ...], int]]:
    """(kind, world group, bytes received) of every collective this rank's stage programs
    run in one step, from their schedules: each forward task's forward steps, each backward
    task's backward steps (for the outputs it seeds), and, with micro-batches, the deferred
    synchronisation once per chunk."""
    out: Counter[tuple[str, tuple[int, ...], int]] = Counter()
    accumulating = runner.micro_batches > 1

    def add(steps: Any) -> None:
        for st in steps:
            out[(str(st.collective), tuple(runner.ranks[g] for g in st.group),
                 st.recv_bytes)] += 1

    for kind, c, _ in runner.tasks:
        vs = runner.chunks[c]
        prog, st = runner.programs[vs], runner.stages[vs]
        seeded = [b is None or v.dtype.kind == "f" for v, b in zip(prog.graph.outputs, st.sent)]
        sched = [s for s in prog.schedule(runner.local, seeded) if s.collective is not None]
        add(s for s in sched if (kind == "B") == s.backward
            and not (s.deferred and accumulating))
    if accumulating:
        for vs in runner.chunks:
            add(s for s in runner.programs[vs].schedule(runner.local)
                if s.collective is not None and s.deferred)
    return out


class Tied(nn.Cell):
    """An embedding table read again as the output head's weight (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, np.float64)
        self.mid = nn.Dense(8, 8, dtype=np.float64)
        self.matmul = simpar.ops.MatMul(transpose_b=True)

    def construct(self, ids: Any) -> Any:
        return self.matmul(self.mid(self.embed(ids)), self.embed.embedding_table)


def test_a_tied_parameter_has_its_gradient_summed_between_its_stages() -> None:
    """A weight read on the first and the last stage (an embedding table tied to the output
    head) is held by both, and both hold the single-device value after training."""
    rank = comm.get_rank()
    n = comm.get_group_size()

    def run(stages: int) -> tuple[nn.TrainOneStepCell, list[float]]:
        simpar.reset_auto_parallel_context()
        net = Tied()
        if stages > 1:
            net.embed.pipeline_stage, net.mid.pipeline_stage = 0, 1
            simpar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                             pipeline_stages=2)
        cell = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits())
        params = cell.trainable_params()
        train = nn.TrainOneStepCell(nn.PipelineCell(cell, 2), nn.SGD(params, 0.1), seed=SEED,
                                    parallel_mode=None if stages > 1 else "stand_alone")
        rng = np.random.default_rng(0)
        losses = [train(rng.integers(0, 16, 4 * n).astype(np.int32),
                        rng.integers(0, 16, 4 * n).astype(np.int32)) for _ in range(2)]
        simpar.reset_auto_parallel_context()
        return train, losses

    with abort_job_on_error("tied embedding"):
        ref, ref_losses = run(1)
        par, losses = run(2)
    assert par.pipeline is not None
    problems = []
    name = "_backbone.embed.embedding_table"
    if name not in par.pipeline.shared:
        problems.append(f"rank {rank}: {name} is not shared between the stages "
                        f"({par.pipeline.shared})")
    whole = par.global_parameters()
    for key, value in ref.params.items():
        e = relative_error(whole[key], value)
        if not e <= 1e-10:
            problems.append(f"rank {rank}: {key} differs from one device's by {e:.2e}")
    e = float(np.max([relative_error(np.float64(a), b) for a, b in zip(losses, ref_losses)]))
    if not e <= 1e-10:
        problems.append(f"rank {rank}: losses differ by {e:.2e}")
    assert not _agreed(problems), "\n".join(problems)


@pytest.mark.parametrize("schedule_flag", ["1f1b", "gpipe", "interleaved"])
def test_the_main_job_runs_pipeline_stages_and_passes_its_check(
        schedule_flag: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``--pipeline-stages 2 --micro-batches 2`` with each schedule: the job's own check
    against one device passes, and rank 0 prints a busy/idle/peak-memory line per stage."""
    from simpar import train as job
    out = shared_dir(tmp_path) / "out"
    with abort_job_on_error(f"main job {schedule_flag}"):
        code = job.main(["--model", "gpt", "--n-layers", "2", "--n-heads", "2", "--d-model",
                         "16", "--seq-length", "8", "--steps", "2", "--parallel-mode",
                         "data_parallel", "--pipeline-stages", "2", "--micro-batches", "2",
                         "--pipeline-schedule", schedule_flag, "--out", str(out)])
        comm.barrier()
    text = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and summary["passed"] is True, text[-2000:]
    if comm.get_rank() == 0:
        for s in range(2):
            assert f"  stage {s}: busy " in text and "peak memory" in text, text[-2000:]
        assert "predicted step" in text
    assert summary["comm"]["Send"]["count"] > 0 and summary["comm"]["Receive"]["count"] > 0


def test_auto_parallel_wrapper_pipeline_trains_as_one_device() -> None:
    """MindSpore 2.x's way: ``AutoParallel(net, "semi_auto").pipeline(stages=2)`` on the
    network, its Cells' ``pipeline_stage`` set; the global context untouched."""
    rank = comm.get_rank()
    simpar.reset_auto_parallel_context()
    net = _gpt(2)
    cell = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits())
    params = cell.trainable_params()
    wrapped = nn.AutoParallel(nn.PipelineCell(cell, 2), "semi_auto")
    wrapped.pipeline(stages=2, scheduler="gpipe")
    wrapped.dataset_strategy("full_batch")
    wrapped.enable_gradients_mean()
    with abort_job_on_error("AutoParallel.pipeline"):
        train = nn.TrainOneStepCell(wrapped, nn.Adam(params, LR), seed=SEED)
        losses = [train(*_batch(k)) for k in range(STEPS)]
        ref_losses, ref_params = _reference()
    assert simpar.get_auto_parallel_context("pipeline_stages") == 1
    assert train.pipeline is not None and train.pipeline.count == 2
    problems = []
    e = float(np.max([relative_error(np.float64(a), b) for a, b in zip(losses, ref_losses)]))
    if not e <= 1e-10:
        problems.append(f"rank {rank}: losses differ by {e:.2e}")
    for name, (owner, _) in train.pipeline.params().items():
        err = relative_error(train.params[name], distribute(
            ref_params[name], owner.storage_layout(name), train.pipeline.local))
        if not err <= 1e-10:
            problems.append(f"rank {rank}: {name} differs by {err:.2e}")
    assert not _agreed(problems), "\n".join(problems)


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused_on_every_rank() -> None:
    """MindSpore's rule, micro_size >= pipeline_stages, for 1F1B; GPipe runs fewer."""
    with pytest.raises(ValueError, match=r"the 1f1b scheduler needs micro_size >= "
                       r"pipeline_stages, as MindSpore's Pipeline does: got 1 micro-batches "
                       r"for 2 stages"):
        _train("pp2", 1, "1f1b")
    simpar.reset_auto_parallel_context()
    train, _, _ = _train("pp2", 1, "gpipe")
    assert train.pipeline is not None and train.pipeline.micro_batches == 1


@pytest.mark.mpi(min_size=4)
def test_bad_pipelines_are_refused_with_one_error_on_every_rank() -> None:
    """Stages that do not divide the ranks, a Cell on a stage that does not exist, stages out
    of order along the graph, and a tied parameter its two stages cut differently."""
    n = comm.get_group_size()

    def run(net: nn.Cell, stages: int, mode: str = "data_parallel") -> None:
        simpar.reset_auto_parallel_context()
        simpar.set_auto_parallel_context(parallel_mode=mode, pipeline_stages=stages)
        cell = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits())
        train = nn.TrainOneStepCell(nn.PipelineCell(cell, 4), nn.SGD(cell.trainable_params(),
                                                                     0.1), seed=SEED)
        try:
            train(*_batch(0)) if isinstance(net, nn.GPT) else train(
                np.zeros(4 * n, np.int32), np.zeros(4 * n, np.int32))
        finally:
            simpar.reset_auto_parallel_context()

    raised_everywhere(lambda: run(_gpt(3), 3), ValueError,
                      f"pipeline_stages=3 must divide the {n} ranks")
    beyond = _gpt(2)
    beyond.blocks[2].pipeline_stage = 2
    raised_everywhere(lambda: run(beyond, 2), ValueError, "is on pipeline_stage 2, but "
                      "pipeline_stages is 2")
    backwards = _gpt(2)
    backwards.blocks[0].pipeline_stage = 1
    raised_everywhere(lambda: run(backwards, 2), ValueError,
                      "a value may only flow to its own or a later stage")
    tied = Tied()
    tied.embed.pipeline_stage, tied.mid.pipeline_stage = 0, 1
    tied.embed.gather.shard(((2, 1), (1,)))        # stage 0 cuts the table's rows,
    tied.matmul.shard(((1, 2), (1, 2)))              # stage 1 its columns
    raised_everywhere(lambda: run(tied, 2, "semi_auto_parallel"), ValueError,
                      "shard it alike on every stage that reads it")


def test_ranks_that_disagree_on_the_pipeline_are_refused_before_any_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's schedule guard, when it is built: ranks that agree build it, and the
    messages each lists are the ones its step then sends and receives (peer, direction,
    micro-batch, bytes). One rank refusing its part (an unknown scheduler), running another
    count of micro-batches, or listing other messages makes every rank raise, instead of the
    others waiting forever for it."""
    train = _cell("pp2", 4, "1f1b")
    train(*_batch(0))
    runner = train.pipeline
    assert runner is not None
    mine = runner.messages()
    assert mine and sorted((m[0], m[1], m[2] % 2, m[3], m[4]) for m in mine) == sorted(
        (t.kind, t.peer, int(t.backward), t.micro, t.nbytes) for t in runner.trace)
    simpar.reset_auto_parallel_context()
    rank, last = comm.get_rank(), comm.get_group_size() - 1

    def rebuild(scheduler: str = "gpipe", micro: int = 4) -> None:
        PipelineRunner(runner.stages, runner.programs, rank, runner.count,
                       scheduler if rank == last else "gpipe", micro if rank == last else 4,
                       runner.loss_seed)

    raised_everywhere(lambda: rebuild("bogus"), ValueError, "bogus")
    raised_everywhere(lambda: rebuild(micro=2), ValueError,
                      "ranks disagree on (scheduler, micro-batches, stages, chunks)")
    if rank == last:   # one message fewer than its peer expects
        listed = PipelineRunner.messages
        monkeypatch.setattr(PipelineRunner, "messages", lambda self: listed(self)[:-1])
    raised_everywhere(rebuild, ValueError, "every rank must run the same pipeline")


def test_memory_dimensions_searched_per_stage_train_as_one_device() -> None:
    """auto_parallel with ``memory_dimensions="search"`` in 2 stages of 1F1B over 4
    micro-batches, under a cap between what stage 1 needs and what stage 0 needs without
    them (stage 0 holds 2 micro-batches' activations at once, stage 1 one): stage 0 must
    choose a memory dimension, stage 1 none, and training must equal one device's. The cuts
    are sharding propagation's, the same under any cap (a search of the cuts would trade
    them for memory): the dimensions are the only way under it."""
    from simpar.cost_model_context import reset_cost_model_context, set_cost_model_context
    from simpar.pipeline import plan_pipeline
    rank, n = comm.get_rank(), comm.get_group_size()

    def cell(capacity: float | None) -> nn.Cell:
        simpar.reset_auto_parallel_context()
        simpar.set_auto_parallel_context(
            parallel_mode="auto_parallel", search_mode="sharding_propagation",
            dataset_strategy="data_parallel", gradients_mean=True, pipeline_stages=2,
            parallel_optimizer_config={"parallel_optimizer_threshold": 0})
        simpar.set_algo_parameters(memory_dimensions="search")
        reset_cost_model_context()
        if capacity is not None:
            set_cost_model_context(device_memory_capacity=capacity)
        net = _gpt(2)
        for block in net.blocks:
            block.recompute()
        return nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits())

    with abort_job_on_error("memory dimensions per stage"):
        try:
            spec = [((BATCH // 4, GPT["seq_length"]), np.int32)] * 2
            _, programs = plan_pipeline(cell(None), spec, 2, n, "auto_parallel",
                                        "data_parallel", 4,   # one search for all, as training
                                        plan=partial(plan_once, together=True))
            free = [p.strategy_map.dimensions for p in programs]
            none = [next(a for a in f.alternatives if a.key == (4, None, ())) for f in free]
            cap = max(none[1].memory, free[0].least_memory.memory) + 1.0
            assert cap < none[0].memory, (cap, none)
            wrapped = cell(cap)
            train = nn.TrainOneStepCell(nn.PipelineCell(wrapped, 4),
                                        nn.Adam(wrapped.trainable_params(), LR), seed=SEED)
            losses = [train(*_batch(k)) for k in range(STEPS)]
        finally:
            simpar.reset_auto_parallel_context()
            simpar.reset_algo_parameters()
            reset_cost_model_context()
        ref_losses, ref_params = _reference()
    runner = train.pipeline
    assert runner is not None
    chosen = train.program_dimensions.chosen
    problems = []
    if runner.stage == 0 and not (chosen.recompute or chosen.level is not None):
        problems.append(f"rank {rank}: stage 0 chose {chosen.describe()} under cap {cap}")
    if runner.stage == 1 and chosen.key != (4, None, ()):
        problems.append(f"rank {rank}: stage 1 chose {chosen.describe()}, though it fits")
    err = float(np.max([relative_error(np.float64(a), b) for a, b in zip(losses, ref_losses)]))
    if not err <= 1e-10:
        problems.append(f"rank {rank}: losses {losses} differ from one device's by {err:.2e}")
    for name, (owner, _) in runner.params().items():
        e = relative_error(train.params[name], distribute(ref_params[name],
                                                          owner.storage_layout(name),
                                                          runner.local))
        if not e <= 1e-10:
            problems.append(f"rank {rank}: {name} differs from one device's by {e:.2e}")
    assert not _agreed(problems), "\n".join(problems)


def test_auto_pipeline_chooses_the_stages_and_trains_as_one_device() -> None:
    """MindSpore's ``auto_pipeline``: up to ``pipeline_stages`` (here every rank), under a
    memory cap midway between the stage counts' peaks without one, every count is planned
    under the cap and priced, the fastest that fits runs (here with stages: recursive
    programming searches each count's cuts under the cap, so which counts fit is the search's
    to say; tests/test_pipeline.py has a cap that only stages meet), and training equals one
    device's; outside auto_parallel with recursive programming it is refused on every
    rank."""
    from simpar.cost_model_context import reset_cost_model_context, set_cost_model_context
    rank, n = comm.get_rank(), comm.get_group_size()

    def train(capacity: float | None, mode: str = "auto_parallel") -> nn.TrainOneStepCell:
        simpar.reset_auto_parallel_context()
        simpar.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True,
                                         dataset_strategy="data_parallel", auto_pipeline=True,
                                         pipeline_stages=n)
        reset_cost_model_context()
        if capacity is not None:
            set_cost_model_context(device_memory_capacity=capacity)
        cell = nn.WithLossCell(_gpt(), nn.SoftmaxCrossEntropyWithLogits())
        return nn.TrainOneStepCell(nn.PipelineCell(cell, 8), nn.Adam(cell.trainable_params(),
                                                                     LR), seed=SEED)

    with abort_job_on_error("auto_pipeline"):
        try:
            free = train(None)
            free.build(*_batch(0))
            peaks = sorted(p.peak_memory for p in free.stage_counts if not p.why)
            assert len(peaks) >= 2, free.stage_counts
            cap = (peaks[0] + peaks[-1]) / 2
            squeezed = train(cap)
            losses = [squeezed(*_batch(k)) for k in range(STEPS)]
        finally:
            simpar.reset_auto_parallel_context()
            reset_cost_model_context()
        ref_losses, ref_params = _reference()
    runner = squeezed.pipeline
    problems = []
    fitting = [p for p in squeezed.stage_counts if p.fits]
    best = min(fitting, key=lambda p: (p.step_seconds, p.stages))
    if runner is None or runner.count != best.stages or best.peak_memory > cap:
        problems.append(f"rank {rank}: under a cap of {cap:.0f} bytes it ran "
                        f"{runner.count if runner else 1} stages of {squeezed.stage_counts}")
    err = float(np.max([relative_error(np.float64(a), b) for a, b in zip(losses, ref_losses)]))
    if not err <= 1e-10:
        problems.append(f"rank {rank}: losses {losses} differ from one device's by {err:.2e}")
    if runner is not None:
        for name, (owner, _) in runner.params().items():
            e = relative_error(squeezed.params[name], distribute(
                ref_params[name], owner.storage_layout(name), runner.local))
            if not e <= 1e-10:
                problems.append(f"rank {rank}: {name} differs from one device's by {e:.2e}")
    assert not _agreed(problems), "\n".join(problems)

    def refused() -> None:
        try:
            train(None, "semi_auto_parallel")(*_batch(0))
        finally:
            simpar.reset_auto_parallel_context()

    raised_everywhere(refused, ValueError, "auto_pipeline needs parallel_mode 'auto_parallel' "
                      "and search_mode 'recursive_programming'")
