"""MindSpore's ``auto_pipeline``: auto_parallel chooses the number of pipeline stages, up to
``pipeline_stages``, and where the network is cut (pure: every rank chooses alike).

The cut is contiguous in the traced order (which is topological, so values only flow to the
same or a later stage) and made where the fewest values cross, a transformer's residual
stream between its blocks, with the stages' FLOPs as even as those places allow
(:func:`~simpar.pipeline.stages.balance_stages`). Each stage count that divides the devices
(and, under 1F1B, that the micro-batches cover) is planned by the request's search and priced
on the cost model's profile, a pipelined one on its schedule's timeline with its
micro-batches in flight (:func:`~simpar.pipeline.price.price_pipeline`); the fastest that
fits the memory cap wins, the fewer stages on a tie (:func:`choose_stages`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from simpar.cost import SimparCostModel, evaluate
from simpar.pipeline.price import price_pipeline
from simpar.pipeline.runner import plan_pipeline
from simpar.search import plan_request

__all__ = ["StageCount", "choose_stages"]


@dataclass(frozen=True)
class StageCount:
    """One stage count priced: predicted step seconds, peak bytes per rank, fits the cap; or
    why it has no plan (``why``; the figures then infinite)."""

    stages: int
    step_seconds: float
    peak_memory: float
    fits: bool
    why: str = ""
    #: A pipelined count's (stages, programs) as planned, for building the chosen one.
    plan: Any = field(default=None, compare=False, repr=False)


def choose_stages(network: Any, specs: Sequence[tuple[tuple[int, ...], Any]], world: int,
                  upper: int, dataset: Any, micro_batches: int, scheduler: str,
                  request: Any, plan_one: Any, plan: Any = plan_request
                  ) -> tuple[int, list[StageCount]]:
    """The stage count in ``1..upper`` dividing ``world`` with the fastest predicted step that
    fits (``request``'s cost model's memory cap and profile), and every count priced.
    ``plan_one()`` plans the network without stages (the caller's own path; None: it cannot
    be, e.g. its batch does not split over ``world``); ``plan`` searches each stage's request
    (:func:`~simpar.pipeline.runner.plan_pipeline`'s). A count whose planning is refused is
    listed with why; if every count is, the first refusal is raised."""
    model = request.cost_model
    if not isinstance(model, SimparCostModel):
        raise ValueError("auto_pipeline: choosing the stages prices them with simpar's cost "
                         "model; the search's cost model is MindSpore's "
                         "(set_cost_model_context) or another")
    cap = (request.memory_capacity if request.memory_capacity is not None
           else model.memory_capacity)
    priced = []
    refused: list[ValueError] = []
    for s in range(1, upper + 1):
        if world % s or (scheduler == "1f1b" and 1 < s > micro_batches):
            continue
        try:
            if s == 1:
                if plan_one is None:
                    continue
                report = evaluate(plan_one(), model.profile, model.optimizer)
                seconds, peak = report.step_seconds, float(report.peak_memory)
            else:
                parts, programs = plan_pipeline(network, specs, s, world, "auto_parallel",
                                                dataset, micro_batches, scheduler=scheduler,
                                                auto_split=True, plan=plan)
                cost = price_pipeline(parts, programs, s, scheduler, micro_batches,
                                      model.profile, model.optimizer)
                seconds, peak = cost.step_seconds, float(cost.peak_memory)
                made = (parts, programs)
        except ValueError as e:   # this count cannot be planned (NoAvailableCost is one)
            refused.append(e)
            priced.append(StageCount(s, math.inf, math.inf, False, str(e)))
            continue
        priced.append(StageCount(s, seconds, peak, peak <= cap,
                                 plan=made if s > 1 else None))
    planned = [p for p in priced if not p.why]
    if not planned:
        raise refused[0] if refused else ValueError(
            f"auto_pipeline: no stage count up to pipeline_stages={upper} divides the {world} "
            "devices and the micro-batches")
    fitting = [p for p in planned if p.fits] or planned
    best = min(fitting, key=lambda p: (p.step_seconds, p.stages))
    return best.stages, priced
