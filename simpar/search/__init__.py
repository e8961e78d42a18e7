"""simpar.search: planners that turn a traced graph into a :class:`StrategyMap`.

Pure (no MPI, no data). Every planner takes a :class:`PlanRequest`, everything a plan depends
on, built once from the context by :func:`request_from_context` (:mod:`simpar.search.request`),
and returns a :class:`StrategyMap`; :func:`plan_request` picks the planner
(:mod:`simpar.search.planner`). stand_alone, data_parallel and semi_auto_parallel keep the
user's ``.shard()`` strategies and fill in the rest by sharding propagation
(:func:`follow_producers`, :mod:`simpar.search.sharding_propagation`). The auto_parallel
searches register with :func:`register_search` under their ``search_mode``:
``recursive_programming`` (MindSpore's default: bisection rounds, then a refinement in the
plan's neighbourhood, :mod:`simpar.search.recursive_programming`), ``dynamic_programming``
(MindSpore's elimination search, :mod:`simpar.search.dynamic_programming`),
``sharding_propagation`` (the user's strategies spread by least redistribution cost) and
``exact`` (the cost graph's ILP optimum, :mod:`simpar.search.exact`). All of them price
through one :class:`~simpar.search.pricing.Pricer`: one cost model, one redistribution
planner.
"""

from simpar.cost_model_context import set_search_cost_model
from simpar.search.auto import (
    dynamic_programming_planner,
    exact_planner,
    recursive_programming_planner,
    sharding_propagation_planner,
)
from simpar.search.cost_graph import CostGraph, brute_force, build_cost_graph
from simpar.search.planner import (
    OptimizerShardWarning,
    Planner,
    check_builtin_searches,
    complete_plan,
    plan_once,
    plan_request,
    plan_strategies,
    register_search,
    registered_searches,
    search_for,
    shard_optimizer,
)
from simpar.search.propagation import follow_producers
from simpar.search.request import (
    MODES,
    PlanRequest,
    dataset_layouts,
    global_input_shapes,
    parameter_plans,
    request_from_context,
)
from simpar.search.strategy_map import OpStrategy, Source, StrategyMap

# The searches of auto_parallel (cost graph + solver) under the built-in search_modes.
register_search("dynamic_programming", dynamic_programming_planner)
register_search("exact", exact_planner)
register_search("recursive_programming", recursive_programming_planner)
register_search("sharding_propagation", sharding_propagation_planner)
check_builtin_searches()

__all__ = [
    "MODES",
    "CostGraph",
    "OpStrategy",
    "OptimizerShardWarning",
    "PlanRequest",
    "Planner",
    "Source",
    "StrategyMap",
    "complete_plan",
    "dataset_layouts",
    "global_input_shapes",
    "brute_force",
    "build_cost_graph",
    "follow_producers",
    "parameter_plans",
    "plan_once",
    "plan_request",
    "plan_strategies",
    "register_search",
    "registered_searches",
    "request_from_context",
    "search_for",
    "shard_optimizer",
    "set_search_cost_model",
]
