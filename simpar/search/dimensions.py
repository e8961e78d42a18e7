"""auto_parallel's choice of the memory dimensions with the cuts: the optimizer-parallel level,
the recomputed Cells and the number of micro-batches (``set_algo_parameters(
memory_dimensions="search" | "when_needed")``, simpar's own; MindSpore leaves all three to the
user).

The request names what may be chosen (``PlanRequest.searched``: what the user left unset) and
holds one micro-batch's graph for every micro-batch count on offer (``micro_graphs``). Every
combination is planned by the request's own search (its ``search_mode``), under the memory
cap, with the whole step as the objective (:mod:`simpar.cost.step_price`: every micro-batch's
kernels and moves, each level's ReduceScatters and AllGathers against the AllReduce they
replace, a recomputed Cell's second forward, the optimizer's update of what each rank stores),
so that the cuts are chosen for the dimensions and the dimensions compared on one scale. The
fastest combination that fits wins; ties go to the simpler one (fewer micro-batches, a lower
level, fewer recomputed Cells).

The optimizer level is one for the whole network (MindSpore's ``optimizer_level`` is global
too; its threshold still leaves small parameters whole). Which Cells recompute: with
search_mode "exact" and at most :data:`EXHAUSTIVE_SEGMENTS` marked Cells, every subset is
planned, so that the result is the proven optimum over cuts x level x recomputed Cells x
micro-batches. Otherwise it plans none and all of them (recomputing everything can pay when
the memory it frees lets faster cuts fit) and, when only recomputation fits, the fewest Cells
in trace order that fit (found by bisection on the memory of the all-recomputed plan's cuts,
then planned): the identical blocks of a transformer all save and cost alike.

>>> set_algo_parameters(memory_dimensions="search")         # doctest: +SKIP
>>> smap = plan_request(request)                            # doctest: +SKIP
>>> print(smap.dimensions.table())                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from simpar.graph import Graph
from simpar.optimizer_parallel import OptimizerLevel
from simpar.search.auto import pricer_of
from simpar.search.pricing import NoAvailableCost
from simpar.search.request import PlanRequest
from simpar.search.strategy_map import StrategyMap

__all__ = ["EXHAUSTIVE_SEGMENTS", "MICRO_BATCH_CHOICES", "Alternative", "DimensionSearch",
           "Spread", "graph_of", "search_dimensions"]

#: The micro-batch counts training offers the search (those that divide the batch).
MICRO_BATCH_CHOICES = (1, 2, 4, 8)

#: Up to this many recomputable Cells, search_mode "exact" plans every subset of them.
EXHAUSTIVE_SEGMENTS = 4

log = logging.getLogger("simpar.search")

Planner = Callable[[PlanRequest], StrategyMap]
Completer = Callable[[PlanRequest, StrategyMap], StrategyMap]
#: One combination's plans: (its map, or None, and its row) per recomputed-Cell choice.
Options = list[tuple[StrategyMap | None, "Alternative"]]


class Spread(Protocol):
    """Workers that share the combinations' planning: :meth:`map` runs ``work(i)`` for every
    ``i`` in ``range(count)``, each on one worker, and gives every worker every value (JSON:
    str, numbers, None, lists and dicts of them), in order; an error one ``work(i)`` raised
    is raised on every worker. Every worker calls it with the same request, so each works
    out the same combinations and, with every plan, chooses as one process would.
    :class:`simpar.search.planner.WorldSpread` spreads them over the MPI ranks."""

    def map(self, work: Callable[[int], Any], count: int) -> list[Any]: ...


@dataclass(frozen=True, slots=True)
class Alternative:
    """One combination of the memory dimensions as its search planned it: the step objective
    (seconds) and the bytes per rank of its plan, or why no plan fits (``seconds`` None;
    ``memory`` then the refused plan's, or the least any plan needs, when known)."""

    micro_batches: int
    level: OptimizerLevel | None
    recompute: tuple[str, ...]
    segments: int
    seconds: float | None
    memory: float | None
    why: str = ""

    @property
    def fits(self) -> bool:
        return self.seconds is not None

    @property
    def key(self) -> tuple[int, OptimizerLevel | None, tuple[str, ...]]:
        return (self.micro_batches, self.level, self.recompute)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (:meth:`from_dict` inverts it)."""
        return {"micro_batches": self.micro_batches,
                "level": None if self.level is None else str(self.level),
                "recompute": list(self.recompute), "segments": self.segments,
                "seconds": self.seconds, "memory": self.memory, "why": self.why}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Alternative:
        return cls(int(d["micro_batches"]),
                   None if d["level"] is None else OptimizerLevel(d["level"]),
                   tuple(str(n) for n in d["recompute"]), int(d["segments"]),
                   None if d["seconds"] is None else float(d["seconds"]),
                   None if d["memory"] is None else float(d["memory"]), str(d["why"]))

    def describe(self) -> str:
        """``level3, 2/4 Cells recomputed, 8 micro-batches``."""
        return (f"{self.level or 'optimizer parallel off'}, "
                f"{len(self.recompute)}/{self.segments} Cells recomputed, "
                f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}")


@dataclass(frozen=True)
class DimensionSearch:
    """What the search of the memory dimensions planned: ``chosen`` among ``alternatives``
    (trace order of the search), under ``capacity`` bytes per rank; ``searched`` the
    dimensions it chose (empty when the user's settings fitted under "when_needed")."""

    chosen: Alternative | None
    alternatives: tuple[Alternative, ...]
    capacity: float
    searched: frozenset[str]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (:meth:`from_dict` inverts it): what an error of planning carries to
        every rank (:func:`simpar.search.planner.plan_once`)."""
        return {"chosen": None if self.chosen is None else self.chosen.to_dict(),
                "alternatives": [a.to_dict() for a in self.alternatives],
                "capacity": self.capacity, "searched": sorted(self.searched)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DimensionSearch:
        alternatives = tuple(Alternative.from_dict(a) for a in d["alternatives"])
        chosen = None if d["chosen"] is None else Alternative.from_dict(d["chosen"])
        # the chosen one is one of the alternatives, as the search made it
        chosen = next((a for a in alternatives if a == chosen), chosen)
        return cls(chosen, alternatives, float(d["capacity"]),
                   frozenset(str(n) for n in d["searched"]))

    @property
    def least_memory(self) -> Alternative | None:
        known = [a for a in self.alternatives if a.memory is not None]
        return min(known, key=lambda a: a.memory or 0.0) if known else None

    def binding(self) -> list[str]:
        """For the chosen combination (else the one of least memory), each searched dimension
        and what relaxing it one notch does: a dimension binds when the plan would no longer
        fit (or, when nothing fits, would need more memory)."""
        at = self.chosen or self.least_memory
        if at is None:
            return []
        rows = {a.key: a for a in self.alternatives}
        lines = []
        relax: list[tuple[str, tuple[int, OptimizerLevel | None, tuple[str, ...]] | None]] = []
        if "optimizer" in self.searched:
            levels = [None, *OptimizerLevel]
            below = levels[levels.index(at.level) - 1] if at.level is not None else None
            relax.append(("optimizer level", (at.micro_batches, below, at.recompute)
                          if at.level is not None else None))
        if "recompute" in self.searched:
            relax.append(("recomputation", (at.micro_batches, at.level, ())
                          if at.recompute else None))
        if "micro_batches" in self.searched:
            fewer = [a.micro_batches for a in self.alternatives
                     if a.micro_batches < at.micro_batches]
            relax.append(("micro-batches", (max(fewer), at.level, at.recompute)
                          if fewer else None))
        for name, key in relax:
            if key is None:
                lines.append(f"{name}: not used ({at.describe()})")
                continue
            other = rows.get(key)
            if other is None:
                lines.append(f"{name}: not relaxed (that combination was not planned)")
                continue
            if other.memory is None or at.memory is None:
                lines.append(f"{name}: {'binds' if not other.fits else 'does not bind'} "
                             f"(relaxed to {_notch(name, other)}: "
                             f"{'no plan fits' if not other.fits else 'fits'})")
                continue
            more = other.memory - at.memory
            binds = (not other.fits) if at.fits else more > 0
            lines.append(f"{name}: {'binds' if binds else 'does not bind'} (relaxed to "
                         f"{_notch(name, other)}: {_bytes(other.memory)} per rank, "
                         f"{'+' if more >= 0 else '-'}{_bytes(abs(more))}"
                         f"{'' if other.fits else ', over the cap'})")
        return lines

    def table(self) -> str:
        """The alternatives, one line each: predicted step, memory, verdict."""
        rows = [["micro-batches", "optimizer", "recomputed", "step (objective)", "memory/rank",
                 "verdict"]]
        for a in self.alternatives:
            rows.append([str(a.micro_batches), "any" if a.why.startswith("the inputs") else
                         str(a.level or "off"),
                         f"{len(a.recompute)}/{a.segments}" + (
                             f" ({', '.join(n.rsplit('/', 1)[-1] for n in a.recompute)})"
                             if 0 < len(a.recompute) <= 2 and len(a.recompute) < a.segments
                             else ""),
                         "-" if a.seconds is None else f"{a.seconds * 1e3:.3f} ms",
                         "-" if a.memory is None else _bytes(a.memory),
                         ("CHOSEN" if a == self.chosen else "fits") if a.fits
                         else f"over the cap of {_bytes(self.capacity)}"
                         if a.memory is not None else a.why.split(";")[0][:60]])
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                         for r in rows)


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _notch(name: str, a: Alternative) -> str:
    if name == "optimizer level":
        return str(a.level or "off")
    if name == "recomputation":
        return "no Cell recomputed"
    return f"{a.micro_batches} micro-batches"


def graph_of(request: PlanRequest, smap: StrategyMap) -> Graph:
    """The graph ``smap`` plans: one micro-batch's of the micro-batch count it chose."""
    return request.micro_graphs.get(smap.micro_batches, request.graph)


def search_dimensions(request: PlanRequest, inner: Planner, complete: Completer,
                      spread: Spread | None = None) -> StrategyMap:
    """The plan of ``request`` with the memory dimensions chosen (see the module): ``inner``
    plans one combination's cuts, ``complete`` adds its dimensions to the map; ``spread``
    shares the combinations among workers (:class:`Spread`; None: all planned here). The
    map's ``dimensions`` holds the :class:`DimensionSearch`; :class:`NoAvailableCost` (with
    the search as its ``search`` attribute) when no combination fits."""
    capacity = request.capacity
    if request.algo.memory_dimensions == "when_needed":
        # (one worker plans it for all: an exact search's time limit may end it otherwise
        # on another)
        [(smap, row)] = _planned([request], lambda r: [_attempt(r, inner, complete)], spread,
                                 {})[0]
        if smap is not None:
            found = DimensionSearch(row, (row,), capacity, frozenset())
            return dataclasses.replace(smap, dimensions=found)
    searched = request.searched
    counts = sorted(request.micro_graphs) if "micro_batches" in searched else [
        request.micro_batches]
    levels: Sequence[OptimizerLevel | None] = [None, *OptimizerLevel] if \
        "optimizer" in searched else [request.optimizer.level]
    rows: list[Alternative] = []
    with _each_warning_once() as seen:
        best = _search(request, counts, levels, lambda r: _recompute_options(
            r, inner, complete), rows, spread, seen)
    found = DimensionSearch(best[2] if best else None, tuple(rows), capacity, searched)
    if best is None:
        least = found.least_memory
        err = NoAvailableCost(
            f"No available cost: no combination of the memory dimensions fits the capacity of "
            f"{capacity:.0f} bytes per rank ({len(rows)} planned"
            + (f"; the least memory is {least.memory:.0f} bytes, with {least.describe()}"
               if least is not None and least.memory is not None else "")
            + "). " + "; ".join(found.binding()), least.memory if least else None)
        err.search = found  # type: ignore[attr-defined]
        raise err
    return dataclasses.replace(best[1], dimensions=found)


def _search(request: PlanRequest, counts: Sequence[int],
            levels: Sequence[OptimizerLevel | None], options: Callable[[PlanRequest], Options],
            rows: list[Alternative], spread: Spread | None, seen: dict[str, int]
            ) -> tuple[float, StrategyMap, Alternative] | None:
    """Plan every combination (``options``: its recomputed-Cell choices), appending its rows
    to ``rows`` in order; the fastest that fits."""
    order: list[int | Alternative] = []   # a combination's index, or the row of a count
    combinations: list[PlanRequest] = []
    for m in counts:
        for level in levels:
            try:
                combination = _combination(request, m, level)
            except ValueError as e:   # the micro-batch does not split as the dataset does
                order.append(Alternative(m, level, (), len(request.graph.segments), None,
                                         None, f"the inputs do not split: {e}"))
                break   # (whatever the level)
            order.append(len(combinations))
            combinations.append(combination)
    planned = _planned(combinations, options, spread, seen)
    best: tuple[float, StrategyMap, Alternative] | None = None
    for entry in order:
        for smap, row in [(None, entry)] if isinstance(entry, Alternative) else planned[entry]:
            rows.append(row)
            if smap is not None and row.seconds is not None and (
                    best is None or row.seconds < best[0] * (1 - 1e-12)):
                best = (row.seconds, smap, row)
    return best


def _planned(combinations: Sequence[PlanRequest], options: Callable[[PlanRequest], Options],
             spread: Spread | None, seen: dict[str, int]) -> list[Options]:
    """``options`` of every combination: here, or shared among ``spread``'s workers, each
    plan sent as JSON (:meth:`StrategyMap.to_dict`) with the searches' logged warnings it
    gave (counted in ``seen`` on every worker, as if planned here)."""
    def kept(c: PlanRequest) -> Options:   # (a map that cannot be chosen is not kept)
        return [(smap if row.seconds is not None else None, row) for smap, row in options(c)]

    if spread is None:
        return [kept(c) for c in combinations]

    def work(i: int) -> dict[str, Any]:
        before = dict(seen)
        done = kept(combinations[i])
        return {"options": [[None if smap is None else smap.to_dict(), row.to_dict()]
                            for smap, row in done],
                "logged": {t: n - before.get(t, 0) for t, n in seen.items()
                           if n != before.get(t, 0)}}

    start = dict(seen)
    got = spread.map(work, len(combinations))
    seen.clear()
    seen.update(start)
    for item in got:
        for text, n in item["logged"].items():
            seen[text] = seen.get(text, 0) + n
    return [[(None if smap is None else StrategyMap.from_dict(smap), Alternative.from_dict(row))
             for smap, row in item["options"]] for item in got]


@contextlib.contextmanager
def _each_warning_once() -> Iterator[dict[str, int]]:
    """The searches' logged warnings (dynamic programming's thinned lists, ...) once each,
    with how many combinations gave them, rather than once per combination (the counts,
    by text, are what it yields)."""
    seen: dict[str, int] = {}

    def once(record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        text = record.getMessage()
        seen[text] = seen.get(text, 0) + 1
        return False

    log.addFilter(once)
    try:
        yield seen
    finally:
        log.removeFilter(once)
        for text, count in seen.items():
            log.warning("%s (in %d combinations of the memory dimensions)", text, count)


def _combination(request: PlanRequest, m: int, level: OptimizerLevel | None) -> PlanRequest:
    """The request of ``m`` micro-batches and optimizer ``level``, priced as a whole step."""
    g = request.micro_graphs.get(m, request.graph)
    layouts = tuple(lay.with_shape(v.shape) for lay, v in zip(request.input_layouts, g.inputs))
    optimizer = dataclasses.replace(request.optimizer, level=level) if \
        "optimizer" in request.searched else request.optimizer
    return dataclasses.replace(request, graph=g, input_layouts=layouts, micro_batches=m,
                               optimizer=optimizer, step_objective=True,
                               recompute=() if "recompute" in request.searched
                               else request.recompute)


def _recompute_options(request: PlanRequest, inner: Planner, complete: Completer
                       ) -> Options:
    """The recomputed-Cell choices planned for one combination (see the module)."""
    names = tuple(seg.name for seg in request.graph.segments)
    if "recompute" not in request.searched:
        return [_attempt(request, inner, complete)]
    if request.search_mode == "exact" and len(names) <= EXHAUSTIVE_SEGMENTS:
        return [_attempt(dataclasses.replace(request, recompute=subset), inner, complete)
                for k in range(len(names) + 1)
                for subset in itertools.combinations(names, k)]
    plain = _attempt(request, inner, complete)
    every = _attempt(dataclasses.replace(request, recompute=names), inner, complete)
    if plain[0] is not None or every[0] is None or len(names) == 1:
        return [plain, every]
    # The fewest Cells, in trace order, that bring the all-recomputed cuts under the cap.
    capacity = request.capacity
    smap = every[0]
    strategies = [smap.ops[node.name].in_strategy for node in request.graph.nodes]

    def fits(k: int) -> bool:
        priced = pricer_of(dataclasses.replace(request, recompute=names[:k]))
        shardings = [priced.sharding(n, s) for n, s in enumerate(strategies)]
        if None in shardings:
            return False
        held = [s for s in shardings if s is not None]
        return priced.memory(held) + priced.transient(held) <= capacity

    lo, hi = 0, len(names)   # fits(hi), not fits(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    if hi == len(names):
        return [plain, every]
    fewest = _attempt(dataclasses.replace(request, recompute=names[:hi]), inner, complete)
    return [plain, fewest, every]


def _attempt(request: PlanRequest, inner: Planner, complete: Completer
             ) -> tuple[StrategyMap | None, Alternative]:
    """``request`` planned by ``inner`` and priced as a whole step (None and the reason when
    no plan fits)."""
    segments = len(request.graph.segments)
    head = (request.micro_batches, request.optimizer.level, request.recompute, segments)
    try:
        smap = complete(request, inner(request))
    except NoAvailableCost as e:
        return None, Alternative(*head, None, e.memory, str(e))
    priced = pricer_of(dataclasses.replace(request, step_objective=True))
    shardings = [priced.sharding(n, smap.ops[node.name].in_strategy)
                 for n, node in enumerate(request.graph.nodes)]
    if None in shardings:   # a strategy file's or user's strategy the pricer refuses
        return smap, Alternative(*head, None, None, "not priced")
    # what it holds throughout, and its largest transient (the searches fit both when they
    # can: simpar.search.auto.fitting_transients)
    memory = priced.memory(shardings) + priced.transient(shardings)  # type: ignore[arg-type]
    if memory > priced.memory_capacity:
        return None, Alternative(*head, None, memory, "over the cap")
    return smap, Alternative(*head, priced.total(shardings),  # type: ignore[arg-type]
                             memory)
