"""Sharding propagation: every op without a ``.shard()`` strategy takes one from its neighbours.

The one propagation in simpar. It fills in the unannotated ops of stand_alone, data_parallel
and semi_auto_parallel (moving the fewest bytes), and it is auto_parallel's
``search_mode="sharding_propagation"`` (moving at the least cost under the search's cost model,
MindSpore's recommendation for large models where the user shards a few key ops).

How it runs (MindSpore's ``sharding_propagation``, pure: no MPI, no data):

- **Seeds.** The ops the user set with ``.shard()`` (in and out strategies) are settled from
  the start, and so are the graph inputs (in the dataset strategy's layouts: MindSpore's
  ``_VirtualDataset``). A breadth-first walk starts from all of them at once, in trace order:
  the readers of the graph inputs, then the neighbours of each user op.
- **Walk.** Taking an op from the queue, it settles it, then queues its consumers (forward)
  and then its producers (backward) that are not settled yet.
- **Choice.** A reached op takes the candidate that moves least between it and every
  neighbour settled so far (its producers' outputs, its consumers' inputs, the graph inputs it
  reads; MindSpore weighs only the edge it was reached through, simpar every settled edge):
  the smallest redistribution cost, then the least of it against user strategies (what the
  user set is where layouts should meet), then the fewest redistribution steps (the fill-in
  counts local slices too: a free slice now can force a gather later), then its own cost,
  then the least moved into the op (it follows its producers, and a move waits for the op
  that needs it), then the most parallel candidate, then the lexicographically greatest
  strategy (MindSpore's ``Strategy::Compare``; its first entry is input 0's batch cut).
  A parameter read by several ops keeps the layout its first settled reader gave it: a later
  reader takes a candidate that reads it so when it has one.
- **Unreached ops** (no path to any seed) take their first candidate (MindSpore's default):
  all ones, unless fully_use_devices drops it.
- **Parameters** (auto_parallel): a parameter read by several ops ends with one layout
  (:func:`~simpar.search.shared_layouts.one_layout_per_parameter`), as in every search; the
  fill-in of semi_auto_parallel lets a reader read it otherwise (the runtime moves it).
- **Conflicts** (auto_parallel): two user strategies that read one parameter in different
  layouts, or that meet on an identity edge (``elementwise_op_strategy_follow``) with
  different layouts, raise a ValueError naming both ops and what joins them, on every rank.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Collection, Sequence
from typing import Any

from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding
from simpar.ops.strategy import Strategy, StrategyError
from simpar.redistribution import RedistributionPlan
from simpar.search.pricing import Priced, Pricer, canonical, check_memory, listed
from simpar.search.shared_layouts import one_layout_per_parameter, users_read_one_layout
from simpar.search.strategy_map import OpStrategy, Source, StrategyMap, lay_out_by_consumer

__all__ = ["MovedBytes", "propagate"]


class MovedBytes:
    """The fill-in's measure: a redistribution costs the busiest sampled rank's elements sent
    plus received; ops cost nothing and hold nothing (a :class:`~simpar.cost.CostModel`)."""

    name = "moved-bytes"
    unit = "elements"
    memory_capacity = math.inf

    def op(self, sharding: OpSharding, parameters: Collection[int], itemsize: int,
           input_itemsizes: Sequence[int] | None = None) -> float:
        return 0.0

    def edge(self, plan: RedistributionPlan, itemsize: int) -> float:
        if not plan.steps:
            return 0.0
        return float(plan.busiest_bytes(1, sent=True))

    def program(self, program: Any) -> float:
        raise NotImplementedError("MovedBytes prices redistributions only, not programs")

    def memory(self, sharding: OpSharding, parameters: Collection[int], itemsize: int,
               kept_elsewhere: Collection[int] = (),
               input_itemsizes: Sequence[int] | None = None,
               involved: Collection[int] | None = None, frozen: Collection[int] = ()
               ) -> float:
        return 0.0

    def keeps_output(self, op: Any, n_inputs: int, parameters: Collection[int],
                     involved: Collection[int], kept_elsewhere: Collection[int]) -> bool:
        return False


Key = tuple[float, float, int, float, float, int, tuple[int, ...]]


class _Propagation:
    def __init__(self, pricer: Pricer, mode: str, fully_use_devices: bool) -> None:
        self.pr, self.mode, self.fully = pricer, mode, fully_use_devices
        self.chosen: list[OpSharding | None] = [None] * len(pricer.sites)
        self.param_layout: dict[str, TensorLayout] = {}
        self._candidates: dict[int, list[Priced]] = {}
        self._memo: dict[tuple[Any, ...], Strategy] = {}

    def candidates(self, n: int) -> list[Priced]:
        """The op's valid candidates (parameters whole in data_parallel), priced."""
        site = self.pr.sites[n]
        found = self._candidates.get(site.kind)
        if found is None:
            found = []
            for strat in self.pr.candidates(n, self.fully):
                if self.mode == "data_parallel" and any(
                        c != 1 for k in site.params for c in strat[k]):
                    continue
                priced = self.pr.price(n, strat)
                if priced is not None:
                    found.append(priced)
            self._candidates[site.kind] = found
        return found

    def _moves(self, n: int, sh: OpSharding) -> tuple[float, float, int, float]:
        """Moving between ``sh`` and everything settled around op ``n``: the cost, the cost
        of the moves against user strategies, the steps (the fill-in counts local ones too:
        a free slice now can force a gather later; the search counts collectives), and the
        cost of the moves into the op (from its producers and the graph inputs)."""
        pr, chosen = self.pr, self.chosen
        cost = user = 0.0
        steps = 0
        site = pr.sites[n]
        local = self.mode != "auto_parallel"

        def count(src: TensorLayout, dst: TensorLayout) -> int:
            return sum(1 for s in pr.plan(src, dst).steps if local or not s.kind.local)

        for k, lay in site.inputs.items():
            cost += pr.move(lay, sh.in_layouts[k], site.node.inputs[k].dtype.itemsize)
            steps += count(lay, sh.in_layouts[k])
        if sh.inner_plan is not None:  # a move the op makes itself (Reshape's) is a move too
            cost += pr.model.edge(sh.inner_plan, site.node.inputs[0].dtype.itemsize)
            steps += count(sh.inner_plan.src, sh.inner_plan.dst)
        inward = cost
        for e, outward in [*((e, False) for e in pr.in_edges[n]),
                           *((e, True) for e in pr.out_edges[n])]:
            edge = pr.edges[e]
            other = edge.consumer if outward else edge.producer
            near = chosen[other]
            if near is None:
                continue
            src, dst = (sh, near) if outward else (near, sh)
            c = pr.edge_cost(e, src, dst)
            cost += c
            user += c if pr.sites[other].user else 0.0
            inward += 0.0 if outward else c
            steps += count(src.outputs[edge.output][1], dst.in_layouts[edge.input])
        return cost, user, steps, inward

    def _agrees(self, n: int, sh: OpSharding) -> bool:
        """Whether ``sh`` reads every shared parameter in the layout it already has."""
        site = self.pr.sites[n]
        for k in site.params:
            have = self.param_layout.get(site.node.inputs[k].name)
            if have is not None and canonical(have) != canonical(sh.in_layouts[k]):
                return False
        return True

    def key(self, n: int, priced: Priced) -> Key:
        sh = priced.sharding
        cost, user, steps, inward = self._moves(n, sh)
        inputs = self.pr.sites[n].inputs
        own = priced.cost - sum(self.pr.move(lay, sh.in_layouts[k],
                                             self.pr.sites[n].node.inputs[k].dtype.itemsize)
                                for k, lay in inputs.items())
        # Ties: the most parallel, then the lexicographically greatest strategy (MindSpore's
        # Strategy::Compare; its first entry is the batch cut of input 0).
        return (cost, user, steps, own, inward, sh.repeat,
                tuple(-c for cuts in sh.strategy for c in cuts))

    def _memo_key(self, n: int) -> tuple[Any, ...]:
        pr, chosen = self.pr, self.chosen
        site = pr.sites[n]
        key = pr.layout_key
        ins, outs = [], []
        for e in pr.in_edges[n]:
            edge = pr.edges[e]
            if (src := chosen[edge.producer]) is not None:
                ins.append((edge.input, key(src.outputs[edge.output][1]), edge.follows,
                            pr.sites[edge.producer].user))
        for e in pr.out_edges[n]:
            edge = pr.edges[e]
            if (dst := chosen[edge.consumer]) is not None:
                outs.append((edge.output, key(dst.in_layouts[edge.input]),
                             pr.sites[edge.consumer].user))
        params = tuple(canonical(self.param_layout[site.node.inputs[k].name])
                       if site.node.inputs[k].name in self.param_layout else None
                       for k in sorted(site.params))
        return (site.kind, tuple(ins), tuple(outs), params)

    def decide(self, n: int) -> OpSharding:
        """The candidate that moves least against the settled neighbours (see the module)."""
        memo = self._memo_key(n)
        strat = self._memo.get(memo)
        if strat is None:
            cands = self.candidates(n)
            if not cands:
                site = self.pr.sites[n]
                raise StrategyError(f"{site.name}: no valid strategy for shapes "
                                    f"{list(site.shapes)} on {self.pr.device_num} devices")
            agreeing = [p for p in cands if self._agrees(n, p.sharding)] or cands
            best: tuple[Key, Priced] | None = None
            follow = self._follow(n) if self.mode != "auto_parallel" else None
            if follow is not None and self.key(n, follow)[:3] == (0.0, 0.0, 0):
                best = (self.key(n, follow), follow)  # the fill-in: nothing moves, nothing beats
            for priced in agreeing if best is None else ():
                k = self.key(n, priced)
                if best is None or k < best[0]:
                    best = (k, priced)
            assert best is not None
            strat = self._memo[memo] = best[1].sharding.strategy
        found = self.pr.price(n, strat)
        assert found is not None
        return found.sharding

    def _follow(self, n: int) -> Priced | None:
        """The strategy that keeps every activation input where its producer (or the
        dataset) put it, parameters and constants whole; None when the op rejects it."""
        pr, site = self.pr, self.pr.sites[n]
        producers = {pr.edges[e].input: e for e in pr.in_edges[n]}
        cuts = []
        for k, v in enumerate(site.node.inputs):
            lay = site.inputs.get(k)
            if k in producers:
                edge = pr.edges[producers[k]]
                src = self.chosen[edge.producer]
                lay = src.outputs[edge.output][1] if src is not None else None
            cuts.append(lay.cuts if lay is not None else (1,) * v.ndim)
        priced = pr.price(n, tuple(cuts))
        if priced is None or (self.mode == "data_parallel" and any(
                c != 1 for k in site.params for c in cuts[k])):
            return None
        return priced

    def settle(self, n: int, sh: OpSharding) -> None:
        self.chosen[n] = sh
        site = self.pr.sites[n]
        lay_out_by_consumer(self.param_layout, site.node.inputs, sh.in_layouts)


def _check_user_conflicts(pricer: Pricer, user: dict[int, OpSharding]) -> None:
    """Two user strategies that cannot both hold across an identity edge
    (elementwise_op_strategy_follow: no redistribution allowed) raise, naming both ops; a
    parameter they read in two layouts is caught by :func:`one_layout_per_parameter`."""
    sites = pricer.sites

    def shown(n: int) -> str:
        return f"{sites[n].name} (.shard({listed(user[n].strategy)}))"

    for e, edge in enumerate(pricer.edges):
        p, c = edge.producer, edge.consumer
        if edge.follows and p in user and c in user and math.isinf(
                pricer.edge_cost(e, user[p], user[c])):
            raise ValueError(
                f"sharding_propagation: {shown(p)} produces its output {edge.output} cut "
                f"{user[p].outputs[edge.output][1].cuts}, and {shown(c)} reads it as input "
                f"{edge.input} cut {user[c].in_layouts[edge.input].cuts}; under "
                "elementwise_op_strategy_follow that edge allows no redistribution, so these "
                "strategies cannot both hold: make them agree")


def propagate(pricer: Pricer, mode: str, input_layouts: Sequence[TensorLayout],
              source: Source | None = None) -> StrategyMap:
    """Every op's strategy: the user's, and for the others the propagation's (see the
    module docstring). ``mode`` is the parallel mode the map is for; the unannotated ops are
    marked ``source`` (default: propagated; data_parallel in that mode)."""
    user_ops = mode in ("semi_auto_parallel", "auto_parallel")
    fully = pricer.algo.fully_use_devices if mode == "auto_parallel" else False
    prop = _Propagation(pricer, mode, fully)
    sites = pricer.sites
    seeds: list[int] = []
    for site in sites:
        strat = site.node.op.in_strategy
        if user_ops and strat is not None:
            priced = pricer.price(site.index, strat)
            if priced is None:  # the op's own error, raised where the user set it
                site.node.op.sharding(site.shapes, pricer.device_num, strat,
                                      site.node.op.out_strategy, pricer.enable_alltoall)
                raise StrategyError(f"{site.name}: .shard({listed(strat)}) cuts a parameter "
                                    "otherwise than its parameter plan")
            prop.settle(site.index, priced.sharding)
            seeds.append(site.index)
    if mode == "auto_parallel":
        _check_user_conflicts(pricer, {n: sh for n, sh in enumerate(prop.chosen)
                                       if sh is not None})
    queue: collections.deque[int] = collections.deque(
        s.index for s in sites if s.inputs and prop.chosen[s.index] is None)
    for n in seeds:
        queue.extend(pricer.edges[e].consumer for e in pricer.out_edges[n])
        queue.extend(pricer.edges[e].producer for e in pricer.in_edges[n])
    while queue:
        n = queue.popleft()
        if prop.chosen[n] is not None:
            continue
        prop.settle(n, prop.decide(n))
        queue.extend(c for e in pricer.out_edges[n]
                     if prop.chosen[c := pricer.edges[e].consumer] is None)
        queue.extend(p for e in pricer.in_edges[n]
                     if prop.chosen[p := pricer.edges[e].producer] is None)
    for site in sites:  # unreached: the first candidate (all ones), as MindSpore
        if prop.chosen[site.index] is None:
            cands = prop.candidates(site.index)
            if not cands:
                raise StrategyError(f"{site.name}: no valid strategy for shapes "
                                    f"{list(site.shapes)} on {pricer.device_num} devices")
            prop.settle(site.index, cands[0].sharding)
    if mode == "semi_auto_parallel":   # the user's strategies must agree on a parameter
        users_read_one_layout(pricer, [sh for sh in prop.chosen if sh is not None], mode)
    if mode == "auto_parallel":  # as every search: one layout per parameter, a plan that fits
        chosen = [sh for sh in prop.chosen if sh is not None]
        one_layout_per_parameter(pricer, chosen, "sharding_propagation")
        check_memory(pricer, chosen, "sharding_propagation")
        prop.chosen = list(chosen)
    if source is None:
        source = Source.DATA_PARALLEL if mode == "data_parallel" else Source.PROPAGATED
    ops: dict[str, OpStrategy] = {}
    in_layouts = []
    for site, sh in zip(sites, prop.chosen):
        assert sh is not None
        user = user_ops and site.user
        ops[site.name] = OpStrategy(site.node.op.name, sh.strategy,
                                    site.node.op.out_strategy if user else None,
                                    Source.USER if user else source)
        in_layouts.append(sh.in_layouts)
    graph = pricer.graph
    inputs = {v.name: lay for v, lay in zip(graph.inputs, input_layouts)}
    return StrategyMap(pricer.device_num, mode, ops, {}, inputs).complete(graph, in_layouts)
