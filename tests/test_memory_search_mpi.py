"""auto_parallel choosing the memory dimensions, executed on real MPI ranks (mpirun -n 2, 4
or 8) and compared with one device on every rank.

For each model and each memory cap (none; and halfway between the least memory per rank any
plan of the cuts alone needs and the least with the memory dimensions too, so that only the
dimensions fit) the search
(``set_algo_parameters(memory_dimensions="search")``; dynamic_programming for the MLP,
recursive_programming for the GPT, whose capped dynamic program takes a minute) chooses the
optimizer level, the recomputed Cells and the micro-batches with the cuts; the chosen plan
trains two Adam steps and must equal the single-device run on the whole batch (losses, every
stored slice). The program that ran must be the one chosen (its micro-batches, its slices'
level, its recomputed Cells), and the trace must show it: gradients reduce-scattered into the
slices exactly when a level is chosen, and forward kernels again in the backward exactly when
Cells recompute.

    mpirun -n 4 python -m pytest tests/test_memory_search_mpi.py -q --with-mpi -m mpi
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
from simpar.cost_model_context import reset_cost_model_context, set_cost_model_context
from simpar.layout import distribute
from simpar.runtime.program_schedule import Role
from simpar.search.pricing import NoAvailableCost
from tests.mpi_guard import abort_job_on_error
from tests.small_models import small_batch, small_model

pytestmark = pytest.mark.mpi(min_size=2)

STEPS = 2
SEED = 7
BATCH = 16
MLP_SIZES = (16, 64, 8)
GPT_SIZES = {"vocab_size": 128, "seq_length": 8, "d_model": 32, "n_layers": 2, "n_heads": 4}
LR = {"mlp": 1e-2, "gpt": 3e-3}
SEARCH = {"mlp": "dynamic_programming", "gpt": "recursive_programming"}
#: The caps tried: none, or halfway between the least memory of the cuts alone and the least
#: with the memory dimensions.
CAPS = ("none", "between")


def _model(model: str) -> nn.Cell:
    return small_model(model, MLP_SIZES, GPT_SIZES)


def _batch(model: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    return small_batch(model, step, BATCH, MLP_SIZES, GPT_SIZES, SEED)


def _train(model: str, capacity: float | None, dimensions: str = "search"
           ) -> tuple[nn.TrainOneStepCell, list[float], list[Any]]:
    """Train under auto_parallel with the memory dimensions searched; the cell, its losses
    and the collectives of its last step."""
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode=SEARCH[model],
                                     dataset_strategy="data_parallel",
                                     gradients_mean=True,
                                     parallel_optimizer_config={
                                         "parallel_optimizer_threshold": 0})
    simpar.set_algo_parameters(memory_dimensions=dimensions)
    if capacity is not None:
        set_cost_model_context(device_memory_capacity=capacity)
    net = _model(model)
    for part in (net.blocks if isinstance(net, nn.GPT) else net.layers[:-1]):
        part.recompute()      # candidates: the search decides which recompute
    cell = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits())
    train = nn.TrainOneStepCell(cell, nn.Adam(cell.trainable_params(), LR[model]), seed=SEED)
    losses, events = [], []
    try:
        for k in range(STEPS):
            with CommTrace() as trace:
                losses.append(train(*_batch(model, k)))
            events = list(trace.events)
    finally:
        simpar.reset_auto_parallel_context()
        simpar.reset_algo_parameters()
        reset_cost_model_context()
    return train, losses, events


@cache
def _reference(model: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    cell = nn.WithLossCell(_model(model), nn.SoftmaxCrossEntropyWithLogits())
    train = nn.TrainOneStepCell(cell, nn.Adam(cell.trainable_params(), LR[model]),
                                parallel_mode="stand_alone", seed=SEED)
    losses = np.array([train(*_batch(model, k)) for k in range(STEPS)])
    return losses, {k: v.copy() for k, v in train.params.items()}


@cache
def _least(model: str, dimensions: str) -> float:
    """The least memory per rank any plan needs, with the memory dimensions ("search") or the
    cuts alone ("fixed"): the "No available cost" under a cap of one byte."""
    with pytest.raises(NoAvailableCost) as caught:
        _train(model, 1.0, dimensions)
    assert caught.value.memory is not None
    return float(caught.value.memory)


CASES = [(m, cap) for m in ("mlp", "gpt") for cap in CAPS]


@pytest.mark.parametrize(("model", "cap"), CASES, ids=[f"{m}-cap-{c}" for m, c in CASES])
def test_searched_dimensions_train_like_one_device_on_every_rank(model: str, cap: str) -> None:
    rank = comm.get_rank()
    with abort_job_on_error(f"{model} cap {cap}"):
        ref_losses, ref_params = _reference(model)
        capacity = None
        if cap == "between":
            low, high = _least(model, "search"), _least(model, "fixed")
            assert low < high, f"the memory dimensions save nothing: {low} vs {high} bytes"
            capacity = (low + high) / 2
        train, losses, events = _train(model, capacity)
    prog, found = train.program, train.program_dimensions
    assert prog is not None and found is not None and found.chosen is not None
    chosen = found.chosen
    problems = []
    if capacity is not None and not chosen.memory <= capacity:  # type: ignore[operator]
        problems.append(f"rank {rank}: the chosen plan needs {chosen.memory} bytes, over the "
                        f"cap {capacity}")
    if capacity is not None and (chosen.level, chosen.recompute, chosen.micro_batches) == (
            None, (), 1):
        problems.append(f"rank {rank}: a cap under what the cuts alone reach chose no memory "
                        "dimension")
    # What runs is what was chosen.
    levels = {str(s.level) for s in prog.param_shards.values()}
    if (prog.micro_batches, train.micro_batches) != (chosen.micro_batches,) * 2 or \
            levels != ({str(chosen.level)} if chosen.level else set()) or \
            tuple(seg.name for seg in prog.segments) != chosen.recompute:
        problems.append(f"rank {rank}: ran {prog.micro_batches} micro-batches, levels {levels}, "
                        f"segments {[s.name for s in prog.segments]}; chose {chosen}")
    err = float(np.max([relative_error(np.float64(a), b) for a, b in zip(losses, ref_losses)]))
    if not err <= 1e-10:
        problems.append(f"rank {rank}: losses differ from one device by {err:.2e} ({chosen})")
    for name in (p.name for p in train.optimizer.parameters):
        lay = prog.storage_layout(name)
        e = relative_error(train.params[name], distribute(ref_params[name], lay, rank))
        if not e <= 1e-10:
            problems.append(f"rank {rank}: {name} differs from one device's by {e:.2e}")
    # The trace shows the chosen dimensions.
    sched = prog.schedule(rank)
    roles = Counter((sched[e.step].backward, str(sched[e.step].role), e.kind)
                    for e in events if e.step is not None)
    scattered = roles[True, str(Role.MIRROR), "ReduceScatter"]
    if chosen.level is not None and not scattered:
        problems.append(f"rank {rank}: {chosen.level} chosen but no gradient was "
                        "reduce-scattered")
    if chosen.level is None and scattered:
        problems.append(f"rank {rank}: gradients reduce-scattered with optimizer parallel off")
    again = sum(1 for s in sched if s.backward and s.collective is None and s.reason ==
                "recompute")
    if bool(again) != bool(chosen.recompute):
        problems.append(f"rank {rank}: {again} forward kernels run again in the backward for "
                        f"{len(chosen.recompute)} recomputed Cells")
    count = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
    assert not count or not problems, "\n".join(problems)
    assert not count, "another rank failed"
