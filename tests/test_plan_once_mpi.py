"""A search runs once for the world, and its plan reaches every rank (simpar.search.plan_once):
on rank 0, or with the memory dimensions searched, their combinations shared among the
ranks. The same map and memory-dimension choice as planning alone, the same warnings, the
same error, on every rank, with no rank left waiting (mpirun -n 2, 4 or 8).

    mpirun -n 4 python -m pytest tests/test_plan_once_mpi.py -q --with-mpi -m mpi
"""

from __future__ import annotations

import functools
import json
import warnings
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import graph, nn
from simpar.cost_model_context import reset_cost_model_context, set_cost_model_context
from simpar.optimizer_parallel import OptimizerLevel
from simpar.pipeline.runner import plan_pipeline
from simpar.search import (
    OptimizerShardWarning,
    dimensions,
    plan_once,
    plan_request,
    planner,
    request_from_context,
)
from simpar.search.pricing import NoAvailableCost
from tests.mpi_guard import abort_job_on_error

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(autouse=True)
def _clean() -> Any:
    yield
    simpar.reset_auto_parallel_context()
    simpar.reset_algo_parameters()
    reset_cost_model_context()


def _request(search_mode: str = "dynamic_programming", dimensions: str = "search") -> Any:
    """A two-layer MLP under auto_parallel on the whole world, its hidden layer a recompute
    candidate, the memory dimensions searched."""
    simpar.set_auto_parallel_context(dataset_strategy="data_parallel",
                                     parallel_optimizer_config={
                                         "parallel_optimizer_threshold": 0})
    simpar.set_algo_parameters(memory_dimensions=dimensions)
    mlp = nn.MLP(16, 32, 8, n_hidden=1, dtype=np.float64)
    mlp.layers[0].recompute()
    net = nn.WithLossCell(mlp, nn.SoftmaxCrossEntropyWithLogits())
    graphs = {}
    for m in (1, 2):
        specs = [((16 // m, 16), np.dtype(np.float64)), ((16 // m,), np.dtype(np.int32))]
        graphs[m] = graph.trace(net, specs, ["data", "label"])
    return request_from_context(graphs[1], cell=net, device_num=comm.get_group_size(),
                                mode="auto_parallel", search_mode=search_mode,
                                micro_graphs=graphs)


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts this rank's searches (plan_once's calls of plan_request)."""
    calls: list[int] = []
    real = planner.plan_request

    def counted(request: Any, *args: Any) -> Any:
        calls.append(1)
        return real(request, *args)

    monkeypatch.setattr(planner, "plan_request", counted)
    return calls


def _same_on_every_rank(text: str) -> bool:
    """Whether every rank's ``text`` is rank 0's."""
    mine = text == comm.broadcast_text(text if comm.get_rank() == 0 else None)
    return bool(comm.all_reduce(np.array([0 if mine else 1], dtype=np.int64), op="max")[0]
                == 0)


#: The combinations of :func:`_request`, in the search's order: (micro-batches, level).
ORDER = [(m, level) for m in (1, 2) for level in (None, *OptimizerLevel)]


def _combinations(monkeypatch: pytest.MonkeyPatch, fail: int | None = None) -> list[int]:
    """The memory dimensions' combinations this rank plans, numbered in :data:`ORDER` by what
    each request is (its micro-batches and optimizer level); the one numbered ``fail``
    raises."""
    planned: list[int] = []
    real = dimensions._recompute_options

    def counted(request: Any, *args: Any) -> Any:
        planned.append(ORDER.index((request.micro_batches, request.optimizer.level)))
        if planned[-1] == fail:
            raise ZeroDivisionError(f"a bug in combination {fail}")
        return real(request, *args)

    monkeypatch.setattr(dimensions, "_recompute_options", counted)
    return planned


def test_the_ranks_share_the_combinations_and_every_rank_gets_the_plan_it_would_find(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two micro-batch counts x four optimizer levels: rank r plans combinations r, r +
    size, ..., and no rank calls the search of the whole request by itself."""
    rank, size = comm.get_rank(), comm.get_group_size()
    with abort_job_on_error("plan_once"):
        set_cost_model_context(device_memory_capacity=1e9)
        request = _request()
        calls, planned = _calls(monkeypatch), _combinations(monkeypatch)
        shared = plan_once(request)
        monkeypatch.undo()
        alone = plan_request(request)   # what this rank finds by itself
    assert len(calls) == 1 and planned == list(range(rank, 8, size))
    assert shared == alone and shared.to_dict() == alone.to_dict()
    assert shared.dimensions == alone.dimensions   # every alternative, as planned
    assert shared.dimensions.chosen in shared.dimensions.alternatives
    assert _same_on_every_rank(json.dumps(shared.to_dict(), sort_keys=True))


def test_rank_0_plans_a_request_without_the_memory_dimensions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with abort_job_on_error("plan_once fixed"):
        request = _request(dimensions="fixed")
        calls = _calls(monkeypatch)
        shared = plan_once(request)
        monkeypatch.undo()
        alone = plan_request(request)
    assert len(calls) == (1 if comm.get_rank() == 0 else 0)
    assert shared == alone and shared.dimensions is None


def test_no_combination_fitting_is_one_error_on_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with abort_job_on_error("plan_once error"):
        set_cost_model_context(device_memory_capacity=1.0)
        request = _request()
        with pytest.raises(NoAvailableCost, match="no combination of the memory dimensions "
                                                  "fits the capacity of 1 bytes") as caught:
            plan_once(request)
    err = caught.value
    assert err.memory is not None and err.search.least_memory.memory == err.memory
    assert len(err.search.alternatives) == 16   # 8 combinations, its Cell recomputed or not
    assert _same_on_every_rank(f"{err} {err.memory} {err.search.table()}")


def test_a_bug_in_one_rank_s_combination_is_raised_on_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last rank's first combination raises: that rank raises it as it was, every other
    rank names it, and no rank waits for the plans the others would have sent."""
    size = comm.get_group_size()
    with abort_job_on_error("plan_once bug in a combination"):
        request = _request()
        _combinations(monkeypatch, fail=size - 1)
        want = ZeroDivisionError if comm.get_rank() == size - 1 else RuntimeError
        with pytest.raises(want, match=f"a bug in combination {size - 1}"):
            plan_once(request)


def test_an_unexpected_error_on_rank_0_ends_no_rank_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(request: Any) -> Any:
        raise ZeroDivisionError("a bug in a search")

    with abort_job_on_error("plan_once bug"):
        request = _request(dimensions="fixed")
        monkeypatch.setattr(planner, "plan_request", broken)
        want = ZeroDivisionError if comm.get_rank() == 0 else RuntimeError
        with pytest.raises(want, match="a bug in a search"):
            plan_once(request)


@pytest.mark.parametrize("memory_dimensions", ["fixed", "search"])
def test_the_planning_s_warnings_are_given_on_every_rank(memory_dimensions: str) -> None:
    """A weight of 3 rows that optimizer parallel cannot slice on any world of 2, 4 or 8:
    rank 0's warning, or (the dimensions searched, the level left to the search) the
    warnings of the combinations of levels 1, 2 and 3, planned by ranks 1, 2, 3 (on 2 ranks:
    1, 0, 1)."""
    with abort_job_on_error("plan_once warnings"):
        simpar.set_auto_parallel_context(parallel_optimizer_config={
            "parallel_optimizer_threshold": 0})
        if memory_dimensions == "fixed":
            simpar.set_auto_parallel_context(enable_parallel_optimizer=True)
        simpar.set_algo_parameters(memory_dimensions=memory_dimensions)
        net = nn.WithLossCell(nn.Dense(16, 3, dtype=np.float64), nn.MSELoss())
        g = graph.trace(net, [((8, 16), np.float64), ((8, 3), np.float64)], ["x", "y"])
        request = request_from_context(g, device_num=comm.get_group_size(),
                                       mode="auto_parallel", search_mode="dynamic_programming")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan_once(request)
    whole = [str(w.message) for w in caught if issubclass(w.category, OptimizerShardWarning)]
    levels = ["level1"] if memory_dimensions == "fixed" else ["level1", "level2", "level3"]
    assert [text.split("(")[1].split(")")[0] for text in whole] == levels
    assert all("_backbone.weight: dimension 0 of its block has 3 rows" in t for t in whole)
    assert _same_on_every_rank("\n".join(whole))


def test_allgather_text_gives_every_rank_s_text_and_refuses_a_non_str_on_every_rank(
) -> None:
    rank, size = comm.get_rank(), comm.get_group_size()
    with abort_job_on_error("allgather_text"):
        assert comm.allgather_text("é" * rank) == ["é" * r for r in range(size)]
        with pytest.raises(TypeError, match=r"allgather_text: text must be a str on every "
                                            r"rank; ranks \[1\] gave another type"):
            comm.allgather_text(None if rank == 1 else "ok")  # type: ignore[arg-type]


def test_broadcast_text_refuses_a_non_str_on_every_rank() -> None:
    with abort_job_on_error("broadcast_text"):
        with pytest.raises(TypeError, match="broadcast_text: text must be a str on rank 0"):
            comm.broadcast_text(b"bytes" if comm.get_rank() == 0 else None)  # type: ignore
        assert comm.broadcast_text("ok" if comm.get_rank() == 0 else None) == "ok"


def test_rank_0_searches_every_pipeline_stage_and_every_rank_gets_each_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stages of a two-block GPT, each searched for half the world: rank 0 searches
    both, every rank lowers the plans it receives, and they are what it finds alone."""
    world = comm.get_group_size()
    with abort_job_on_error("plan_once pipeline"):
        simpar.set_auto_parallel_context(dataset_strategy="data_parallel", search_mode=
                                         "dynamic_programming")
        net = nn.GPT(vocab_size=32, seq_length=8, d_model=16, n_layers=2, n_heads=2,
                     dtype=np.float64)
        net.embedding.pipeline_stage = net.blocks[0].pipeline_stage = 0
        for part in (net.blocks[1], net.ln_f, net.head):
            part.pipeline_stage = 1
        cell = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits())
        specs = [((8, 8), np.dtype(np.int32))] * 2

        def stages(plan: Any) -> list[str]:
            _, programs = plan_pipeline(cell, specs, 2, world, "auto_parallel",
                                        "data_parallel", 2, plan=plan)
            return [json.dumps(p.strategy_map.to_dict(), sort_keys=True) for p in programs]

        calls = _calls(monkeypatch)
        shared = stages(functools.partial(plan_once, together=True))
        monkeypatch.undo()
        alone = stages(plan_request)
    assert len(calls) == (2 if comm.get_rank() == 0 else 0)
    assert shared == alone
    assert _same_on_every_rank("".join(shared))
