"""The main job's pipeline stages (``--pipeline-stages``): which Cells each stage runs, and
the per-stage summary line (pure helpers of :mod:`simpar.train`).

The model's units (the GPT's embedding, blocks and head; the MLP's layers; the ResNet's
stem, blocks and classifier) are cut into
contiguous runs, as even as the units allow: with ``--pipeline-schedule interleaved`` into
two chunks per stage (``pipeline_segment``), in virtual-stage order.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np

from simpar import comm, nn
from simpar.pipeline import PipelineCost
from simpar.train_models import stage_units

__all__ = ["SCHEDULES", "assign_stages", "measured_peak", "pipeline_config", "stage_lines",
           "units"]

#: ``--pipeline-schedule`` choices.
SCHEDULES = ("1f1b", "gpipe", "interleaved")


def pipeline_config(schedule: str) -> dict[str, Any]:
    """MindSpore's ``pipeline_config`` for a ``--pipeline-schedule`` choice."""
    return {"pipeline_interleave": schedule == "interleaved",
            "pipeline_scheduler": "gpipe" if schedule == "gpipe" else "1f1b"}


def units(model: nn.Cell) -> list[nn.Cell]:
    """The Cells stages are cut between, in order (:func:`simpar.train_models.stage_units`)."""
    return stage_units(model)


def assign_stages(model: nn.Cell, stages: int, chunks: int = 1) -> None:
    """Set every unit's ``pipeline_stage`` (and ``pipeline_segment``): unit ``k`` of ``n``
    on virtual stage ``k * stages * chunks // n``; the GPT's final LayerNorm with its head.
    Raises ``ValueError`` when there are fewer units than virtual stages."""
    parts = units(model)
    virtual = stages * chunks
    if len(parts) < virtual:
        raise ValueError(f"--pipeline-stages {stages}"
                         f"{' with 2 interleaved chunks' if chunks > 1 else ''} needs at least "
                         f"{virtual} units to cut between, but the {type(model).__name__} has "
                         f"{len(parts)} (more --n-layers)")
    for k, unit in enumerate(parts):
        v = k * virtual // len(parts)
        unit.pipeline_stage = v % stages
        if chunks > 1:
            unit.pipeline_segment = v // stages
    if isinstance(model, nn.GPT):
        model.ln_f.pipeline_stage = parts[-1].pipeline_stage
        if chunks > 1:
            model.ln_f.pipeline_segment = parts[-1].pipeline_segment


def measured_peak(train: nn.TrainOneStepCell, data: np.ndarray, label: np.ndarray) -> int:
    """This rank's peak bytes over one more pipelined forward and backward on the batch
    (tracemalloc; no update), with its parameters and optimizer state: what the cost model
    counts (collective: every rank calls)."""
    held = sum(a.nbytes for a in train.params.values()) + sum(
        a.nbytes for slots in train.optimizer.state.values() for a in slots.values())
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        train.value_and_grad(data, label, step=train.step_count)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return held + peak


def stage_lines(train: nn.TrainOneStepCell, cost: PipelineCost | None, busy: float,
                idle: float, peak: int) -> str:
    """One line per stage: its last step's time busy and idle in the bubble (blocked in
    receives), and its peak memory, measured (the slowest or fullest of its ranks; this
    rank's ``busy``, ``idle`` and ``peak``: collective, every rank calls), next to the
    prediction ``cost`` (:func:`~simpar.pipeline.price_pipeline`'s, None: none); then the
    predicted step."""
    runner = train.pipeline
    assert runner is not None
    every = comm.all_gather(np.array([[runner.stage, busy, idle, peak]], dtype=np.float64),
                            axis=0)
    lines = [f"pipeline: {runner.count} stages x {runner.per_stage} ranks, "
             f"{len(runner.chunks)} chunk(s) per stage, {runner.micro_batches} micro-batches, "
             f"{train.pipeline_scheduler}" + (" interleaved" if len(runner.chunks) > 1 else "")]
    for s in range(runner.count):
        rows = every[every[:, 0] == s]
        b, i, m = rows[:, 1].max(), rows[:, 2].max(), rows[:, 3].max()
        line = (f"  stage {s}: busy {b * 1e3:.1f} ms, idle {i * 1e3:.1f} ms "
                f"({i / max(b + i, 1e-12):.0%} bubble) in the last step, peak memory "
                f"{m / 2**20:.2f} MiB")
        if cost is not None:
            c = cost.stages[s]
            line += (f"; predicted busy {c.busy * 1e3:.1f} ms, idle {c.idle * 1e3:.1f} ms, "
                     f"peak {c.peak_memory / 2**20:.2f} MiB ({c.in_flight} micro-batch(es) "
                     "in flight)")
        lines.append(line)
    if cost is not None:
        lines.append(f"  predicted step {cost.step_seconds * 1e3:.1f} ms on {cost.profile}, "
                     f"bubble {cost.bubble:.0%}")
    return "\n".join(lines)
