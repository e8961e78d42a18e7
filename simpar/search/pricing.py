"""Prices of one graph's strategies and moves, on demand: what every search of auto_parallel
reads (pure: shapes only, no MPI, no data).

A :class:`Pricer` walks the traced graph once, in trace order, and records for each op what its
price depends on: its signature (op, attributes, shapes, where each input comes from, how its
memory treats each input), and the edges it has. Then:

- :meth:`Pricer.price` gives one strategy of one op its cost and memory under the cost model,
  including moving any graph input it reads from the dataset's layout;
- :meth:`Pricer.move` prices one redistribution, planned by the real planner (what is costed
  is what runs).

Both are memoised: ops with one signature (the same op at the same place of two identical
layers) are priced once per strategy, and layouts that give every rank the same block
(:func:`canonical`) share one move. Dynamic programming and the ILP enumerate every candidate
and every edge through it (:func:`~simpar.search.cost_graph.build_cost_graph`); recursive
programming and sharding propagation ask only for what they visit.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from simpar.comm_fusion import AllReduceFusion
from simpar.context import AlgoParameters, algo_parameters
from simpar.cost.interface import CostModel
from simpar.graph import Graph
from simpar.layout import TensorLayout, block_key
from simpar.mesh import DeviceMesh
from simpar.ops._base import OpSharding, registry
from simpar.ops.comm_spec import CommSpec
from simpar.ops.strategy import Strategy, StrategyError
from simpar.optimizer_parallel import OptimizerParallel, ParamFacts, ParamShard, shard_parameters
from simpar.redistribution import RedistributionPlan, plan
from simpar.search.moves import MoveBlock, decode, move_memo, plan_moves, signature_of
from simpar.search.sites import Site, SiteEdge, memory_roles, signature

__all__ = ["ELEMENTWISE_OPS", "NoAvailableCost", "Priced", "Pricer", "algo_or_context",
           "canonical", "check_memory", "listed"]

#: The registered ops MindSpore counts elementwise (``IsElementWiseOperator``: the unary
#: ones), read from each op's own ``elementwise`` fact, which is what the pricer reads. Under
#: ``set_algo_parameters(elementwise_op_strategy_follow=True)`` an edge leaving one is an
#: identity edge: its consumer reads the value in the layout it is produced, no redistribution.
ELEMENTWISE_OPS = frozenset(name for name, op in registry().items() if op.elementwise)


class NoAvailableCost(ValueError):
    """No plan fits the memory cap (MindSpore: "No available cost"). ``memory``: the bytes
    per rank of the plan refused (or the least any plan needs), when known."""

    def __init__(self, message: str, memory: float | None = None) -> None:
        super().__init__(message)
        self.memory = memory


_MISSING: Any = object()


@dataclass(frozen=True)
class Priced:
    """One strategy of one op: its sharding, its cost (kernels, own collectives, Mirror,
    moving graph inputs), its memory per rank, and what it holds for a while beside that
    (its backward's or its collectives' transient: a plan's largest one adds to its sum), and
    in a recomputed Cell what its tape holds again while the backward reruns the Cell (a
    Cell's ops' sum, the largest Cell's, adds to the plan's transient)."""

    sharding: OpSharding
    cost: float
    memory: float
    transient: float = 0.0
    rerun: float = 0.0


#: The key equal for layouts that hold the same block and pending sums on every rank
#: (:func:`simpar.layout.block_key`); moves are priced once per pair of keys.
canonical = block_key


def _prime_power(n: int) -> tuple[int, int] | None:
    """``(p, k)`` with ``n == p**k`` for a prime ``p``, else None (``(1, 0)`` for one
    device)."""
    p = next((f for f in range(2, n + 1) if n % f == 0), 1)
    k = 0
    while n % p == 0 and n > 1:
        n //= p
        k += 1
    return (p, k) if n == 1 else None


def algo_or_context(algo: AlgoParameters | None) -> AlgoParameters:
    """``algo``, or the context's algo parameters for a pricer or cost graph built by hand
    (tests, benchmarks): every planner passes its request's."""
    return algo if algo is not None else algo_parameters()


def listed(strategy: Strategy) -> list[list[int]]:
    """A strategy as MindSpore prints it: ``((2, 1), (1, 4))`` -> ``[[2, 1], [1, 4]]``."""
    return [list(c) for c in strategy]


class Pricer:
    """Prices strategies of ``graph``'s ops and moves between layouts under ``model``.

    ``input_layouts`` are the graph inputs' layouts (None: free in any layout, as in
    MindSpore r1.0's networks compiled without a ``_VirtualDataset``); ``parameter_plan`` maps
    parameter names to the cuts every reader must use; ``follow`` turns edges out of
    elementwise ops into identity edges (elementwise_op_strategy_follow);
    ``user_strategies=False`` ignores ``.shard()`` strategies (data_parallel, stand_alone).
    ``algo`` are the algo parameters the searches read (:func:`algo_or_context`), and
    ``memory_capacity`` the bytes per rank a plan may take (None: the model's own).
    :meth:`limited` gives a pricer under a transient limit.
    """

    def __init__(self, graph: Graph, device_num: int, model: CostModel,
                 input_layouts: Sequence[TensorLayout] | None = None,
                 parameter_plan: Mapping[str, Sequence[int]] | None = None,
                 enable_alltoall: bool = False, follow: bool = False,
                 user_strategies: bool = True, *, algo: AlgoParameters | None = None,
                 memory_capacity: float | None = None,
                 optimizer: OptimizerParallel | None = None,
                 recompute: Collection[str] = (), micro_batches: int = 1,
                 step_objective: bool = False,
                 comm_fusion: AllReduceFusion | None = None) -> None:
        self.graph, self.device_num, self.model = graph, device_num, model
        #: The most a strategy or a move the searches choose may hold for a while
        #: (:meth:`limited`; inf: no limit).
        self.transient_limit = math.inf
        #: Per twin, the most a recomputed op may make again (:meth:`limited`; None:
        #: no bounds, the largest Cell's tapes made again counted in its ops' memories).
        self.rerun_limits: dict[int, float] | None = None
        # The whole step's seconds, with the memory dimensions' time (a model with
        # ``step_op``): what the search of the memory dimensions compares across them.
        self.step_objective = step_objective and hasattr(model, "step_op")
        self.micro_batches = micro_batches
        self._scale = micro_batches if self.step_objective else 1
        # The memory dimensions, for a model that prices them: optimizer slices, and the
        # recomputed Cells (their nodes, and the first of each).
        self.optimizer = optimizer or OptimizerParallel()
        recomputed = [seg for seg in graph.segments if seg.name in set(recompute)]
        self._recomputed = {i for seg in recomputed for i in seg.nodes}
        self._opens = {seg.nodes[0] for seg in recomputed if seg.nodes}
        # A recomputed Cell's tapes live again while the backward reruns it, one Cell at a
        # time: the largest Cell's (most bytes of outputs) are counted in its ops' memories,
        # a sum the searches minimise; a plan whose other Cells rerun more adds the excess
        # to its transient (:meth:`rerun`). Identical blocks rerun alike: no excess.
        self._cells = [tuple(seg.nodes) for seg in recomputed if seg.nodes]
        charged = max(self._cells, default=(), key=lambda nodes: sum(
            math.prod(v.shape) * v.dtype.itemsize for n in nodes
            for v in graph.nodes[n].outputs))
        self._charged = frozenset(charged)
        self._charged_cell = tuple(charged)
        # A recomputed Cell with mp_comm_recompute moves its inputs again: their forward.
        self._rerun = {i for seg in recomputed if seg.mp_comm for i in seg.nodes}
        # ... and without parallel_optimizer_comm_recompute it keeps the weights it gathered.
        self._holds_gathered = {i for seg in recomputed if not seg.opt_comm for i in seg.nodes}
        self.enable_alltoall = enable_alltoall
        self.algo = algo_or_context(algo)
        # A Mirror holds its packed gradient bucket beside every array while it sums it (the
        # final pricing's communication buffer). When one bucket may pack all of a group's
        # gradients (comm_fusion's "index" mode, the default), each replicated gradient counts
        # again on the op that counts its parameter (their sum bounds the largest bucket);
        # under a size threshold the threshold is reserved off the cap instead.
        fusion = comm_fusion or AllReduceFusion()
        buckets = getattr(model, "prices_memory_dimensions", False)
        self._bucketed = buckets and fusion.packs_all
        # Under a size threshold a group's gradients take about bytes / threshold calls, and
        # without fusion one each: each replicated gradient pays its share of the calls'
        # fixed costs (under "index" the calls are one per bucket, whatever the cuts).
        self._calls = fusion if buckets and hasattr(model, "mirror_call_seconds") and (
            not fusion.openstate or fusion.mode != "index") else None
        #: Bytes held back from the cap for a gradient bucket of bounded size (no more than
        #: every trainable parameter's gradient whole).
        self.reserve = float(min(fusion.threshold_bytes, sum(
            math.prod(v.shape) * v.dtype.itemsize for v in graph.params
            if v.param is None or v.param.requires_grad)) if buckets else 0)
        #: The bytes per rank the ops' and edges' memories may add up to.
        self.memory_capacity = float(model.memory_capacity if memory_capacity is None
                                     else memory_capacity) - self.reserve
        self.plans = {k: tuple(v) for k, v in (parameter_plan or {}).items()}
        inputs = {v.id: lay for v, lay in zip(graph.inputs, input_layouts or ())}
        index = {node.id: k for k, node in enumerate(graph.nodes)}
        # Memory, in trace order: a parameter is counted by its first reader; a value its
        # producer keeps (the model's keeps_output) is not counted again by a consumer.
        counted: set[str] = set()
        involved: set[int] = set()  # values computed from a parameter
        kept: set[int] = set()      # arrays some op's memory already holds
        array: dict[int, int] = {}  # a view's value id -> the value whose array it is
        kept_inputs = getattr(model, "kept_inputs", None) if getattr(
            model, "shares_arrays", False) else None
        sites: list[Site] = []
        edges: list[SiteEdge] = []
        kinds: dict[tuple[Any, ...], int] = {}
        for n, node in enumerate(graph.nodes):
            roles = memory_roles(node, counted, involved, kept, array)
            mine = {k: inputs[v.id] for k, v in enumerate(node.inputs) if v.id in inputs}
            sig = (signature(node, inputs, self.plans, roles),
                   n in self._recomputed, n in self._opens, n in self._rerun,
                   n in self._holds_gathered, n in self._charged)
            site = Site(n, node, sig, kinds.setdefault(sig, len(kinds)),
                        tuple(tuple(v.shape) for v in node.inputs), roles,
                        user_strategies and node.op.in_strategy is not None, mine)
            sites.append(site)
            params = site.params
            inv = {k for k, (_, i) in enumerate(roles) if i}
            counted.update(node.inputs[k].name for k in params)
            if inv:
                involved.update(v.id for v in node.outputs)
            if model.keeps_output(node.op, len(node.inputs), params, inv, site.positions("held")):
                kept.update(v.id for v in node.outputs)
            if kept_inputs is not None:  # one array counted once: by its first keeper
                kept.update(array.get(node.inputs[k].id, node.inputs[k].id)
                            for k in kept_inputs(node.op, roles))
                if node.op.output_aliases_input and node.inputs:
                    array[node.outputs[0].id] = array.get(node.inputs[0].id, node.inputs[0].id)
            for k, v in enumerate(node.inputs):
                if v.producer is not None:
                    p = index[v.producer.id]
                    edges.append(SiteEdge(p, v.index, n, k, v.dtype.itemsize,
                                          follow and graph.nodes[p].op.elementwise))
        self.sites: tuple[Site, ...] = tuple(sites)
        self.edges: tuple[SiteEdge, ...] = tuple(edges)
        # A recomputed op's twin: its signature but for being in the largest Cell (the ops at
        # one place in identical blocks are twins; bounds on what they make again are per
        # twin, as the cost graph prices a kind once).
        twins: dict[tuple[Any, ...], int] = {}
        self._twin = {n: twins.setdefault(sites[n].signature[:-1], len(twins))
                      for nodes in self._cells for n in nodes}
        self._base_capacity = self.memory_capacity
        # A consumer that keeps an input an earlier op's memory holds ("held") keeps an array
        # of its own when the edge moves it (the final pricing counts every redistributed
        # input apart): bytes the edge adds, per pair of candidates. A view (Reshape) passes
        # its input on: the copy a move into it makes is kept by whoever keeps the view.
        self._copy_bytes = float(getattr(model, "activation_copies", 1))
        keeps: dict[tuple[int, int], bool] = {}

        def keeps_copy(n: int, k: int) -> bool:
            if (n, k) not in keeps:
                site, keeps[(n, k)] = sites[n], False
                op = site.node.op
                if kept_inputs is None or site.roles[k][0] != "held" or n in self._recomputed:
                    return False
                free = tuple(("free", i) if j == k else (r, i)
                             for j, (r, i) in enumerate(site.roles))
                keeps[(n, k)] = k in kept_inputs(op, free) or (
                    op.output_aliases_input and k == 0 and any(
                        keeps_copy(edges[e].consumer, edges[e].input)
                        for e in out_edges.get(n, ()) if edges[e].output == 0))
            return keeps[(n, k)]

        out_edges: dict[int, list[int]] = {}
        for e, se in enumerate(edges):
            out_edges.setdefault(se.producer, []).append(e)
        self._copies = tuple(keeps_copy(se.consumer, se.input) for se in edges)
        #: Views whose output is such a copy when they move their input themselves
        #: (a Reshape's ``inner_plan``): their candidates that do hold it.
        self._view_copies = {n for n, site in enumerate(sites)
                             if site.node.op.output_aliases_input and site.node.inputs
                             and keeps_copy(n, 0)}
        self.in_edges: list[list[int]] = [[] for _ in sites]
        self.out_edges: list[list[int]] = [[] for _ in sites]
        for e, edge in enumerate(edges):
            self.in_edges[edge.consumer].append(e)
            self.out_edges[edge.producer].append(e)
        uses: dict[str, list[tuple[int, int]]] = {}
        for site in sites:
            for k in sorted(site.params):
                uses.setdefault(site.node.inputs[k].name, []).append((site.index, k))
        #: Parameters read by several ops: (node index, input position) of each read.
        self.shared = {name: tuple(u) for name, u in uses.items() if len(u) > 1}
        self._priced: dict[tuple[int, Strategy], Priced | None] = {}
        # The moves' prices, transients and matrices: every pricer of one model, device
        # count and AllToAll setting shares them (the memory dimensions' combinations each
        # make a pricer, and move the same layouts).
        self._moves, self._transients, self._matrices, self._held = move_memo(
            model, device_num, enable_alltoall)
        # The largest Cell's prices without its tapes made again (under rerun bounds),
        # shared by every pricer :meth:`limited` makes.
        self._uncharged: dict[tuple[int, Strategy], Priced] = {}
        # Layouts with one block key cost alike to move when the device count is a prime
        # power (the planner's refinements are then unique); over mixed factors (6, 12) two
        # writings of one pair of layouts can plan differently, so moves are keyed exactly.
        self._power = _prime_power(device_num)
        self._key: Any = block_key if self._power else (lambda lay: lay)
        self._fine_mesh = DeviceMesh((self._power[0],) * self._power[1]) if self._power and \
            self._power[1] else None

    def _slices(self, site: Site, sh: OpSharding) -> dict[int, ParamShard]:
        """Per new trainable parameter, the slice optimizer parallel gives it under this
        sharding."""
        if not self.optimizer.enabled:
            return {}
        out = {}
        for k in site.positions("new"):
            v = site.node.inputs[k]
            shards, _ = shard_parameters({v.name: ParamFacts(sh.in_layouts[k], v.dtype.itemsize,
                                                             True)}, self.optimizer)
            if v.name in shards:
                out[k] = shards[v.name]
        return out

    def _sliced(self, site: Site, slices: Mapping[int, ParamShard]
                ) -> dict[int, tuple[int, bool]]:
        """Per sliced parameter: (the ranks its slices spread over, whether the gathered copy
        is kept to the backward: by this op's tape, or by the recomputed Cell it is in, which
        does not gather again; level3 gathers again either way)."""
        n = site.index
        return {k: (shard.size, not shard.level.regathers and (
            n in self._holds_gathered if n in self._recomputed
            else site.node.op.keeps_input(k))) for k, shard in slices.items()}

    def limited(self, transient_limit: float,
                rerun_bounds: Mapping[int, float] | None = None) -> Pricer:
        """This pricer under ``transient_limit``, sharing everything priced so far (a search
        again under a limit prices nothing twice): the searches may choose only strategies
        and moves whose transient is at most the limit, and the ops' and edges' memories may
        add up to the capacity less it, so that a plan they find fits with its largest
        transient (unless a ``.shard()`` strategy, which always stands, holds more).

        ``rerun_bounds`` (:meth:`rerun_bounds`) bound what each recomputed op makes again in
        the backward, per twin; the capacity is then less the most a Cell's ops' bounds add
        up to, and no Cell's tapes count in its ops' memories."""
        if isinstance(transient_limit, bool) or not isinstance(transient_limit, (int, float)) \
                or not 0 < transient_limit < math.inf:
            raise ValueError(f"Pricer.limited: transient_limit must be a finite number of "
                             f"bytes > 0, got {transient_limit!r}")
        out = copy.copy(self)
        reserve = 0.0
        if rerun_bounds is not None:
            out.rerun_limits = dict(rerun_bounds)
            reserve = max((sum(out.rerun_limits[self._twin[n]] for n in nodes)
                           for nodes in self._cells), default=0.0)
        out.memory_capacity = self._base_capacity - transient_limit - reserve
        out.transient_limit = float(transient_limit)
        return out

    def rerun_bounds(self, strategies: Sequence[OpSharding]) -> dict[int, float]:
        """Per twin (recomputed ops alike but for being in the largest Cell), what one
        sharding per op makes again there (:attr:`Priced.rerun`): the most of the largest
        Cell's ops (they stand for their twins in identical Cells), else of all its ops."""
        charged = {self._twin[n] for n in self._charged}
        out: dict[int, float] = {}
        for n, twin in self._twin.items():
            if twin in charged and n not in self._charged:
                continue   # its twin in the largest Cell stands for it
            found = self.priced(n, strategies[n].strategy)
            out[twin] = max(out.get(twin, 0.0), 0.0 if found is None else found.rerun)
        return out

    def candidates(self, n: int, fully_use_devices: bool) -> list[Strategy]:
        """Op ``n``'s candidate strategies under the algo parameters' slice alignment."""
        site = self.sites[n]
        return site.node.op.candidate_strategies(site.shapes, self.device_num,
                                                 fully_use_devices=fully_use_devices,
                                                 slice_align=self.algo.slice_align)

    def sharding(self, n: int, strategy: Strategy) -> OpSharding | None:
        """Op ``n`` under ``strategy`` (None: the op rejects it, it cuts a parameter
        otherwise than the parameter's plan, or it holds more than the transient limit)."""
        priced = self.price(n, strategy)
        return None if priced is None else priced.sharding

    def price(self, n: int, strategy: Strategy) -> Priced | None:
        """Cost and memory of op ``n`` under ``strategy`` (None, as :meth:`sharding`, and
        when its transient is over the :attr:`transient_limit`)."""
        found = self.priced(n, strategy)
        if found is None or self.sites[n].user:
            return found
        if found.transient > self.transient_limit or (
                self.rerun_limits is not None and n in self._twin
                and found.rerun > self.rerun_limits[self._twin[n]]):
            return None
        return found

    def priced(self, n: int, strategy: Strategy) -> Priced | None:
        """:meth:`price`, whatever the transient (a plan's own strategies, to price it); under
        :attr:`rerun_limits` the largest Cell's memories without its tapes made again (the
        capacity holds them back)."""
        found = self._priced_op(n, strategy)
        if self.rerun_limits is None or found is None or n not in self._charged \
                or not found.rerun:
            return found
        key = (self.sites[n].kind, strategy)
        out = self._uncharged.get(key)
        if out is None:
            out = self._uncharged[key] = replace(found, memory=found.memory - found.rerun)
        return out

    def _sharding(self, site: Site, strategy: Strategy) -> OpSharding | None:
        """The op's layouts under ``strategy`` (None: it rejects it)."""
        op = site.node.op
        try:
            return op.sharding(site.shapes, self.device_num, strategy,
                               op.out_strategy if site.user else None, self.enable_alltoall)
        except (StrategyError, ValueError):
            return None

    def _priced_op(self, n: int, strategy: Strategy) -> Priced | None:
        site = self.sites[n]
        key = (site.kind, strategy)
        found = self._priced.get(key, _MISSING)
        if found is not _MISSING:
            return found
        node = site.node
        found = None
        sh = self._sharding(site, strategy)
        if sh is not None and not any(
                v.kind == "param" and v.name in self.plans and lay.cuts != self.plans[v.name]
                for v, lay in zip(node.inputs, sh.in_layouts)):
            itemsize = node.outputs[0].dtype.itemsize
            in_sizes = tuple(v.dtype.itemsize for v in node.inputs)
            params = site.params
            slices = self._slices(site, sh)
            if self.step_objective:
                cost = self.model.step_op(  # type: ignore[attr-defined]
                    sh, site.positions("new"), itemsize, in_sizes,
                    shards={k: (s.level, s.size) for k, s in slices.items()},
                    micro_batches=self.micro_batches, recomputed=n in self._recomputed)
            else:
                cost = self.model.op(sh, params, itemsize, in_sizes)
            for k, lay in site.inputs.items():  # a graph input arrives in the dataset's layout
                cost += self.move(lay, sh.in_layouts[k], node.inputs[k].dtype.itemsize)
            mirrored = self._mirrored(site, sh, slices, in_sizes) if (
                self._bucketed or self._calls is not None) else []
            if self._calls is not None:
                cost += self._call_shares(mirrored)
            involved = {k for k, (_, i) in enumerate(site.roles) if i}
            rerun = 0.0
            if getattr(self.model, "prices_memory_dimensions", False):
                args = (sh, site.positions("new"), itemsize, site.positions("held"), in_sizes,
                        involved, site.positions("frozen"), self._sliced(site, slices))
                memory = self.model.memory(*args, (n in self._recomputed, n in self._opens))
                if n in self._recomputed:   # its tape, made again in the backward
                    rerun = max(0.0, self.model.memory(*args, (False, False)) - memory)
                    if n in self._charged:
                        memory += rerun
            else:
                memory = self.model.memory(sh, site.positions("new"), itemsize,
                                           site.positions("held"), in_sizes, involved,
                                           site.positions("frozen"))
            if n in self._view_copies and sh.inner_plan is not None:
                memory += self._copy_bytes * sh.out.local_size() * itemsize
            if self._bucketed:   # the gradients its Mirrors pack into a bucket
                memory += sum(nbytes for nbytes, _ in mirrored)
            transient = 0.0
            if hasattr(self.model, "transient"):   # its gradients not counted as gradients
                grads = {k: (1.0 / slices[k].size if k in slices else 0.0)
                         for k, v in enumerate(node.inputs) if node.op.gives_gradient(
                             k, v.dtype) and (v.kind != "param" or k in slices)}
                transient = self.model.transient(
                    sh, grads, itemsize, in_sizes,
                    {k: (s.size, s.level.regathers and node.op.keeps_input(k))
                     for k, s in slices.items()})
            found = Priced(sh, cost, memory, transient, rerun)
        self._priced[key] = found
        return found

    @staticmethod
    def _mirrored(site: Site, sh: OpSharding, slices: Mapping[int, ParamShard],
                  in_sizes: Sequence[int]) -> list[tuple[int, CommSpec]]:
        """The bytes and the Mirror of each replicated gradient the op counts (its new
        trainable parameters that optimizer parallel does not slice)."""
        out = []
        for k in site.positions("new"):
            spec = None if k in slices else sh.input_grad_spec(k)
            if spec is not None:
                out.append((sh.in_layouts[k].local_size() * in_sizes[k], spec))
        return out

    def _call_shares(self, mirrored: Sequence[tuple[int, CommSpec]]) -> float:
        """The replicated gradients' shares of their Mirror calls' fixed costs (``_calls``):
        bytes / threshold of a call each under a size threshold (a gradient over it goes
        alone: one call), one call each without fusion."""
        fusion = self._calls
        assert fusion is not None
        model: Any = self.model
        return sum((1.0 if not fusion.openstate else min(1.0, nbytes / fusion.threshold_bytes))
                   * model.mirror_call_seconds(spec) for nbytes, spec in mirrored)

    def layout_key(self, layout: TensorLayout) -> Any:
        """What moves into or out of ``layout`` cost depends on (memo keys)."""
        return self._key(layout)

    def plan(self, src: TensorLayout, dst: TensorLayout) -> RedistributionPlan:
        return plan(src, dst, self.enable_alltoall)

    def move(self, src: TensorLayout, dst: TensorLayout, itemsize: int) -> float:
        """The model's cost of redistributing a value from ``src`` to ``dst`` (every
        micro-batch's, under the step objective)."""
        return self._scale * self._move(src, dst, itemsize)

    def _move(self, src: TensorLayout, dst: TensorLayout, itemsize: int) -> float:
        key = (self._key(src), self._key(dst), itemsize)
        found = self._moves.get(key)
        if found is None:
            found = self._moves[key] = self.model.edge(self.plan(src, dst), itemsize)
        return found

    def edge_factor(self, e: int) -> float:
        """What edge ``e``'s move is multiplied by beyond the micro-batches: 1.5 into an op a
        Cell recomputes with mp_comm_recompute (its forward half runs again), else 1."""
        return 1.5 if self.step_objective and self.edges[e].consumer in self._rerun else 1.0

    def move_matrix(self, srcs: Sequence[TensorLayout], dsts: Sequence[TensorLayout],
                    itemsize: int) -> np.ndarray:
        """``out[i, j]`` = :meth:`move` from ``srcs[i]`` to ``dsts[j]``, for every pair at once.

        On a prime-power device count without AllToAll, and for a model that prices moves in
        bulk (``edge_prices``), every pair is planned at once in numpy
        (:func:`~simpar.search.moves.plan_signatures`) and priced by the model in one call;
        one pair of every kind of plan is then planned by the real planner and priced by the
        model's ``edge``, and must agree exactly. Otherwise every distinct pair is planned and
        priced alone."""
        out = np.empty((len(srcs), len(dsts)))
        if not srcs or not dsts:
            return out
        s_keys, us, rows = self._distinct(srcs)
        d_keys, ud, cols = self._distinct(dsts)
        bulk = getattr(self.model, "edge_prices", None)
        key = (s_keys, d_keys, itemsize)  # edges of equal layouts: once
        unique = self._matrices.get(key)
        # A 0-d tensor (a loss before its last scaling) has no dims for the bulk tables: its
        # few moves (pending sums, completed or not) are priced pair by pair.
        if unique is None and (self._fine_mesh is None or self.enable_alltoall or bulk is None
                               or not us[0].ndim):
            unique = np.array([[self._move(s, d, itemsize) for d in ud] for s in us])
        elif unique is None:
            unique = self._signature_matrix(us, ud, itemsize, bulk)
        self._matrices[key] = unique
        unique = unique * self._scale if self._scale != 1 else unique
        return unique[np.ix_(rows, cols)]

    def _distinct(self, layouts: Sequence[TensorLayout]
                  ) -> tuple[tuple[Any, ...], list[TensorLayout], list[int]]:
        """The distinct layouts of ``layouts`` by :attr:`_key`: their keys and the first
        layout of each, in order of first appearance, and each layout's index among them
        (a matrix over edges of equal layouts is made once, over distinct pairs only)."""
        at: dict[Any, int] = {}
        firsts: list[TensorLayout] = []
        index = []
        for lay in layouts:
            n = at.setdefault(self._key(lay), len(firsts))
            if n == len(firsts):
                firsts.append(lay)
            index.append(n)
        return tuple(at), firsts, index

    def _signature_matrix(self, srcs: Sequence[TensorLayout], dsts: Sequence[TensorLayout],
                          itemsize: int, bulk: Any) -> np.ndarray:
        assert self._power is not None and self._fine_mesh is not None
        p, k = self._power
        prices = np.empty((len(srcs), len(dsts)))
        firsts: dict[int, tuple[MoveBlock, int]] = {}
        for block in plan_moves(srcs, dsts, p, k):
            prices[block.sources] = bulk(self._fine_mesh, block.steps, itemsize).reshape(
                len(block.sources), len(dsts)) if block.steps else 0.0
            kinds, first = np.unique(block.kinds, return_index=True)
            for kind, at in zip(kinds.tolist(), first.tolist()):
                firsts.setdefault(kind, (block, at))
        # Check the numpy replay against the real planner and the model's own edge price on
        # one pair of every kind of plan (which steps it has).
        ndim = len(srcs[0].shape)
        by_block: dict[int, tuple[MoveBlock, list[int]]] = {}
        for block, at in firsts.values():
            by_block.setdefault(id(block), (block, []))[1].append(at)
        for block, ats in by_block.values():
            for at, row in zip(ats, block.rows(np.array(ats))):
                s, d = int(block.sources[at // len(dsts)]), at % len(dsts)
                src, dst = srcs[s], dsts[d]
                planned = signature_of(self.plan(src, dst), p, k)
                assert planned == decode(row, ndim), (src, dst, planned)
                assert prices[s, d] == self._move(src, dst, itemsize), (src, dst, prices[s, d])
        return prices

    @property
    def moves_priced(self) -> int:
        """How many distinct moves were priced pair by pair, by this pricer and those that
        share its memo (:func:`~simpar.search.moves.move_memo`)."""
        return len(self._moves)

    def edge_cost(self, e: int, producer: OpSharding, consumer: OpSharding) -> float:
        """Edge ``e`` between a producer and a consumer sharding (``inf`` for a followed
        elementwise producer whose layout the consumer would move)."""
        edge = self.edges[e]
        src = producer.outputs[edge.output][1]
        dst = consumer.in_layouts[edge.input]
        if edge.follows:
            return 0.0 if not self.plan(src, dst).steps else math.inf
        if self.limits(e) and self._move_transient(src, dst, edge.itemsize) > \
                self.transient_limit:
            return math.inf
        return self.edge_factor(e) * self.move(src, dst, edge.itemsize)

    def limits(self, e: int) -> bool:
        """Whether :attr:`transient_limit` bounds edge ``e``'s moves (a finite limit, and
        not :meth:`between_users`)."""
        return math.isfinite(self.transient_limit) and not self.between_users(e)

    def between_users(self, e: int) -> bool:
        """Whether both ends of edge ``e`` are the user's (``.shard()``): their strategies,
        and the move between them, stand whatever they hold."""
        edge = self.edges[e]
        return self.sites[edge.producer].user and self.sites[edge.consumer].user

    def _move_transient(self, src: TensorLayout, dst: TensorLayout, itemsize: int) -> float:
        """Bytes a move holds for a while: its largest collective's buffer and result (as the
        final pricing's communication buffer counts them; 0 for a local slice)."""
        key = (self._key(src), self._key(dst), itemsize)
        found = self._transients.get(key)
        if found is None:
            found = self._transients[key] = float(max(
                ((st.src.local_size() + st.dst.local_size()) * itemsize
                 for st in self.plan(src, dst).steps if not st.kind.local), default=0))
        return found

    def edge_transients(self, e: int, producers: Sequence[OpSharding],
                        consumers: Sequence[OpSharding]) -> np.ndarray:
        """:meth:`_move_transient` of edge ``e`` for every pair of candidates: each distinct
        pair of layouts once, all at once in numpy on a prime-power device count without
        AllToAll (:meth:`_bulk_transients`, whatever the cost model), else planned one by
        one."""
        edge = self.edges[e]
        srcs = [pc.outputs[edge.output][1] for pc in producers]
        dsts = [cc.in_layouts[edge.input] for cc in consumers]
        if not srcs or not dsts:
            return np.zeros((len(srcs), len(dsts)))
        s_keys, us, rows = self._distinct(srcs)
        d_keys, ud, cols = self._distinct(dsts)
        key = (s_keys, d_keys, edge.itemsize)
        unique = self._held.get(key)
        if unique is None:
            if self._fine_mesh is not None and not self.enable_alltoall and us[0].ndim:
                unique = self._bulk_transients(us, ud, edge.itemsize)
            else:
                unique = np.array([[self._move_transient(s, d, edge.itemsize) for d in ud]
                                   for s in us]).reshape(len(us), len(ud))
            self._held[key] = unique
        return unique[np.ix_(rows, cols)]

    def _bulk_transients(self, srcs: Sequence[TensorLayout], dsts: Sequence[TensorLayout],
                         itemsize: int) -> np.ndarray:
        """:meth:`_move_transient` of every pair, from the steps
        :func:`~simpar.search.moves.plan_moves` replays for all of them at once: the largest
        collective's elements before and after. One pair of every kind of plan is checked
        against the real planner's."""
        assert self._power is not None
        p, k = self._power
        out = np.zeros((len(srcs), len(dsts)))
        firsts: dict[int, tuple[MoveBlock, int]] = {}
        for block in plan_moves(srcs, dsts, p, k):
            held = np.zeros(len(block.sources) * len(dsts))
            for st in block.steps:
                if not st.kind.local:
                    np.maximum(held, np.where(st.present, (st.src_elements + st.dst_elements)
                                              * itemsize, 0), out=held)
            out[block.sources] = held.reshape(len(block.sources), len(dsts))
            kinds, first = np.unique(block.kinds, return_index=True)
            for kind, at in zip(kinds.tolist(), first.tolist()):
                firsts.setdefault(kind, (block, at))
        for block, at in firsts.values():
            s, d = int(block.sources[at // len(dsts)]), at % len(dsts)
            assert out[s, d] == self._move_transient(srcs[s], dsts[d], itemsize), (
                srcs[s], dsts[d], out[s, d])
        return out

    def edge_memory(self, e: int, producer: OpSharding, consumer: OpSharding) -> float:
        """Bytes per rank edge ``e`` adds between a producer and a consumer sharding: the
        consumer's own copy of a held input that the pair moves (0 otherwise)."""
        matrix = self.edge_memory_matrix(e, [producer], [consumer])
        return 0.0 if matrix is None else float(matrix[0, 0])

    def edge_memory_matrix(self, e: int, producers: Sequence[OpSharding],
                           consumers: Sequence[OpSharding]) -> np.ndarray | None:
        """:meth:`edge_memory` for every pair at once (None: the edge adds none). A consumer
        that moves the input itself (a Reshape's ``inner_plan``) counts its own output
        instead."""
        if not self._copies[e]:
            return None
        edge = self.edges[e]
        codes: dict[Any, int] = {}
        src = [codes.setdefault(self._key(pc.outputs[edge.output][1]), len(codes))
               for pc in producers]
        dsts = [cc.in_layouts[edge.input] for cc in consumers]
        dst = [codes.setdefault(self._key(lay), len(codes)) for lay in dsts]
        nbytes = np.array([0.0 if cc.inner_plan is not None else
                           self._copy_bytes * lay.local_size() * edge.itemsize
                           for cc, lay in zip(consumers, dsts)])
        matrix = np.where(np.array(src)[:, None] != np.array(dst)[None, :], nbytes[None, :],
                          0.0).reshape(len(producers), len(consumers))
        matrix.flags.writeable = False
        return matrix

    def total(self, strategies: Sequence[OpSharding]) -> float:
        """The objective of one sharding per op: their costs and every edge's move."""
        cost = 0.0
        for site, sh in zip(self.sites, strategies):
            priced = self.priced(site.index, sh.strategy)
            cost += math.inf if priced is None else priced.cost
        for e, edge in enumerate(self.edges):
            cost += self.edge_cost(e, strategies[edge.producer], strategies[edge.consumer])
        return cost

    def memory(self, strategies: Sequence[OpSharding]) -> float:
        """Bytes per rank of one sharding per op: the ops' and the edges'."""
        return sum(self.op_memories(strategies)) + self.edges_memory(strategies)

    def op_memories(self, strategies: Sequence[OpSharding]) -> list[float]:
        """Each op's bytes per rank under its sharding (inf where it is not priced)."""
        found = [self.priced(site.index, sh.strategy) for site, sh in zip(self.sites,
                                                                         strategies)]
        return [math.inf if p is None else p.memory for p in found]

    def transient(self, strategies: Sequence[OpSharding]) -> float:
        """The largest transient of one sharding per op: its ops' (:attr:`Priced.transient`)
        and its edges' moves', with what a recomputed Cell's tapes made again in the backward
        hold beyond the memories count (:meth:`rerun`; on top of any op's, as the final
        pricing counts it with the backward's)."""
        priced = [self.priced(site.index, sh.strategy) for site, sh in zip(self.sites,
                                                                          strategies)]
        ops = max((p.transient for p in priced if p is not None), default=0.0)
        return max(ops, max((self._move_transient(
            strategies[se.producer].outputs[se.output][1],
            strategies[se.consumer].in_layouts[se.input], se.itemsize)
            for se in self.edges if not se.follows), default=0.0)) + self.rerun(strategies)

    def rerun(self, strategies: Sequence[OpSharding]) -> float:
        """Bytes the tapes of the recomputed Cell that makes most of them again hold while the
        backward reruns it (:attr:`Priced.rerun`, summed over the Cell's ops), beyond the
        largest Cell's, which its ops' memories count."""
        def cell(nodes: Sequence[int]) -> float:
            found = [self.priced(n, strategies[n].strategy) for n in nodes]
            return sum(p.rerun for p in found if p is not None)
        cells, charged = self.rerun_cells()
        most = max((cell(nodes) for nodes in cells), default=0.0)
        return max(0.0, most - cell(charged))

    def rerun_cells(self) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """The recomputed Cells whose tapes made again :meth:`rerun` counts (ops by index),
        and the one among them whose ops' memories count theirs already; none under
        :attr:`rerun_limits` (held back from the capacity)."""
        if self.rerun_limits is not None:
            return (), ()
        return tuple(self._cells), self._charged_cell

    def edges_memory(self, strategies: Sequence[OpSharding]) -> float:
        """Bytes per rank the edges add to one sharding per op (:meth:`edge_memory`)."""
        return sum(self.edge_memory(e, strategies[edge.producer], strategies[edge.consumer])
                   for e, edge in enumerate(self.edges) if self._copies[e])


def check_memory(pricer: Pricer, shardings: Sequence[OpSharding], search: str) -> float:
    """The bytes per rank of one sharding per op; :class:`NoAvailableCost` when they exceed
    the model's memory capacity, naming the op that needs most of them."""
    mems = pricer.op_memories(shardings)
    memory, capacity = sum(mems) + pricer.edges_memory(shardings), pricer.memory_capacity
    if memory > capacity:
        worst = max(range(len(mems)), key=mems.__getitem__)
        raise NoAvailableCost(
            f"No available cost: {search}'s plan needs {memory:.0f} bytes per rank, over the "
            f"memory capacity of {capacity:.0f}"
            + (f" (the device's less {pricer.reserve:.0f} held for a gradient bucket)"
               if pricer.reserve else "")
            + (f" (less {pricer.transient_limit:.0f} held for the largest transient)"
               if math.isfinite(pricer.transient_limit) else "")
            + f" (Failure: Out of memory!); the op that needs "
            f"most of it is {pricer.sites[worst].name} ({mems[worst]:.0f} bytes, strategy "
            f"{[list(c) for c in shardings[worst].strategy]}). dynamic_programming searches "
            "under the cap; or use more devices.", memory)
    return memory
