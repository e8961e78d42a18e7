"""The plan request: everything a plan depends on, in one frozen value, and the one place it is
built from the context.

A planner is a pure function of its :class:`PlanRequest`: the traced graph, the device count,
the parallel and search mode, the graph inputs' layouts (the dataset strategy applied), the
Cells' parameter plans, ``enable_alltoall``, the algorithm parameters, the cost model the
search minimises and the memory cap. Nothing under ``simpar.search`` or ``simpar.cost`` reads
the process-wide context while planning: every entry point (training, ``run_op``,
``search_strategies``, ``simpar.plan``, the ``AutoParallel`` wrapper, ``plan_strategies``)
builds its request here, with :func:`request_from_context`, and plans that.

>>> request = request_from_context(g, cell=net)            # doctest: +SKIP
>>> smap = simpar.search.plan_request(request)             # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from simpar.comm_fusion import AllReduceFusion
from simpar.context import AlgoParameters, algo_parameters, auto_parallel_context
from simpar.cost.interface import CostModel, MindSporeCostModel, SimparCostModel
from simpar.cost_model_context import cost_model_context, get_search_cost_model
from simpar.graph import Graph
from simpar.layout import TensorLayout
from simpar.optimizer_parallel import OptimizerParallel

__all__ = ["MODES", "PlanRequest", "dataset_layouts", "global_input_shapes", "parameter_plans",
           "request_from_context"]

#: The modes planned from the user's strategies and the fill-in (auto_parallel searches).
MODES = ("stand_alone", "data_parallel", "semi_auto_parallel")


def _simpar_model() -> CostModel:
    return SimparCostModel("cpu-local")


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What every planner is given. ``input_layouts`` has one layout per graph input (the
    dataset strategy already applied); ``parameter_plan`` maps parameter names to cuts, checked
    against the graph's parameters; ``search_mode`` names the auto_parallel search;
    ``memory_capacity`` is the bytes per rank a plan may need (None: the cost model's own);
    ``optimizer`` the optimizer-parallel settings (:mod:`simpar.optimizer_parallel`);
    ``micro_batches`` how many micro-batches a step runs (the graph is one micro-batch's);
    ``recompute`` the recomputed Cells (``graph.segments`` names: the backward runs their
    forward again).

    Under ``set_algo_parameters(memory_dimensions=...)`` other than "fixed", ``searched``
    names the dimensions auto_parallel chooses ("optimizer", "recompute", "micro_batches":
    those the user left unset), ``micro_graphs`` holds the graph of one micro-batch for each
    micro-batch count it may choose, and ``step_objective`` prices a whole step with the
    memory dimensions' time (:mod:`simpar.search.dimensions`)."""

    graph: Graph = field(compare=False, repr=False)
    device_num: int
    mode: str
    input_layouts: tuple[TensorLayout, ...]
    parameter_plan: Mapping[str, tuple[int, ...]] = field(default_factory=dict, compare=False)
    enable_alltoall: bool = False
    search_mode: str = "recursive_programming"
    algo: AlgoParameters = AlgoParameters()
    cost_model: CostModel = field(default_factory=_simpar_model)
    memory_capacity: float | None = None
    optimizer: OptimizerParallel = OptimizerParallel()
    micro_batches: int = 1
    recompute: tuple[str, ...] = ()
    searched: frozenset[str] = frozenset()
    micro_graphs: Mapping[int, Graph] = field(default_factory=dict, compare=False, repr=False)
    step_objective: bool = False
    #: How the Mirrors' gradient AllReduces are bucketed (the context's ``comm_fusion``).
    comm_fusion: AllReduceFusion = AllReduceFusion()

    @property
    def capacity(self) -> float:
        """The bytes per rank a plan may take: ``memory_capacity``, else the cost model's."""
        return float(self.cost_model.memory_capacity if self.memory_capacity is None
                     else self.memory_capacity)


def request_from_context(graph: Graph, *, cell: Any = None,
                         parameter_plan: Mapping[str, Any] | None = None,
                         device_num: int | None = None, mode: str | None = None,
                         dataset_strategy: Any = None, enable_alltoall: bool | None = None,
                         search_mode: str | None = None, cost_model: CostModel | None = None,
                         algo: Mapping[str, Any] | None = None,
                         unset: Mapping[str, Any] | None = None,
                         optimizer: OptimizerParallel | None = None,
                         micro_batches: int = 1,
                         recompute: tuple[str, ...] | None = None,
                         micro_graphs: Mapping[int, Graph] | None = None) -> PlanRequest:
    """The request to plan ``graph``: every argument left None is the context's.

    ``mode`` and ``device_num`` default to ``parallel_mode`` and ``device_num`` (which the
    context has already checked against the MPI world once it is known); stand_alone plans
    for one device, data_parallel splits the inputs' batch, and one device takes the inputs
    whole. ``parameter_plan`` defaults to ``cell``'s Cells' plans. ``algo`` replaces some algo
    parameters for this request only (``{"exact_time_limit": 60}``). ``unset`` gives the
    value of an auto-parallel key the user left unset (``search_strategies`` keeps its own
    defaults so). The cost model is ``cost_model``, else :func:`set_search_cost_model`'s, else
    MindSpore's when a key of its objective was set, else simpar's on ``cpu-local``; the
    memory cap is ``device_memory_capacity`` when set, else the model's own
    (:mod:`simpar.cost_model_context`). ``optimizer`` defaults to the context's
    ``enable_parallel_optimizer`` and ``parallel_optimizer_config`` (off on one device);
    ``recompute`` to every Cell the user marked with ``Cell.recompute()``.
    ``micro_graphs`` maps each micro-batch count auto_parallel may choose to its graph (under
    ``memory_dimensions`` "when_needed" or "search"; ``graph`` is ``micro_batches``'s); the
    optimizer level is searched unless ``enable_parallel_optimizer`` was set, the recomputed
    Cells among those marked.

    >>> request_from_context(g, mode="semi_auto_parallel", device_num=8)  # doctest: +SKIP
    PlanRequest(device_num=8, mode='semi_auto_parallel', input_layouts=(...), ...)
    """
    ctx = auto_parallel_context()

    def given(key: str, value: Any) -> Any:
        if value is not None:
            return value
        if unset is not None and key in unset and key not in ctx.explicit:
            return unset[key]
        return getattr(ctx, key)

    mode = str(given("parallel_mode", mode))
    if mode not in (*MODES, "auto_parallel"):
        raise ValueError(f"plan: mode must be one of {list(MODES)} or 'auto_parallel', got "
                         f"{mode!r}")
    device_num = 1 if mode == "stand_alone" else int(given("device_num", device_num))
    dataset = given("dataset_strategy", dataset_strategy)
    if mode == "data_parallel":
        dataset = "data_parallel"
    if device_num == 1:
        dataset = "full_batch"
    plans = {k: tuple(v) if isinstance(v, (tuple, list)) else (v,) for k, v in (
        parameter_plans(cell) if parameter_plan is None else parameter_plan).items()}
    _check_parameter_plan(graph, plans)
    layouts = tuple(dataset_layouts([v.shape for v in graph.inputs], device_num, dataset))
    settings = cost_model_context()
    model = cost_model or get_search_cost_model() or (
        MindSporeCostModel(settings) if settings.objective_changed else _simpar_model())
    if isinstance(model, MindSporeCostModel) and model.ctx is None:
        model = replace(model, ctx=settings)
    cap = (settings.device_memory_capacity if settings.memory_capacity_changed
           else float(model.memory_capacity))
    searched: set[str] = set()
    algos = replace(algo_parameters(), **(algo or {}))
    if mode == "auto_parallel" and algos.memory_dimensions != "fixed":
        if optimizer is None and "enable_parallel_optimizer" not in ctx.explicit and \
                device_num > 1:
            searched.add("optimizer")
        if graph.segments:
            searched.add("recompute")
        if len(micro_graphs or {}) > 1:
            searched.add("micro_batches")
    if optimizer is None:
        optimizer = _optimizer_settings(ctx, device_num)
    if "optimizer" in searched:   # off, with the config's threshold for the levels tried
        config = ctx.parallel_optimizer_config
        optimizer = OptimizerParallel(None, config.optimizer_weight_shard_size
                                      if device_num % max(config.optimizer_weight_shard_size, 1)
                                      == 0 else -1, config.parallel_optimizer_threshold)
    return PlanRequest(graph, device_num, mode, layouts, plans,
                       bool(given("enable_alltoall", enable_alltoall)),
                       str(given("search_mode", search_mode)), algos, model, cap, optimizer,
                       micro_batches, _recompute(graph, recompute), frozenset(searched),
                       dict(micro_graphs or {micro_batches: graph}),
                       comm_fusion=ctx.comm_fusion)


def _recompute(graph: Graph, names: tuple[str, ...] | None) -> tuple[str, ...]:
    """The recomputed segments: ``names``, each one of ``graph``'s, or all of them."""
    known = [seg.name for seg in graph.segments]
    if names is None:
        return tuple(known)
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"recompute: {bad[0]!r} is no recomputable Cell of this graph; it has "
                         f"{known or 'none (mark Cells with Cell.recompute())'}")
    return tuple(names)


def _optimizer_settings(ctx: Any, device_num: int) -> OptimizerParallel:
    """The context's optimizer-parallel settings for ``device_num`` devices; a shard size
    that does not divide ``device_num`` can divide no parameter's repeated group."""
    config = ctx.parallel_optimizer_config
    if not ctx.enable_parallel_optimizer or device_num == 1:
        return OptimizerParallel()
    size = config.optimizer_weight_shard_size
    if size != -1 and (size > device_num or device_num % size):
        raise ValueError(f"parallel_optimizer_config: optimizer_weight_shard_size {size} does "
                         f"not divide device_num {device_num}, so it divides no parameter's "
                         f"group of ranks; use -1 (each parameter's whole group) or a divisor "
                         f"of {device_num}")
    return OptimizerParallel(config.optimizer_level, size, config.parallel_optimizer_threshold)


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


def global_input_shapes(local_shapes: Sequence[Sequence[int]], device_num: int,
                        dataset_strategy: Any) -> list[tuple[int, ...]]:
    """The global shapes of inputs of which each device holds the slice of ``local_shapes``
    (MindSpore's ``full_batch=False`` feeding): "full_batch" (and 0-d inputs) as given,
    "data_parallel" dim 0 times every device, a tuple of cuts each dim times its cut."""
    out = []
    for k, shape in enumerate(local_shapes):
        shape = tuple(int(d) for d in shape)
        if dataset_strategy == "full_batch" or not shape:
            out.append(shape)
        elif dataset_strategy == "data_parallel":
            out.append((shape[0] * device_num, *shape[1:]))
        else:
            if k >= len(dataset_strategy) or len(dataset_strategy[k]) != len(shape):
                raise ValueError(f"dataset_strategy {dataset_strategy} has no cut per dimension "
                                 f"for input {k} of per-device shape {shape}")
            out.append(tuple(d * int(c) for d, c in zip(shape, dataset_strategy[k])))
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
