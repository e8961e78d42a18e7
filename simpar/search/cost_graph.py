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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from simpar.comm_fusion import AllReduceFusion
from simpar.context import AlgoParameters
from simpar.cost.interface import CostModel
from simpar.graph import Graph, Node
from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding
from simpar.ops.strategy import Strategy, StrategyError
from simpar.optimizer_parallel import OptimizerParallel
from simpar.search.pricing import ELEMENTWISE_OPS, Pricer, algo_or_context, canonical
from simpar.search.request import dataset_layouts
from simpar.search.sites import Site

__all__ = ["ELEMENTWISE_OPS", "CostEdge", "CostGraph", "CostNode", "brute_force",
           "build_cost_graph", "canonical", "cost_graph_from", "distinct_blocks",
           "restricted_cost_graph", "same_blocks", "within_transient_limit"]

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
    #: What each candidate holds for a while beside the plan's sum (its backward's or its
    #: collectives' transient; :attr:`~simpar.search.pricing.Priced.transient`), the
    #: plan's largest adding to it under the cap; empty: not counted here.
    transients: tuple[float, ...] = ()
    #: In a recomputed Cell (:attr:`CostGraph.cells`), what each candidate's tape holds
    #: again while the backward reruns the Cell (:attr:`~simpar.search.pricing.Priced.rerun`);
    #: empty: not counted here.
    reruns: tuple[float, ...] = ()

    @property
    def name(self) -> str:
        return self.node.name


@dataclass(frozen=True)
class CostEdge:
    """``producer``'s output ``output`` feeds ``consumer``'s input ``input``; ``costs[i][j]``
    moves it from producer candidate i's layout to consumer candidate j's (``inf``: the pair is
    not allowed, as when ``elementwise_op_strategy_follow`` makes the consumer follow): a
    read-only float array, which edges between ops of equal signatures share (or rows of
    floats, for a graph built by hand). ``memories[i][j]``, when given, are the bytes per
    rank the pair adds (:meth:`~simpar.search.pricing.Pricer.edge_memory`: a consumer's own
    copy of a held input that the pair moves); None adds none."""

    producer: int
    output: int
    consumer: int
    input: int
    costs: np.ndarray | tuple[tuple[float, ...], ...]
    memories: np.ndarray | tuple[tuple[float, ...], ...] | None = None
    #: What each pair's move holds for a while (its largest collective's buffer and
    #: result), counted as the nodes' :attr:`CostNode.transients`; None: not counted.
    transients: np.ndarray | None = None


@dataclass(frozen=True)
class CostGraph:
    """Nodes in trace order, edges, and the shared-parameter constraints: for each parameter
    read by several ops, ``shared[name]`` lists (node index, input position) pairs whose
    chosen candidates must give the parameter the same layout. A choice must keep the sum of
    its nodes' and edges' memories within ``memory_capacity`` (bytes per rank)."""

    nodes: tuple[CostNode, ...]
    edges: tuple[CostEdge, ...]
    shared: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    device_num: int = 1
    unit: str = ""
    memory_capacity: float = math.inf
    #: The recomputed Cells whose tapes made again the graph counts (node indices; each
    #: Cell's are held while the backward reruns it, one Cell at a time), and the Cell among
    #: them whose reruns the nodes' memories already count: a plan's other Cells add what
    #: they hold beyond it to its transient (:meth:`rerun`). Empty: not counted.
    cells: tuple[tuple[int, ...], ...] = ()
    charged: tuple[int, ...] = ()

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
        cost += sum(float(e.costs[choice[e.producer]][choice[e.consumer]])
                    for e in self.edges)
        return cost

    def memory(self, choice: Sequence[int]) -> float:
        """Bytes per rank of a choice: the sum of its nodes' memories and its edges'."""
        return (sum(node.memories[c] for node, c in zip(self.nodes, choice))
                + sum(float(e.memories[choice[e.producer]][choice[e.consumer]])
                      for e in self.edges if e.memories is not None))

    def transient(self, choice: Sequence[int]) -> float:
        """The largest transient of a choice that the graph counts (its nodes' and its
        edges' moves'; 0 where it counts none), and on top of it what a recomputed Cell's
        tapes made again hold beyond the memories' count (:meth:`rerun`)."""
        return max([0.0, *(node.transients[c] for node, c in zip(self.nodes, choice)
                           if node.transients),
                    *(float(e.transients[choice[e.producer], choice[e.consumer]])
                      for e in self.edges if e.transients is not None)]) + self.rerun(choice)

    def rerun(self, choice: Sequence[int]) -> float:
        """What the Cell among :attr:`cells` that makes the most again in the backward holds
        beyond what the :attr:`charged` Cell makes again (0 when the graph counts no Cell),
        as :meth:`~simpar.search.pricing.Pricer.rerun` prices it."""
        def cell(nodes: Sequence[int]) -> float:
            return sum(self.nodes[n].reruns[choice[n]] for n in nodes if self.nodes[n].reruns)
        most = max((cell(nodes) for nodes in self.cells), default=0.0)
        return max(0.0, most - cell(self.charged))

    def fits(self, choice: Sequence[int]) -> bool:
        """Whether a choice's memory and its largest counted transient fit the capacity."""
        return self.memory(choice) + self.transient(choice) <= self.memory_capacity

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
                     parameter_plan: Mapping[str, Sequence[int]] | None = None,
                     algo: AlgoParameters | None = None,
                     memory_capacity: float | None = None,
                     optimizer: OptimizerParallel | None = None,
                     recompute: Sequence[str] = (), micro_batches: int = 1,
                     step_objective: bool = False,
                     comm_fusion: AllReduceFusion | None = None) -> CostGraph:
    """The cost graph of ``graph`` on ``device_num`` devices under ``model``, within
    ``memory_capacity`` bytes per rank (None: the model's own), with the memory of the
    ``optimizer`` slices, the ``recompute``-d Cells and the gradient buckets of
    ``comm_fusion`` priced (a model that prices them; :class:`~simpar.search.pricing.Pricer`).
    ``step_objective``: the costs are a whole step's of ``micro_batches`` micro-batches with
    the memory dimensions' time (:mod:`simpar.cost.step_price`).

    Candidates come from each op's ``candidate_strategies`` under the algo parameters
    ``algo`` (None: the context's, :func:`~simpar.search.pricing.algo_or_context`;
    fully_use_devices, tensor_slice_align_*; enable_algo_approxi keeps the
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
    algo = algo_or_context(algo)
    if input_layouts is None and dataset_strategy is not None:
        input_layouts = dataset_layouts([v.shape for v in graph.inputs], device_num,
                                        dataset_strategy)
    return cost_graph_from(Pricer(
        graph, device_num, model, input_layouts, parameter_plan, enable_alltoall,
        algo.elementwise_op_strategy_follow, algo=algo, memory_capacity=memory_capacity,
        optimizer=optimizer, recompute=recompute, micro_batches=micro_batches,
        step_objective=step_objective, comm_fusion=comm_fusion))


def cost_graph_from(pricer: Pricer, transients: bool = False) -> CostGraph:
    """:func:`build_cost_graph` of the graph, prices, algo parameters and limits that
    ``pricer`` holds (a pricer shared by several graphs shares what it has priced).
    ``transients``: with each candidate's and each move's transient (:func:`_transients`),
    for a search that fits the largest under the cap itself (exact's ILP)."""
    algo, device_num, model = pricer.algo, pricer.device_num, pricer.model
    fully, approxi = algo.fully_use_devices, algo.enable_algo_approxi
    keep = math.ceil(1.0 / algo.algo_approxi_epsilon)
    nodes: list[CostNode] = []
    priced: dict[tuple[Any, ...], tuple[tuple[OpSharding, ...], tuple[float, ...],
                                        tuple[float, ...], tuple[float, ...],
                                        tuple[float, ...]]] = {}
    started = time.perf_counter()
    for site in pricer.sites:
        if site.signature not in priced:
            user = site.node.op.in_strategy
            strategies = [user] if user is not None else pricer.candidates(site.index, fully)
            found = [p for p in (pricer.price(site.index, s) for s in strategies)
                     if p is not None]
            if not found:
                raise StrategyError(_no_candidate(site, strategies, device_num, algo))
            cands = [p.sharding for p in found]
            costs = [p.cost for p in found]
            mems = [p.memory for p in found]
            if approxi and not site.user:
                cands, costs, mems = _approximate(cands, costs, mems, keep)
            held = {id(p.sharding): (p.transient, p.rerun) for p in found}
            priced[site.signature] = (tuple(cands), tuple(costs), tuple(mems),
                                      tuple(held[id(c)][0] for c in cands),
                                      tuple(held[id(c)][1] for c in cands))
        cands_t, costs_t, mems_t, held_t, rerun_t = priced[site.signature]
        nodes.append(CostNode(site.node, cands_t, costs_t, site.user, mems_t,
                              held_t if transients else (),
                              rerun_t if transients and any(rerun_t) else ()))
        if (site.index + 1) % 200 == 0 or site.index + 1 == len(pricer.sites):
            log.info("cost graph: %d/%d ops priced (%d distinct) in %.1f s", site.index + 1,
                     len(pricer.sites), len(priced), time.perf_counter() - started)
    # An edge between two signatures is built once; its pairs of layouts priced once each.
    matrices: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray | None]] = {}
    edges = []
    for e, se in enumerate(pricer.edges):
        p, c = se.producer, se.consumer
        key = (pricer.sites[p].kind, se.output, pricer.sites[c].kind, se.input,
               se.follows)
        if key not in matrices:
            matrices[key] = _edge_matrices(pricer, e, nodes[p].candidates,
                                           nodes[c].candidates)
            if approxi and np.isinf(matrices[key][0]).all():
                raise StrategyError(
                    f"{nodes[c].name}: with enable_algo_approxi no kept candidate of it "
                    f"agrees with its producer {nodes[p].name}; raise "
                    "algo_approxi_epsilon's reciprocal or disable the approximation")
        edges.append(CostEdge(p, se.output, c, se.input, *matrices[key]))
    log.info("cost graph: %d edges (%d distinct matrices, %d layout pairs priced) in %.1f s",
             len(edges), len(matrices), pricer.moves_priced, time.perf_counter() - started)
    cg = CostGraph(tuple(nodes), tuple(edges), pricer.shared, device_num, model.unit,
                   pricer.memory_capacity)
    return _transients(pricer, cg) if transients else cg


def _transients(pricer: Pricer, cg: CostGraph) -> CostGraph:
    """``cg`` with its moves' transients too (the nodes' are in) and its recomputed Cells'
    tapes made again (:meth:`~simpar.search.pricing.Pricer.rerun_cells`), for a search under
    the pricer's full capacity; without any where even the hungriest choice fits with twice
    the largest moved tensor whole and the most any Cell makes again beside it (no move
    holds more), or under a transient limit (its moves over it are forbidden already, and
    its rerun bounds hold the Cells' back from the cap). The user's ``.shard()`` strategies
    and the moves between two of them count too: they are the same in every plan, a floor
    for its largest transient."""
    plain = replace(cg, nodes=tuple(replace(n, transients=(), reruns=()) for n in cg.nodes))
    if not math.isfinite(cg.memory_capacity) or math.isfinite(pricer.transient_limit):
        return plain
    cells, charged = pricer.rerun_cells()
    hungriest = sum(max(n.memories, default=0.0) for n in cg.nodes) + sum(
        float(np.max(e.memories)) for e in cg.edges if e.memories is not None and
        np.size(e.memories))
    moved = max((2 * math.prod(pricer.sites[se.producer].node.outputs[se.output].shape)
                 * se.itemsize for se in pricer.edges), default=0)
    held = max((max(n.transients, default=0.0) for n in cg.nodes), default=0.0)
    again = max((sum(max(cg.nodes[n].reruns, default=0.0) for n in nodes)
                 for nodes in cells), default=0.0)
    if hungriest + max(held, moved) + again <= cg.memory_capacity:
        return plain
    edges = []
    matrices: dict[tuple[Any, ...], np.ndarray] = {}
    for e, (se, edge) in enumerate(zip(pricer.edges, cg.edges)):
        if se.follows:
            edges.append(edge)
            continue
        p, c = cg.nodes[se.producer], cg.nodes[se.consumer]
        key = (id(p.candidates), se.output, id(c.candidates), se.input, se.itemsize)
        if key not in matrices:
            matrix = pricer.edge_transients(e, p.candidates, c.candidates)
            matrix.flags.writeable = False
            matrices[key] = matrix
        edges.append(replace(edge, transients=matrices[key] if matrices[key].any() else None))
    return replace(cg, edges=tuple(edges), cells=cells if again else (),
                   charged=charged if again else ())


def _no_candidate(site: Site, strategies: Sequence[Strategy], device_num: int,
                  algo: AlgoParameters) -> str:
    """Why op ``site`` has no candidate on ``device_num`` devices: its own error for a
    ``.shard()`` strategy, else the algo parameters that left none (every cut must divide its
    dimension, so shapes that nothing divides leave only the unsplit strategy)."""
    op = site.node.op
    head = (f"{site.name}: no strategy of {op.name} fits shapes {list(site.shapes)} on "
            f"{device_num} devices")
    if site.user and strategies:
        try:
            op.sharding(site.shapes, device_num, strategies[0], op.out_strategy)
        except ValueError as e:
            return f"{head}: its .shard() strategy is refused: {e}"
        return (f"{head}: its .shard() strategy {strategies[0]} cuts a parameter otherwise "
                "than the parameter plan")
    rules = []
    if algo.fully_use_devices:
        rules.append(f"fully_use_devices=True keeps only strategies that use all {device_num} "
                     "devices (False lets an op repeat its calculation instead)")
    if algo.slice_align > 1:
        rules.append(f"tensor_slice_align_enable=True keeps only slices whose dimensions are "
                     f"multiples of {algo.slice_align}")
    if not rules:
        return f"{head}: none of its {len(strategies)} candidate strategies is valid here"
    return (f"{head}: a cut must divide its dimension, and {'; '.join(rules)}. Use a "
            "device_num whose factors divide these dimensions, or change set_algo_parameters")


def _edge_matrix(pricer: Pricer, e: int, producers: Sequence[OpSharding],
                 consumers: Sequence[OpSharding]) -> np.ndarray:
    """Edge ``e``'s cost for every pair of candidates (all at once unless it is followed), as
    a read-only array."""
    se = pricer.edges[e]
    if se.follows:
        matrix = np.array([[pricer.edge_cost(e, pc, cc) for cc in consumers]
                           for pc in producers], dtype=float).reshape(len(producers),
                                                                      len(consumers))
    else:
        matrix = pricer.move_matrix([pc.outputs[se.output][1] for pc in producers],
                                    [cc.in_layouts[se.input] for cc in consumers], se.itemsize)
        factor = pricer.edge_factor(e)
        if factor != 1.0:
            matrix = matrix * factor
        if pricer.limits(e):   # moves that hold more than the limit: not allowed
            matrix = np.where(pricer.edge_transients(e, producers, consumers)
                              > pricer.transient_limit, math.inf, matrix)
    matrix.flags.writeable = False
    return matrix


def _edge_matrices(pricer: Pricer, e: int, producers: Sequence[OpSharding],
                   consumers: Sequence[OpSharding]) -> tuple[np.ndarray, np.ndarray | None]:
    """Edge ``e``'s costs and memories for every pair of candidates."""
    return (_edge_matrix(pricer, e, producers, consumers),
            pricer.edge_memory_matrix(e, producers, consumers))


def restricted_cost_graph(pricer: Pricer, candidates: Sequence[Sequence[Strategy]]
                          ) -> CostGraph:
    """The cost graph of ``pricer``'s graph whose op ``n`` has the candidates
    ``candidates[n]`` (strategies the op rejects are dropped): a neighbourhood for a search to
    refine its plan in exactly. Ops with equal signatures and equal candidate lists share
    their prices, and edges between such ops their matrices."""
    nodes: list[CostNode] = []
    shared: dict[tuple[int, tuple[Strategy, ...]], tuple[tuple[OpSharding, ...],
                                                        tuple[float, ...], tuple[float, ...]]] = {}
    for site, strategies in zip(pricer.sites, candidates):
        key = (site.kind, tuple(strategies))
        if key not in shared:
            found = [p for p in (pricer.price(site.index, s) for s in dict.fromkeys(strategies))
                     if p is not None]
            if not found:
                raise StrategyError(f"{site.name}: none of the strategies "
                                    f"{list(strategies)[:4]} of {site.node.op.name} is valid "
                                    f"for shapes {list(site.shapes)} on {pricer.device_num} "
                                    "devices")
            shared[key] = (tuple(p.sharding for p in found), tuple(p.cost for p in found),
                           tuple(p.memory for p in found))
        cands, costs, mems = shared[key]
        nodes.append(CostNode(site.node, cands, costs, site.user, mems))
    matrices: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray | None]] = {}
    edges = []
    for e, se in enumerate(pricer.edges):
        p, c = se.producer, se.consumer
        pair = (pricer.sites[p].kind, id(nodes[p].candidates), se.output,
                pricer.sites[c].kind, id(nodes[c].candidates), se.input, se.follows)
        if pair not in matrices:
            matrices[pair] = _edge_matrices(pricer, e, nodes[p].candidates,
                                            nodes[c].candidates)
        edges.append(CostEdge(p, se.output, c, se.input, *matrices[pair]))
    return CostGraph(tuple(nodes), tuple(edges), pricer.shared, pricer.device_num,
                     pricer.model.unit, pricer.memory_capacity)


def within_transient_limit(pricer: Pricer, cg: CostGraph, limit: float) -> CostGraph:
    """``cg`` (``pricer``'s, as :func:`cost_graph_from` builds it) with every candidate and
    every move that holds more than ``limit`` for a while forbidden, as under
    :meth:`Pricer.limited` (a ``.shard()`` strategy, and a move between two, stand): the
    candidate's memory and the pair's cost become infinite, for the plan of least memory
    under the limit (which reads the nodes' memories and the pairs allowed). Nothing is
    priced again: each candidate's transient is the Pricer's, each move's from
    :meth:`Pricer.edge_transients`, and the graph is not built again for each limit. Under
    ``enable_algo_approxi`` the graph's candidates are the ones its approximation kept of
    them all, where :meth:`Pricer.limited`'s graph approximates those within the limit: it
    may keep candidates that this one has dropped."""
    masked: dict[tuple[int, int], tuple[float, ...]] = {}
    nodes = []
    for n, node in enumerate(cg.nodes):
        key = (id(node.candidates), id(node.memories))
        if not node.user_set and key not in masked:
            masked[key] = tuple(
                m if pricer.priced(n, c.strategy).transient <= limit  # type: ignore[union-attr]
                else math.inf for c, m in zip(node.candidates, node.memories))
        nodes.append(node if node.user_set else replace(node, memories=masked[key]))
    allowed: dict[tuple[Any, ...], np.ndarray] = {}
    edges = []
    for e, (se, edge) in enumerate(zip(pricer.edges, cg.edges)):
        if se.follows or pricer.between_users(e):
            edges.append(edge)
            continue
        p, c = cg.nodes[se.producer], cg.nodes[se.consumer]
        pair = (id(p.candidates), se.output, id(c.candidates), se.input, id(edge.costs))
        if pair not in allowed:
            held = pricer.edge_transients(e, p.candidates, c.candidates)
            matrix = np.where(held > limit, math.inf, np.asarray(edge.costs, dtype=float))
            matrix.flags.writeable = False
            allowed[pair] = matrix
        edges.append(replace(edge, costs=allowed[pair]))
    return replace(cg, nodes=tuple(nodes), edges=tuple(edges))


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
