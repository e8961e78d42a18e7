"""The planners of stand_alone, data_parallel and semi_auto_parallel: a :class:`StrategyMap`
from the user's strategies, and a forward fill-in for the ops without one.

Pure: shapes, the device count and the redistribution planner; no MPI, no data.

The fill-in walks the graph in order. An op the user annotated with ``.shard()`` keeps its
strategy (semi_auto_parallel). Any other op takes the candidate strategy that moves the fewest
bytes from its producers' layouts, then the fewest redistribution steps (even a free local
slice now can force a gather later), then the most parallel one, then the largest batch cut
(README, "Unannotated ops follow their producers"). In data_parallel the same rule runs with
parameters held whole. Parameters take the layout of their ``parameter_plan`` or of their
first consumer; graph inputs the layout of the dataset strategy.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from simpar import context
from simpar.cost.collective import sample_ranks
from simpar.graph import Graph, Node
from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding, Strategy, StrategyError
from simpar.redistribution import RedistributionPlan, plan
from simpar.search.planner import PlanRequest, search_for
from simpar.search.strategy_map import OpStrategy, Source, StrategyMap

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
    strategies kept (semi_auto_parallel), every other op filled in from its producers."""
    graph, device_num, mode = request.graph, request.device_num, request.mode
    plans, enable_alltoall = request.parameter_plan, request.enable_alltoall
    layouts: dict[int, TensorLayout] = {}
    inputs: dict[str, TensorLayout] = {}
    for v, lay in zip(graph.inputs, request.input_layouts):
        layouts[v.id] = inputs[v.name] = lay
    for v in graph.consts:
        layouts[v.id] = TensorLayout((device_num,), [-1] * v.ndim, v.shape)
    ops: dict[str, OpStrategy] = {}
    params: dict[str, TensorLayout] = {}
    for node in graph.nodes:
        shapes = [v.shape for v in node.inputs]
        sh, source = _choose(node, shapes, device_num, mode, layouts, plans, enable_alltoall)
        if source == Source.USER:
            _check_plan_against_strategy(node, sh, plans)
        ops[node.name] = OpStrategy(node.op.name, sh.strategy, _out_strategy(node, source),
                                    source)
        for v, need in zip(node.inputs, sh.in_layouts):
            if v.kind == "param" and v.id not in layouts:
                layouts[v.id] = params[v.name] = need
        for v, (_, out, _) in zip(node.outputs, sh.outputs):
            layouts[v.id] = out
    for v in graph.params:
        if v.name not in params:  # unused parameter: keep it replicated
            params[v.name] = TensorLayout((device_num,), [-1] * v.ndim, v.shape)
    return StrategyMap(device_num, mode, ops, params, inputs)


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


def _check_plan_against_strategy(node: Node, sh: OpSharding,
                                 plans: Mapping[str, tuple[int, ...]]) -> None:
    """A parameter plan and the ``.shard()`` strategy of the op that reads the parameter
    must agree: simpar would otherwise silently follow one of them."""
    for v, lay in zip(node.inputs, sh.in_layouts):
        if v.kind == "param" and v.name in plans and lay.cuts != plans[v.name]:
            raise ValueError(f"parameter_plan gives {v.name} the cuts {plans[v.name]}, but "
                             f"{node.name} (.shard({[list(c) for c in sh.strategy]})) reads it "
                             f"cut {lay.cuts}; make them agree, or drop one of them")


def _out_strategy(node: Node, source: Source) -> Strategy | None:
    return node.op.out_strategy if source == Source.USER else None


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


def _moved_bytes(p: RedistributionPlan) -> int:
    """The busiest sampled rank's bytes sent plus received, per element byte."""
    return max(p.recv_bytes(r, 1) + p.send_bytes(r, 1)
               for r in sample_ranks(p.src.device_num)) if p.steps else 0


def _follow_strategy(node: Node, known: dict[int, TensorLayout]) -> Strategy:
    """Cuts that keep every activation input where it already is (params and consts free)."""
    cuts = []
    for v in node.inputs:
        lay = known.get(v.id)
        cuts.append(lay.cuts if lay is not None and v.kind in ("op", "input") else
                    (1,) * v.ndim)
    return tuple(cuts)


def _param_cuts_ok(node: Node, strat: Strategy, mode: str,
                   plans: Mapping[str, tuple[int, ...]]) -> bool:
    for v, cuts in zip(node.inputs, strat):
        if v.kind != "param":
            continue
        if v.name in plans and tuple(cuts) != plans[v.name]:
            return False
        if mode == "data_parallel" and any(c != 1 for c in cuts):
            return False
    return True


def _choose(node: Node, shapes: list[tuple[int, ...]], device_num: int, mode: str,
            known: dict[int, TensorLayout], param_plans: Mapping[str, tuple[int, ...]],
            enable_alltoall: bool) -> tuple[OpSharding, Source]:
    op = node.op
    if mode == "semi_auto_parallel" and op.in_strategy is not None:
        return op.sharding(shapes, device_num, enable_alltoall=enable_alltoall), Source.USER

    def score(sh: OpSharding) -> tuple[int, int, int, int]:
        cost = steps = 0
        for v, lay in zip(node.inputs, sh.in_layouts):
            src = known.get(v.id)
            if src is not None and v.kind in ("op", "input"):
                p = plan(src, lay, enable_alltoall)
                cost += _moved_bytes(p)
                steps += len(p.steps)
        batch_cut = -sh.in_layouts[0].cuts[0] if sh.in_layouts and sh.in_layouts[0].ndim else 0
        return cost, steps, sh.repeat, batch_cut

    source = Source.DATA_PARALLEL if mode == "data_parallel" else Source.PROPAGATED
    follow = _follow_strategy(node, known)
    if _param_cuts_ok(node, follow, mode, param_plans):
        try:
            sh = op.sharding(shapes, device_num, follow, enable_alltoall=enable_alltoall)
            if score(sh)[:2] == (0, 0):  # no byte and no step to move: nothing can beat it
                return sh, source
        except (StrategyError, ValueError):
            pass
    best: tuple[tuple[int, int, int, int], OpSharding] | None = None
    for strat in op.candidate_strategies(shapes, device_num, fully_use_devices=False):
        if not _param_cuts_ok(node, strat, mode, param_plans):
            continue
        try:
            sh = op.sharding(shapes, device_num, strat, enable_alltoall=enable_alltoall)
        except (StrategyError, ValueError):
            continue
        key = score(sh)
        if best is None or key < best[0]:
            best = (key, sh)
    if best is None:
        raise StrategyError(f"{node.name}: no valid strategy for shapes {shapes} on "
                            f"{device_num} devices")
    return best[1], source
