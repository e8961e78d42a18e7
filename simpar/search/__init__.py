"""simpar.search: planners that turn a traced graph into a :class:`StrategyMap`.

Pure (no MPI, no data). Every planner takes a :class:`PlanRequest` and returns a
:class:`StrategyMap` (:mod:`simpar.search.planner`). Today: the user's ``.shard()``
strategies with a fill-in from the producers for the rest (stand_alone, data_parallel,
semi_auto_parallel: :func:`follow_producers`). The auto_parallel searches (dynamic
programming, recursive programming, sharding propagation) register with
:func:`register_search` under their ``search_mode``; :func:`plan_strategies` picks the one
the context names.
"""

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

__all__ = [
    "MODES",
    "OpStrategy",
    "PlanRequest",
    "Planner",
    "Source",
    "StrategyMap",
    "dataset_layouts",
    "follow_producers",
    "parameter_plans",
    "plan_strategies",
    "register_search",
    "registered_searches",
    "search_for",
]
