"""Optimizer parallel, gradient accumulation and recomputation on real MPI ranks against the
single-device run (mpirun -n 2, 4 or 8).

Every (model, strategy, level, micro-batches, recompute) trains ``STEPS`` Adam steps with
every trainable parameter sliced (threshold 0) and is compared on every rank with one device
run on the whole batch: the losses, every stored slice against its part of the single-device
parameter, and the collectives of one step read from the trace, each matched to the schedule
step that ran it. Recomputation marks every GPT block (every MLP layer but the last).

The same strategy, micro-batches and recomputation without optimizer parallel are traced
too: its Mirror AllReduces must have become ReduceScatters into the slices (once per step at
level1, once per micro-batch at level2 and level3), and AllGathers must make each weight
whole before each micro-batch's forward uses it (and, at level3, again in its backward,
once per recomputed Cell that reads it). Without optimizer parallel, micro-batches sum their
gradients and sync once per step: the Mirrors run as often as with one micro-batch.

    mpirun -n 8 python -m pytest tests/test_optimizer_parallel_mpi.py -q --with-mpi -m mpi
"""

from __future__ import annotations

from collections import Counter
from functools import cache
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
from simpar.runtime.program_schedule import Role
from tests.mpi_guard import abort_job_on_error
from tests.small_models import small_batch, small_model

pytestmark = pytest.mark.mpi(min_size=2)

STEPS = 2
TRACED_STEP = 1
SEED = 5
BATCH = 32                # 8 ranks x 4 micro-batches
MLP_SIZES = (16, 32, 8)
GPT_SIZES = {"vocab_size": 128, "seq_length": 16, "d_model": 32, "n_layers": 1, "n_heads": 4}
LR = {"mlp": 1e-2, "gpt": 3e-3}
LEVELS = ("level1", "level2", "level3")


def _model(model: str) -> nn.Cell:
    return small_model(model, MLP_SIZES, GPT_SIZES)


def _batch(model: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    return small_batch(model, step, BATCH, MLP_SIZES, GPT_SIZES, SEED)


def _train(model: str, kind: str, level: str | None, micro: int = 1, steps: int = STEPS,
           recompute: bool = False) -> tuple[nn.TrainOneStepCell, list[float], list[Any]]:
    """Train ``steps`` steps; returns the cell, its losses and the events of TRACED_STEP."""
    n = comm.get_group_size()
    simpar.reset_auto_parallel_context()
    net = _model(model)
    loss = nn.SoftmaxCrossEntropyWithLogits()
    if kind == "dp":
        mode, dataset = "data_parallel", "data_parallel"
    else:   # Megatron's hybrid: dp 2 x mp n/2 (on 2 ranks, mp 2 alone)
        dp = 2 if n >= 4 else 1
        if model == "mlp":
            presets.megatron_mlp(net, dp, n // dp)  # type: ignore[arg-type]
        else:
            presets.megatron_gpt(net, dp, n // dp, loss)  # type: ignore[arg-type]
        mode = "semi_auto_parallel"
        dataset = ((dp, 1), (dp,) if model == "mlp" else (dp, 1))
    config: dict[str, Any] = {"parallel_mode": mode, "gradients_mean": True,
                              "dataset_strategy": dataset}
    if level is not None:
        config.update(enable_parallel_optimizer=True, parallel_optimizer_config={
            "optimizer_level": level, "parallel_optimizer_threshold": 0})
    simpar.set_auto_parallel_context(**config)
    if recompute:
        for part in (net.blocks if isinstance(net, nn.GPT) else net.layers[:-1]):
            part.recompute()
    cell: nn.Cell = nn.WithLossCell(net, loss)
    opt = nn.Adam(cell.trainable_params(), LR[model])
    if micro > 1:
        cell = nn.GradAccumulation(cell, micro)
    train = nn.TrainOneStepCell(cell, opt, seed=SEED)
    losses, events = [], []
    for k in range(steps):
        with CommTrace() as trace:
            losses.append(train(*_batch(model, k)))
        if k == TRACED_STEP:
            events = list(trace.events)
    simpar.reset_auto_parallel_context()
    return train, losses, events


@cache
def _reference(model: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The single-device run (small enough that every rank runs its own): losses and final
    parameters."""
    cell = nn.WithLossCell(_model(model), nn.SoftmaxCrossEntropyWithLogits())
    train = nn.TrainOneStepCell(cell, nn.Adam(cell.trainable_params(), LR[model]),
                                parallel_mode="stand_alone", seed=SEED)
    losses = np.array([train(*_batch(model, k)) for k in range(STEPS)])
    return losses, {k: v.copy() for k, v in train.params.items()}


def _roles(train: nn.TrainOneStepCell, events: list[Any]) -> Counter[tuple[bool, str, str]]:
    """(backward, role, kind) of every traced collective, from the schedule step it ran."""
    assert train.program is not None
    sched = train.program.schedule(comm.get_rank())
    return Counter((sched[e.step].backward, str(sched[e.step].role), e.kind)
                   for e in events if e.step is not None)


def _worst(problems: list[str]) -> list[str]:
    """Every rank's problems, gathered: all ranks pass or fail together."""
    count = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
    return problems if count else []


# Every level with 1, 2 and 4 micro-batches on Megatron's hybrid (model-parallel weights and
# data-parallel ones), every level on data parallel, and accumulation alone.
CASES = ([(m, "hybrid", lv, micro, rc) for m in ("mlp", "gpt") for lv in LEVELS
          for micro in (1, 2, 4) for rc in (False, True)]
         + [(m, "dp", lv, 1, False) for m in ("mlp", "gpt") for lv in LEVELS]
         + [(m, kind, None, micro, False) for m in ("mlp", "gpt") for kind in ("dp", "hybrid")
            for micro in (2, 4)]
         + [(m, "hybrid", None, 1, True) for m in ("mlp", "gpt")])


@cache
def _plain(model: str, kind: str, micro: int, recompute: bool
           ) -> tuple[nn.TrainOneStepCell, list[Any]]:
    """The same strategy, micro-batches and recomputation without optimizer parallel: its
    cell and traced step."""
    train, _, events = _train(model, kind, None, micro, TRACED_STEP + 1, recompute)
    return train, events


@pytest.mark.parametrize(("model", "kind", "level", "micro", "recompute"), CASES,
                         ids=[f"{m}-{k}-{lv}-micro{mb}{'-recompute' if rc else ''}"
                              for m, k, lv, mb, rc in CASES])
def test_sliced_training_matches_one_device_on_every_rank(model: str, kind: str,
                                                          level: str | None, micro: int,
                                                          recompute: bool) -> None:
    rank = comm.get_rank()
    with abort_job_on_error(f"{model} {kind} {level} micro {micro} recompute {recompute}"):
        ref_losses, ref_params = _reference(model)
        train, losses, events = _train(model, kind, level, micro, STEPS, recompute)
        plain_train, plain_events = _plain(model, kind, micro, recompute)
        plain = _roles(plain_train, plain_events)
        if micro > 1:   # the Mirrors of one micro-batch's run: once per step either way
            once_train, once_events = _plain(model, kind, 1, recompute)
            once = _roles(once_train, once_events)
    prog = train.program
    assert prog is not None
    problems = []
    # np.max keeps a NaN (Python's max may drop it), and "not <=" fails on it.
    err = float(np.max([relative_error(np.float64(a), b) for a, b in zip(losses, ref_losses)]))
    if not err <= 1e-10:
        problems.append(f"rank {rank}: losses differ from one device by {err:.2e}")
    trainable = [p.name for p in train.optimizer.parameters]
    # Threshold 0: every parameter that two ranks hold alike is sliced (on 2 ranks, the
    # hybrid's model-parallel weights have no replica to slice over).
    unsliced = [name for name in trainable if name not in prog.param_shards
                and _repeated(prog.param_layouts[name]) > 1 and level is not None]
    if unsliced:
        problems.append(f"rank {rank}: threshold 0 left {unsliced} whole")
    for name in trainable:
        lay = prog.storage_layout(name)
        held = train.params[name]
        if held.shape != lay.local_shape():
            problems.append(f"rank {rank}: {name} stored as {held.shape}, not its slice "
                            f"{lay.local_shape()}")
            continue
        whole = prog.param_layouts[name].local_size()
        if name in prog.param_shards and held.size * prog.param_shards[name].size != whole:
            problems.append(f"rank {rank}: {name}'s slice is not 1/{prog.param_shards[name].size}"
                            f" of its block")
        want = distribute(ref_params[name], lay, rank)
        e = relative_error(held, want)
        if not e <= 1e-10:
            problems.append(f"rank {rank}: {name} differs from its slice of one device's by "
                            f"{e:.2e}")
        for slot, state in train.optimizer.state[name].items():
            if state.shape != held.shape:
                problems.append(f"rank {rank}: Adam's {slot} of {name} is {state.shape}, not "
                                f"the slice {held.shape}")
    roles = _roles(train, events)
    sliced = len(prog.param_shards)
    if micro > 1:
        mirrors = (plain[True, str(Role.MIRROR), "AllReduce"],
                   once[True, str(Role.MIRROR), "AllReduce"])
        if mirrors[0] != mirrors[1] or (kind == "dp" and not mirrors[1]):
            problems.append(f"rank {rank}: {micro} micro-batches ran {mirrors[0]} Mirror "
                            f"AllReduces a step, one batch {mirrors[1]}")
    if level is None:
        assert not _worst(problems), "\n".join(problems)
        return
    # The gradient sync: no Mirror AllReduce of a sliced parameter is left; each one the
    # plain run summed over a group is reduce-scattered into its slice over that group.
    plain_prog = plain_train.program
    assert plain_prog is not None
    summed = {name: plain_prog.mirror_group(name, rank) for name in prog.param_shards
              if len(plain_prog.mirror_group(name, rank)) > 1}
    scattered = [e.group for e in events if e.step is not None and e.kind == "ReduceScatter"
                 and _step(train, e).role == Role.MIRROR]
    per_step = 1 if level == "level1" else micro   # level2/3: each micro-batch's, as made
    if sorted(scattered) != sorted(list(summed.values()) * per_step):
        problems.append(f"rank {rank}: gradients reduce-scattered over {sorted(scattered)}, "
                        f"where the plain run's Mirrors summed over {sorted(summed.values())}")
    mirror_ar = roles[True, str(Role.MIRROR), "AllReduce"]
    if mirror_ar:
        problems.append(f"rank {rank}: {mirror_ar} Mirror AllReduces remain (every parameter is "
                        "sliced over its whole group)")
    if sliced and kind == "dp" and len(summed) != sliced:
        problems.append(f"rank {rank}: data parallel sums {len(summed)} of {sliced} sliced "
                        "gradients")
    gathers = roles[False, str(Role.GATHER), "AllGather"]
    if gathers != sliced * micro:
        problems.append(f"rank {rank}: {gathers} forward weight AllGathers for {sliced} sliced "
                        f"parameters and {micro} micro-batches")
    again = roles[True, str(Role.GATHER), "AllGather"]
    kept = _kept_weights(train) * micro
    if recompute and len(prog.segments) != (GPT_SIZES["n_layers"] if model == "gpt" else 2):
        problems.append(f"rank {rank}: {len(prog.segments)} recomputed Cells")
    if level == "level3" and again != kept:
        problems.append(f"rank {rank}: level3 gathered {again} weights again in the backward; "
                        f"{kept} ops keep a weight for their backward")
    if level != "level3" and again:
        problems.append(f"rank {rank}: {level} gathered {again} weights again in the backward")
    # Everything else is the plain run's: the op's own collectives and redistributions.
    for key in set(plain) | set(roles):
        if key[1] in (str(Role.MIRROR), str(Role.GATHER)):
            continue
        if plain[key] != roles[key]:
            problems.append(f"rank {rank}: {key} ran {roles[key]} times, {plain[key]} without "
                            "optimizer parallel")
    assert not _worst(problems), "\n".join(problems)


def _repeated(lay: Any) -> int:
    return int(np.prod([lay.device_matrix[a] for a in lay.replica_axes]))


def _step(train: nn.TrainOneStepCell, event: Any) -> Any:
    assert train.program is not None
    return train.program.schedule(comm.get_rank())[event.step]


def _reads(step: Any, k: int, needs: Any) -> bool:
    """Whether the op's backward reads input ``k``: written inline, some gradient it needs
    names ``x{k}``; otherwise assumed."""
    sh = step.sharding
    inline = sh.op.inline(tuple(lay.local_shape() for lay in sh.in_layouts))
    if inline is None or any(n and g is None for n, g in zip(needs, inline.grads)):
        return True
    return any(n and f"{{x{k}}}" in g for n, g in zip(needs, inline.grads))


def _kept_weights(train: nn.TrainOneStepCell) -> int:
    """How many sliced weights level3 gathers again per micro-batch: each one an op's tape
    keeps outside a recomputed Cell and its backward reads (the inline gradients it needs
    name it), and each one a recomputed Cell reads (once per Cell)."""
    prog = train.program
    assert prog is not None
    bplan = prog.backward_plan()
    names = set()
    for i, s in enumerate(prog.steps):
        if prog.segment_of(i) is not None:
            continue
        for k, v in enumerate(s.node.inputs):
            if v.kind == "param" and v.name in prog.param_shards and \
                    s.node.id in prog.grad_nodes and s.sharding.inner_plan is None and \
                    s.node.op.keeps_input(k) and _reads(s, k, bplan.nodes[s.node.id].needs):
                names.add(v.name)
    read = sum(len({v.name for i in range(seg.first, seg.last + 1)
                    for v in prog.steps[i].node.inputs
                    if v.kind == "param" and v.name in prog.param_shards})
               for seg in prog.segments)
    return len(names) + read
