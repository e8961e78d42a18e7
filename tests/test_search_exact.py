"""search_mode "exact": its time limit (the algo parameter ``exact_time_limit``, simpar's own,
and ``python -m simpar.plan --time-limit``), the optimality gap it reports when the limit runs
out, and the reductions of its ILP, which must keep the optimum (one process, no MPI).

    python -m pytest tests/test_search_exact.py -q
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.optimize

from simpar import context, graph, nn, ops, plan
from simpar.cost import SimparCostModel
from simpar.graph import Node
from simpar.search import StrategyMap, plan_strategies
from simpar.search.cost_graph import CostEdge, CostGraph, CostNode, brute_force, build_cost_graph
from simpar.search.exact import TimeLimitWarning, describe_gap, solve_exact
from simpar.search.pricing import NoAvailableCost

SMALL_GPT = ["--model", "gpt", "--layers", "1", "--hidden", "32", "--heads", "4", "--seq", "8",
             "--vocab", "64", "--batch", "8", "--device-num", "2", "--search-mode", "exact",
             "--quiet"]


@pytest.fixture(autouse=True)
def _fresh_algo_parameters() -> Iterator[None]:
    context.reset_algo_parameters()
    yield
    context.reset_algo_parameters()


def _node(k: int, costs: tuple[float, ...], memories: tuple[float, ...] | None = None
          ) -> CostNode:
    return CostNode(Node(k, ops.Identity(), ()), tuple(range(len(costs))),  # type: ignore
                    costs, False, memories or (1.0,) * len(costs))


def _frustrated_triangle() -> CostGraph:
    """Three nodes of two candidates; each edge costs 1 when both ends pick the same index.
    The LP relaxation halves every choice at cost 0; any whole choice costs at least 1 (an odd
    cycle cannot alternate), so the search must branch."""
    same = ((1.0, 0.0), (0.0, 1.0))
    return CostGraph(tuple(_node(k, (0.0, 0.0)) for k in range(3)),
                     tuple(CostEdge(p, 0, c, 0, same) for p, c in ((0, 1), (1, 2), (0, 2))))


def _medium_graph() -> tuple[graph.Graph, CostGraph]:
    net = nn.GPT(vocab_size=64, seq_length=16, d_model=32, n_heads=4, n_layers=2,
                 dtype=np.float32)
    g = graph.trace(net, [((16, 16), np.int32)], ["ids"])
    return g, build_cost_graph(g, 16, SimparCostModel("cpu-local"), "data_parallel")


@pytest.fixture
def stopped_highs(monkeypatch: pytest.MonkeyPatch) -> None:
    """HiGHS as if its time limit ran out in branch and bound with a plan 25% from proven:
    the LP relaxation comes back fractional, branch and bound with status 1 and gap 0.25."""
    real = scipy.optimize.milp

    def milp(c: Any, **kwargs: Any) -> Any:
        result = real(c, **kwargs)
        if not np.any(kwargs["integrality"]):
            result.x = result.x.copy()
            result.x[0] = 0.5
        else:
            result.status, result.message, result.mip_gap = 1, "Time limit reached", 0.25
        return result

    monkeypatch.setattr(scipy.optimize, "milp", milp)


# ------------------------------------------------------------------ the parameter
@pytest.mark.parametrize("value", [0, 0.0, -1, -0.5, math.nan, math.inf])
def test_an_exact_time_limit_that_is_not_a_positive_number_of_seconds_is_refused(
        value: float) -> None:
    with pytest.raises(ValueError, match=r"set_algo_parameters: exact_time_limit must be None "
                       r"\(no limit\) or a finite number of seconds > 0, but got "
                       f"{re.escape(repr(value))}"):
        context.set_algo_parameters(exact_time_limit=value)
    assert context.get_algo_parameters("exact_time_limit") is None


@pytest.mark.parametrize("value", ["60", True, [60]])
def test_an_exact_time_limit_of_the_wrong_type_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=f"exact_time_limit must be None .* but got "
                       f"{re.escape(repr(value))} of type {type(value).__name__}"):
        context.set_algo_parameters(exact_time_limit=value)


def test_the_exact_time_limit_is_seconds_or_none_and_resets_to_none() -> None:
    assert context.algo_parameters().exact_time_limit is None
    context.set_algo_parameters(exact_time_limit=np.int64(60))
    assert context.get_algo_parameters("exact_time_limit") == 60.0
    assert type(context.get_algo_parameters("exact_time_limit")) is float
    context.set_algo_parameters(exact_time_limit=None)
    assert context.get_algo_parameters("exact_time_limit") is None


def test_the_context_limit_reaches_the_exact_search() -> None:
    """A limit too short for anything stops the planner with TimeoutError naming the limit;
    without it the same request plans."""
    g, _ = _medium_graph()
    context.set_algo_parameters(exact_time_limit=1e-9)
    with pytest.raises(TimeoutError, match=r"time limit of 1e-09 s ran out before HiGHS found "
                       r"any strategy .*exact_time_limit"):
        plan_strategies(g, 16, "auto_parallel", "data_parallel", search_mode="exact")
    context.set_algo_parameters(exact_time_limit=None)
    smap = plan_strategies(g, 16, "auto_parallel", "data_parallel", search_mode="exact")
    assert smap.optimality_gap == 0.0


# ------------------------------------------------------------------ the gap
def test_branch_and_bound_proves_what_the_relaxation_cannot() -> None:
    cg = _frustrated_triangle()
    found = solve_exact(cg)
    assert found.cost == 1.0 == brute_force(cg)[1]
    assert found.proven and found.status == "optimal"


@pytest.mark.parametrize("limit", [1e-9, 1e-3, 0.02, 0.2])
def test_a_short_limit_gives_a_bounded_plan_or_a_timeout_never_a_false_proof(
        limit: float) -> None:
    """Whatever HiGHS managed in the time: no plan (TimeoutError), a plan with its gap that
    bounds how far it is from the optimum, or the proven optimum."""
    _, cg = _medium_graph()
    optimum = solve_exact(cg).cost
    try:
        found = solve_exact(cg, time_limit=limit)
    except TimeoutError as e:
        assert f"time limit of {limit} s ran out" in str(e)
        return
    assert found.cost >= optimum * (1 - 1e-9)
    if found.proven:
        assert found.cost == pytest.approx(optimum, rel=1e-9)
    else:
        assert found.status == "time limit" and 0 < found.gap <= 1
        assert found.cost * (1 - found.gap) <= optimum * (1 + 1e-9)


def test_a_plan_stopped_by_the_limit_reports_its_gap(stopped_highs: None) -> None:
    found = solve_exact(_frustrated_triangle(), time_limit=5.0)
    assert (found.status, found.gap, found.proven) == ("time limit", 0.25, False)
    assert describe_gap(found.gap) == ("optimality gap 25.00%: its objective is at most 1.333 "
                                       "x the optimum")


def test_the_planner_warns_and_its_map_carries_the_gap(stopped_highs: None) -> None:
    g, _ = _medium_graph()
    context.set_algo_parameters(exact_time_limit=30)
    with pytest.warns(TimeLimitWarning, match=r"the time limit of 30 s \(exact_time_limit\) ran "
                      r"out; the plan is the best found, not proven optimal \(optimality gap "
                      r"25.00%: its objective is at most 1.333 x the optimum\)"):
        smap = plan_strategies(g, 16, "auto_parallel", "data_parallel", search_mode="exact")
    assert smap.optimality_gap == 0.25
    assert "optimality gap 25.00%" in str(smap).splitlines()[0]
    again = StrategyMap.from_dict(json.loads(json.dumps(smap.to_dict())))
    assert again == smap and again.optimality_gap == 0.25


@pytest.mark.parametrize("gap", [-0.1, 1.5, math.nan, True, "0.1"])
def test_a_strategy_map_refuses_a_gap_outside_0_to_1(gap: object) -> None:
    with pytest.raises(ValueError, match=r"optimality_gap must be None or a float in \[0, 1\]"):
        StrategyMap(8, "auto_parallel", optimality_gap=gap)  # type: ignore[arg-type]


# ------------------------------------------------------------------ python -m simpar.plan
def test_plan_prints_and_saves_the_gap_of_a_stopped_search(
        stopped_highs: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error", TimeLimitWarning)  # the summary says it instead
        code = plan.main([*SMALL_GPT, "--time-limit", "30", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "search exact within 30 s" in printed.splitlines()[0]
    assert ("NOT PROVEN OPTIMAL: search_mode exact stopped at its time limit of 30 s with "
            "its best plan (optimality gap 25.00%: its objective is at most 1.333 x the "
            "optimum)") in printed
    d = json.loads(out.read_text())
    assert d["time_limit"] == 30.0 and d["optimality_gap"] == 0.25
    assert d["strategy_map"]["optimality_gap"] == 0.25
    assert context.get_algo_parameters("exact_time_limit") is None  # restored


def test_plan_says_when_the_exact_plan_is_proven(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert plan.main([*SMALL_GPT, "--time-limit", "600", "--out", str(out)]) == 0
    assert "proven optimum (optimality gap 0)" in capsys.readouterr().out
    assert json.loads(out.read_text())["optimality_gap"] == 0.0


def test_plan_exits_1_when_the_limit_leaves_no_plan(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    assert plan.main([*SMALL_GPT, "--time-limit", "1e-9"]) == 1
    assert "no plan: search_mode 'exact': the time limit of 1e-09 s ran out" in (
        capsys.readouterr().err)


@pytest.mark.parametrize(("argv", "message"), [
    (["--time-limit", "0"], "argument --time-limit: must be a finite number of seconds > 0, "
                            "got 0"),
    (["--time-limit", "soon"], "argument --time-limit: must be a number of seconds > 0, got "
                               "'soon'"),
    (["--time-limit", "inf"], "argument --time-limit: must be a finite number of seconds"),
    (["--search-mode", "dynamic_programming", "--time-limit", "5"],
     "argument --time-limit: only --search-mode exact has a time limit, not "
     "'dynamic_programming'"),
])
def test_plan_refuses_a_bad_time_limit(argv: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        plan.main([*SMALL_GPT, *argv])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ the reductions
def test_reductions_keep_the_optimum_and_shrink_the_model() -> None:
    """A constant edge (folded into its nodes), a second edge between the same two nodes
    (summed), equal rows (one class), a forbidden pair and a candidate whose every pair is
    forbidden (no variable; the candidate is fixed at 0): the brute-force optimum, with fewer
    variables than one per candidate and per pair."""
    inf = math.inf
    nodes = (_node(0, (1.0, 2.0, 3.0)), _node(1, (0.5, 0.0, 4.0)), _node(2, (0.0, 0.1)))
    edges = (CostEdge(0, 0, 1, 0, ((1.0, 2.0, 0.0), (1.0, 2.0, 0.0), (inf, inf, inf))),
             CostEdge(0, 1, 1, 1, ((0.0, inf, 0.5), (0.0, inf, 0.5), (0.0, 0.0, 0.0))),
             CostEdge(1, 0, 2, 0, ((3.0, 3.0), (3.0, 3.0), (3.0, 3.0))),
             CostEdge(0, 0, 2, 1, ((0.0, 1.0), (1.0, 0.0), (2.0, 0.0))))
    cg = CostGraph(nodes, edges)
    choice, best = brute_force(cg)
    found = solve_exact(cg)
    assert found.cost == best and found.choice == choice and found.proven
    assert found.product_variables == 8 + 9 + 9 + 6 + 6
    assert found.variables < found.product_variables - 15


def test_a_memory_cap_that_binds_nothing_is_left_out_and_one_that_binds_is_kept() -> None:
    nodes = (_node(0, (1.0, 2.0), (10.0, 1.0)), _node(1, (1.0, 2.0), (10.0, 1.0)))
    cg = CostGraph(nodes, (CostEdge(0, 0, 1, 0, ((0.0, 5.0), (5.0, 0.0))),),
                   memory_capacity=100.0)
    loose = solve_exact(cg)
    assert loose.choice == (0, 0)
    tight = solve_exact(dataclasses.replace(cg, memory_capacity=15.0))
    assert tight.constraints == loose.constraints + 1
    assert tight.choice == (1, 1) == brute_force(
        dataclasses.replace(cg, memory_capacity=15.0))[0]


def test_the_largest_transient_fits_with_the_plan_in_the_ilp() -> None:
    """Transients count as their largest: a node's chosen candidate's and an edge's chosen
    pair's move's, beside the sum. Under a cap the plain optimum (0, 0) only fits without its
    transient: the ILP picks what brute force picks, the cheapest plan that fits with it."""
    nodes = (dataclasses.replace(_node(0, (1.0, 2.0, 3.0), (10.0, 10.0, 10.0)),
                                 transients=(30.0, 5.0, 0.0)),
             dataclasses.replace(_node(1, (1.0, 2.0), (10.0, 10.0)), transients=(0.0, 0.0)))
    move = np.array([[0.0, 0.0], [25.0, 0.0], [0.0, 0.0]])
    edges = (CostEdge(0, 0, 1, 0, ((0.0, 1.0), (0.0, 1.0), (0.0, 1.0)), None, move),)
    cg = CostGraph(nodes, edges, memory_capacity=40.0)
    assert cg.memory((0, 0)) == 20.0 and cg.transient((0, 0)) == 30.0 and not cg.fits((0, 0))
    assert cg.transient((1, 0)) == 25.0 and not cg.fits((1, 0)) and cg.fits((1, 1))
    choice, best = brute_force(cg)
    found = solve_exact(cg)
    assert found.choice == choice == (2, 0) and found.cost == best == 4.0 and found.proven
    # without the transients the plain optimum comes back; with room for them, too
    plain = CostGraph(tuple(dataclasses.replace(n, transients=()) for n in nodes),
                      (dataclasses.replace(edges[0], transients=None),), memory_capacity=40.0)
    assert solve_exact(plain).choice == (0, 0)
    assert solve_exact(dataclasses.replace(cg, memory_capacity=50.0)).choice == (0, 0)
    with pytest.raises(NoAvailableCost):
        solve_exact(dataclasses.replace(cg, memory_capacity=19.0))


def _recomputed_cells(capacity: float) -> CostGraph:
    """Three recomputed Cells in a chain, candidate 0 of each op cheap and making much again
    in the backward, candidate 1 dearer and making little: Cell A (ops 0, 1) is charged (its
    ops' memories count what they make again), B (ops 2, 3) and C (op 4) add what they make
    beyond A's, one Cell at a time."""
    again = ((4.0, 1.0), (4.0, 1.0), (10.0, 1.0), (10.0, 1.0), (15.0, 0.0))
    costs = ((1.0, 2.0), (1.0, 2.0), (1.0, 2.5), (1.0, 2.0), (1.0, 1.5))
    nodes = tuple(dataclasses.replace(
        _node(k, c, tuple(10.0 + (r if k < 2 else 0.0) for r in again[k])), reruns=again[k])
        for k, c in enumerate(costs))
    free = ((0.0, 0.0), (0.0, 0.0))
    return CostGraph(nodes, tuple(CostEdge(k, 0, k + 1, 0, free) for k in range(4)),
                     memory_capacity=capacity, cells=((0, 1), (2, 3), (4,)), charged=(0, 1))


def test_the_tapes_a_recomputed_cell_makes_again_fit_with_the_plan_in_the_ilp() -> None:
    """What the Cell that makes most again holds beyond the charged Cell's adds to a plan's
    memory, as the pricer counts it: the cheapest plan holds 58 bytes of arrays, and B makes
    20 again where A makes 8, 12 more. Under a cap of 66, C's dear candidate does not help
    (B still makes 20); B's dear op 3 does, and then C, making 15, is the Cell that makes
    most: 58 + 7 fits. The ILP picks what brute force picks; without the Cells, the plain
    optimum comes back."""
    cg = _recomputed_cells(66.0)
    cheapest = (0, 0, 0, 0, 0)
    assert cg.memory(cheapest) == 58.0 and cg.rerun(cheapest) == 20.0 - 8.0
    assert not cg.fits(cheapest) and not cg.fits((0, 0, 0, 0, 1))
    assert cg.rerun((0, 0, 0, 1, 0)) == 15.0 - 8.0
    choice, best = brute_force(cg)
    found = solve_exact(cg)
    assert found.choice == choice == (0, 0, 0, 1, 0) and found.cost == best and found.proven
    assert cg.memory(found.choice) + cg.transient(found.choice) == 65.0
    assert solve_exact(dataclasses.replace(cg, cells=(), charged=())).choice == cheapest
    # a cap the cheapest plan meets with its Cells binds nothing: the same plan
    assert solve_exact(dataclasses.replace(cg, memory_capacity=70.0)).choice == cheapest
    # with the ops' own transients too (T and R in one row): brute force's choice under
    # every cap from the least that fits to one that binds nothing
    held = ((0.0, 6.0), (2.0, 0.0), (0.0, 0.0), (5.0, 1.0), (9.0, 0.0))
    both = dataclasses.replace(cg, nodes=tuple(
        dataclasses.replace(n, transients=t) for n, t in zip(cg.nodes, held)))
    for cap in (60.0, 63.0, 66.0, 69.0, 72.0, 75.0, 80.0):
        capped = dataclasses.replace(both, memory_capacity=cap)
        choice, best = brute_force(capped)
        found = solve_exact(capped)
        assert found.choice == choice and found.cost == best, cap
    with pytest.raises(NoAvailableCost):
        solve_exact(dataclasses.replace(cg, memory_capacity=50.0))
