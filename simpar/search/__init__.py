"""simpar.search: planners that turn a traced graph into a :class:`StrategyMap`.

Pure (no MPI, no data). Every planner takes a :class:`PlanRequest` and returns a
:class:`StrategyMap` (:mod:`simpar.search.planner`). Today: the user's ``.shard()``
strategies with a fill-in from the producers for the rest (stand_alone, data_parallel,
semi_auto_parallel: :func:`follow_producers`). The auto_parallel searches register with
:func:`register_search` under their ``search_mode``, and :func:`plan_strategies` picks the one
the context names: ``dynamic_programming`` (MindSpore's elimination search,
:mod:`simpar.search.dynamic_programming`) and ``exact`` (the cost graph's ILP optimum,
:mod:`simpar.search.exact`); recursive programming and sharding propagation are to come.
"""

from simpar.search.auto import dynamic_programming_planner, exact_planner, set_search_cost_model
from simpar.search.cost_graph import CostGraph, brute_force, build_cost_graph
from simpar.search.planner import (
    Planner,
    PlanRequest,
    register_search,
    registered_searches,
    search_for,
)
from simpar.search.propagation import (
    MODES,
    dataset_layouts,
    follow_producers,
    parameter_plans,
    plan_strategies,
)
from simpar.search.strategy_map import OpStrategy, Source, StrategyMap

# The searches of auto_parallel (cost graph + solver) register under their search_mode.
register_search("dynamic_programming", dynamic_programming_planner)
register_search("exact", exact_planner)

__all__ = [
    "MODES",
    "CostGraph",
    "OpStrategy",
    "PlanRequest",
    "Planner",
    "Source",
    "StrategyMap",
    "dataset_layouts",
    "brute_force",
    "build_cost_graph",
    "follow_producers",
    "parameter_plans",
    "plan_strategies",
    "register_search",
    "registered_searches",
    "search_for",
    "set_search_cost_model",
]
