"""Pipeline schedules: the order in which one stage runs its micro-batches' forwards and
backwards (pure).

* ``gpipe`` (GPipe, Huang et al. 2019): every forward, then every backward. Each stage
  keeps all ``M`` micro-batches' activations until its backwards start.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021; MindSpore's default): stage ``s`` of
  ``S`` runs ``min(S - s - 1, M)`` forwards to fill the pipeline, then alternates one
  forward and one backward, then drains the backwards. It keeps at most ``S - s``
  micro-batches' activations.
* with ``chunks`` V > 1 virtual stages per stage (``pipeline_interleave``), ``1f1b`` is
  Megatron-LM's interleaved schedule (Narayanan et al. 2021, section 2.2): the forwards go
  through the chunks in groups of ``S`` micro-batches, ``(S - s - 1) * 2 + (V - 1) * S`` of
  them first (all of them when ``M == S``), then one forward and one backward alternate;
  ``M`` must be a multiple of ``S``. Its bubble is ``1 / V`` of the plain schedule's.
  ``gpipe`` runs every chunk's forwards in chunk order, then the backwards in reverse.

A task is ``(kind, chunk, micro-batch)``: ``"F"`` or ``"B"``, the chunk of this stage (0
without interleaving; virtual stage ``chunk * S + s``), the micro-batch. Every schedule runs
each chunk's micro-batches in order in each direction, so the messages between two virtual
stages arrive in the order they are sent. With equal stages the plain schedules leave each
stage idle for ``(S - 1) / (M + S - 1)`` of the step (the bubble).

>>> [f"{kind}{k}" for kind, _, k in schedule("1f1b", stage=0, stages=4, micro_batches=4)]
['F0', 'F1', 'F2', 'F3', 'B0', 'B1', 'B2', 'B3']
>>> [f"{kind}{k}" for kind, _, k in schedule("1f1b", stage=3, stages=4, micro_batches=4)]
['F0', 'B0', 'F1', 'B1', 'F2', 'B2', 'F3', 'B3']
"""

from __future__ import annotations

from collections.abc import Sequence

from simpar.context import PIPELINE_SCHEDULERS

__all__ = ["bubble_fraction", "chunk_in_flight", "in_flight", "most_held", "schedule"]

Task = tuple[str, int, int]


def schedule(scheduler: str, stage: int, stages: int, micro_batches: int, chunks: int = 1
             ) -> tuple[Task, ...]:
    """Stage ``stage``'s tasks in order (see the module)."""
    if scheduler not in PIPELINE_SCHEDULERS:
        raise ValueError(f"pipeline: scheduler must be one of {list(PIPELINE_SCHEDULERS)}, got "
                         f"{scheduler!r}")
    if not 0 <= stage < stages or micro_batches < 1 or chunks < 1:
        raise ValueError(f"pipeline: stage must be in 0..{stages - 1}, micro_batches and "
                         f"chunks >= 1, got stage {stage}, micro_batches {micro_batches} and "
                         f"chunks {chunks}")
    m, v = micro_batches, chunks
    if scheduler == "gpipe":
        return (tuple(("F", c, k) for c in range(v) for k in range(m))
                + tuple(("B", c, k) for c in reversed(range(v)) for k in range(m)))
    if v == 1:
        warmup = min(stages - stage - 1, m)
        tasks: list[Task] = [("F", 0, k) for k in range(warmup)]
        for k in range(m - warmup):
            tasks += [("F", 0, warmup + k), ("B", 0, k)]
        return tuple(tasks + [("B", 0, k) for k in range(m - warmup, m)])
    if m % stages:
        raise ValueError(f"pipeline: the interleaved schedule runs the micro-batches in groups "
                         f"of pipeline_stages ({stages}); micro_batches ({m}) must be a "
                         "multiple of it")
    total = m * v

    def task(kind: str, j: int) -> Task:
        c = (j // stages) % v
        return kind, c if kind == "F" else v - 1 - c, (j // (stages * v)) * stages + j % stages

    warmup = total if m == stages else min((stages - stage - 1) * 2 + (v - 1) * stages, total)
    tasks = [task("F", j) for j in range(warmup)]
    for j in range(total - warmup):
        tasks += [task("F", warmup + j), task("B", j)]
    return tuple(tasks + [task("B", j) for j in range(total - warmup, total)])


def in_flight(tasks: tuple[Task, ...]) -> int:
    """The most (chunk, micro-batch) forwards that ran before their backward: how many sets
    of activations the stage holds at once."""
    live = most = 0
    for kind, _, _ in tasks:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def chunk_in_flight(tasks: tuple[Task, ...], chunks: int) -> list[int]:
    """Per chunk, the most of its micro-batches whose forward ran and backward did not: the
    activations each chunk holds at once."""
    live, most = [0] * chunks, [0] * chunks
    for kind, c, _ in tasks:
        live[c] += 1 if kind == "F" else -1
        most[c] = max(most[c], live[c])
    return most


def most_held(tasks: tuple[Task, ...], per_micro_batch: Sequence[float],
              running: Sequence[float] | None = None) -> float:
    """The most bytes held at once as a stage runs ``tasks`` in order: each chunk's
    ``per_micro_batch`` activations for every micro-batch of it in flight, plus, while a task
    of chunk ``c`` runs, ``running[c]`` (its transient)."""
    live, most = [0] * len(per_micro_batch), 0.0
    for kind, c, _ in tasks:
        if kind == "F":
            live[c] += 1
        most = max(most, sum(n * b for n, b in zip(live, per_micro_batch))
                   + (running[c] if running is not None else 0.0))
        if kind == "B":
            live[c] -= 1
    return most


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle share of a step of equal stages: (S - 1) / (M + S - 1) under GPipe or 1F1B,
    and with V interleaved chunks (S - 1) / (V M + S - 1) (the bubble's time shrinks V-fold
    against the step's)."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)
