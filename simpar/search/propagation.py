"""The planners of stand_alone, data_parallel and semi_auto_parallel: a :class:`StrategyMap`
from the user's strategies, and sharding propagation for the ops without one.

Pure: shapes, the device count and the redistribution planner; no MPI, no data.

An op the user annotated with ``.shard()`` keeps its strategy (semi_auto_parallel). Every
other op is reached by sharding propagation from the user's ops and the graph inputs (in the
dataset strategy's layouts), forward and backward, and takes the candidate that moves the
fewest bytes against its settled neighbours (ties: see
:mod:`simpar.search.sharding_propagation`; why:
docs/design.md#unannotated-ops-are-filled-in-by-sharding-propagation-the-one-propagation-in-simpar).
In data_parallel the same rule runs with parameters held whole. Parameters take
the layout of their ``parameter_plan`` or of their first settled reader.
"""

from __future__ import annotations

from collections.abc import Mapping

from simpar.graph import Node
from simpar.search.pricing import Pricer
from simpar.search.request import PlanRequest
from simpar.search.sharding_propagation import MovedBytes, propagate
from simpar.search.strategy_map import StrategyMap

__all__ = ["follow_producers"]


def follow_producers(request: PlanRequest) -> StrategyMap:
    """The planner of stand_alone, data_parallel and semi_auto_parallel: ``.shard()``
    strategies kept (semi_auto_parallel), every other op filled in by sharding propagation
    (:func:`~simpar.search.sharding_propagation.propagate`), moving the fewest bytes."""
    pricer = Pricer(request.graph, request.device_num, MovedBytes(), request.input_layouts,
                    request.parameter_plan, request.enable_alltoall,
                    user_strategies=request.mode == "semi_auto_parallel", algo=request.algo)
    if request.mode == "semi_auto_parallel":
        for site in pricer.sites:
            if site.user:
                _check_plan_against_strategy(site.node, request.device_num,
                                             request.parameter_plan, request.enable_alltoall)
    return propagate(pricer, request.mode, request.input_layouts)


def _check_plan_against_strategy(node: Node, device_num: int,
                                 plans: Mapping[str, tuple[int, ...]],
                                 enable_alltoall: bool) -> None:
    """A parameter plan and the ``.shard()`` strategy of the op that reads the parameter
    must agree: simpar would otherwise silently follow one of them."""
    sh = node.op.sharding([v.shape for v in node.inputs], device_num,
                          enable_alltoall=enable_alltoall)
    for v, lay in zip(node.inputs, sh.in_layouts):
        if v.kind == "param" and v.name in plans and lay.cuts != plans[v.name]:
            raise ValueError(f"parameter_plan gives {v.name} the cuts {plans[v.name]}, but "
                             f"{node.name} (.shard({[list(c) for c in sh.strategy]})) reads it "
                             f"cut {lay.cuts}; make them agree, or drop one of them")
