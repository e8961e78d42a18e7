"""auto_parallel's searches as planners (``register_search``): the cost graph of the request,
solved, as a :class:`StrategyMap` whose ops are marked ``searched`` (or ``annotated`` where the
user set ``.shard()``). Costs come from the request's cost model, within its memory cap, under
its algo parameters (:class:`~simpar.search.request.PlanRequest`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence

from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding
from simpar.search.cost_graph import (
    CostGraph,
    build_cost_graph,
    cost_graph_from,
    within_transient_limit,
)
from simpar.search.dynamic_programming import least_memory_plan, solve_dynamic_programming
from simpar.search.exact import ExactSolution, TimeLimitWarning, describe_gap, solve_exact
from simpar.search.pricing import NoAvailableCost, Pricer
from simpar.search.recursive_programming import solve_recursive_programming
from simpar.search.request import PlanRequest
from simpar.search.sharding_propagation import propagate
from simpar.search.strategy_map import OpStrategy, Source, StrategyMap, lay_out_by_consumer

__all__ = ["TRANSIENT_LIMITS", "cost_graph_of", "dynamic_programming_planner",
           "exact_planner", "fitting_transients", "pricer_of", "recursive_programming_planner",
           "sharding_propagation_planner", "strategy_map_from", "strategy_map_of"]

log = logging.getLogger("simpar.search")

#: How many transient limits a search tries when its plan fits only without its largest
#: transient: that transient, then half of it each time.
TRANSIENT_LIMITS = 4
#: How many transient limits, halving, the least memory a failed search reports tries
#: (:func:`_with_transient`), while the need falls.
NEED_LIMITS = 4


def strategy_map_of(request: PlanRequest, cg: CostGraph, choice: tuple[int, ...],
                    optimality_gap: float | None = None) -> StrategyMap:
    """The strategy map of one candidate per node of ``cg``."""
    return strategy_map_from(request, [node.candidates[c] for node, c in zip(cg.nodes, choice)],
                             optimality_gap)


def strategy_map_from(request: PlanRequest, shardings: Sequence[OpSharding],
                      optimality_gap: float | None = None) -> StrategyMap:
    """The strategy map of one sharding per node of ``request.graph`` (trace order): searched,
    or the user's where the op has a ``.shard()`` strategy; ``optimality_gap`` as the search
    proved it (:class:`StrategyMap`)."""
    ops: dict[str, OpStrategy] = {}
    params: dict[str, TensorLayout] = {}
    for node, sh in zip(request.graph.nodes, shardings):
        user = node.op.in_strategy is not None
        source = Source.USER if user else Source.SEARCHED
        out = node.op.out_strategy if user else None
        ops[node.name] = OpStrategy(node.op.name, sh.strategy, out, source)
        lay_out_by_consumer(params, node.inputs, sh.in_layouts)
    inputs = {v.name: lay for v, lay in zip(request.graph.inputs, request.input_layouts)}
    return StrategyMap(request.device_num, "auto_parallel", ops, params, inputs,
                       optimality_gap)


def pricer_of(request: PlanRequest) -> Pricer:
    """The on-demand prices of a request under its cost model."""
    return Pricer(request.graph, request.device_num, request.cost_model,
                  request.input_layouts, request.parameter_plan, request.enable_alltoall,
                  request.algo.elementwise_op_strategy_follow, algo=request.algo,
                  memory_capacity=request.memory_capacity, optimizer=request.optimizer,
                  recompute=request.recompute, micro_batches=request.micro_batches,
                  step_objective=request.step_objective, comm_fusion=request.comm_fusion)


def fitting_transients(request: PlanRequest,
                       search: Callable[[Pricer], list[OpSharding]]) -> list[OpSharding]:
    """``search(pricer)``'s plan when its memory and its largest transient fit the cap
    together; else the first plan that does of ``search(pricer.limited(limit))``, a search
    that keeps every op's and move's transient within ``limit`` and the rest of the plan
    within the cap less ``limit`` (:class:`~simpar.search.pricing.Pricer`'s
    ``transient_limit``; one pricer, so nothing is priced twice), for limits
    from the first plan's largest transient down by halves (at most
    :data:`TRANSIENT_LIMITS`); the first plan when none does (the final pricing says by how
    much it is over).

    The searches count what a plan holds throughout the step as a sum over its ops; a
    transient (an op's backward's cotangent and input gradients, its collective's buffer)
    adds only the largest of a plan's, a maximum no search's objective decomposes. On GPT
    125M with batch 208 on 8 devices, dynamic programming's first plan needs 55.46 GiB of
    arrays and a backward transient of 10.16 GiB against 64 GiB.

    What a recomputed Cell's tapes hold again in the backward is a sum over the Cell and a
    maximum over the Cells: the first search counts the largest Cell's in its ops' memories
    (:class:`~simpar.search.pricing.Pricer`); the searches again bound each recomputed op's
    by its twin's in the first plan's largest Cell (:meth:`Pricer.rerun_bounds`) and hold the
    most a Cell's bounds add up to back from the cap, so every Cell's fits."""
    pricer = pricer_of(request)

    def over(shardings: Sequence[OpSharding]) -> float:
        return (pricer.memory(shardings) + pricer.transient(shardings)
                - pricer.memory_capacity)

    try:
        first = search(pricer)
    except NoAvailableCost as e:
        raise _with_transient(pricer, e) from None
    if over(first) <= 0 or not pricer.transient(first):
        return first
    # The user's strategies keep theirs whatever the limit: no limit below it can fit.
    floor = max((pricer.priced(s.index, first[s.index].strategy).transient  # type: ignore
                 for s in pricer.sites if s.user), default=0.0)
    # A recomputed Cell's tapes made again are bounded per position in the Cell by the first
    # plan's largest Cell's (every identical Cell at most as heavy) and held back from the cap.
    bounds = pricer.rerun_bounds(first) or None
    limit = pricer.transient(first) - pricer.rerun(first)
    for _ in range(TRANSIENT_LIMITS):
        if limit < floor or limit <= 0:
            break
        try:
            found = search(pricer.limited(limit, bounds))
        except (NoAvailableCost, ValueError, TimeoutError):
            found = []
        fits = bool(found) and over(found) <= 0
        log.info("transients: a plan within a transient limit of %.0f bytes: %s", limit,
                 "none" if not found else f"{pricer.total(found):.6g}, "
                 f"{'fits' if fits else 'over'}")
        if fits:
            return found
        limit /= 2
    return first


def _with_transient(pricer: Pricer, e: NoAvailableCost) -> NoAvailableCost:
    """``e`` with the least memory a plan of least arrays needs with its largest transient:
    what a cap must hold for such a plan (the least of the arrays alone is not enough). With
    recomputed Cells, also the plan of least arrays whose Cells each make again at most what
    that plan's largest Cell does (:meth:`Pricer.rerun_bounds`): without the bound the other
    Cells' tapes are free in a sum of arrays, and the plan of least arrays may rerun more.

    The plan of least arrays may hold a vast transient: on the 24-layer GPT of 350M widths
    (batch 512) over 64 devices it cuts the head's MatMul along its contraction, whose
    partial output's backward holds 200 GiB beside 40.7 GiB of arrays. So the plans of least
    arrays within transient limits (every op's and move's, :func:`within_transient_limit`)
    are tried too, from that plan's transient down by halves while the need falls (at most
    :data:`NEED_LIMITS`), and the least need is given."""
    def need_of(cg: CostGraph) -> tuple[float, list[OpSharding]] | None:
        found = least_memory_plan(cg)
        if found is None:
            return None
        shardings = [node.candidates[c] for node, c in zip(cg.nodes, found)]
        return pricer.memory(shardings) + pricer.transient(shardings), shardings

    def least(limited: Pricer) -> tuple[float, list[OpSharding]] | None:
        try:
            return need_of(cost_graph_from(limited))
        except ValueError:   # an op with no candidate within the bounds
            return None

    try:
        whole = cost_graph_from(pricer)
    except ValueError:
        return e
    first = need_of(whole)
    if first is None:
        return e
    need, shardings = first
    bounds = pricer.rerun_bounds(shardings)
    limit = pricer.transient(shardings) - pricer.rerun(shardings)
    if bounds and limit > 0:
        bounded = least(pricer.limited(limit, bounds))
        if bounded is not None:
            need = min(need, bounded[0])
    for _ in range(NEED_LIMITS):
        limit /= 2
        if not limit > 0:
            break
        if pricer.algo.enable_algo_approxi:   # the candidates within it approximated anew
            within = least(pricer.limited(limit, bounds or None))
        else:
            within = need_of(within_transient_limit(pricer, whole, limit))
        if within is None or within[0] >= need:
            break
        need = within[0]
    stop = "" if str(e).endswith(".") else "."
    return NoAvailableCost(f"{e}{stop} With its largest transient the plan of least memory "
                           f"needs {need:.0f} bytes per rank.", need)


def cost_graph_of(request: PlanRequest) -> CostGraph:
    """The cost graph of a request under its cost model."""
    return build_cost_graph(request.graph, request.device_num, request.cost_model,
                            input_layouts=request.input_layouts,
                            parameter_plan=request.parameter_plan,
                            enable_alltoall=request.enable_alltoall, algo=request.algo,
                            memory_capacity=request.memory_capacity,
                            optimizer=request.optimizer, recompute=request.recompute,
                            micro_batches=request.micro_batches,
                            step_objective=request.step_objective,
                            comm_fusion=request.comm_fusion)


def exact_planner(request: PlanRequest) -> StrategyMap:
    """search_mode "exact": the ILP optimum of the cost graph (HiGHS), within the algo
    parameter ``exact_time_limit`` (simpar's own); where the plan's largest transient puts
    it over the cap, the optimum of the ILP that holds every op's and move's transient too
    (:func:`~simpar.search.cost_graph.cost_graph_from`'s ``transients``). When the limit
    runs out first, the map is the best plan found, its ``optimality_gap`` says how far from
    proven it is, and a :class:`~simpar.search.exact.TimeLimitWarning` says so."""
    limit = request.algo.exact_time_limit
    started = time.perf_counter()   # one limit for every ILP the search solves
    solved: list[tuple[list[OpSharding], ExactSolution]] = []

    runs: list[ExactSolution] = []   # every ILP solved: the first has the whole limit

    def solve(cg: CostGraph) -> tuple[list[OpSharding], ExactSolution]:
        left = limit if limit is None or not runs else limit - (time.perf_counter() - started)
        if left is not None and left <= 0:   # the first plan took it all
            raise TimeoutError("exact_time_limit spent")
        found = solve_exact(cg, left)
        runs.append(found)
        return [node.candidates[c] for node, c in zip(cg.nodes, found.choice)], found

    def search(pricer: Pricer) -> list[OpSharding]:
        plan, found = solve(cost_graph_from(pricer))
        if not math.isfinite(pricer.transient_limit) and \
                pricer.memory(plan) + pricer.transient(plan) > pricer.memory_capacity:
            # Its largest transient puts it over: the ILP again, with every op's and move's
            # transient and the recomputed Cells' tapes made again in it, whose plan fits
            # with them and is the optimum of those that do. None fits: the limits below.
            with contextlib.suppress(NoAvailableCost, TimeoutError):
                plan, found = solve(cost_graph_from(pricer, transients=True))
        solved.append((plan, found))
        return plan

    shardings = fitting_transients(request, search)
    found = next(f for plan, f in solved if plan is shardings)
    if not found.proven:
        why = ("HiGHS stopped before proving it" if limit is None else
               f"the time limit of {limit:g} s (exact_time_limit) ran out")
        warnings.warn(f"search_mode 'exact': {why}; the plan is the best found, not proven "
                      f"optimal ({describe_gap(found.gap)}). Raise exact_time_limit with "
                      "set_algo_parameters, or set it to None, for the proven optimum",
                      TimeLimitWarning, stacklevel=2)
    # the gap of the first plan is the whole graph's; a plan under a transient limit is the
    # optimum of a smaller graph, not of this one
    return strategy_map_from(request, shardings, found.gap if shardings is solved[0][0]
                             else None)


def dynamic_programming_planner(request: PlanRequest) -> StrategyMap:
    """search_mode "dynamic_programming": MindSpore's elimination search of the cost graph."""
    def search(pricer: Pricer) -> list[OpSharding]:
        cg = cost_graph_from(pricer)
        choice = solve_dynamic_programming(cg).choice
        return [node.candidates[c] for node, c in zip(cg.nodes, choice)]

    return strategy_map_from(request, fitting_transients(request, search))


def recursive_programming_planner(request: PlanRequest) -> StrategyMap:
    """search_mode "recursive_programming": MindSpore's rec bisection rounds."""
    return strategy_map_from(request, fitting_transients(request, lambda pricer: list(
        solve_recursive_programming(pricer).shardings)))


def sharding_propagation_planner(request: PlanRequest) -> StrategyMap:
    """search_mode "sharding_propagation": the user's strategies spread to every other op
    through the edges of least redistribution cost under the search cost model (not searched
    again under transient limits: its plan does not depend on the cap)."""
    return propagate(pricer_of(request), "auto_parallel", request.input_layouts)
