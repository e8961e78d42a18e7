"""One interface for every planner: a :class:`PlanRequest` in, a :class:`StrategyMap` out.

A planner is a pure function of the request: the traced graph, the device count, the mode,
the graph inputs' layouts (from the dataset strategy), the Cells' parameter plans and the
``enable_alltoall`` switch. ``plan_strategies`` builds the request and picks the planner:
the user's strategies with the fill-in for stand_alone, data_parallel and semi_auto_parallel
(:mod:`simpar.search.propagation`), and for auto_parallel the search registered under the
context's ``search_mode``. A search joins with ``register_search("name", planner)``, which
also makes ``"name"`` a valid ``search_mode``; then ``set_auto_parallel_context(
parallel_mode="auto_parallel", search_mode="name")`` plans with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from simpar import context
from simpar.graph import Graph
from simpar.layout import TensorLayout
from simpar.search.strategy_map import StrategyMap

__all__ = ["PlanRequest", "Planner", "register_search", "registered_searches", "search_for"]


@dataclass(frozen=True)
class PlanRequest:
    """What every planner is given. ``input_layouts`` has one layout per graph input (the
    dataset strategy already applied); ``parameter_plan`` maps parameter names to cuts, checked
    against the graph's parameters."""

    graph: Graph = field(compare=False)
    device_num: int
    mode: str
    input_layouts: tuple[TensorLayout, ...]
    parameter_plan: Mapping[str, tuple[int, ...]] = field(default_factory=dict, compare=False)
    enable_alltoall: bool = False


#: A planner: pure, no MPI; it returns a strategy for every node of ``request.graph``.
Planner = Callable[[PlanRequest], StrategyMap]

_SEARCHES: dict[str, Planner] = {}


def register_search(name: str, planner: Planner) -> None:
    """Make ``planner`` the auto_parallel search for ``search_mode=name`` (and ``name`` an
    accepted ``search_mode``). Registering a name again replaces its planner."""
    if not callable(planner):
        raise TypeError(f"register_search: planner must be callable, got "
                        f"{type(planner).__name__}")
    context.register_search_mode(name, honoured=True)
    _SEARCHES[name] = planner


def registered_searches() -> tuple[str, ...]:
    """The search_modes that have a planner."""
    return tuple(_SEARCHES)


def search_for(search_mode: str) -> Planner:
    """The planner of ``search_mode``; NotImplementedError when none is registered yet."""
    found = _SEARCHES.get(search_mode)
    if found is None:
        have = f"; implemented: {list(_SEARCHES)}" if _SEARCHES else ""
        raise NotImplementedError(
            f"parallel_mode='auto_parallel' needs the strategy search, which is not "
            f"implemented yet (search_mode {search_mode!r}{have}); use semi_auto_parallel "
            "with .shard() strategies, or data_parallel")
    return found
