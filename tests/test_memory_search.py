"""auto_parallel's search of the memory dimensions (simpar.search.dimensions), pure: which
combination it chooses under a cap, that search_mode "exact" proves the optimum over every
combination, how far the other searches land from it, the step objective it compares them
on, and the errors."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import numpy as np
import pytest

import simpar
from simpar import graph, nn
from simpar.cost.interface import SimparCostModel
from simpar.cost_model_context import reset_cost_model_context, set_cost_model_context
from simpar.optimizer_parallel import OptimizerLevel
from simpar.search import plan_request, request_from_context
from simpar.search.auto import cost_graph_of, pricer_of
from simpar.search.dimensions import graph_of
from simpar.search.pricing import NoAvailableCost

DEVICES = 4
MICRO = (1, 2)


@pytest.fixture(autouse=True)
def _clean() -> Any:
    simpar.reset_auto_parallel_context()
    simpar.reset_algo_parameters()
    reset_cost_model_context()
    yield
    simpar.reset_auto_parallel_context()
    simpar.reset_algo_parameters()
    reset_cost_model_context()


def _request(search_mode: str, capacity: float | None, dimensions: str = "search",
             recompute: bool = True, layers: int = 1, **config: Any) -> Any:
    """A GPT of ``layers`` blocks on 4 devices, its blocks recompute candidates, 1 or 2
    micro-batches."""
    graphs, net = {}, None
    for m in MICRO:
        model = nn.GPT(64, 8, 16, layers, 2, dtype=np.float32)
        for block in model.blocks if recompute else ():
            block.recompute()
        net = nn.WithLossCell(model, nn.SoftmaxCrossEntropyWithLogits())
        ids = ((8 // m, 8), np.dtype(np.int32))
        graphs[m] = graph.trace(net, [ids, ids], ["data", "label"])
    simpar.set_algo_parameters(memory_dimensions=dimensions)
    simpar.set_auto_parallel_context(parallel_optimizer_config={
        "parallel_optimizer_threshold": 0}, **config)
    if capacity is not None:
        set_cost_model_context(device_memory_capacity=capacity)
    return request_from_context(graphs[1], cell=net, device_num=DEVICES, mode="auto_parallel",
                                search_mode=search_mode,
                                cost_model=SimparCostModel("cpu-local", "adam"),
                                micro_graphs=graphs)


@functools.cache
def _planned(search_mode: str, capacity: float, layers: int = 1) -> tuple[Any, Any]:
    """(request, plan) of :func:`_request` with the dimensions searched (pure: cached)."""
    request = _request(search_mode, capacity, layers=layers)
    smap = plan_request(request)
    simpar.reset_auto_parallel_context()
    simpar.reset_algo_parameters()
    reset_cost_model_context()
    return request, smap


def test_the_request_names_what_the_user_left_unset() -> None:
    assert _request("dynamic_programming", None).searched == {"optimizer", "recompute",
                                                              "micro_batches"}
    fixed = _request("dynamic_programming", None, enable_parallel_optimizer=True,
                     recompute=False)
    assert fixed.searched == {"micro_batches"}
    assert fixed.optimizer.level == OptimizerLevel.LEVEL1
    assert _request("dynamic_programming", None, dimensions="fixed").searched == frozenset()


def test_without_a_binding_cap_the_plain_plan_wins() -> None:
    smap = plan_request(_request("dynamic_programming", None))
    found = smap.dimensions
    chosen = found.chosen
    assert (chosen.micro_batches, chosen.level, chosen.recompute) == (1, None, ())
    assert (smap.micro_batches, smap.recompute, dict(smap.shards)) == (1, (), {})
    # Every combination was planned and fits; the others cost more.
    assert len(found.alternatives) == len(MICRO) * 4 * 2
    assert all(a.fits for a in found.alternatives)
    assert chosen.seconds == min(a.seconds for a in found.alternatives)


# Caps (bytes per rank) on the one-block GPT: none binds; only two micro-batches fit.
# (Recomputing its only block saves nothing: the backward makes the block's tapes again.)
CAPS = (1e9, 44000.0)
# On the two-block GPT, only recomputing both blocks with two micro-batches fits.
TIGHT = 64000.0


@pytest.mark.parametrize("capacity", CAPS)
def test_exact_proves_the_optimum_of_every_combination(capacity: float) -> None:
    request, smap = _planned("exact", capacity)
    found = smap.dimensions
    fitting = [a for a in found.alternatives if a.fits]
    # Every level x subset of the one Cell x micro-batch count was planned by the ILP.
    assert {a.key for a in found.alternatives} == {
        (m, lv, rc) for m in MICRO for lv in (None, *OptimizerLevel)
        for rc in ((), (request.graph.segments[0].name,))}
    assert found.chosen.seconds == min(a.seconds for a in fitting)
    assert found.chosen.memory <= capacity
    # The map is the chosen combination's, on that micro-batch count's graph.
    assert graph_of(request, smap) is request.micro_graphs[found.chosen.micro_batches]
    assert smap.recompute == found.chosen.recompute
    assert {s.level for s in smap.shards.values()} <= {found.chosen.level}
    if capacity == CAPS[1]:   # micro-batches are needed
        assert found.chosen.micro_batches == 2
        assert not any(a.fits for a in found.alternatives if a.micro_batches == 1)
    assert found.chosen.recompute == ()


def test_recomputation_is_chosen_where_it_saves_memory() -> None:
    """Two blocks: recomputing both keeps one block's tapes at a time in the backward
    instead of two, which with two micro-batches is what fits (the tapes made again are
    counted: recomputing one of two saves nothing either)."""
    request, smap = _planned("dynamic_programming", TIGHT, 2)
    found = smap.dimensions
    names = tuple(seg.name for seg in request.graph.segments)
    assert (found.chosen.micro_batches, found.chosen.recompute) == (2, names)
    assert found.chosen.memory <= TIGHT
    assert not any(a.fits for a in found.alternatives if a.micro_batches == 1)
    assert not any(a.fits for a in found.alternatives if not a.recompute)
    assert smap.recompute == names


@pytest.mark.parametrize("capacity", CAPS)
def test_dynamic_programming_reaches_the_exact_optimum(capacity: float) -> None:
    best = _planned("exact", capacity)[1].dimensions.chosen
    dp = _planned("dynamic_programming", capacity)[1].dimensions.chosen
    assert dp.seconds == pytest.approx(best.seconds, rel=1e-9)


@pytest.mark.parametrize("capacity", CAPS)
def test_recursive_programming_fits_and_is_never_better_than_exact(capacity: float) -> None:
    """Exact's plans are the proven optimum of the plans that fit with their largest op's or
    move's transient (held in its ILP), so no search beats them, under either cap."""
    best = _planned("exact", capacity)[1].dimensions.chosen
    rp = _planned("recursive_programming", capacity)[1].dimensions.chosen
    assert rp.memory <= capacity
    assert rp.seconds >= best.seconds * (1 - 1e-9)


def test_the_objective_is_the_cost_graph_of_the_chosen_combination() -> None:
    """The seconds compared are what the search minimised: the cost graph of the chosen
    combination, whole step, priced with its micro-batches, level and recomputed Cells."""
    request, smap = _planned("dynamic_programming", TIGHT, 2)
    chosen = smap.dimensions.chosen
    g = graph_of(request, smap)
    again = dataclasses.replace(
        request, graph=g, micro_batches=chosen.micro_batches, recompute=chosen.recompute,
        step_objective=True, input_layouts=tuple(lay.with_shape(v.shape) for lay, v in zip(
            request.input_layouts, g.inputs)),
        optimizer=dataclasses.replace(request.optimizer, level=chosen.level))
    cg = cost_graph_of(again)
    pricer = pricer_of(again)
    choice = []
    for node, cnode in zip(g.nodes, cg.nodes):
        strategy = smap.ops[node.name].in_strategy
        choice.append(next(k for k, c in enumerate(cnode.candidates) if c.strategy == strategy))
    shardings = [pricer.sharding(n, smap.ops[node.name].in_strategy)
                 for n, node in enumerate(g.nodes)]
    assert cg.total(choice) == pytest.approx(chosen.seconds, rel=1e-12)
    # its memory: what it holds throughout, and its largest transient
    assert pricer.transient(shardings) > 0  # type: ignore[arg-type]
    assert cg.memory(choice) + pricer.transient(  # type: ignore[arg-type]
        shardings) == pytest.approx(chosen.memory, rel=1e-12)
    # More micro-batches and a level cost time on the same cuts: the objective prices them.
    plain = dataclasses.replace(again, micro_batches=1, optimizer=request.optimizer,
                                recompute=())
    assert pricer_of(plain).total(shardings) < pricer.total(shardings)


class _Backwards:
    """A :class:`~simpar.search.dimensions.Spread` of one worker that plans the combinations
    last first and hands every value on as JSON text, as the ranks of the world do."""

    def __init__(self) -> None:
        self.items = 0

    def map(self, work: Any, count: int) -> list[Any]:
        self.items += count
        done = {i: json.dumps(work(i)) for i in reversed(range(count))}
        return [json.loads(done[i]) for i in range(count)]


@pytest.mark.parametrize("dimensions", ["search", "when_needed"])
def test_combinations_planned_elsewhere_in_any_order_give_the_same_plan(
        dimensions: str) -> None:
    """Shared among workers (sent as JSON, planned in another order), the combinations give
    the map, the choice and every alternative one process gives: under a cap that only two
    micro-batches meet, and where the user's settings fit (when_needed's first plan, which
    one worker makes for all)."""
    if dimensions == "search":
        request, alone = _planned("recursive_programming", CAPS[1])
    else:
        request = _request("dynamic_programming", None, dimensions)
        alone = plan_request(request)
    spread = _Backwards()
    shared = plan_request(request, spread)
    assert spread.items == (len(MICRO) * 4 if dimensions == "search" else 1)
    assert shared == alone and shared.to_dict() == alone.to_dict()
    assert shared.dimensions == alone.dimensions


def test_when_needed_keeps_the_users_settings_that_fit() -> None:
    fits = plan_request(_request("dynamic_programming", None, "when_needed")).dimensions
    assert fits.searched == frozenset() and len(fits.alternatives) == 1
    tight = plan_request(_request("dynamic_programming", CAPS[1], "when_needed")).dimensions
    assert tight.chosen == _planned("dynamic_programming", CAPS[1])[1].dimensions.chosen
    assert tight.searched == {"optimizer", "recompute", "micro_batches"}
    assert tight.chosen.memory <= CAPS[1]


def test_nothing_fits_says_the_least_memory_and_which_dimensions_bind() -> None:
    with pytest.raises(NoAvailableCost, match="no combination of the memory dimensions") as e:
        plan_request(_request("dynamic_programming", 1.0, layers=2))
    found = e.value.search
    least = found.least_memory
    assert e.value.memory == least.memory and math.isfinite(least.memory)
    assert least.micro_batches == 2 and least.recompute
    lines = found.binding()
    assert [line.split(":")[0] for line in lines] == ["optimizer level", "recomputation",
                                                      "micro-batches"]
    assert "recomputation: binds" in "\n".join(lines)
    assert "micro-batches: binds" in "\n".join(lines)
    assert "over the cap" in found.table()


def test_memory_dimensions_takes_only_its_values() -> None:
    with pytest.raises(ValueError, match="memory_dimensions must be one of 'fixed', "
                                         "'when_needed', 'search', but got 'always'"):
        simpar.set_algo_parameters(memory_dimensions="always")
    with pytest.raises(TypeError, match="memory_dimensions"):
        simpar.set_algo_parameters(memory_dimensions=True)
