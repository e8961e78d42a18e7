"""A plan is a function of its request (one process): every entry point builds the same
:class:`~simpar.search.PlanRequest` from the context and gets the same plan; the cost model,
its settings and the memory cap are in the request; a new search joins in one call.

    python -m pytest tests/test_plan_request.py -q
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from simpar import context, cost_model_context, graph, nn, plan
from simpar.cost import CostModel, MindSporeCostModel, SimparCostModel, load_profile
from simpar.parallel import search_strategies
from simpar.search import (
    PlanRequest,
    StrategyMap,
    parameter_plans,
    plan_request,
    plan_strategies,
    register_search,
    request_from_context,
    set_search_cost_model,
)
from simpar.search import planner as planner_module
from simpar.search.auto import pricer_of, strategy_map_from
from simpar.search.pricing import NoAvailableCost

DEVICES = 4
SEARCH = "dynamic_programming"
#: A 1-layer GPT with its loss, as ``python -m simpar.plan`` builds it.
OPTIONS = plan.PlanOptions(model="gpt", hidden=32, layers=1, batch=8, device_num=DEVICES,
                           search_mode=SEARCH, profile=load_profile("cpu-local"), heads=4,
                           seq=8, vocab=64, optimizer="momentum",
                           dataset_strategy="data_parallel", enable_alltoall=True)


@pytest.fixture(autouse=True)
def _auto_parallel_context() -> Iterator[None]:
    """auto_parallel with dynamic programming, the batch split, AllToAll on (as the
    AutoParallel wrapper sets it), simpar's model on cpu-local; everything reset after."""
    context.reset_auto_parallel_context()
    context.reset_algo_parameters()
    cost_model_context.reset_cost_model_context()
    context.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode=SEARCH,
                                      dataset_strategy="data_parallel", enable_alltoall=True)
    set_search_cost_model(SimparCostModel("cpu-local", "momentum"))
    try:
        yield
    finally:
        set_search_cost_model(None)
        context.reset_auto_parallel_context()
        context.reset_algo_parameters()
        cost_model_context.reset_cost_model_context()


def _traced(net: nn.Cell) -> graph.Graph:
    _, specs = plan.build_network(OPTIONS)
    return graph.trace(net, specs, ["data", "label"])


def test_one_request_gives_one_plan_from_every_entry_point() -> None:
    """The planner, plan_strategies, search_strategies, simpar.plan's make_plan and the
    AutoParallel wrapper's compilation plan one GPT alike (training's own planning under
    mpirun: tests/test_auto_parallel_mpi.py)."""
    net, specs = plan.build_network(OPTIONS)
    g = _traced(net)
    request = request_from_context(g, cell=net, device_num=DEVICES)
    assert (request.device_num, request.mode, request.search_mode, request.enable_alltoall) == (
        DEVICES, "auto_parallel", SEARCH, True)
    maps: dict[str, StrategyMap] = {"planner": plan_request(request)}
    maps["plan_strategies"] = plan_strategies(g, DEVICES, "auto_parallel", "data_parallel",
                                              True, parameter_plans(net))
    maps["search_strategies"] = search_strategies(net, specs, DEVICES,
                                                  input_names=["data", "label"])
    maps["make_plan"] = plan.make_plan(OPTIONS).strategy_map
    wrapped = nn.AutoParallel(net, parallel_mode=SEARCH)
    with wrapped.parallel_context():
        maps["AutoParallel"] = plan_request(request_from_context(
            graph.trace(wrapped, specs, ["data", "label"]), cell=wrapped, device_num=DEVICES))
    assert maps["planner"].ops and len({len(m.ops) for m in maps.values()}) == 1
    for name, smap in maps.items():
        assert smap == maps["planner"], name


def test_the_request_is_all_a_plan_reads() -> None:
    """A request planned after the context changed plans as it did before."""
    net, _ = plan.build_network(OPTIONS)
    request = request_from_context(_traced(net), cell=net, device_num=DEVICES)
    before = plan_request(request)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", context.NotHonouredWarning)
        context.set_algo_parameters(fully_use_devices=True, enable_algo_approxi=True,
                                    algo_approxi_epsilon=1.0)
    context.set_auto_parallel_context(search_mode="sharding_propagation", enable_alltoall=False)
    cost_model_context.set_cost_model_context(costmodel_beta=50.0,
                                              device_memory_capacity=1024.0)
    set_search_cost_model(None)
    assert plan_request(request) == before
    changed = request_from_context(request.graph, cell=net, device_num=DEVICES)
    assert changed != request and changed.algo.fully_use_devices


def test_search_strategies_honours_the_context_and_keeps_its_defaults_otherwise() -> None:
    """search_mode, device_num, dataset_strategy and enable_alltoall left out are the
    context's where the user set them, else dynamic_programming, full_batch, no AllToAll."""
    net, specs = plan.build_network(OPTIONS)
    g = _traced(net)
    context.set_auto_parallel_context(search_mode="recursive_programming",
                                      dataset_strategy=((2, 1), (2, 1)))
    ours = search_strategies(net, specs, DEVICES, input_names=["data", "label"])
    assert ours == plan_strategies(g, DEVICES, "auto_parallel", ((2, 1), (2, 1)), True,
                                   search_mode="recursive_programming")
    assert [lay.cuts for lay in ours.inputs.values()] == [(2, 1), (2, 1)]
    context.reset_auto_parallel_context()
    unset = search_strategies(net, specs, DEVICES, input_names=["data", "label"])
    assert unset == plan_strategies(g, DEVICES, "auto_parallel", "full_batch", False,
                                    search_mode="dynamic_programming")


def test_mindspore_cost_model_keys_make_the_search_minimise_mindspores_model() -> None:
    """No search model named: a key of MindSpore's objective set away from its default
    selects MindSpore's model with those settings; device_memory_capacity caps memory under
    either model; the model set_search_cost_model names wins."""
    net, _ = plan.build_network(OPTIONS)
    g = _traced(net)
    set_search_cost_model(None)
    simpar_request = request_from_context(g, cell=net, device_num=DEVICES)
    assert isinstance(simpar_request.cost_model, SimparCostModel)
    assert simpar_request.memory_capacity == load_profile("cpu-local").memory_capacity
    cost_model_context.set_cost_model_context(costmodel_beta=50.0, costmodel_gamma=0.5)
    request = request_from_context(g, cell=net, device_num=DEVICES)
    assert isinstance(request.cost_model, MindSporeCostModel)
    assert request.cost_model.ctx == cost_model_context.cost_model_context()
    assert request.memory_capacity == 2.0 ** 34
    assert plan_request(request) == plan_strategies(g, DEVICES, "auto_parallel",
                                                    "data_parallel", True,
                                                    parameter_plans(net))
    cost_model_context.reset_cost_model_context()
    cost_model_context.set_cost_model_context(device_memory_capacity=1024.0)
    capped = request_from_context(g, cell=net, device_num=DEVICES)
    assert isinstance(capped.cost_model, SimparCostModel) and capped.memory_capacity == 1024.0
    with pytest.raises(NoAvailableCost, match="1024"):
        plan_request(capped)
    set_search_cost_model(MindSporeCostModel())
    named = request_from_context(g, cell=net, device_num=DEVICES)
    assert isinstance(named.cost_model, MindSporeCostModel) and named.memory_capacity == 1024.0


def _first_candidates(request: PlanRequest) -> StrategyMap:
    """A new search, as small as one can be: every op takes its first candidate."""
    pricer = pricer_of(request)
    shardings = []
    for site in pricer.sites:
        strategy = site.node.op.in_strategy or pricer.candidates(site.index, False)[0]
        priced = pricer.price(site.index, strategy)
        assert priced is not None
        shardings.append(priced.sharding)
    return strategy_map_from(request, shardings)


@pytest.fixture
def _new_search(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Register the search for this test only."""
    monkeypatch.setattr(planner_module, "_SEARCHES", dict(planner_module._SEARCHES))
    monkeypatch.setattr(context, "_SEARCH_MODES", list(context._SEARCH_MODES))
    monkeypatch.setattr(context, "_HONOURED_SEARCHES", set(context._HONOURED_SEARCHES))
    register_search("first_candidates", _first_candidates)
    yield "first_candidates"


def test_a_new_search_plans_once_registered(_new_search: str) -> None:
    """One register_search call: the name is a search_mode the context accepts (without a
    not-honoured warning), and every entry point plans with it."""
    net, specs = plan.build_network(OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", context.NotHonouredWarning)
        context.set_auto_parallel_context(search_mode=_new_search)
    smap = search_strategies(net, specs, DEVICES, input_names=["data", "label"])
    assert smap == plan_request(request_from_context(_traced(net), cell=net,
                                                     device_num=DEVICES))
    assert all(s.in_strategy == tuple((1,) * len(c) for c in s.in_strategy)
               for s in smap.ops.values())


def test_planning_collects_garbage_less_often_and_restores_the_collector_after(
        _new_search: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a search runs the young generation's threshold is planning's (a search keeps
    most of what it allocates); after it, and after a search that raises, the user's
    thresholds are back. A threshold already higher is left alone."""
    import gc
    seen: list[tuple[int, ...]] = []

    def probing(request: PlanRequest) -> StrategyMap:
        seen.append(gc.get_threshold())
        if request.device_num == 2:
            raise RuntimeError("the search failed")
        return _first_candidates(request)

    monkeypatch.setitem(planner_module._SEARCHES, _new_search, probing)
    net, _ = plan.build_network(OPTIONS)
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 9, 8)
        plan_request(request_from_context(_traced(net), cell=net, device_num=DEVICES,
                                          search_mode=_new_search))
        assert seen[-1] == (planner_module.PLANNING_GC_THRESHOLD, 9, 8)
        assert gc.get_threshold() == (700, 9, 8)
        with pytest.raises(RuntimeError, match="the search failed"):
            plan_request(request_from_context(_traced(net), cell=net, device_num=2,
                                              search_mode=_new_search))
        assert gc.get_threshold() == (700, 9, 8)
        gc.set_threshold(50_000, 9, 8)
        plan_request(request_from_context(_traced(net), cell=net, device_num=DEVICES,
                                          search_mode=_new_search))
        assert seen[-1] == (50_000, 9, 8) and gc.get_threshold() == (50_000, 9, 8)
    finally:
        gc.set_threshold(*before)


def test_a_request_is_a_frozen_value() -> None:
    net, _ = plan.build_network(OPTIONS)
    request = request_from_context(_traced(net), cell=net, device_num=DEVICES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.device_num = 8  # type: ignore[misc]
    again: Any = request_from_context(request.graph, cell=net, device_num=DEVICES)
    assert again == request


def test_set_search_cost_model_refuses_what_is_not_a_cost_model() -> None:
    with pytest.raises(TypeError, match="set_search_cost_model: expected a simpar.cost."
                                        "CostModel"):
        set_search_cost_model(np.zeros(3))


def test_the_cost_model_members_are_the_protocols() -> None:
    members = {m for m in dir(CostModel) if not m.startswith("_")}
    assert set(cost_model_context._COST_MODEL_MEMBERS) == members
