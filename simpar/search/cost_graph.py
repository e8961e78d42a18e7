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
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from simpar import context
from simpar.cost.interface import CostModel
from simpar.graph import Graph, Node
from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding, StrategyError
from simpar.redistribution import plan
from simpar.search.propagation import dataset_layouts

__all__ = ["ELEMENTWISE_OPS", "CostEdge", "CostGraph", "CostNode", "brute_force",
           "build_cost_graph", "distinct_blocks", "same_blocks"]

log = logging.getLogger("simpar.search")


@dataclass(frozen=True)
class CostNode:
    """One op: its candidate shardings, what each costs on its own (kernels, its own
    collectives, its parameters' gradient sync, and moving any graph input it reads), and the
    memory per rank each adds (:meth:`CostModel.memory`)."""

    node: Node
    candidates: tuple[OpSharding, ...]
    costs: tuple[float, ...]
    user_set: bool = False
    memories: tuple[float, ...] = ()

    @property
    def name(self) -> str:
        return self.node.name


@dataclass(frozen=True)
class CostEdge:
    """``producer``'s output ``output`` feeds ``consumer``'s input ``input``; ``costs[i][j]``
    moves it from producer candidate i's layout to consumer candidate j's (``inf``: the pair is
    not allowed, as when ``elementwise_op_strategy_follow`` makes the consumer follow)."""

    producer: int
    output: int
    consumer: int
    input: int
    costs: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class CostGraph:
    """Nodes in trace order, edges, and the shared-parameter constraints: for each parameter
    read by several ops, ``shared[name]`` lists (node index, input position) pairs whose
    chosen candidates must give the parameter the same layout. A choice must keep the sum of
    its nodes' memories within ``memory_capacity`` (bytes per rank)."""

    nodes: tuple[CostNode, ...]
    edges: tuple[CostEdge, ...]
    shared: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    device_num: int = 1
    unit: str = ""
    memory_capacity: float = math.inf

    def total(self, choice: Sequence[int]) -> float:
        """The objective of one candidate per node (``inf`` when shared parameters disagree
        or an edge forbids the pair)."""
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

    def memory(self, choice: Sequence[int]) -> float:
        """Bytes per rank of a choice: the sum of its nodes' memories."""
        return sum(node.memories[c] for node, c in zip(self.nodes, choice))

    def fits(self, choice: Sequence[int]) -> bool:
        return self.memory(choice) <= self.memory_capacity

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


#: MindSpore's elementwise operators (``IsElementWiseOperator``: the unary ones). Under
#: ``set_algo_parameters(elementwise_op_strategy_follow=True)`` an edge leaving one is an
#: identity edge: its consumer reads the value in the layout it is produced, no redistribution.
ELEMENTWISE_OPS = frozenset({
    "Abs", "Cast", "Exp", "GeLU", "Log", "LogSoftmax", "Neg", "ReLU", "Sigmoid", "Softmax",
    "Sqrt", "Square", "Tanh"})


def _memory_roles(node: Node, counted: set[str], involved: set[int], kept: set[int],
                  array: Mapping[int, int]) -> tuple[tuple[str, bool], ...]:
    """Per input, how the op's memory treats it: "new" (a trainable parameter no earlier op
    counts; its first position only), "frozen" (the same, not trainable), "held" (a parameter
    counted already, or a value an earlier op's memory holds), "free" (the op's to keep or
    not); and whether it is computed from a parameter (MindSpore's ``is_parameter_involve``)."""
    roles = []
    seen: set[str] = set()
    for v in node.inputs:
        if v.kind == "param":
            role = "held" if v.name in counted or v.name in seen else (
                "new" if v.param is None or v.param.requires_grad else "frozen")
            seen.add(v.name)
        else:
            role = "held" if array.get(v.id, v.id) in kept else "free"
        roles.append((role, v.kind == "param" or v.id in involved))
    return tuple(roles)


def _signature(node: Node, inputs: Mapping[int, TensorLayout],
               plans: Mapping[str, tuple[int, ...]], roles: tuple[tuple[str, bool], ...]
               ) -> tuple[Any, ...]:
    """What a node's candidates, costs and memories depend on: equal signatures (the same op
    at the same place of two identical layers) share one computation."""
    ins = []
    for v in node.inputs:
        where: Any = v.kind
        if v.id in inputs:
            where = ("input", inputs[v.id])
        elif v.kind == "param":
            where = ("param", plans.get(v.name))
        ins.append((v.shape, v.dtype.str, where))
    return (type(node.op), repr(node.op), node.op.out_strategy, tuple(ins), roles,
            tuple((v.shape, v.dtype.str) for v in node.outputs))


@lru_cache(maxsize=1 << 16)
def canonical(layout: TensorLayout) -> tuple[Any, ...]:
    """A key equal for layouts that give every rank the same block and the same pending sums,
    however their device matrices are written: axes of size 1 dropped, and neighbouring axes
    merged when both are replicas, both pending sums, or successive splits of one dimension.
    (Pure arithmetic on the device matrix; :func:`same_blocks` compares every rank's block.)"""
    dm = layout.device_matrix
    roles: list[Any] = [("rep",)] * len(dm)
    for d, axes in enumerate(layout.dim_axes):
        for k, a in enumerate(x for x in axes if dm[x] > 1):  # outer first, size-1 dropped
            roles[a] = ("dim", d, k)
    for a in layout.partial_axes:
        roles[a] = ("partial",)
    merged: list[list[Any]] = []
    for size, role in zip(layout.device_matrix, roles):
        if size == 1:
            continue
        if merged:
            last = merged[-1]
            same = role[0] == last[1][0] and role[0] in ("rep", "partial")
            follows = (role[0] == "dim" == last[1][0] and role[1] == last[1][1]
                       and role[2] == last[1][2] + 1)
            if same or follows:
                last[0] *= size
                last[1] = role
                continue
        merged.append([size, role])
    # Positions within a dimension only order its axes (outer first): after merging, each
    # merged axis takes its rank among its dimension's.
    ks: dict[int, list[int]] = {}
    for _, role in merged:
        if role[0] == "dim":
            ks.setdefault(role[1], []).append(role[2])
    out = []
    for size, role in merged:
        if role[0] == "dim":
            role = ("dim", role[1], sorted(ks[role[1]]).index(role[2]))
        out.append((size, role))
    return (layout.shape, tuple(out))


def _approximate(shardings: list[OpSharding], costs: list[float], memories: list[float],
                 keep: int) -> tuple[list[OpSharding], list[float], list[float]]:
    """MindSpore's ``ApproximateStrategies``: the ``keep`` cheapest candidates (stable)."""
    if len(shardings) <= keep:
        return shardings, costs, memories
    order = sorted(sorted(range(len(costs)), key=costs.__getitem__)[:keep])
    return ([shardings[i] for i in order], [costs[i] for i in order],
            [memories[i] for i in order])


def build_cost_graph(graph: Graph, device_num: int, model: CostModel,
                     dataset_strategy: Any = "full_batch",
                     enable_alltoall: bool = False, *,
                     input_layouts: Sequence[TensorLayout] | None = None,
                     parameter_plan: Mapping[str, Sequence[int]] | None = None) -> CostGraph:
    """The cost graph of ``graph`` on ``device_num`` devices under ``model``.

    Candidates come from each op's ``candidate_strategies`` under the algo parameters
    (fully_use_devices, tensor_slice_align_*; enable_algo_approxi keeps the
    ``ceil(1 / algo_approxi_epsilon)`` cheapest of each op, and elementwise_op_strategy_follow
    makes every edge out of an elementwise op an identity edge, allowing only the pairs that
    need no redistribution). A ``.shard()`` strategy is the only candidate, and a candidate
    that cuts a parameter otherwise than its ``parameter_plan`` is dropped. Graph inputs
    arrive in ``input_layouts`` (default: the ``dataset_strategy``'s; with
    ``dataset_strategy=None`` they are free in any layout, as in MindSpore r1.0's networks
    compiled without a ``_VirtualDataset``).

    Identical layers are priced once: nodes with equal signatures (op, attributes, shapes,
    where each input comes from) share their candidates, costs and memories, and edges between
    such nodes their matrices, so building grows with the distinct layers, not the depth.
    Progress goes to the ``simpar.search`` logger.
    """
    fully = bool(context.get_algo_parameters("fully_use_devices"))
    approxi = bool(context.get_algo_parameters("enable_algo_approxi"))
    keep = math.ceil(1.0 / float(context.get_algo_parameters("algo_approxi_epsilon")))
    follow = bool(context.get_algo_parameters("elementwise_op_strategy_follow"))
    if input_layouts is None and dataset_strategy is not None:
        input_layouts = dataset_layouts([v.shape for v in graph.inputs], device_num,
                                        dataset_strategy)
    # dataset_strategy None: graph inputs cost nothing in any layout (MindSpore r1.0 compiling
    # a network without a _VirtualDataset)
    inputs = {v.id: lay for v, lay in zip(graph.inputs, input_layouts or ())}
    plans = {k: tuple(v) for k, v in (parameter_plan or {}).items()}
    index = {node.id: k for k, node in enumerate(graph.nodes)}
    # Memory, in trace order: a parameter is counted by its first reader; a value its
    # producer keeps (the model's keeps_output) is not counted again by a consumer.
    counted: set[str] = set()
    involved: set[int] = set()  # values computed from a parameter
    kept: set[int] = set()      # arrays some op's memory already holds
    array: dict[int, int] = {}  # a view's value id -> the value whose array it is
    kept_inputs = getattr(model, "kept_inputs", None) if getattr(
        model, "shares_arrays", False) else None
    nodes: list[CostNode] = []
    signatures: list[tuple[Any, ...]] = []
    priced: dict[tuple[Any, ...], tuple[tuple[OpSharding, ...], tuple[float, ...],
                                        tuple[float, ...]]] = {}
    started = time.perf_counter()
    for n, node in enumerate(graph.nodes):
        shapes = [v.shape for v in node.inputs]
        user = node.op.in_strategy is not None
        roles = _memory_roles(node, counted, involved, kept, array)
        sig = _signature(node, inputs, plans, roles)
        signatures.append(sig)
        params = {k for k, v in enumerate(node.inputs) if v.kind == "param"}
        inv = {k for k, (_, i) in enumerate(roles) if i}
        held = {k for k, (r, _) in enumerate(roles) if r == "held"}
        if sig not in priced:
            strategies = ([node.op.in_strategy] if user else
                          node.op.candidate_strategies(shapes, device_num,
                                                       fully_use_devices=fully))
            cands: list[OpSharding] = []
            costs: list[float] = []
            mems: list[float] = []
            new = {k for k, (r, _) in enumerate(roles) if r == "new"}
            frozen = {k for k, (r, _) in enumerate(roles) if r == "frozen"}
            itemsize = node.outputs[0].dtype.itemsize
            in_sizes = tuple(v.dtype.itemsize for v in node.inputs)
            for strat in strategies:
                try:
                    sh = node.op.sharding(shapes, device_num, strat, None if not user else
                                          node.op.out_strategy, enable_alltoall)
                except (StrategyError, ValueError):
                    continue
                if any(v.kind == "param" and v.name in plans and lay.cuts != plans[v.name]
                       for v, lay in zip(node.inputs, sh.in_layouts)):
                    continue
                cost = model.op(sh, params, itemsize, in_sizes)
                for k, v in enumerate(node.inputs):
                    if v.id in inputs:  # a graph input arrives in the dataset's layout
                        cost += model.edge(plan(inputs[v.id], sh.in_layouts[k],
                                                enable_alltoall), v.dtype.itemsize)
                cands.append(sh)
                costs.append(cost)
                mems.append(model.memory(sh, new, itemsize, held, in_sizes, inv, frozen))
            if not cands:
                raise StrategyError(f"{node.name}: no strategy of {node.op.name} fits shapes "
                                    f"{shapes} on {device_num} devices")
            if approxi and not user:
                cands, costs, mems = _approximate(cands, costs, mems, keep)
            priced[sig] = (tuple(cands), tuple(costs), tuple(mems))
        cands_t, costs_t, mems_t = priced[sig]
        nodes.append(CostNode(node, cands_t, costs_t, user, mems_t))
        counted.update(node.inputs[k].name for k in params)
        if inv:
            involved.update(v.id for v in node.outputs)
        if model.keeps_output(node.op, len(node.inputs), params, inv, held):
            kept.update(v.id for v in node.outputs)
        if kept_inputs is not None:  # one array counted once: by its first keeper, via views
            kept.update(array.get(node.inputs[k].id, node.inputs[k].id)
                        for k in kept_inputs(node.op, roles))
            if node.op.output_aliases_input and node.inputs:
                array[node.outputs[0].id] = array.get(node.inputs[0].id, node.inputs[0].id)
        if (n + 1) % 200 == 0 or n + 1 == len(graph.nodes):
            log.info("cost graph: %d/%d ops priced (%d distinct) in %.1f s", n + 1,
                     len(graph.nodes), len(priced), time.perf_counter() - started)
    # Many candidates share layouts: each (source, destination) pair is planned and priced
    # once per build; and an edge between two signatures is built once.
    moves: dict[tuple[Any, Any, int], float] = {}

    def move(src: TensorLayout, dst: TensorLayout, itemsize: int) -> float:
        key = (canonical(src), canonical(dst), itemsize)
        if key not in moves:
            moves[key] = model.edge(plan(src, dst, enable_alltoall), itemsize)
        return moves[key]

    def moves_free(src: TensorLayout, dst: TensorLayout) -> bool:
        return not plan(src, dst, enable_alltoall).steps

    matrices: dict[tuple[Any, ...], tuple[tuple[float, ...], ...]] = {}
    edges = []
    for c, node in enumerate(graph.nodes):
        for k, v in enumerate(node.inputs):
            if v.producer is None:
                continue
            p = index[v.producer.id]
            follows = follow and nodes[p].node.op.name in ELEMENTWISE_OPS
            key = (signatures[p], v.index, signatures[c], k, follows)
            if key not in matrices:
                matrices[key] = tuple(
                    tuple(math.inf if follows and not moves_free(pc.outputs[v.index][1],
                                                                  cc.in_layouts[k])
                          else move(pc.outputs[v.index][1], cc.in_layouts[k],
                                    v.dtype.itemsize)
                          for cc in nodes[c].candidates)
                    for pc in nodes[p].candidates)
                if approxi and all(math.isinf(x) for row in matrices[key] for x in row):
                    raise StrategyError(
                        f"{node.name}: with enable_algo_approxi no kept candidate of it "
                        f"agrees with its producer {nodes[p].name}; raise "
                        "algo_approxi_epsilon's reciprocal or disable the approximation")
            edges.append(CostEdge(p, v.index, c, k, matrices[key]))
    log.info("cost graph: %d edges (%d distinct matrices, %d layout pairs priced) in %.1f s",
             len(edges), len(matrices), len(moves), time.perf_counter() - started)
    uses: dict[str, list[tuple[int, int]]] = {}
    for c, node in enumerate(graph.nodes):
        for k, v in enumerate(node.inputs):
            if v.kind == "param":
                uses.setdefault(v.name, []).append((c, k))
    shared = {name: tuple(u) for name, u in uses.items() if len(u) > 1}
    return CostGraph(tuple(nodes), tuple(edges), shared, device_num, model.unit,
                     float(model.memory_capacity))


def brute_force(cg: CostGraph, limit: int = 1_000_000) -> tuple[tuple[int, ...], float]:
    """The optimum within the memory capacity by trying every combination (tests'
    reference; refuses more than ``limit`` combinations)."""
    count = math.prod(len(n.candidates) for n in cg.nodes)
    if count > limit:
        raise ValueError(f"brute_force: {count} combinations exceed the limit {limit}; use a "
                         "search")
    best: tuple[tuple[int, ...], float] | None = None
    for choice in itertools.product(*(range(len(n.candidates)) for n in cg.nodes)):
        cost = cg.total(choice)
        if not cg.fits(choice):
            continue
        if best is None or cost < best[1]:
            best = (choice, cost)
    if best is None:
        raise ValueError(f"brute_force: no combination fits {cg.memory_capacity:.0f} bytes")
    if math.isinf(best[1]):
        raise ValueError("brute_force: no combination satisfies every constraint (shared "
                         "parameters, followed producers)")
    return best
