"""``search_mode="exact"``: the proven optimum of the cost graph, by integer linear programming.

Variables: a 0/1 ``x[n, i]`` = 1 when node ``n`` takes candidate ``i`` (one per node). An edge
costs ``M[i, j]`` when its producer takes ``i`` and its consumer ``j``; producer candidates
whose rows of ``M`` are equal form one class (they give one output layout), and so do consumer
candidates whose columns are equal. Each allowed pair of classes ``(a, b)`` has a continuous
``z[e, a, b] >= 0``, linked to ``x`` by ``sum_b z[e, a, b] = sum_{i in a} x[p, i]`` and
``sum_a z[e, a, b] = sum_{j in b} x[c, j]``: once ``x`` is 0/1 these leave ``z`` exactly one
value (1 on the chosen pair), so the model is the plain product formulation (a 0/1 per
candidate and per pair) with fewer variables, and fewer of them integral. Three more
reductions are exact too: edges between the same two nodes are summed into one; an edge whose
matrix is ``u[i] + v[j]`` (a constant one, or one of a single class) is added to its nodes'
costs and needs no ``z``; and infinite entries (forbidden pairs) get no ``z``, a candidate
whose every pair is forbidden being fixed at 0. A parameter read by several ops holds one
layout: for each class of layouts that give every rank the same block, the readers' ``x`` in
that class sum equally. The nodes' memories, and the edges' (a pair's bytes on its ``z``; such
an edge's classes are of equal costs and memories, and it is not folded), sum to at most the
graph's memory capacity (the row is left out when even the hungriest choice fits). Where the
graph counts transients (:attr:`CostNode.transients`, :attr:`CostEdge.transients`: what an
op's backward or collective, or a move, holds for a while), a continuous ``T`` joins that
row, with a row per node ``T >= sum_i t[n, i] x[n, i]`` and per edge ``T >= sum t[e, a, b]
z[e, a, b]``: ``T`` is at least the plan's largest transient, so the plan fits with it.
Where it counts recomputed Cells' tapes made again (:attr:`CostGraph.cells`: each Cell's
are held while the backward reruns it, and the nodes' memories count the charged Cell's), a
continuous ``R`` joins the row too, with a row per other Cell ``R >= sum_{n in Cell, i}
r[n, i] x[n, i] - sum_{n in charged, i} r[n, i] x[n, i]``: ``R`` is at least what the Cell
that makes most again holds beyond the charged one. The optimum is proven over the plans
that fit with both. The objective is the cost graph's: node costs
plus edge costs.

HiGHS solves it through ``scipy.optimize.milp`` (the optional ``exact`` extra): the LP
relaxation first, which on transformer graphs already picks one whole candidate per node and
so proves the optimum, then branch and bound where it does not. With a time limit it returns
its best solution and the optimality gap (``ExactSolution.gap``, relative: the objective is at
most ``1 / (1 - gap)`` times the optimum), or raises ``TimeoutError`` when the limit ran out
before any solution. It is the optimality reference of the tests and a mode for small and
medium graphs.

>>> sol = solve_exact(cg, time_limit=60.0)                    # doctest: +SKIP
>>> str(sol)                                                  # doctest: +SKIP
'exact: optimal, objective 0.0279472, gap 0 (109410 -> 102463 variables, 13311 constraints)'
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from simpar.layout import TensorLayout
from simpar.search.cost_graph import CostEdge, CostGraph
from simpar.search.pricing import NoAvailableCost

__all__ = ["ExactSolution", "TimeLimitWarning", "describe_gap", "product_variables",
           "solve_exact"]

# Memory in units of the cap. The row's bound is first the cap itself (a plan that fills it
# exactly fits, as CostGraph.fits says); if HiGHS's feasibility tolerance lets a plan over the
# cap by a hair through, the ILP is solved again with the bound lowered by this much.
_MEMORY_SLACK = 1e-6


class _OverCap(Exception):
    """The solver's plan exceeds the memory cap within HiGHS's tolerance."""


class TimeLimitWarning(UserWarning):
    """The exact search's time limit ran out: its plan is the best found, not proven optimal."""


@dataclass(frozen=True, slots=True)
class ExactSolution:
    """A choice of candidate per node, its objective, and how sure: ``gap`` 0 is proven
    (status ``"optimal"``); status ``"time limit"`` is the best found in time, whose
    objective exceeds the optimum by at most ``gap`` of itself. ``variables`` and
    ``constraints`` are the model's size, and ``product_variables`` the size the plain
    product formulation (a 0/1 per candidate and per edge pair) would have."""

    choice: tuple[int, ...]
    cost: float
    gap: float
    status: str
    variables: int = 0
    constraints: int = 0
    product_variables: int = 0

    @property
    def proven(self) -> bool:
        """Whether ``cost`` is the proven optimum."""
        return self.gap == 0.0

    def __str__(self) -> str:
        return (f"exact: {self.status}, objective {self.cost:.6g}, gap {self.gap:.3g} "
                f"({self.product_variables} -> {self.variables} variables, "
                f"{self.constraints} constraints)")


def describe_gap(gap: float) -> str:
    """What an optimality gap means for a plan, in words (for warnings and printed plans).

    >>> describe_gap(0.25)
    'optimality gap 25.00%: its objective is at most 1.333 x the optimum'
    """
    if gap == 0.0:
        return "optimality gap 0: the proven optimum"
    if gap >= 1.0:
        return "optimality gap 100%: no bound on how far it is from the optimum"
    return f"optimality gap {gap:.2%}: its objective is at most {1 / (1 - gap):.4g} x the optimum"


def solve_exact(cg: CostGraph, time_limit: float | None = None) -> ExactSolution:
    """The optimum of ``cg`` (or, with ``time_limit`` seconds for building the ILP and
    solving it, the best found and its gap).

    The LP relaxation is solved first: when its optimum picks one whole candidate per node,
    that choice is the proven optimum (no choice costs less than the relaxation), which is
    the common case on transformer graphs and several times faster than branch and bound.
    Otherwise HiGHS branches, within what is left of the limit. Raises ``TimeoutError`` when
    the limit runs out before any strategy is found, and ``ValueError`` when no choice
    satisfies every constraint.
    """
    started = time.perf_counter()
    try:
        return _solve(cg, _Model(cg, 0.0), time_limit, started)
    except _OverCap:
        pass
    try:   # the cap tightened by the solver's tolerance
        return _solve(cg, _Model(cg, _MEMORY_SLACK), time_limit, started)
    except _OverCap:
        raise NoAvailableCost(
            f"search_mode 'exact': no plan fits the memory capacity of "
            f"{cg.memory_capacity:.0f} bytes per rank by more than the solver's tolerance "
            f"({_MEMORY_SLACK:g} of it)") from None


def _solve(cg: CostGraph, ilp: _Model, time_limit: float | None, started: float
           ) -> ExactSolution:
    """:func:`solve_exact` on one model of ``cg``; ``_OverCap`` when its plan is over the cap."""
    n_var = len(ilp.cost)

    def solution(choice: tuple[int, ...], gap: float, status: str) -> ExactSolution:
        return ExactSolution(choice, cg.total(choice), gap, status, n_var, ilp.rows.count,
                             ilp.product_variables)

    relaxed = _highs(ilp, integer=False, time_limit=_left(time_limit, started))
    if relaxed.x is None:
        _refuse(relaxed, time_limit, "in the LP relaxation")
    bound = float(relaxed.fun) * ilp.scale()
    rounded = ilp.choice(relaxed.x)
    best: ExactSolution | None = None
    if rounded is not None and cg.fits(rounded) and math.isfinite(cg.total(rounded)):
        total = cg.total(rounded)
        if total - bound <= _ABS_GAP * ilp.scale():  # the relaxation's optimum is whole
            return solution(rounded, 0.0, "optimal")
        best = solution(rounded, _gap(total, bound), "time limit")
    left = _left(time_limit, started)
    if left is not None and left <= 0:
        if best is None:
            raise _timeout(time_limit, "the LP relaxation took it all", str(relaxed.message))
        return best
    result = _highs(ilp, integer=True, time_limit=left)
    if result.x is None:
        if best is not None and result.status == 1:
            return best
        _refuse(result, time_limit, "in branch and bound")
    choice = ilp.choice(result.x)
    assert choice is not None, "HiGHS returned a choice that is not one candidate per node"
    assert not math.isinf(cg.total(choice)), "the solver broke a shared-parameter constraint"
    if not cg.fits(choice):
        raise _OverCap
    if result.status == 0:  # optimal within HiGHS's gaps: 1e-6 of the scale, so proven
        found = solution(choice, 0.0, "optimal")
    else:
        found = solution(choice, min(1.0, float(getattr(result, "mip_gap", 0.0) or 1.0)),
                         "time limit" if result.status == 1 else str(result.message))
    if best is None or found.cost <= best.cost:
        return found
    dual = getattr(result, "mip_dual_bound", None)  # the branching's bound, if any is better
    if dual is not None and math.isfinite(dual):
        bound = max(bound, float(dual) * ilp.scale())
    return solution(best.choice, _gap(best.cost, bound), "time limit")


def _left(time_limit: float | None, started: float) -> float | None:
    """What is left of ``time_limit`` seconds since ``started`` (None: no limit)."""
    return None if time_limit is None else time_limit - (time.perf_counter() - started)


def product_variables(cg: CostGraph) -> int:
    """The plain product formulation's size: a 0/1 per candidate and per pair of every edge
    (the model :func:`solve_exact` builds has at most this many variables; HiGHS needs about
    1 KiB per variable)."""
    return (sum(len(n.candidates) for n in cg.nodes)
            + sum(len(e.costs) * len(e.costs[0]) for e in cg.edges if len(e.costs)))


# HiGHS's default absolute MIP gap, in the units of the scaled objective.
_ABS_GAP = 1e-6


def _gap(total: float, bound: float) -> float:
    """HiGHS's relative gap of an objective ``total`` above a lower ``bound`` (at most 1: no
    cost is negative, so 0 bounds every objective)."""
    return min(1.0, max(0.0, (total - bound) / total)) if total > 0 else 0.0


def _refuse(result: Any, time_limit: float | None, when: str) -> NoReturn:
    """Raise for a HiGHS ``result`` without a solution: a timeout or an infeasible model."""
    if result.status == 1:   # a time (or iteration) limit, no solution
        raise _timeout(time_limit, when, str(result.message))
    raise NoAvailableCost(f"search_mode 'exact': no strategy satisfies every constraint "
                          f"({result.message})")


def _timeout(time_limit: float | None, when: str, message: str) -> TimeoutError:
    return TimeoutError(f"search_mode 'exact': the time limit of {time_limit} s ran out before "
                        f"HiGHS found any strategy that satisfies every constraint ({when}); "
                        "raise it (the algo parameter exact_time_limit, or simpar.plan's "
                        "--time-limit), or use search_mode 'dynamic_programming' "
                        f"({message})")


def _highs(ilp: _Model, integer: bool, time_limit: float | None) -> Any:
    """HiGHS on the model (through ``scipy.optimize.milp``), its ``x`` integral or not."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp  # noqa: PLC0415
        from scipy.sparse import coo_array  # noqa: PLC0415
    except ImportError:  # an optional extra: say how to get it
        raise ImportError("search_mode 'exact' needs scipy (HiGHS): pip install 'simpar[exact]'"
                          ) from None
    n_var = len(ilp.cost)
    matrix = coo_array((ilp.rows.values(), (ilp.rows.row_index(), ilp.rows.col_index())),
                       shape=(ilp.rows.count, n_var)).tocsr()
    integrality = np.zeros(n_var)
    # Presolve removes next to nothing from this model and takes longer than the LP; the
    # branching keeps it, and HiGHS's first-solution heuristic (feasibility jump) only when
    # a time limit makes any solution worth having.
    options: dict[str, Any] = {"disp": False, "presolve": False}
    if integer:
        integrality[:ilp.n_x] = 1
        options.update(mip_rel_gap=0.0, presolve=True,
                       mip_heuristic_run_feasibility_jump=time_limit is not None)
    if time_limit is not None:
        options["time_limit"] = max(float(time_limit), 0.0)
    with warnings.catch_warnings():  # milp's note that it passes an option on verbatim
        warnings.filterwarnings("ignore", message="Unrecognized options")
        return milp(ilp.cost / ilp.scale(), integrality=integrality,
                    bounds=Bounds(np.zeros(n_var), ilp.upper),
                    constraints=LinearConstraint(matrix, ilp.rows.lower(), ilp.rows.upper()),
                    options=options)


@dataclass
class _Rows:
    """Constraint rows as COO blocks, appended a block at a time."""

    count: int = 0
    _rows: list[np.ndarray] = field(default_factory=list)
    _cols: list[np.ndarray] = field(default_factory=list)
    _vals: list[np.ndarray] = field(default_factory=list)
    _lo: list[np.ndarray] = field(default_factory=list)
    _hi: list[np.ndarray] = field(default_factory=list)

    def add(self, n_rows: int, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray | float,
            lo: float, hi: float) -> None:
        """``n_rows`` new rows; entry k of the block is ``vals[k]`` at (``rows[k]``,
        ``cols[k]``), ``rows`` counted from the block's first row."""
        self._rows.append(np.asarray(rows, dtype=np.int64) + self.count)
        self._cols.append(np.asarray(cols, dtype=np.int64))
        self._vals.append(np.broadcast_to(np.asarray(vals, dtype=float), len(self._cols[-1])))
        self._lo.append(np.full(n_rows, lo))
        self._hi.append(np.full(n_rows, hi))
        self.count += n_rows

    def row_index(self) -> np.ndarray:
        return _cat(self._rows, np.int64)

    def col_index(self) -> np.ndarray:
        return _cat(self._cols, np.int64)

    def values(self) -> np.ndarray:
        return _cat(self._vals, float)

    def lower(self) -> np.ndarray:
        return _cat(self._lo, float)

    def upper(self) -> np.ndarray:
        return _cat(self._hi, float)


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)


@dataclass(frozen=True)
class _Edge:
    """One edge's matrix reduced to classes: ``row_class[i]`` of each producer candidate,
    ``col_class[j]`` of each consumer candidate, the matrix of classes, and what it needs."""

    row_class: np.ndarray
    col_class: np.ndarray
    matrix: np.ndarray           # classes x classes; inf: forbidden
    # separable: M[i, j] = row_fold[a(i)] + col_fold[b(j)] wherever allowed (0 elsewhere)
    row_fold: np.ndarray | None
    col_fold: np.ndarray | None
    memory: np.ndarray | None = None   # classes x classes: bytes the pair adds
    transient: np.ndarray | None = None   # per edge, classes x classes: its move holds


class _Model:
    """The ILP of a cost graph: objective, upper bounds and rows; ``x`` first (node ``k``'s
    candidates at ``offset[k]:offset[k + 1]``), then the edges' ``z``."""

    def __init__(self, cg: CostGraph, slack: float) -> None:
        self.slack = slack
        counts = np.array([len(n.candidates) for n in cg.nodes], dtype=np.int64)
        self.offset = np.concatenate(([0], np.cumsum(counts)))
        self.n_x = int(self.offset[-1])
        node_cost = (np.concatenate([np.asarray(n.costs, dtype=float) for n in cg.nodes])
                     if cg.nodes else np.zeros(0))
        self.product_variables = product_variables(cg)
        upper = np.isfinite(node_cost).astype(float)
        node_cost = np.where(upper > 0, node_cost, 0.0)
        self.rows = _Rows()
        # one candidate per node
        self.rows.add(len(cg.nodes), np.repeat(np.arange(len(cg.nodes)), counts),
                      np.arange(self.n_x), 1.0, 1.0, 1.0)
        z_cost: list[np.ndarray] = []
        n_var = self.n_x
        reduced: dict[tuple[tuple[int, int, int], ...], _Edge] = {}
        self._z_memory: list[tuple[np.ndarray, np.ndarray]] = []   # (z, bytes) of pairs
        self._z_transient: list[tuple[np.ndarray, np.ndarray]] = []   # of each edge's pairs
        for (p, c), edges in _by_pair(cg.edges).items():
            # identical layers share their matrices
            key = tuple((id(e.costs), id(e.memories), id(e.transients)) for e in edges)
            if key not in reduced:
                mems = [np.asarray(e.memories, dtype=float) for e in edges
                        if e.memories is not None]
                held = [np.asarray(e.transients, dtype=float) for e in edges
                        if e.transients is not None]
                reduced[key] = _reduce(np.sum([np.asarray(e.costs, dtype=float)
                                               for e in edges], axis=0),
                                       np.sum(mems, axis=0) if mems else None,
                                       held if held else None)
            r = reduced[key]
            xp = self.offset[p] + np.arange(counts[p])
            xc = self.offset[c] + np.arange(counts[c])
            allowed = np.isfinite(r.matrix)
            upper[xp[~allowed.any(axis=1)[r.row_class]]] = 0.0  # every pair forbidden
            upper[xc[~allowed.any(axis=0)[r.col_class]]] = 0.0
            if r.row_fold is not None and r.col_fold is not None:
                node_cost[xp] += r.row_fold[r.row_class]
                node_cost[xc] += r.col_fold[r.col_class]
                continue
            a, b = np.nonzero(allowed)
            z = n_var + np.arange(len(a))
            n_var += len(a)
            z_cost.append(r.matrix[a, b])
            if r.memory is not None:
                self._z_memory.append((z, r.memory[a, b]))
            for held in r.transient if r.transient is not None else ():
                self._z_transient.append((z, held[a, b]))
            na, nb = r.matrix.shape
            # rows 0..na-1: the producer's classes; na..na+nb-1: the consumer's
            self.rows.add(na + nb, np.concatenate((a, na + b, r.row_class, na + r.col_class)),
                          np.concatenate((z, z, xp, xc)),
                          np.concatenate((np.ones(2 * len(a)), -np.ones(len(xp) + len(xc)))),
                          0.0, 0.0)
        self._shared(cg, upper)
        extra = self._memory(cg, n_var)   # T and R, where the graph counts them
        self.cost = np.concatenate([node_cost, *z_cost, np.zeros(extra)])
        self.upper = np.concatenate([upper, np.ones(n_var - self.n_x),
                                     np.full(extra, np.inf)])
        cheapest = [np.min(node_cost[lo:hi][upper[lo:hi] > 0], initial=np.inf)
                    for lo, hi in zip(self.offset[:-1], self.offset[1:])]
        cheapest += [np.min(z) for z in z_cost if len(z)]
        self._floor = float(sum(cheapest))

    def choice(self, x: np.ndarray) -> tuple[int, ...] | None:
        """The candidate per node that ``x`` picks, or None unless each node has one whole
        candidate (within HiGHS's integrality tolerance)."""
        picks = x[:self.n_x]
        if np.max(np.abs(picks - np.round(picks)), initial=0.0) > 1e-6:
            return None
        starts = self.offset[:-1]
        if not np.allclose(np.add.reduceat(np.round(picks), starts), 1.0):
            return None
        return tuple(int(np.argmax(picks[lo:hi])) for lo, hi in zip(starts, self.offset[1:]))

    def scale(self) -> float:
        """What the costs are divided by: a lower bound of the optimum (every node's and every
        edge's cheapest entry), so that HiGHS's absolute tolerances (1e-6) are at most a
        millionth of the optimum and cannot take a worse choice for a nearly equal one; the
        largest cost when that bound is 0."""
        if 0 < self._floor < math.inf:
            return float(self._floor)
        return float(np.max(np.abs(self.cost), initial=0.0)) or 1.0

    def _shared(self, cg: CostGraph, upper: np.ndarray) -> None:
        """One layout per parameter: readers' candidates in each class of layouts sum alike."""
        for uses in cg.shared.values():
            for (a, ka), (b, kb) in zip(uses, uses[1:]):
                if a == b:  # one op reads it twice: its candidates must agree with themselves
                    ca = _block_classes([c.in_layouts[ka] for c in cg.nodes[a].candidates] +
                                        [c.in_layouts[kb] for c in cg.nodes[a].candidates])
                    n = len(cg.nodes[a].candidates)
                    bad = np.nonzero(ca[:n] != ca[n:])[0]
                    upper[self.offset[a] + bad] = 0.0
                    continue
                n_a = len(cg.nodes[a].candidates)
                classes = _block_classes([c.in_layouts[ka] for c in cg.nodes[a].candidates] +
                                         [c.in_layouts[kb] for c in cg.nodes[b].candidates])
                cols = np.concatenate((self.offset[a] + np.arange(n_a),
                                       self.offset[b] + np.arange(len(classes) - n_a)))
                vals = np.where(np.arange(len(classes)) < n_a, 1.0, -1.0)
                self.rows.add(int(classes.max()) + 1, classes, cols, vals, 0.0, 0.0)

    def _memory(self, cg: CostGraph, t: int) -> int:
        """The memory row: the nodes' and pairs' bytes, plus ``T`` (variable ``t``), the
        largest transient the graph counts, at least each chosen candidate's and each chosen
        pair's move's (a row each), plus ``R`` (the next variable), what the recomputed Cells
        whose tapes made again hold most hold beyond the charged Cell's, at least each
        Cell's sum less the charged Cell's (a row each). Returns how many variables it adds
        (``T`` and ``R`` where the graph counts them)."""
        if not math.isfinite(cg.memory_capacity) or not cg.nodes:
            return 0
        cap = cg.memory_capacity
        mems = np.concatenate([np.asarray(n.memories, dtype=float) for n in cg.nodes])
        share = mems / cap
        held = self._per_candidate(cg, "transients") / cap
        again = self._per_candidate(cg, "reruns") / cap
        most = max([float(np.max(held, initial=0.0)),
                    *(float(np.max(h, initial=0.0)) / cap for _, h in self._z_transient)])
        cells = [self._candidates_of(nodes) for nodes in cg.cells]
        charged = self._candidates_of(cg.charged)
        rerun = max((float(np.maximum.reduceat(again[at], starts).sum())
                     for at, starts in cells if len(at)), default=0.0)
        hungriest = np.maximum.reduceat(share, self.offset[:-1]).sum() + sum(
            np.max(m, initial=0.0) for _, m in self._z_memory) / cap
        if hungriest + most + rerun <= 1.0 - self.slack:   # every choice fits: no row binds
            return 0
        used = np.nonzero(share)[0]
        cols = np.concatenate([used, *(z for z, _ in self._z_memory)])
        vals = np.concatenate([share[used], *(m / cap for _, m in self._z_memory)])
        extra = [v for v, on in ((t, most > 0), (t + (most > 0), rerun > 0)) if on]
        self.rows.add(1, np.zeros(len(cols) + len(extra)), np.append(cols, extra),
                      np.append(vals, np.ones(len(extra))), -np.inf, 1.0 - self.slack)
        if most > 0:
            # T >= sum_i held[n, i] x[n, i] for each node n with a transient (a row each) ...
            at = np.nonzero(held)[0]
            node_of = np.searchsorted(self.offset, at, side="right") - 1
            nodes, row = np.unique(node_of, return_inverse=True)
            self.rows.add(len(nodes), np.concatenate([row, np.arange(len(nodes))]),
                          np.concatenate([at, np.full(len(nodes), t)]),
                          np.concatenate([held[at], -np.ones(len(nodes))]), -np.inf, 0.0)
            # ... and sum_ab held[e, a, b] z[e, a, b] for each edge's moves
            for z, h in self._z_transient:
                live = np.nonzero(h)[0]
                if len(live):
                    self.rows.add(1, np.zeros(len(live) + 1, dtype=np.int64),
                                  np.append(z[live], t), np.append(h[live] / cap, -1.0),
                                  -np.inf, 0.0)
        if rerun > 0:
            # R >= sum over a Cell's candidates of again[n, i] x[n, i], less the charged
            # Cell's sum, for each Cell but the charged one (a row each)
            r = extra[-1]
            minus = charged[0][again[charged[0]] > 0]
            for at, _ in cells:
                if np.array_equal(at, charged[0]):
                    continue
                live = at[again[at] > 0]
                self.rows.add(1, np.zeros(len(live) + len(minus) + 1, dtype=np.int64),
                              np.concatenate([live, minus, [r]]),
                              np.concatenate([again[live], -again[minus], [-1.0]]),
                              -np.inf, 0.0)
        return len(extra)

    def _per_candidate(self, cg: CostGraph, what: str) -> np.ndarray:
        """The nodes' ``transients`` or ``reruns``, one entry per ``x`` (0 where a node has
        none)."""
        return np.concatenate([np.asarray(getattr(n, what), dtype=float) if getattr(n, what)
                               else np.zeros(len(n.candidates)) for n in cg.nodes])

    def _candidates_of(self, nodes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ``x`` of ``nodes``' candidates, and where each node's start among them."""
        if not nodes:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        counts = [int(self.offset[n + 1] - self.offset[n]) for n in nodes]
        at = np.concatenate([self.offset[n] + np.arange(k) for n, k in zip(nodes, counts)])
        return at.astype(np.int64), np.cumsum([0, *counts[:-1]]).astype(np.int64)


def _by_pair(edges: Sequence[CostEdge]) -> dict[tuple[int, int], list[CostEdge]]:
    """Edges grouped by (producer, consumer): several edges between two nodes cost their sum."""
    out: dict[tuple[int, int], list[CostEdge]] = {}
    for e in edges:
        out.setdefault((e.producer, e.consumer), []).append(e)
    return out


def _reduce(m: np.ndarray, mem: np.ndarray | None = None,
            held: Sequence[np.ndarray] | None = None) -> _Edge:
    """Classes of equal rows and of equal columns of ``m``, and whether it is separable;
    with memories ``mem`` or transients ``held`` (one matrix per edge; not all 0), classes
    of equal rows and columns of them all, and no folding (a pair's memory and transient
    need its ``z``)."""
    extra = [x for x in [mem] if x is not None and x.any()]
    moves = [x for x in held or () if x.any()]
    if extra or moves:
        rows, row_class = np.unique(np.stack([m, *extra, *moves], axis=-1), axis=0,
                                    return_inverse=True)
        cols, col_class = np.unique(rows, axis=1, return_inverse=True)
        return _Edge(row_class.ravel(), col_class.ravel(), cols[..., 0], None, None,
                     cols[..., 1] if extra else None,
                     np.moveaxis(cols[..., 1 + len(extra):], -1, 0) if moves else None)
    rows, row_class = np.unique(m, axis=0, return_inverse=True)
    cols, col_class = np.unique(rows, axis=1, return_inverse=True)
    row_class, col_class = row_class.ravel(), col_class.ravel()
    allowed = np.isfinite(cols)
    live_r, live_c = allowed.any(axis=1), allowed.any(axis=0)
    sub = cols[np.ix_(live_r, live_c)]
    fold: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
    if sub.size and np.isfinite(sub).all():
        if sub.shape[1] == 1:  # one class of consumer candidates: the producer pays it all
            u, v = sub[:, 0], np.zeros(1)
        else:
            u, v = sub[:, 0] - sub[0, 0], sub[0, :]
        if np.array_equal(u[:, None] + v[None, :], sub):  # exactly, not within rounding
            row_fold, col_fold = np.zeros(len(live_r)), np.zeros(len(live_c))
            row_fold[live_r], col_fold[live_c] = u, v
            fold = (row_fold, col_fold)
    return _Edge(row_class, col_class, cols, *fold)


def _block_classes(layouts: Sequence[TensorLayout]) -> np.ndarray:
    """A class per layout: equal for layouts that give every rank the same block."""
    seen: dict[TensorLayout, int] = {}
    by_blocks: dict[Hashable, int] = {}
    out = np.empty(len(layouts), dtype=np.int64)
    for k, lay in enumerate(layouts):
        if lay not in seen:
            blocks = (lay.device_num, tuple(lay.slice_of(r) for r in range(lay.device_num)))
            seen[lay] = by_blocks.setdefault(blocks, len(by_blocks))
        out[k] = seen[lay]
    return out
