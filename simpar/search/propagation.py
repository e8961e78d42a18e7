"""The planners of stand_alone, data_parallel and semi_auto_parallel: a :class:`StrategyMap`
from the user's strategies, and sharding propagation for the ops without one.

Pure: shapes, the device count and the redistribution planner; no MPI, no data.

An op the user annotated with ``.shard()`` keeps its strategy (semi_auto_parallel). Every
other op is reached by sharding propagation from the user's ops and the graph inputs (in the
dataset strategy's layouts), forward and backward, and takes the candidate that moves the
fewest bytes against its settled neighbours (ties: see
:mod:`simpar.search.sharding_propagation`; README, "Unannotated ops are filled in by sharding
propagation"). In data_parallel the same rule runs with parameters held whole. Parameters take
the layout of their ``parameter_plan`` or of their first settled reader.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from simpar import context
from simpar.graph import Graph, Node
from simpar.layout import TensorLayout
from simpar.search.planner import PlanRequest, search_for
from simpar.search.pricing import Pricer
from simpar.search.sharding_propagation import MovedBytes, propagate
from simpar.search.strategy_map import StrategyMap

__all__ = ["MODES", "dataset_layouts", "follow_producers", "parameter_plans", "plan_strategies"]

MODES = ("stand_alone", "data_parallel", "semi_auto_parallel")


def plan_strategies(graph: Graph, device_num: int, mode: str,
                    dataset_strategy: Any = "full_batch", enable_alltoall: bool = False,
                    parameter_plan: Mapping[str, Sequence[int]] | None = None,
                    search_mode: str | None = None) -> StrategyMap:
    """Every op's strategy, every parameter's and input's layout, for ``graph`` on
    ``device_num`` devices in ``mode`` ("stand_alone" plans for one device). auto_parallel
    runs the search registered for ``search_mode`` (default: the context's)."""
    if mode not in (*MODES, "auto_parallel"):
        raise ValueError(f"plan_strategies: mode must be one of {list(MODES)} or "
                         f"auto_parallel, got {mode!r}")
    if mode == "auto_parallel":
        found = search_for(search_mode if search_mode is not None else
                           str(context.get_auto_parallel_context("search_mode")))
    if mode == "stand_alone":
        device_num = 1
    if mode == "data_parallel":
        dataset_strategy = "data_parallel"
    if device_num == 1:
        dataset_strategy = "full_batch"
    plans = {k: tuple(v) if isinstance(v, (tuple, list)) else (v,)
             for k, v in (parameter_plan or {}).items()}
    _check_parameter_plan(graph, plans)
    request = PlanRequest(graph, device_num, mode, tuple(dataset_layouts(
        [v.shape for v in graph.inputs], device_num, dataset_strategy)), plans, enable_alltoall)
    return found(request) if mode == "auto_parallel" else follow_producers(request)


def follow_producers(request: PlanRequest) -> StrategyMap:
    """The planner of stand_alone, data_parallel and semi_auto_parallel: ``.shard()``
    strategies kept (semi_auto_parallel), every other op filled in by sharding propagation
    (:func:`~simpar.search.sharding_propagation.propagate`), moving the fewest bytes."""
    pricer = Pricer(request.graph, request.device_num, MovedBytes(), request.input_layouts,
                    request.parameter_plan, request.enable_alltoall,
                    user_strategies=request.mode == "semi_auto_parallel")
    if request.mode == "semi_auto_parallel":
        for site in pricer.sites:
            if site.user:
                _check_plan_against_strategy(site.node, request.device_num,
                                             request.parameter_plan, request.enable_alltoall)
    return propagate(pricer, request.mode, request.input_layouts)


def _check_parameter_plan(graph: Graph, plans: Mapping[str, tuple[int, ...]]) -> None:
    names = {v.name: v for v in graph.params}
    for key, cuts in plans.items():
        if key not in names:
            close = difflib.get_close_matches(key, list(names), n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else (
                f"; its parameters are {sorted(names)[:8]}")
            raise ValueError(f"parameter_plan: the network has no parameter named {key!r}"
                             f"{hint}")
        shape = names[key].shape
        if len(cuts) != len(shape) or any(
                isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1 or n % c
                for c, n in zip(cuts, shape)):
            raise ValueError(f"parameter_plan: {key} has shape {shape}, so its plan needs "
                             f"{len(shape)} int cuts >= 1 that divide their dimensions, got "
                             f"{cuts}")


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


def parameter_plans(cell: Any) -> dict[str, tuple[int, ...]]:
    """{full parameter name: cuts} from every Cell's ``parameter_plan``."""
    out: dict[str, tuple[int, ...]] = {}
    if cell is None:
        return out
    for path, sub in cell.cells_and_names():
        for key, cuts in sub.parameter_plan.items():
            key = key.removeprefix("self.")
            out[f"{path}.{key}" if path else key] = cuts
    return out


def dataset_layouts(shapes: Sequence[Sequence[int]], device_num: int,
                    dataset_strategy: Any) -> list[TensorLayout]:
    """Layouts of the graph inputs: "full_batch" replicates, "data_parallel" splits dim 0 over
    every device, a tuple of cuts splits as given (remaining devices repeat, on the right)."""
    out = []
    for k, shape in enumerate(shapes):
        shape = tuple(shape)
        if dataset_strategy == "full_batch" or not shape:
            out.append(TensorLayout((device_num,), [-1] * len(shape), shape))
        elif dataset_strategy == "data_parallel":
            if shape[0] % device_num:
                raise ValueError(f"dataset_strategy 'data_parallel': input {k} of shape {shape} "
                                 f"has batch {shape[0]}, which does not split over "
                                 f"{device_num} devices; use full_batch or a tuple strategy")
            out.append(TensorLayout((device_num,), [0] + [-1] * (len(shape) - 1), shape))
        else:
            if k >= len(dataset_strategy):
                raise ValueError(f"dataset_strategy {dataset_strategy} has no entry for input "
                                 f"{k} of shape {shape}")
            cuts = tuple(dataset_strategy[k])
            used = math.prod(cuts)
            if len(cuts) != len(shape) or device_num % used:
                raise ValueError(f"dataset_strategy entry {cuts} for input {k} of shape "
                                 f"{shape} must have one cut per dimension and use a divisor "
                                 f"of device_num {device_num}")
            dm = tuple(c for c in cuts if c > 1) + ((device_num // used,)
                                                    if device_num > used else ())
            out.append(TensorLayout.from_strategy(dm or (1,), cuts, shape))
    return out


