"""The cost graph that auto_parallel's searches solve (pure: shapes only, no MPI, no data).

One :class:`CostNode` per traced op, with its candidate strategies and each one's cost; one
:class:`CostEdge` per producer -> consumer pair, with the redistribution cost between every
producer candidate's output layout and every consumer candidate's input layout, planned by the
real redistribution planner (what is costed is what runs). Graph inputs have fixed layouts
(the dataset strategy), so an op reading one pays a per-candidate cost instead of an edge. A
parameter read by several ops must have one layout: :attr:`CostGraph.shared` lists, per such
parameter, the (node, candidate) choices that agree.

Costs come from any :class:`~simpar.cost.CostModel` (simpar's seconds or MindSpore's
objective). A strategy set with ``.shard()`` is the node's only candidate (MindSpore keeps user
strategies in auto_parallel).

>>> g = graph.trace(net, shapes)                                   # doctest: +SKIP
>>> cg = build_cost_graph(g, 8, SimparCostModel("ascend910a"))     # doctest: +SKIP
>>> choice, cost = brute_force(cg)                                 # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from simpar import context
from simpar.cost.interface import CostModel
from simpar.graph import Graph, Node
from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding, StrategyError
from simpar.redistribution import plan
from simpar.search.propagation import dataset_layouts

__all__ = ["CostEdge", "CostGraph", "CostNode", "brute_force", "build_cost_graph",
           "distinct_blocks", "same_blocks"]


@dataclass(frozen=True)
class CostNode:
    """One op: its candidate shardings and what each costs on its own (kernels, its own
    collectives, its parameters' gradient sync, and moving any graph input it reads)."""

    node: Node
    candidates: tuple[OpSharding, ...]
    costs: tuple[float, ...]
    user_set: bool = False

    @property
    def name(self) -> str:
        return self.node.name


@dataclass(frozen=True)
class CostEdge:
    """``producer``'s output ``output`` feeds ``consumer``'s input ``input``; ``costs[i][j]``
    moves it from producer candidate i's layout to consumer candidate j's."""

    producer: int
    output: int
    consumer: int
    input: int
    costs: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class CostGraph:
    """Nodes in trace order, edges, and the shared-parameter constraints: for each parameter
    read by several ops, ``shared[name]`` lists (node index, input position) pairs whose
    chosen candidates must give the parameter the same layout."""

    nodes: tuple[CostNode, ...]
    edges: tuple[CostEdge, ...]
    shared: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    device_num: int = 1
    unit: str = ""

    def total(self, choice: Sequence[int]) -> float:
        """The objective of one candidate per node (``inf`` when shared parameters disagree)."""
        if len(choice) != len(self.nodes):
            raise ValueError(f"CostGraph.total: choice has {len(choice)} entries, the graph "
                             f"{len(self.nodes)} nodes")
        for uses in self.shared.values():
            layouts = {self.nodes[n].candidates[choice[n]].in_layouts[k] for n, k in uses}
            if len(distinct_blocks(layouts)) > 1:
                return math.inf
        cost = sum(node.costs[c] for node, c in zip(self.nodes, choice))
        cost += sum(e.costs[choice[e.producer]][choice[e.consumer]] for e in self.edges)
        return cost

    def strategies(self, choice: Sequence[int]) -> dict[str, tuple[tuple[int, ...], ...]]:
        """{op name: strategy} of a choice."""
        return {n.name: n.candidates[c].strategy for n, c in zip(self.nodes, choice)}


def distinct_blocks(layouts: set[TensorLayout]) -> list[TensorLayout]:
    """Layouts that hold different blocks on some rank (one matrix written two ways is one)."""
    out: list[TensorLayout] = []
    for lay in layouts:
        if not any(same_blocks(lay, o) for o in out):
            out.append(lay)
    return out


def same_blocks(a: TensorLayout, b: TensorLayout) -> bool:
    """Whether two layouts give every rank the same block (one matrix written two ways)."""
    return a.device_num == b.device_num and all(
        a.slice_of(r) == b.slice_of(r) for r in range(a.device_num))


def build_cost_graph(graph: Graph, device_num: int, model: CostModel,
                     dataset_strategy: Any = "full_batch",
                     enable_alltoall: bool = False, *,
                     input_layouts: Sequence[TensorLayout] | None = None,
                     parameter_plan: Mapping[str, Sequence[int]] | None = None) -> CostGraph:
    """The cost graph of ``graph`` on ``device_num`` devices under ``model``. Candidates come
    from each op's ``candidate_strategies`` under the algo parameters (fully_use_devices,
    tensor_slice_align_*); a ``.shard()`` strategy is the only candidate, and a candidate that
    cuts a parameter otherwise than its ``parameter_plan`` is dropped. Graph inputs arrive in
    ``input_layouts`` (default: the ``dataset_strategy``'s)."""
    fully = bool(context.get_algo_parameters("fully_use_devices"))
    if input_layouts is None:
        input_layouts = dataset_layouts([v.shape for v in graph.inputs], device_num,
                                        dataset_strategy)
    inputs = {v.id: lay for v, lay in zip(graph.inputs, input_layouts)}
    plans = {k: tuple(v) for k, v in (parameter_plan or {}).items()}
    index = {node.id: k for k, node in enumerate(graph.nodes)}
    nodes: list[CostNode] = []
    for node in graph.nodes:
        shapes = [v.shape for v in node.inputs]
        user = node.op.in_strategy is not None
        strategies = ([node.op.in_strategy] if user else
                      node.op.candidate_strategies(shapes, device_num, fully_use_devices=fully))
        cands, costs = [], []
        params = {k for k, v in enumerate(node.inputs) if v.kind == "param"}
        for strat in strategies:
            try:
                sh = node.op.sharding(shapes, device_num, strat, None if not user else
                                      node.op.out_strategy, enable_alltoall)
            except (StrategyError, ValueError):
                continue
            if any(v.kind == "param" and v.name in plans and lay.cuts != plans[v.name]
                   for v, lay in zip(node.inputs, sh.in_layouts)):
                continue
            cost = model.op(sh, params, node.outputs[0].dtype.itemsize)
            for k, v in enumerate(node.inputs):
                if v.id in inputs:  # a graph input arrives in the dataset's layout
                    cost += model.edge(plan(inputs[v.id], sh.in_layouts[k], enable_alltoall),
                                       v.dtype.itemsize)
            cands.append(sh)
            costs.append(cost)
        if not cands:
            raise StrategyError(f"{node.name}: no strategy of {node.op.name} fits shapes "
                                f"{shapes} on {device_num} devices")
        nodes.append(CostNode(node, tuple(cands), tuple(costs), user))
    # Many candidates share layouts: each (source, destination) pair is planned and priced
    # once per build.
    moves: dict[tuple[TensorLayout, TensorLayout, int], float] = {}

    def move(src: TensorLayout, dst: TensorLayout, itemsize: int) -> float:
        key = (src, dst, itemsize)
        if key not in moves:
            moves[key] = model.edge(plan(src, dst, enable_alltoall), itemsize)
        return moves[key]

    edges = []
    for c, node in enumerate(graph.nodes):
        for k, v in enumerate(node.inputs):
            if v.producer is None:
                continue
            p = index[v.producer.id]
            matrix = tuple(
                tuple(move(pc.outputs[v.index][1], cc.in_layouts[k], v.dtype.itemsize)
                      for cc in nodes[c].candidates)
                for pc in nodes[p].candidates)
            edges.append(CostEdge(p, v.index, c, k, matrix))
    uses: dict[str, list[tuple[int, int]]] = {}
    for c, node in enumerate(graph.nodes):
        for k, v in enumerate(node.inputs):
            if v.kind == "param":
                uses.setdefault(v.name, []).append((c, k))
    shared = {name: tuple(u) for name, u in uses.items() if len(u) > 1}
    return CostGraph(tuple(nodes), tuple(edges), shared, device_num, model.unit)


def brute_force(cg: CostGraph, limit: int = 1_000_000) -> tuple[tuple[int, ...], float]:
    """The optimum by trying every combination (tests' reference; refuses more than
    ``limit`` combinations)."""
    count = math.prod(len(n.candidates) for n in cg.nodes)
    if count > limit:
        raise ValueError(f"brute_force: {count} combinations exceed the limit {limit}; use a "
                         "search")
    best: tuple[tuple[int, ...], float] | None = None
    for choice in itertools.product(*(range(len(n.candidates)) for n in cg.nodes)):
        cost = cg.total(choice)
        if best is None or cost < best[1]:
            best = (choice, cost)
    assert best is not None
    if math.isinf(best[1]):
        raise ValueError("brute_force: no combination gives shared parameters one layout")
    return best
