"""auto_parallel's searches as planners (``register_search``): the cost graph of the request,
solved, as a :class:`StrategyMap` whose ops are marked ``searched`` (or ``annotated`` where the
user set ``.shard()``). Costs come from simpar's model on the ``cpu-local`` profile unless
:func:`set_search_cost_model` chose another :class:`~simpar.cost.CostModel`.
"""

from __future__ import annotations

from simpar.cost.interface import CostModel, SimparCostModel
from simpar.layout import TensorLayout
from simpar.search.cost_graph import CostGraph, build_cost_graph
from simpar.search.dynamic_programming import solve_dynamic_programming
from simpar.search.exact import solve_exact
from simpar.search.planner import PlanRequest
from simpar.search.strategy_map import OpStrategy, Source, StrategyMap

__all__ = ["cost_graph_of", "dynamic_programming_planner", "exact_planner", "search_cost_model",
           "set_search_cost_model", "strategy_map_of"]

_MODEL: CostModel | None = None


def set_search_cost_model(model: CostModel | None) -> None:
    """The cost model the searches minimise (None: simpar's, on the cpu-local profile)."""
    global _MODEL
    if model is not None and not isinstance(model, CostModel):
        raise TypeError(f"set_search_cost_model: expected a simpar.cost.CostModel (op, edge, "
                        f"program), got {type(model).__name__}")
    _MODEL = model


def search_cost_model() -> CostModel:
    return _MODEL if _MODEL is not None else SimparCostModel("cpu-local")


def strategy_map_of(request: PlanRequest, cg: CostGraph, choice: tuple[int, ...]) -> StrategyMap:
    """The strategy map of one candidate per node of ``cg``."""
    ops: dict[str, OpStrategy] = {}
    params: dict[str, TensorLayout] = {}
    for node, c in zip(cg.nodes, choice):
        sh = node.candidates[c]
        source = Source.USER if node.user_set else Source.SEARCHED
        out = node.node.op.out_strategy if node.user_set else None
        ops[node.name] = OpStrategy(node.node.op.name, sh.strategy, out, source)
        for v, lay in zip(node.node.inputs, sh.in_layouts):
            if v.kind == "param":
                params.setdefault(v.name, lay)
    inputs = {v.name: lay for v, lay in zip(request.graph.inputs, request.input_layouts)}
    return StrategyMap(request.device_num, "auto_parallel", ops, params, inputs)


def cost_graph_of(request: PlanRequest) -> CostGraph:
    """The cost graph of a request under the search cost model."""
    return build_cost_graph(request.graph, request.device_num, search_cost_model(),
                            input_layouts=request.input_layouts,
                            parameter_plan=request.parameter_plan,
                            enable_alltoall=request.enable_alltoall)


def exact_planner(request: PlanRequest) -> StrategyMap:
    """search_mode "exact": the ILP optimum of the cost graph (HiGHS)."""
    cg = cost_graph_of(request)
    return strategy_map_of(request, cg, solve_exact(cg).choice)


def dynamic_programming_planner(request: PlanRequest) -> StrategyMap:
    """search_mode "dynamic_programming": MindSpore's elimination search of the cost graph."""
    cg = cost_graph_of(request)
    return strategy_map_of(request, cg, solve_dynamic_programming(cg).choice)
