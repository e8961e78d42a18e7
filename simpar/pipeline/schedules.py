"""Pipeline schedules: the order in which one stage runs its micro-batches' forwards and
backwards (pure).

* ``gpipe`` (GPipe, Huang et al. 2019): every forward, then every backward. Each stage
  keeps all ``M`` micro-batches' activations until its backwards start.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021; MindSpore's default): stage ``s`` of
  ``S`` runs ``min(S - s - 1, M)`` forwards to fill the pipeline, then alternates one
  forward and one backward, then drains the backwards. It keeps at most ``S - s``
  micro-batches' activations.

Both run the micro-batches in order in each direction, so the messages between two stages
arrive in the order they are sent. With equal stages, either leaves each stage idle for
``(S - 1) / (M + S - 1)`` of the step (the bubble).

>>> schedule("1f1b", stage=0, stages=4, micro_batches=4)
(('F', 0), ('F', 1), ('F', 2), ('F', 3), ('B', 0), ('B', 1), ('B', 2), ('B', 3))
>>> schedule("1f1b", stage=3, stages=4, micro_batches=4)
(('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2), ('F', 3), ('B', 3))
"""

from __future__ import annotations

from simpar.context import PIPELINE_SCHEDULERS

__all__ = ["bubble_fraction", "in_flight", "schedule"]

Task = tuple[str, int]


def schedule(scheduler: str, stage: int, stages: int, micro_batches: int
             ) -> tuple[Task, ...]:
    """Stage ``stage``'s tasks in order: ``("F", k)`` the forward of micro-batch ``k``,
    ``("B", k)`` its backward."""
    if scheduler not in PIPELINE_SCHEDULERS:
        raise ValueError(f"pipeline: scheduler must be one of {list(PIPELINE_SCHEDULERS)}, got "
                         f"{scheduler!r}")
    if not 0 <= stage < stages or micro_batches < 1:
        raise ValueError(f"pipeline: stage must be in 0..{stages - 1} and micro_batches >= 1, "
                         f"got stage {stage} and micro_batches {micro_batches}")
    m = micro_batches
    if scheduler == "gpipe":
        return tuple(("F", k) for k in range(m)) + tuple(("B", k) for k in range(m))
    warmup = min(stages - stage - 1, m)
    tasks: list[Task] = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        tasks += [("F", warmup + k), ("B", k)]
    tasks += [("B", k) for k in range(m - warmup, m)]
    return tuple(tasks)


def in_flight(tasks: tuple[Task, ...]) -> int:
    """The most micro-batches whose forward ran and backward did not yet: how many sets of
    activations the stage holds at once."""
    live = most = 0
    for kind, _ in tasks:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a step of equal stages under GPipe or 1F1B: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
