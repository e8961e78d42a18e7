"""auto_parallel's searches as planners (``register_search``): the cost graph of the request,
solved, as a :class:`StrategyMap` whose ops are marked ``searched`` (or ``annotated`` where the
user set ``.shard()``). Costs come from the request's cost model, within its memory cap, under
its algo parameters (:class:`~simpar.search.request.PlanRequest`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding
from simpar.search.cost_graph import CostGraph, build_cost_graph
from simpar.search.dynamic_programming import solve_dynamic_programming
from simpar.search.exact import TimeLimitWarning, describe_gap, solve_exact
from simpar.search.pricing import Pricer
from simpar.search.recursive_programming import solve_recursive_programming
from simpar.search.request import PlanRequest
from simpar.search.sharding_propagation import propagate
from simpar.search.strategy_map import OpStrategy, Source, StrategyMap, lay_out_by_consumer

__all__ = ["cost_graph_of", "dynamic_programming_planner", "exact_planner", "pricer_of",
           "recursive_programming_planner", "sharding_propagation_planner",
           "strategy_map_from", "strategy_map_of"]


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
    parameter ``exact_time_limit`` (simpar's own). When the limit runs out first, the map
    is the best plan found, its ``optimality_gap`` says how far from proven it is, and a
    :class:`~simpar.search.exact.TimeLimitWarning` says so."""
    cg = cost_graph_of(request)
    limit = request.algo.exact_time_limit
    found = solve_exact(cg, limit)
    if not found.proven:
        why = ("HiGHS stopped before proving it" if limit is None else
               f"the time limit of {limit:g} s (exact_time_limit) ran out")
        warnings.warn(f"search_mode 'exact': {why}; the plan is the best found, not proven "
                      f"optimal ({describe_gap(found.gap)}). Raise exact_time_limit with "
                      "set_algo_parameters, or set it to None, for the proven optimum",
                      TimeLimitWarning, stacklevel=2)
    return strategy_map_of(request, cg, found.choice, found.gap)


def dynamic_programming_planner(request: PlanRequest) -> StrategyMap:
    """search_mode "dynamic_programming": MindSpore's elimination search of the cost graph."""
    cg = cost_graph_of(request)
    return strategy_map_of(request, cg, solve_dynamic_programming(cg).choice)


def recursive_programming_planner(request: PlanRequest) -> StrategyMap:
    """search_mode "recursive_programming": MindSpore's rec bisection rounds."""
    return strategy_map_from(request, solve_recursive_programming(pricer_of(request)).shardings)


def sharding_propagation_planner(request: PlanRequest) -> StrategyMap:
    """search_mode "sharding_propagation": the user's strategies spread to every other op
    through the edges of least redistribution cost under the search cost model."""
    return propagate(pricer_of(request), "auto_parallel", request.input_layouts)
