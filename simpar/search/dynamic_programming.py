"""``search_mode="dynamic_programming"``: MindSpore's graph-elimination search over the cost graph.

The cost graph's nodes are ops (a cost per candidate) and its edges redistributions (a cost per
pair of candidates). The search shrinks the graph one elimination at a time, each exact for the
objective, then picks the best entry of what is left and replays the eliminations backwards to
give every op its candidate. The eliminations are MindSpore's (``dp_algo_costmodel.cc``):

* **op**: a node with one neighbour on each side (``u - v - w``) becomes an edge ``u - w``
  whose cost for (i, k) is the best over v's candidates j of ``e(i, j) + v(j) + e'(j, k)``;
* **edge**: parallel edges between two nodes become one (their sum);
* **merge** and **contract**: a node with one edge (a source: merge; a sink: contract) folds
  into its neighbour, whose candidate i gains the best ``e(i, j) + leaf(j)``;
* **triangle**: an op elimination whose two neighbours are already joined (followed by an
  edge elimination);
* **star**, the last resort, when every node has three neighbours or more: MindSpore merges a
  source node into its successors heuristically; simpar merges it into the neighbour that
  gives the smallest product of candidate counts, a node whose candidates are the pairs. That
  is exact, so the search returns the objective's optimum on every graph (at a cost in time
  when stars are large); graphs without stars (chains, residual blocks, attention) never need
  it.

Every table entry is a Pareto list of (cost, memory) pairs, as in MindSpore: an op's memory is
what :meth:`~simpar.cost.CostModel.memory` says, and lists are pruned of dominated pairs and of
pairs over the memory cap. The search runs twice at most: first keeping only the cheapest pair
(the unconstrained optimum); if that plan fits the cap it is the answer, otherwise again with
lists of up to ``width`` (128) pairs per entry. A longer list is thinned evenly by memory, always
keeping its least-memory and its cheapest pair: the least-memory plan stays reachable, so "no
plan fits" is never reported wrongly, and :attr:`DPSolution.exact` says whether any list was
thinned. On graphs where the lists would combine more than ``_BUDGET`` entries (thousands of
ops with hundreds of candidates each), the second pass gives way to a Lagrangian one: the
one-entry search of ``cost + weight * memory``, each weight the slope between the best plans
found on either side of the cap, until no plan lies below that line (a few solves); that
plan fits but is not proven the cheapest (``exact`` False). When nothing fits,
:class:`NoAvailableCost` gives the smallest memory per rank any plan needs and the op that
needs most of it.

A parameter read by several ops gets a virtual node whose candidates are its distinct layouts,
with an edge to each reader that is 0 where the reader's candidate lays it out that way and
infinite elsewhere (MindSpore's ``TmpIdentity``).
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from simpar.search.cost_graph import CostEdge, CostGraph, CostNode, same_blocks
from simpar.search.min_plus import min_plus
from simpar.search.pricing import NoAvailableCost
from simpar.search.tables import Table, pareto, stack

__all__ = ["DPSolution", "NoAvailableCost", "least_memory_plan", "solve_dynamic_programming"]

log = logging.getLogger("simpar.search")

#: Table entries above this many elements are built a block of rows at a time.
_CHUNK = 1 << 22


#: Table entries the Pareto pass may combine in all before it gives way to the Lagrangian one.
_BUDGET = 300_000_000


class _TooBig(Exception):
    """The Pareto pass would combine more entries than its budget."""


@dataclass(frozen=True)
class DPSolution:
    """One candidate per node, the plan's objective and memory per rank, the eliminations
    applied by kind, whether the search was exact (no Pareto list thinned), and which pass
    found it (1: the cheapest plan fits; 2: the memory cap binds)."""

    choice: tuple[int, ...]
    cost: float
    memory: float
    eliminations: dict[str, int]
    exact: bool
    passes: int


class _Eliminator:
    """The elimination graph of one cost graph, under a list width and a memory cap."""

    def __init__(self, cg: CostGraph, width: int, cap: float, memory_as_cost: bool,
                 weight: float = 0.0, hints: dict[Any, np.ndarray] | None = None) -> None:
        self.width, self.cap = width, cap
        #: Per product key, the v of its every (u, w) in an earlier pass over the same graph
        #: (the keys of one graph's eliminations are the same in every pass): where the next
        #: pass's product looks first for its upper bounds.
        self.hints = {} if hints is None else hints
        self.thinned = False
        self.spent = 0
        self.counts: Counter[str] = Counter()
        self.tables: dict[int, Table] = {}
        self.adj: dict[int, dict[int, tuple[int, int, Table]]] = {}
        # Identical layers: the cost graph gives nodes (edges) of one signature the same
        # tuples, so their tables share a key, and so does every elimination made of tables
        # with equal keys; each is computed once (hits counts the rest).
        # Each result is keyed by the keys of what it was made of, and is itself keyed by
        # its number here: keys stay flat, so hashing one costs the same at any depth.
        self.memo: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...],
                                   int]] = {}
        self.hits = 0
        #: What a later pass under another weight recomputes (:meth:`reweigh`): per leaf key,
        #: its node or edge and its tables; per memoised elimination, in the order they were
        #: computed, how to compute it and its tables.
        self.leaves: dict[Any, tuple[CostNode | CostEdge, list[Table]]] = {}
        self.recipes: list[tuple[Any, list[Table]]] = []
        self.root: Table | None = None
        for k, node in enumerate(cg.nodes):
            self._add_node(k, self._leaf(("node", id(node.costs), id(node.memories)), node,
                                         memory_as_cost, weight, k))
        for e in cg.edges:
            self._add_edge(e.producer, e.consumer, self._leaf(
                ("edge", id(e.costs), id(e.memories)), e, memory_as_cost, weight))
        self.next_id = len(cg.nodes)
        for name, uses in cg.shared.items():
            self._add_shared(cg, name, uses)

    @staticmethod
    def _leaf_arrays(source: CostNode | CostEdge, memory_as_cost: bool, weight: float
                     ) -> tuple[np.ndarray, np.ndarray]:
        """A node's (cost, memory) per candidate, or an edge's per pair, as the pass weighs
        them: ``cost + weight * memory``, or memory alone where the cost is finite. An edge's
        memory (a consumer's own copy) weighs as a node's."""
        if isinstance(source, CostNode):
            mem = np.asarray(source.memories, dtype=float)[:, None]
            return (mem.copy() if memory_as_cost else
                    np.asarray(source.costs, dtype=float)[:, None] + weight * mem), mem
        matrix = np.asarray(source.costs, dtype=float)[:, :, None]
        mem = (np.zeros(matrix.shape) if source.memories is None
               else np.asarray(source.memories, dtype=float)[:, :, None])
        return (np.where(np.isinf(matrix), np.inf, mem) if memory_as_cost
                else matrix + weight * mem if weight else matrix), mem

    def _leaf(self, key: Any, source: CostNode | CostEdge, memory_as_cost: bool,
              weight: float, node: int = -1) -> Table:
        """The table of a node or an edge; equal arrays, one key and one computation."""
        found = self.leaves.get(key)
        if found is None:
            found = self.leaves[key] = (source, [])
            cost, mem = self._leaf_arrays(source, memory_as_cost, weight)
        else:
            cost, mem = found[1][0].cost, found[1][0].mem
        table = Table(cost, mem, "node" if node >= 0 else "edge", node=node, key=key)
        found[1].append(table)
        return table

    def reweigh(self, memory_as_cost: bool, weight: float) -> Table:
        """The root of this elimination graph under another weight: the leaves' arrays and
        every memoised elimination recomputed in the order they were first computed (each
        from tables already recomputed), every table that shares them rebound; the order,
        the keys and the replay's tree stay. Only for passes without star eliminations
        (their merged nodes keep only the rows finite under the first weight)."""
        assert self.root is not None and not self.counts["star"], "reweigh a finished pass"
        for source, tables in self.leaves.values():
            cost, mem = self._leaf_arrays(source, memory_as_cost, weight)
            for t in tables:
                t.rebind(cost, mem)
        for compute, tables in self.recipes:
            cost, mem, prov, _ = compute()
            for t in tables:
                t.rebind(cost, mem, prov)
        return self.root

    # -- the graph
    def _add_node(self, k: int, table: Table) -> None:
        self.tables[k] = table
        self.adj[k] = {}

    def _add_edge(self, u: int, v: int, table: Table) -> None:
        """Join ``u`` and ``v`` (``table`` indexed [u's candidate, v's]); a second edge between
        them is summed into the first (edge elimination). Edges remember their direction
        (producer, consumer) for naming the eliminations."""
        old = self.adj[u].get(v)
        if old is not None:
            a = old[2] if old[0] == u else old[2].flipped()
            table = self._sum(a, table)
            self.counts["edge"] += 1
            u_src = old[0] == u
            entry = (u, v, table) if u_src else (v, u, table.flipped())
        else:
            entry = (u, v, table)
        self.adj[u][v] = entry
        self.adj[v][u] = entry

    def _edge(self, u: int, v: int) -> Table:
        """The table of the edge u - v, indexed [u's candidate, v's]."""
        src, _, table = self.adj[u][v]
        return table if src == u else table.flipped()

    def _remove(self, k: int) -> None:
        for n in self.adj.pop(k):
            del self.adj[n][k]
        del self.tables[k]

    def _add_shared(self, cg: CostGraph, name: str, uses: tuple[tuple[int, int], ...]) -> None:
        """A virtual node per parameter read by several ops: one candidate per distinct
        layout, and an edge to each reader allowing only its candidates that agree."""
        classes: list[Any] = []
        of_use: list[list[int]] = []
        for n, k in uses:
            row = []
            for sh in cg.nodes[n].candidates:
                lay = sh.in_layouts[k]
                found = next((c for c, ref in enumerate(classes) if same_blocks(lay, ref)),
                             None)
                if found is None:
                    classes.append(lay)
                    found = len(classes) - 1
                row.append(found)
            of_use.append(row)
        s = self.next_id
        self.next_id += 1
        zeros = np.zeros((len(classes), 1))
        self._add_node(s, Table(zeros, zeros.copy(), "node", node=s))
        for (n, _), row in zip(uses, of_use):
            matrix = np.full((len(classes), len(row), 1), np.inf)
            matrix[row, np.arange(len(row)), 0] = 0.0
            self._add_edge(s, n, Table(matrix, np.zeros_like(matrix), "edge"))
        log.debug("shared parameter %s: %d layouts, %d readers", name, len(classes), len(uses))

    # -- table algebra
    def _memo(self, key: Any, kind: str, parts: tuple[Table, ...], node: int,
              compute: Any) -> Table:
        """The elimination ``key`` of ``parts``: computed once per key, then shared."""
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = (*compute(), len(self.memo))
            self.recipes.append((compute, []))
        else:
            self.hits += 1
        c, m, i, axes, number = found
        table = Table(c, m, kind, parts, i, axes, node=node, key=number)
        self.recipes[number][1].append(table)
        return table

    def _reduce(self, total_c: np.ndarray, total_m: np.ndarray, keep_dims: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pareto-reduce every axis after the first ``keep_dims`` of the summed tables."""
        shape = total_c.shape[:keep_dims]
        rows = math.prod(shape)
        self.spent += total_c.size
        if self.width > 1 and self.spent > _BUDGET:
            raise _TooBig
        c, m, i, thinned = pareto(total_c.reshape(rows, -1), total_m.reshape(rows, -1),
                                   self.width, self.cap)
        self.thinned |= thinned
        f = c.shape[1]
        return c.reshape(*shape, f), m.reshape(*shape, f), i.reshape(*shape, f)

    def _sum(self, a: Table, b: Table) -> Table:
        """Two tables of one index shape, entry lists combined pairwise."""
        def compute() -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]:
            tc = a.cost[..., :, None] + b.cost[..., None, :]
            tm = a.mem[..., :, None] + b.mem[..., None, :]
            c, m, i = self._reduce(tc, tm, a.cost.ndim - 1)
            return c, m, i, (a.cost.shape[-1], b.cost.shape[-1])

        return self._memo(("sum", a.key, b.key), "sum", (a, b), -1, compute)

    def _through(self, a: Table, mid: Table, b: Table) -> Table:
        """``a`` [u, v] + ``mid`` [v] + ``b`` [v, w], best over v: a table [u, w]."""
        def compute() -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]:
            ku, kv, fa = a.cost.shape
            _, kw, fb = b.cost.shape
            fm = mid.cost.shape[1]
            if self.width == 1 and math.isinf(self.cap):  # one entry each: a min-plus product
                self.spent += ku * kv * kw
                hint = self.hints.get(key)
                c, m, i = min_plus(a.cost[:, :, 0] + mid.cost[None, :, 0],
                                   a.mem[:, :, 0] + mid.mem[None, :, 0], b.cost[:, :, 0],
                                   b.mem[:, :, 0], hint=hint if hint is not None
                                   and hint.shape == (ku, kw) else None)
                self.hints[key] = i
                return c[..., None], m[..., None], i[..., None], (kv, fa, fm, fb)
            per_row = kv * kw * fa * fm * fb
            if self.width > 1 and per_row > 8 * _CHUNK:
                raise _TooBig
            step = max(1, _CHUNK // max(per_row, 1))
            parts_c, parts_m, parts_i = [], [], []
            for lo in range(0, ku, step):
                sl = slice(lo, lo + step)
                tc = (a.cost[sl, :, None, :, None, None]
                      + mid.cost[None, :, None, None, :, None]
                      + b.cost[None, :, :, None, None, :])
                tm = (a.mem[sl, :, None, :, None, None] + mid.mem[None, :, None, None, :, None]
                      + b.mem[None, :, :, None, None, :])
                # -> [u, w, v, fa, fm, fb]
                c, m, i = self._reduce(tc.transpose(0, 2, 1, 3, 4, 5),
                                       tm.transpose(0, 2, 1, 3, 4, 5), 2)
                parts_c.append(c)
                parts_m.append(m)
                parts_i.append(i)
            return (*stack(parts_c, parts_m, parts_i), (kv, fa, fm, fb))

        key = ("through", a.key, mid.key, b.key)
        return self._memo(key, "through", (a, mid, b), -1, compute)

    def _fold(self, target: Table, edge: Table, leaf: Table, node: int) -> Table:
        """``target`` [i] gains the best over j of ``edge`` [i, j] + ``leaf`` [j]."""
        def compute() -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]:
            tc = (target.cost[:, None, :, None, None] + edge.cost[:, :, None, :, None]
                  + leaf.cost[None, :, None, None, :])
            tm = (target.mem[:, None, :, None, None] + edge.mem[:, :, None, :, None]
                  + leaf.mem[None, :, None, None, :])
            c, m, i = self._reduce(tc, tm, 1)
            return (c, m, i, tuple(tc.shape[1:]))

        return self._memo(("fold", target.key, edge.key, leaf.key), "fold",
                          (target, edge, leaf), node, compute)

    # -- eliminations
    def _direction(self, k: int, n: int) -> str:
        return "merge" if self.adj[k][n][0] == k else "contract"

    def _eliminate_leaf(self, k: int) -> None:
        (n,) = self.adj[k]
        self.counts[self._direction(k, n)] += 1
        self.tables[n] = self._fold(self.tables[n], self._edge(n, k), self.tables[k], n)
        self._remove(k)

    def _eliminate_middle(self, k: int) -> None:
        u, w = sorted(self.adj[k])
        self.counts["triangle" if w in self.adj[u] else "op"] += 1
        table = self._through(self._edge(u, k), self.tables[k], self._edge(k, w))
        self._remove(k)
        self._add_edge(u, w, table)

    def _eliminate_star(self) -> None:
        """Merge the node and neighbour whose candidate counts have the smallest product."""
        best: tuple[int, int, int] | None = None
        for k in sorted(self.adj):
            for n in sorted(self.adj[k]):
                size = self.tables[k].cost.shape[0] * self.tables[n].cost.shape[0]
                if best is None or size < best[0]:
                    best = (size, k, n)
        assert best is not None
        _, a, b = best
        self.counts["star"] += 1
        ta, tb, e = self.tables[a], self.tables[b], self._edge(a, b)
        ka, kb = ta.cost.shape[0], tb.cost.shape[0]
        tc = (ta.cost[:, None, :, None, None] + tb.cost[None, :, None, :, None]
              + e.cost[:, :, None, None, :])
        tm = (ta.mem[:, None, :, None, None] + tb.mem[None, :, None, :, None]
              + e.mem[:, :, None, None, :])
        c, m, i = self._reduce(tc.reshape(ka * kb, *tc.shape[2:]),
                               tm.reshape(ka * kb, *tm.shape[2:]), 1)
        live = np.flatnonzero(np.isfinite(c).any(axis=1))
        if live.size == 0:
            live = np.arange(1)  # nothing is feasible: keep one, the replay reports it
        s = self.next_id
        self.next_id += 1
        merged = Table(c[live], m[live], "merge", (ta, tb, e), i[live],
                        tuple(tc.shape[2:]), node=s, extra=(live, kb))
        others = [(n, a, live // kb) for n in self.adj[a] if n != b] + \
                 [(n, b, live % kb) for n in self.adj[b] if n != a]
        moved = [(n, self._edge(old, n), rows) for n, old, rows in others]
        self._remove(a)
        self._remove(b)
        self._add_node(s, merged)
        for n, table, rows in moved:
            self._add_edge(s, n, Table(table.cost[rows], table.mem[rows], "rows", (table,),
                                        extra=rows))
        log.info("star elimination: merged two nodes into one of %d candidates", live.size)

    def _edge_key(self, u: int, v: int) -> Any:
        """The key of :meth:`_edge` ``(u, v)``, without building a flipped table."""
        src, _, table = self.adj[u][v]
        return table.key if src == u else ("flip", table.key)

    def _pending(self, k: int) -> Any:
        """The memo key of eliminating ``k`` now (None: ``k`` has more than two neighbours,
        or none)."""
        near = self.adj[k]
        if len(near) == 2:
            u, w = sorted(near)
            return ("through", self._edge_key(u, k), self.tables[k].key, self._edge_key(k, w))
        if len(near) == 1:
            (n,) = near
            return ("fold", self.tables[n].key, self._edge_key(n, k), self.tables[k].key)
        return None

    def run(self, started: float) -> Table:
        """Eliminate until no edge is left, then fold every remaining node into one root.

        The order is MindSpore's sweeps over the nodes in trace order, eliminating every
        node with one or two neighbours, except that with one entry per table an elimination
        the memo already holds goes first. Identical layers cost one elimination of each kind
        either way, and with that rule so does a chain of them whose first joined pair is
        like the others (a GPT's residual stream, between its embedding and its head): every
        other pair is then joined from the memo, which halves the chain into identical
        pairs, then quadruples, in ``log2`` of its length eliminations computed.
        Every order is exact. (Pareto lists keep the sweeps' order: joining two long lists
        from both ends of a chain costs far more than extending one from its start.)
        """
        halving = self.width == 1
        total = len(self.adj)
        version = dict.fromkeys(self.adj, 0)
        heap: list[tuple[int, int, int, int]] = []
        waiting: dict[Any, list[tuple[int, int]]] = {}
        sweep, cursor = 0, -1

        def push(k: int) -> None:
            version[k] += 1
            if not 0 < len(self.adj[k]) < 3:
                return
            if halving:
                key = self._pending(k)
                if key in self.memo:
                    heapq.heappush(heap, (0, 0, k, version[k]))
                    return
                waiting.setdefault(key, []).append((k, version[k]))
            # this sweep if it is still ahead, else the next
            heapq.heappush(heap, (1, sweep + (k <= cursor), k, version[k]))

        for k in sorted(self.adj):
            push(k)
        while True:
            while heap:
                hit, at, k, ver = heapq.heappop(heap)
                if k not in self.adj or version[k] != ver:
                    continue
                if hit:
                    sweep, cursor = at, k
                key = self._pending(k) if halving else None
                near = list(self.adj[k])
                if len(near) == 2:
                    self._eliminate_middle(k)
                else:
                    self._eliminate_leaf(k)
                del version[k]
                again = set(near)
                for n in near:  # a fold changed n's table: its leaves' eliminations too
                    again.update(x for x in self.adj[n] if len(self.adj[x]) == 1)
                for n in sorted(again):
                    push(n)
                for n, ver in waiting.pop(key, ()) if halving else ():  # now in the memo
                    if version.get(n) == ver:
                        heapq.heappush(heap, (0, 0, n, ver))
            log.info("dynamic programming: %d of %d nodes left after %.1f s", len(self.adj),
                     total, time.perf_counter() - started)
            if not any(self.adj[k] for k in self.adj):
                break
            self._eliminate_star()
            sweep, cursor = sweep + 1, -1
            for k in sorted(self.adj):
                version.setdefault(k, 0)
                push(k)
        root = Table(np.zeros((1, 1)), np.zeros((1, 1)), "node", node=-1)
        for k in sorted(self.adj):
            t = self.tables[k]
            zero = np.zeros((1, t.cost.shape[0], 1))
            root = self._fold(root, Table(zero, zero.copy(), "edge"), t, -1)
        self.root = root
        return root


def _replay(root: Table, entry: int, n_nodes: int) -> list[int]:
    """Walk the tables back from the root's chosen entry: every elimination gives the
    candidates (and entries) of what it was made of."""
    choice = [-1] * n_nodes
    stack: list[tuple[Table, tuple[int, ...], int]] = [(root, (0,), entry)]
    while stack:
        t, idx, e = stack.pop()
        if 0 <= t.node < n_nodes:
            choice[t.node] = idx[0]
        kind = t.kind
        if kind in ("node", "edge"):
            continue
        if kind == "flip":
            stack.append((t.parts[0], idx[::-1], e))
            continue
        if kind == "rows":
            stack.append((t.parts[0], (int(t.extra[idx[0]]), idx[1]), e))
            continue
        assert t.prov is not None
        flat = int(t.prov[(*idx, e)])
        assert flat >= 0, "replay reached an empty entry"
        sub = np.unravel_index(flat, t.axes)
        if kind == "sum":
            a, b = t.parts
            stack += [(a, idx, int(sub[0])), (b, idx, int(sub[1]))]
        elif kind == "through":
            a, mid, b = t.parts
            j = int(sub[0])
            stack += [(a, (idx[0], j), int(sub[1])), (mid, (j,), int(sub[2])),
                      (b, (j, idx[1]), int(sub[3]))]
        elif kind == "fold":
            target, edge, leaf = t.parts
            j = int(sub[0])
            stack += [(target, idx, int(sub[1])), (edge, (idx[0], j), int(sub[2])),
                      (leaf, (j,), int(sub[3]))]
        elif kind == "merge":
            ta, tb, edge = t.parts
            live, kb = t.extra
            i, j = divmod(int(live[idx[0]]), kb)
            stack += [(ta, (i,), int(sub[0])), (tb, (j,), int(sub[1])),
                      (edge, (i, j), int(sub[2]))]
        else:
            raise AssertionError(f"unknown table kind {kind!r}")
    return choice


class _Passes:
    """The one-entry passes over one cost graph (the cheapest plan, the least memory, the
    Lagrangian's weights). Which eliminations a pass makes, in which order, and which of them
    are equal depends on the graph alone, so the first pass's elimination graph is kept and
    a later one recomputes only its distinct eliminations under its own weight, then
    replays (:meth:`_Eliminator.reweigh`): on a refinement of the 96-layer GPT of 1.3B widths
    on 1024 devices, 67 tables for 3945 ops. ``hints`` carries the products' answers from
    pass to pass."""

    def __init__(self) -> None:
        self.hints: dict[Any, np.ndarray] = {}
        self.elim: _Eliminator | None = None


def _solve(cg: CostGraph, width: int, cap: float, memory_as_cost: bool = False,
           weight: float = 0.0, passes: _Passes | None = None
           ) -> tuple[tuple[int, ...] | None, bool, Counter[str]]:
    choice, exact, counts, _ = _solve_counting(cg, width, cap, memory_as_cost, weight, passes)
    return choice, exact, counts


def _solve_counting(cg: CostGraph, width: int, cap: float, memory_as_cost: bool = False,
                    weight: float = 0.0, passes: _Passes | None = None
                    ) -> tuple[tuple[int, ...] | None, bool, Counter[str], int]:
    """:func:`_solve`, and how many entries its eliminations combined (with lists of one
    entry, the least a pass with longer lists combines in the same eliminations). One-entry
    passes over ``cg`` that share ``passes`` share their elimination graph."""
    started = time.perf_counter()
    one = width == 1 and math.isinf(cap)
    if passes is not None and one and passes.elim is not None:
        elim = passes.elim
        root = elim.reweigh(memory_as_cost, weight)
    else:
        elim = _Eliminator(cg, width, cap, memory_as_cost, weight,
                           passes.hints if passes is not None else None)
        root = elim.run(started)
        if passes is not None and one and not elim.counts["star"]:
            passes.elim = elim
    finite = np.isfinite(root.cost[0])
    if not finite.any():
        return None, not elim.thinned, elim.counts, elim.spent
    entry = int(np.argmin(root.cost[0]))
    choice = tuple(_replay(root, entry, len(cg.nodes)))
    assert min(choice) >= 0, "the replay left an op without a strategy"
    return choice, not elim.thinned, elim.counts, elim.spent


def solve_dynamic_programming(cg: CostGraph, width: int = 128, pareto: bool = True,
                              start: Sequence[int] | None = None, secant: int = 4
                              ) -> DPSolution:
    """The plan of least objective whose memory fits ``cg.memory_capacity``.

    When the memory cap binds, ``pareto=False`` goes straight to the Lagrangian pass (a plan
    that fits, not proven the cheapest; quicker), a ``start`` plan that fits is where that
    pass starts from instead of the plan of least memory (one solve fewer), and ``secant``
    bounds its solves after the first fitting plan (4: on the 96-layer GPT of the 1.3B widths
    on 1024 devices the fourth finds the plan a fifth would only confirm).

    Raises :class:`NoAvailableCost` when none fits (naming the least memory any plan needs),
    and ValueError when no plan satisfies the graph's constraints (a user strategy against a
    shared parameter, an elementwise op that cannot follow its producer)."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 2:
        raise ValueError(f"solve_dynamic_programming: width must be an int >= 2, got {width!r}")
    if not isinstance(pareto, bool):
        raise TypeError(f"solve_dynamic_programming: pareto must be a bool, got {pareto!r}")
    if isinstance(secant, bool) or not isinstance(secant, int) or secant < 1:
        raise ValueError(f"solve_dynamic_programming: secant must be an int >= 1, got "
                         f"{secant!r}")
    if start is not None:
        sizes = [len(node.candidates) for node in cg.nodes]
        if len(start) != len(sizes) or any(
                isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c < n
                for c, n in zip(start, sizes)):
            raise ValueError(f"solve_dynamic_programming: start must give each of the "
                             f"{len(sizes)} nodes one of its candidates (0 <= c < its count), "
                             f"got {list(start)[:8]!r}")
    if not cg.nodes:
        return DPSolution((), 0.0, 0.0, {}, True, 1)
    one_entry = _Passes()
    choice, exact, counts, spent = _solve_counting(cg, 1, math.inf, passes=one_entry)
    if choice is None:
        raise ValueError("search_mode 'dynamic_programming': no plan satisfies every "
                         "constraint (a parameter shared by ops whose user strategies lay it "
                         "out differently, or an op that cannot follow its producer)")
    passes = 1
    if not cg.fits(choice):
        passes = 2
        # The eliminations with lists of one entry already combine more than the budget
        # (star eliminations aside, the lists change nothing else about them): the Pareto
        # pass would stop at the budget, so it is not run.
        lagrangian = not pareto or spent > _BUDGET and not counts["star"]
        start_fits = not pareto and start is not None and cg.fits(start)
        least = tuple(start) if start is not None and start_fits else None
        try:
            if lagrangian:
                raise _TooBig
            least = _least_memory(cg)
            found, exact, counts = _solve(cg, width, cg.memory_capacity)
        except _TooBig:
            if pareto:
                log.warning("dynamic programming: the memory cap binds and the (cost, memory) "
                            "lists would outgrow the budget; pricing memory instead "
                            "(Lagrangian): the plan fits but is not proven the cheapest that "
                            "does")
            found = _lagrangian(cg, choice, least, one_entry, bracket=not start_fits,
                                secant=secant)
            exact = False
        else:
            if not exact:
                log.warning("dynamic programming: the memory cap binds and some (cost, memory) "
                            "lists were longer than %d entries and were thinned: the plan fits "
                            "but may not be the cheapest that does "
                            "(solve_dynamic_programming(cg, width=...) keeps more)", width)
        assert found is not None, "a plan fits, but the search lost it"
        choice = found
    log.info("dynamic programming: eliminations %s", dict(sorted(counts.items())))
    return DPSolution(choice, cg.total(choice), cg.memory(choice), dict(counts), exact, passes)


def least_memory_plan(cg: CostGraph) -> tuple[int, ...] | None:
    """The plan of least memory, whether it fits or not (None: no plan satisfies the graph's
    constraints)."""
    found, _, _ = _solve(cg, 1, math.inf, memory_as_cost=True)
    return found


def _least_memory(cg: CostGraph, passes: _Passes | None = None) -> tuple[int, ...]:
    """The plan of least memory; :class:`NoAvailableCost` when even that one does not fit."""
    found, _, _ = _solve(cg, 1, math.inf, memory_as_cost=True, passes=passes)
    if found is None or not cg.fits(found):
        raise _no_available_cost(cg, found)
    return found


def _lagrangian(cg: CostGraph, cheapest: tuple[int, ...], least: tuple[int, ...] | None,
                passes: _Passes | None = None, rounds: int = 20,
                bracket: bool = True, secant: int = 20) -> tuple[int, ...]:
    """A plan that fits, on graphs too large for Pareto lists: the one-entry search of
    ``cost + weight * memory``. Every plan it returns is a corner of the lower convex hull of
    all plans' (memory, cost). The first weight is the cheapest plan's cost per byte,
    multiplied by 4 until its plan fits. Then the weight is the slope between the cheapest
    corner found that does not fit and the one that does, so each solve either finds a
    corner below that line, which replaces the end on its side of the cap, or none: the line
    is then the hull's edge across the cap, and its fitting end is the cheapest fitting plan
    any weight gives (the dual optimum), in a few solves where bisecting the weight reaches
    it only in the limit. ``least``, a fitting plan, need not be a corner (a caller's plan);
    the cheapest fitting plan seen is returned. Without one, the plan of least memory is
    searched for only when two weights in a row give no plan that fits (it says whether any
    does). The solves share ``passes``."""
    over, fit = cheapest, least
    best = least
    weight = cg.total(cheapest) / max(cg.memory(cheapest), 1.0) if bracket else 0.0
    misses = 0
    while 0 < weight < math.inf and rounds:
        rounds -= 1
        plan, _, _ = _solve(cg, 1, math.inf, weight=weight, passes=passes)
        if plan is None:
            break
        if not cg.fits(plan):
            over = plan
            weight *= 4
            misses += 1
            if fit is None and misses == 2:
                fit = best = _least_memory(cg, passes)
            continue
        if fit is None or cg.total(plan) < cg.total(fit):
            fit = best = plan
        break
    if fit is None or best is None:
        fit = best = _least_memory(cg, passes)
    for _ in range(min(rounds, secant)):
        c_over, m_over = cg.total(over), cg.memory(over)
        c_fit, m_fit = cg.total(fit), cg.memory(fit)
        if m_over <= m_fit or c_fit <= c_over:
            break
        weight = (c_fit - c_over) / (m_over - m_fit)
        if not math.isfinite(weight):   # a fitting end of infinite cost: no line to follow
            break
        plan, _, _ = _solve(cg, 1, math.inf, weight=weight, passes=passes)
        if plan is None:
            break
        line = c_fit + weight * m_fit
        if cg.total(plan) + weight * cg.memory(plan) >= line - 1e-9 * abs(line):
            break   # no corner below the line
        if cg.fits(plan):
            fit = plan
            if cg.total(plan) < cg.total(best):
                best = plan
        else:
            over = plan
    return best


def _no_available_cost(cg: CostGraph, least: tuple[int, ...] | None) -> NoAvailableCost:
    """MindSpore's "No available cost" error, with the least memory any plan needs."""
    if least is None:
        return NoAvailableCost("No available cost: no plan satisfies every constraint")
    need = cg.memory(least)
    k = max(range(len(cg.nodes)), key=lambda n: cg.nodes[n].memories[least[n]])
    node = cg.nodes[k]
    cand = node.candidates[least[k]]
    strategy = [list(c) for c in cand.strategy] if hasattr(cand, "strategy") else cand
    return NoAvailableCost(
        f"No available cost: no strategy fits the device memory capacity of "
        f"{cg.memory_capacity:.0f} bytes per rank. The minimum memory cost is {need:.0f} bytes "
        f"per rank; the op that needs most of it is {node.name} ({node.memories[least[k]]:.0f} "
        f"bytes, strategy {strategy}, in the plan of least memory). Use more devices, smaller "
        "shapes, or raise "
        "the capacity (device_memory_capacity in set_cost_model_context, or the profile's "
        "memory_capacity).", need)
