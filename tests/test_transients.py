"""The searches fit a plan's largest transient with its arrays: an op's backward (its
outputs' cotangents and its inputs' gradients), an op's own collective's buffer and result,
and an edge's move's (simpar.search.auto.fitting_transients). Pure: no MPI."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest

import simpar
from simpar import graph, nn
from simpar.cost.interface import SimparCostModel
from simpar.cost.model import evaluate
from simpar.cost_model_context import reset_cost_model_context, set_cost_model_context
from simpar.runtime.lowering import lower
from simpar.search import auto, plan_request, request_from_context
from simpar.search.cost_graph import cost_graph_from, within_transient_limit
from simpar.search.dimensions import graph_of
from simpar.search.dynamic_programming import least_memory_plan
from simpar.search.pricing import NoAvailableCost

DEVICES = 8


@pytest.fixture(autouse=True)
def _clean() -> Any:
    simpar.reset_auto_parallel_context()
    simpar.reset_algo_parameters()
    reset_cost_model_context()
    yield
    simpar.reset_auto_parallel_context()
    simpar.reset_algo_parameters()
    reset_cost_model_context()


def _request(search_mode: str, capacity: float, recomputed_blocks: int = 0,
             head_strategy: Any = None) -> Any:
    """A GPT (vocabulary 64, sequence 8, width 16) on 8 devices, batch 8: one block, or
    ``recomputed_blocks`` blocks, each recomputed; ``head_strategy``: the head's MatMul's
    ``.shard()``."""
    simpar.set_auto_parallel_context(dataset_strategy="data_parallel")
    set_cost_model_context(device_memory_capacity=capacity)
    model = nn.GPT(64, 8, 16, max(1, recomputed_blocks), 2, dtype=np.float32)
    if head_strategy is not None:
        model.head.matmul.shard(head_strategy)
    for block in model.blocks if recomputed_blocks else ():
        block.recompute()
    net = nn.WithLossCell(model, nn.SoftmaxCrossEntropyWithLogits())
    ids = ((8, 8), np.dtype(np.int32))
    g = graph.trace(net, [ids, ids], ["data", "label"])
    return request_from_context(g, cell=net, device_num=DEVICES, mode="auto_parallel",
                                search_mode=search_mode,
                                cost_model=SimparCostModel("cpu-local", "adam"))


@functools.cache
def _priced(search_mode: str, capacity: float, recomputed_blocks: int = 0,
            first: bool = False) -> tuple[int, int, float, float]:
    """The plan of :func:`_request` (``first``: the search's first plan, before any search
    again under transient limits): (the final pricing's peak bytes per rank, its largest
    transient, the search's figure for the same plan: its arrays and its largest transient,
    and the plan's seconds as the search prices them). Pure: cached."""
    with pytest.MonkeyPatch.context() as m:
        if first:
            m.setattr(auto, "TRANSIENT_LIMITS", 0)
        request = _request(search_mode, capacity, recomputed_blocks)
        smap = plan_request(request)
    report = evaluate(lower(graph_of(request, smap), smap), "cpu-local", "adam")
    row = max(report.memory, key=lambda r: r.peak)
    pricer = auto.pricer_of(request)
    shardings = [pricer.priced(n, smap.ops[node.name].in_strategy).sharding  # type: ignore
                 for n, node in enumerate(request.graph.nodes)]
    assert pricer.transient(shardings) <= max(row.comm_buffer, row.backward)
    return row.peak, max(row.comm_buffer, row.backward), (
        pricer.memory(shardings) + pricer.transient(shardings)), pricer.total(shardings)


@pytest.mark.parametrize(("search_mode", "capacity"), [
    ("dynamic_programming", 44000.0), ("recursive_programming", 48000.0)])
def test_a_plan_over_the_cap_by_its_transient_is_searched_again_and_fits_when_priced(
        search_mode: str, capacity: float) -> None:
    """The first plan's arrays fit the cap and its transient puts it over, as the final
    pricing counts both; searched again under transient limits, the plan fits when priced,
    and the search's figure (arrays plus largest transient) bounds what the pricing finds."""
    assert _priced(search_mode, capacity, first=True)[0] > capacity
    peak, transient, searched, _ = _priced(search_mode, capacity)
    assert peak <= capacity and transient > 0
    assert searched <= capacity


def test_exact_fits_the_largest_transient_in_its_ilp_and_is_the_optimum_of_plans_that_fit(
) -> None:
    """Where dynamic programming's first plan is over the cap by its transient, exact's first
    plan already fits when priced (its ILP holds the largest transient beside the sum), and
    costs no more than dynamic programming's plan searched again under limits: that plan
    fits too, and exact's is the optimum of the plans that do."""
    assert _priced("dynamic_programming", 44000.0, first=True)[0] > 44000.0
    peak, transient, searched, seconds = _priced("exact", 44000.0, first=True)
    assert peak <= 44000.0 and transient > 0 and searched <= 44000.0
    assert seconds <= _priced("dynamic_programming", 44000.0)[3] * (1 + 1e-9)


def test_nothing_fitting_says_the_least_a_plan_needs_with_its_largest_transient() -> None:
    """Under a cap of one byte every search raises "No available cost" with the least memory
    a plan needs, its largest transient included, and one sentence each. The plan of least
    arrays needs more (on the GPT here its transient is larger than its arrays), so the plans
    of least arrays under transient limits are searched too. A cap of exactly the figure
    given is met: dynamic programming's plan fits it."""
    needs = set()
    for search_mode in ("recursive_programming", "dynamic_programming", "exact"):
        with pytest.raises(NoAvailableCost) as caught:
            plan_request(_request(search_mode, 1.0))
        assert caught.value.memory is not None
        assert ". With its largest transient the plan of least memory needs" in str(
            caught.value) and ".." not in str(caught.value)
        needs.add(caught.value.memory)
    (need,) = needs
    pricer = auto.pricer_of(_request("dynamic_programming", 1.0))
    cg = cost_graph_from(pricer)
    least = [node.candidates[c] for node, c in zip(cg.nodes, least_memory_plan(cg) or ())]
    assert need < pricer.memory(least) + pricer.transient(least)
    peak, _, searched, _ = _priced("dynamic_programming", need)
    assert searched <= need and peak <= need


def test_a_transient_limit_drops_the_candidates_and_moves_over_it() -> None:
    """Under a limit every op's candidate and every edge's allowed move holds at most that
    much for a while (the user's strategies stay), and the cap is lowered by it."""
    request = _request("dynamic_programming", 44000.0)
    free = auto.cost_graph_of(request)
    pricer = auto.pricer_of(request).limited(8192.0)
    limited = cost_graph_from(pricer)
    assert limited.memory_capacity == free.memory_capacity - 8192.0
    assert sum(len(n.candidates) for n in limited.nodes) < sum(
        len(n.candidates) for n in free.nodes)
    for n, node in enumerate(limited.nodes):
        assert all(pricer.priced(n, c.strategy).transient <= 8192.0  # type: ignore
                   for c in node.candidates)
    for e, edge in enumerate(limited.edges):
        allowed = np.isfinite(np.asarray(edge.costs))
        over = pricer.edge_transients(e, limited.nodes[edge.producer].candidates,
                                      limited.nodes[edge.consumer].candidates) > 8192.0
        assert not (allowed & over).any()


@pytest.mark.parametrize("setting", ["searched", "user strategy, elementwise ops follow"])
def test_the_graph_within_a_limit_forbids_what_the_limited_pricer_drops(setting: str) -> None:
    """The graph already built, with what holds more than a limit forbidden (infinite
    memory, infinite move), allows exactly the candidates and pairs that the pricer under
    that limit keeps, and its plan of least memory needs as little: with every op searched,
    and with the head's MatMul the user's (``.shard()``: it stands whatever it holds) and
    elementwise ops following their producers (their edges only allow what follows)."""
    if setting != "searched":
        simpar.set_algo_parameters(elementwise_op_strategy_follow=True)
    request = _request("dynamic_programming", 44000.0,
                       head_strategy=((8, 1), (1, 1)) if setting != "searched" else None)
    if setting != "searched":
        assert any(site.user for site in auto.pricer_of(request).sites)
        assert any(se.follows for se in auto.pricer_of(request).edges)
    pricer = auto.pricer_of(request)
    free = cost_graph_from(pricer)
    within = within_transient_limit(pricer, free, 8192.0)
    limited = cost_graph_from(pricer.limited(8192.0))
    kept = [tuple(c.strategy for c, m in zip(node.candidates, node.memories) if m < np.inf)
            for node in within.nodes]
    assert kept == [tuple(c.strategy for c in node.candidates) for node in limited.nodes]
    assert sum(map(len, kept)) < sum(len(n.candidates) for n in free.nodes)
    for edge, ref in zip(within.edges, limited.edges):
        rows = [i for i, m in enumerate(within.nodes[edge.producer].memories) if m < np.inf]
        cols = [j for j, m in enumerate(within.nodes[edge.consumer].memories) if m < np.inf]
        assert np.array_equal(np.asarray(edge.costs)[np.ix_(rows, cols)],
                              np.asarray(ref.costs))
    plans = [least_memory_plan(cg) for cg in (within, limited)]
    assert None not in plans
    assert within.memory(plans[0]) == limited.memory(plans[1])  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "8192"])
def test_a_transient_limit_must_be_a_finite_number_of_bytes(bad: Any) -> None:
    pricer = auto.pricer_of(_request("dynamic_programming", 44000.0))
    with pytest.raises(ValueError, match=r"transient_limit must be a finite number of bytes "
                                         r"> 0, got " + repr(bad).replace("'", ".")):
        pricer.limited(bad)
    assert pricer.transient_limit == float("inf")


@pytest.mark.parametrize("capacity", [60000.0, 64000.0])
def test_a_recomputed_cell_s_tapes_made_again_are_fitted_with_the_plan(
        capacity: float) -> None:
    """Two recomputed blocks: while the backward runs through one, its tapes are alive again
    (the final pricing's backward transient). The searches count them: the first plan is
    over as priced, the plan searched again under transient limits and bounds on what each
    Cell's ops make again fits, and the search's figure bounds the pricing's peak."""
    assert _priced("dynamic_programming", capacity, 2, first=True)[0] > capacity
    peak, transient, searched, _ = _priced("dynamic_programming", capacity, 2)
    assert peak <= searched <= capacity


def test_bounds_on_what_recomputed_ops_make_again_drop_candidates_and_lower_the_cap() -> None:
    """The largest recomputed Cell's ops count their tapes made again in their memories (a
    sum the searches minimise), so identical Cells are priced right; under bounds per twin
    (the ops at one place in identical blocks) no candidate over its twin's bound stays, no
    memory counts the tapes, and the cap is lowered by the most a Cell's bounds add up to."""
    request = _request("dynamic_programming", 1e9, 2)
    pricer = auto.pricer_of(request)
    plain = auto.pricer_of(dataclasses.replace(request, recompute=()))
    free = cost_graph_from(pricer)
    # each op's candidate that makes least again: a bound the others may pass
    first = [min(node.candidates, key=lambda c, n=n: pricer.priced(  # type: ignore
        n, c.strategy).rerun) for n, node in enumerate(free.nodes)]
    cells = [tuple(seg.nodes) for seg in request.graph.segments]
    charged = [c for c in cells if all(n in pricer._charged for n in c)]
    assert len(charged) == 1
    for n in charged[0]:   # priced as if its tape were kept: what it holds again
        priced = pricer.priced(n, first[n].strategy)
        assert priced.memory == pytest.approx(  # type: ignore[union-attr]
            max(priced.memory - priced.rerun,  # type: ignore[union-attr]
                plain.priced(n, first[n].strategy).memory))  # type: ignore[union-attr]
    bounds = pricer.rerun_bounds(first)
    assert set(bounds) == {pricer._twin[n] for c in cells for n in c}
    limited = pricer.limited(1e6, bounds)
    cg = cost_graph_from(limited)
    reserve = max(sum(bounds[pricer._twin[n]] for n in c) for c in cells)
    assert limited.memory_capacity == pytest.approx(pricer.memory_capacity - 1e6 - reserve)
    for n, node in enumerate(cg.nodes):
        if n in pricer._twin:
            assert all(pricer.priced(n, c.strategy).rerun  # type: ignore[union-attr]
                       <= bounds[pricer._twin[n]] for c in node.candidates)
        for c in node.candidates:
            held = limited.priced(n, c.strategy)
            assert held.memory == pytest.approx(  # type: ignore[union-attr]
                pricer.priced(n, c.strategy).memory  # type: ignore[union-attr]
                - (pricer.priced(n, c.strategy).rerun  # type: ignore[union-attr]
                   if n in pricer._charged else 0.0))
    assert sum(len(n.candidates) for n in cg.nodes) < sum(len(n.candidates) for n in free.nodes)
    assert limited.rerun(first) == 0.0   # held back from the cap instead


def test_the_graph_with_transients_counts_a_plan_as_the_pricer_does() -> None:
    """The graph exact's ILP is built from, with every transient (the head's ``.shard()``
    MatMul's too) and two recomputed Cells' tapes made again, says of any plan what the
    pricer says: its arrays, and its largest transient with what the Cell that makes most
    again holds beyond the charged one (random plans: the two blocks' ops choose apart)."""
    request = _request("exact", 44000.0, recomputed_blocks=2, head_strategy=((8, 1), (1, 1)))
    pricer = auto.pricer_of(request)
    cg = cost_graph_from(pricer, transients=True)
    assert len(cg.cells) == 2 and cg.charged in cg.cells
    head = next(n for n, site in enumerate(pricer.sites) if site.user)
    assert cg.nodes[head].transients and cg.nodes[head].transients[0] > 0
    rng = np.random.default_rng(0)
    excess = 0
    for _ in range(24):
        choice = [int(rng.integers(len(node.candidates))) for node in cg.nodes]
        shardings = [node.candidates[c] for node, c in zip(cg.nodes, choice)]
        assert cg.memory(choice) == pytest.approx(pricer.memory(shardings), rel=1e-12)
        assert cg.transient(choice) == pytest.approx(pricer.transient(shardings), rel=1e-12)
        excess += cg.rerun(choice) > 0
    assert excess > 0
