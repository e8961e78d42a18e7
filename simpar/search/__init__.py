"""simpar.search: planners that turn a traced graph into a :class:`StrategyMap`.

Pure (no MPI, no data). Today: the user's ``.shard()`` strategies with a forward fill-in for
the rest (stand_alone, data_parallel, semi_auto_parallel, :func:`plan_strategies`). The cost
model's searches (dynamic programming, recursive programming, sharding propagation) will
produce the same value.
"""

from simpar.search.propagation import (
    MODES,
    dataset_layouts,
    parameter_plans,
    plan_strategies,
)
from simpar.search.strategy_map import OpStrategy, Source, StrategyMap

__all__ = [
    "MODES",
    "OpStrategy",
    "Source",
    "StrategyMap",
    "dataset_layouts",
    "parameter_plans",
    "plan_strategies",
]
