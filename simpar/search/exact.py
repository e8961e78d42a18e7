"""``search_mode="exact"``: the proven optimum of the cost graph, by integer linear programming.

Variables: ``x[n, i]`` = 1 when node ``n`` takes candidate ``i`` (one per node), and for every
edge ``y[e, i, j]`` = 1 when its producer takes ``i`` and its consumer ``j`` (linked to ``x``
by ``sum_j y[e, i, j] = x[p, i]`` and ``sum_i y[e, i, j] = x[c, j]``, exact for 0/1 values).
A parameter read by several ops forbids pairs of candidates that lay it out differently
(``x[a, i] + x[b, j] <= 1``), an edge's infinite entries fix their ``y`` at 0, and the nodes'
memories sum to at most the graph's memory capacity. The objective is the cost graph's: node
costs plus edge costs.
HiGHS solves it through ``scipy.optimize.milp`` (the optional ``exact`` extra); on a time
limit it returns its best solution and the optimality gap, or raises ``TimeoutError`` when
the limit ran out before any solution.

It is the optimality reference of the tests and a mode for small and medium graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simpar.search.cost_graph import CostGraph, distinct_blocks

__all__ = ["ExactSolution", "solve_exact"]


@dataclass(frozen=True)
class ExactSolution:
    """A choice of candidate per node, its objective, and how sure: ``gap`` 0 is proven."""

    choice: tuple[int, ...]
    cost: float
    gap: float
    status: str


def solve_exact(cg: CostGraph, time_limit: float | None = None) -> ExactSolution:
    """The optimum of ``cg`` (or, with ``time_limit`` seconds, the best found and its gap)."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp  # noqa: PLC0415
        from scipy.sparse import lil_array  # noqa: PLC0415
    except ImportError:  # an optional extra: say how to get it
        raise ImportError("search_mode 'exact' needs scipy (HiGHS): pip install 'simpar[exact]'"
                          ) from None
    offset: list[int] = []
    cost: list[float] = []
    for node in cg.nodes:
        offset.append(len(cost))
        cost.extend(node.costs)
    edge_offset = []
    for e in cg.edges:
        edge_offset.append(len(cost))
        cost.extend(c for row in e.costs for c in row)
    n_var = len(cost)
    rows: list[tuple[dict[int, float], float, float]] = []
    for k, node in enumerate(cg.nodes):                        # one candidate per node
        rows.append(({offset[k] + i: 1.0 for i in range(len(node.candidates))}, 1.0, 1.0))
    for e, off in zip(cg.edges, edge_offset):                  # y links the two ends
        n_p, n_c = len(cg.nodes[e.producer].candidates), len(cg.nodes[e.consumer].candidates)
        for i in range(n_p):
            row = {off + i * n_c + j: 1.0 for j in range(n_c)}
            row[offset[e.producer] + i] = -1.0
            rows.append((row, 0.0, 0.0))
        for j in range(n_c):
            row = {off + i * n_c + j: 1.0 for i in range(n_p)}
            row[offset[e.consumer] + j] = -1.0
            rows.append((row, 0.0, 0.0))
    if math.isfinite(cg.memory_capacity):                      # memory per rank
        # in units of the cap, less HiGHS's feasibility tolerance: a plan over the cap by
        # a hair must not pass for one that fits
        rows.append(({offset[k] + i: m / cg.memory_capacity for k, node in enumerate(cg.nodes)
                      for i, m in enumerate(node.memories) if m}, -np.inf, 1.0 - 1e-6))
    for uses in cg.shared.values():                            # one layout per parameter
        for (a, ka), (b, kb) in zip(uses, uses[1:]):
            if a == b:  # one op reads it twice: its candidates must agree with themselves
                for i, ci in enumerate(cg.nodes[a].candidates):
                    if len(distinct_blocks({ci.in_layouts[ka], ci.in_layouts[kb]})) > 1:
                        rows.append(({offset[a] + i: 1.0}, -np.inf, 0.0))
                continue
            for i, ci in enumerate(cg.nodes[a].candidates):
                for j, cj in enumerate(cg.nodes[b].candidates):
                    if len(distinct_blocks({ci.in_layouts[ka], cj.in_layouts[kb]})) > 1:
                        rows.append(({offset[a] + i: 1.0, offset[b] + j: 1.0}, -np.inf, 1.0))
    matrix = lil_array((len(rows), n_var))
    lower, upper = np.empty(len(rows)), np.empty(len(rows))
    for r, (row, lo, hi) in enumerate(rows):
        for col, val in row.items():
            matrix[r, col] = val
        lower[r], upper[r] = lo, hi
    options: dict[str, object] = {"disp": False, "mip_rel_gap": 0.0}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    # Costs in seconds are ~1e-5: scaled to ~1, so that HiGHS's absolute tolerances cannot
    # take a worse choice for an equal one.
    c = np.asarray(cost, dtype=float)
    allowed = np.isfinite(c)                                   # inf: a forbidden pair
    c = np.where(allowed, c, 0.0)
    scale = float(np.max(np.abs(c))) or 1.0
    result = milp(c / scale, integrality=np.ones(n_var),
                  bounds=Bounds(np.zeros(n_var), allowed.astype(float)),
                  constraints=LinearConstraint(matrix.tocsr(), lower, upper), options=options)
    if result.x is None and result.status == 1:   # a time (or iteration) limit, no solution
        raise TimeoutError(f"search_mode 'exact': the time limit of {time_limit} s ran out "
                           "before HiGHS found any strategy that satisfies every constraint; "
                           "raise the limit, or use search_mode 'dynamic_programming' "
                           f"({result.message})")
    if result.x is None:
        raise ValueError(f"search_mode 'exact': no strategy satisfies every constraint "
                         f"({result.message})")
    x = np.round(result.x).astype(int)
    choice = tuple(int(np.argmax(x[offset[k]:offset[k] + len(n.candidates)]))
                   for k, n in enumerate(cg.nodes))
    gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
    total = cg.total(choice)
    assert not math.isinf(total), "the solver broke a shared-parameter constraint"
    assert cg.fits(choice), "the solver broke the memory constraint"
    return ExactSolution(choice, total, gap, "optimal" if result.status == 0 else
                         str(result.message))
