"""The search entry point: a :class:`~simpar.search.request.PlanRequest` in, a
:class:`StrategyMap` out, and the registry of auto_parallel's searches.

:func:`plan_request` picks the planner of a request: the user's strategies with the fill-in
for stand_alone, data_parallel and semi_auto_parallel (:mod:`simpar.search.propagation`), and
for auto_parallel the search registered under the request's ``search_mode``.
:func:`plan_strategies` builds the request from its arguments and the context, and plans it.

A search joins with ``register_search("name", planner)``: a run-time registration also makes
``"name"`` a ``search_mode`` the context accepts, so that ``set_auto_parallel_context(
parallel_mode="auto_parallel", search_mode="name")`` plans with it. The built-in names
(``simpar.context.BUILTIN_SEARCH_MODES``) are the context's own; ``simpar.search`` registers
their planners when imported and checks that none is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from simpar import comm
from simpar._keyspec import ContextError, ContextTypeError
from simpar.context import BUILTIN_SEARCH_MODES, register_search_mode
from simpar.graph import Graph
from simpar.layout import IndivisibleError
from simpar.ops.strategy import StrategyError
from simpar.optimizer_parallel import ParamFacts, shard_parameters
from simpar.search.dimensions import DimensionSearch, Spread, search_dimensions
from simpar.search.exact import TimeLimitWarning
from simpar.search.pricing import NoAvailableCost
from simpar.search.propagation import follow_producers
from simpar.search.request import PlanRequest, request_from_context
from simpar.search.strategy_map import StrategyMap

__all__ = ["OptimizerShardWarning", "PlanRequest", "Planner", "check_builtin_searches",
           "WorldSpread", "complete_plan", "plan_once", "plan_request", "plan_strategies",
           "planning_gc", "register_search", "registered_searches", "search_for",
           "shard_optimizer"]

#: A planner: pure, no MPI; it returns a strategy for every node of ``request.graph``.
Planner = Callable[[PlanRequest], StrategyMap]

_SEARCHES: dict[str, Planner] = {}


def register_search(name: str, planner: Planner) -> None:
    """Make ``planner`` the auto_parallel search for ``search_mode=name`` (and ``name`` an
    accepted ``search_mode``). Registering a name again replaces its planner."""
    if not callable(planner):
        raise TypeError(f"register_search: planner must be callable, got "
                        f"{type(planner).__name__}")
    if name not in BUILTIN_SEARCH_MODES:
        register_search_mode(name, honoured=True)
    _SEARCHES[name] = planner


def registered_searches() -> tuple[str, ...]:
    """The search_modes that have a planner."""
    return tuple(_SEARCHES)


def check_builtin_searches() -> None:
    """Raise ImportError unless every built-in search_mode has a planner."""
    missing = [name for name in BUILTIN_SEARCH_MODES if name not in _SEARCHES]
    if missing:
        raise ImportError(f"simpar.search: the built-in search_modes {missing} have no planner; "
                          "register one with register_search")


def search_for(search_mode: str) -> Planner:
    """The planner of ``search_mode``; NotImplementedError when none is registered yet."""
    found = _SEARCHES.get(search_mode)
    if found is None:
        have = f"; implemented: {list(_SEARCHES)}" if _SEARCHES else ""
        raise NotImplementedError(
            f"parallel_mode='auto_parallel' needs the strategy search, which is not "
            f"implemented yet (search_mode {search_mode!r}{have}); use semi_auto_parallel "
            "with .shard() strategies, or data_parallel")
    return found


#: The young generation's collection threshold while planning (CPython's default is 700).
PLANNING_GC_THRESHOLD = 7000


@contextlib.contextmanager
def planning_gc() -> Iterator[None]:
    """Collect garbage ten times less often while planning, then as before.

    A search keeps most of what it allocates (priced strategies, cost tables) and makes
    little cyclic garbage, so CPython's default threshold runs young collections that free
    nothing, and full ones over every survivor each time the survivors grow by a quarter. On
    the 96-layer GPT of 1.3B widths on 1024 devices those took 0.6 s of recursive
    programming's 2.9 s and 3.2 s of dynamic programming's 28 s. A threshold already higher
    (or the collector off) is left alone."""
    old = gc.get_threshold()
    if old[0] == 0 or old[0] >= PLANNING_GC_THRESHOLD:
        yield
        return
    gc.set_threshold(PLANNING_GC_THRESHOLD, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def plan_request(request: PlanRequest, spread: Spread | None = None) -> StrategyMap:
    """Every op's strategy, every parameter's and input's layout, for ``request``: the
    search registered for ``request.search_mode`` in auto_parallel, else the user's
    strategies with the fill-in (:func:`~simpar.search.propagation.follow_producers`).
    ``spread`` plans the memory dimensions' combinations over workers (:class:`Spread`;
    :func:`plan_once` gives the ranks of the world); the map is the same."""
    with planning_gc():
        return _plan_request(request, spread)


def _plan_request(request: PlanRequest, spread: Spread | None = None) -> StrategyMap:
    if _searches_dimensions(request):
        return search_dimensions(request, search_for(request.search_mode), complete_plan,
                                 spread)
    if request.mode == "auto_parallel":
        smap = search_for(request.search_mode)(request)
    else:
        smap = follow_producers(request)
    return complete_plan(request, smap)


def complete_plan(request: PlanRequest, smap: StrategyMap) -> StrategyMap:
    """``smap`` (searched, propagated or loaded from a strategy file) with the request's
    dimensions beyond the cuts: the optimizer slices (:func:`shard_optimizer`), the
    micro-batches per step and the recomputed Cells."""
    smap = shard_optimizer(request, smap)
    if (request.micro_batches, request.recompute, request.comm_fusion) != (
            smap.micro_batches, smap.recompute, smap.comm_fusion):
        smap = dataclasses.replace(smap, micro_batches=request.micro_batches,
                                   recompute=request.recompute,
                                   comm_fusion=request.comm_fusion)
    return smap


class OptimizerShardWarning(UserWarning):
    """Optimizer parallel leaves a parameter whole that its settings would slice (MindSpore
    warns so too): a shard size that does not divide its group, or rows that do not divide."""


def shard_optimizer(request: PlanRequest, smap: StrategyMap) -> StrategyMap:
    """``smap`` with every parameter laid out and each one ``request.optimizer`` slices
    recorded (:func:`~simpar.optimizer_parallel.shard_parameters`); unchanged when optimizer
    parallel is off. Warns once naming the parameters left whole for a reason other than the
    threshold or being untrainable."""
    if not request.optimizer.enabled:
        return smap
    g = request.graph
    layouts = []
    for node in g.nodes:
        chosen = smap.ops[node.name]
        layouts.append(node.op.sharding([v.shape for v in node.inputs], request.device_num,
                                        chosen.in_strategy, chosen.out_strategy,
                                        request.enable_alltoall).in_layouts)
    smap = smap.complete(g, layouts)
    facts = {v.name: ParamFacts(smap.params[v.name], v.dtype.itemsize,
                                v.param is not None and v.param.requires_grad)
             for v in g.params}
    shards, whole = shard_parameters(facts, request.optimizer)
    odd = {n: why for n, why in whole.items() if "threshold" not in why and
           why != "not trainable" and "no two ranks" not in why}
    if odd:
        listed = "; ".join(f"{n}: {why}" for n, why in list(odd.items())[:4])
        warnings.warn(f"optimizer parallel ({request.optimizer.level}) leaves {len(odd)} "
                      f"parameters whole: {listed}", OptimizerShardWarning, stacklevel=3)
    return dataclasses.replace(smap, shards=shards)


def plan_strategies(graph: Graph, device_num: int, mode: str,
                    dataset_strategy: Any = "full_batch", enable_alltoall: bool = False,
                    parameter_plan: Mapping[str, Sequence[int]] | None = None,
                    search_mode: str | None = None) -> StrategyMap:
    """The plan of ``graph`` on ``device_num`` devices in ``mode`` ("stand_alone" plans for
    one device); auto_parallel runs the search registered for ``search_mode`` (default: the
    context's). The algo parameters and the cost model are the context's
    (:func:`~simpar.search.request.request_from_context`)."""
    return plan_request(request_from_context(
        graph, parameter_plan=parameter_plan or {}, device_num=device_num, mode=mode,
        dataset_strategy=dataset_strategy, enable_alltoall=enable_alltoall,
        search_mode=search_mode))


#: Errors a rank's planning may raise, raised again by that name on every other rank (another
#: is raised as the first of these it derives from, or else as a RuntimeError naming it). No
#: class is looked up by a name it sent.
_SHARED_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (NoAvailableCost, StrategyError, IndivisibleError, ContextError,
                            ContextTypeError, ValueError, TypeError, KeyError,
                            NotImplementedError, TimeoutError, MemoryError)}
_SHARED_WARNINGS: dict[str, type[Warning]] = {
    w.__name__: w for w in (UserWarning, RuntimeWarning, DeprecationWarning,
                            OptimizerShardWarning, TimeLimitWarning)}


def _searches_dimensions(request: PlanRequest) -> bool:
    """Whether ``request`` searches the memory dimensions (whose combinations
    :func:`plan_once` spreads over the ranks)."""
    return request.mode == "auto_parallel" and request.algo.memory_dimensions != "fixed"


def plan_once(request: PlanRequest, together: bool = False) -> StrategyMap:
    """:func:`plan_request` once for the world (a stage's, inside a stage), instead of every
    rank repeating the same pure search. Where the memory dimensions are searched, their
    combinations are spread over the ranks (:class:`WorldSpread`: each rank plans its share
    and every rank gets every plan, and so chooses as one process would); otherwise rank 0
    plans, and sends its map to every other rank as JSON (:meth:`StrategyMap.to_dict`). The
    warnings the planning gave are given on every rank, and an error it raised is raised on
    every rank (the same type for :data:`_SHARED_ERRORS`, its ``memory`` and ``search``
    kept), so no rank waits on a plan that will not come. One process plans by itself, and
    so does a request for fewer devices than the world unless ``together`` says that every
    rank of the world calls with it (a pipeline's stages, which every rank plans in turn)."""
    if comm.get_group_size() == 1 or (request.device_num != comm.get_group_size()
                                      and not together):
        return plan_request(request)
    if _searches_dimensions(request):
        return plan_request(request, WorldSpread())
    failed: Exception | None = None
    if comm.get_rank() == 0:
        with warnings.catch_warnings(record=True) as caught:
            try:
                # (no memory dimensions searched: the map has no search of them to send)
                payload: dict[str, Any] = {"map": plan_request(request).to_dict()}
            except Exception as e:   # every rank must hear of it
                failed = e
                payload = {"error": _error_payload(e)}
        payload["warnings"] = _warnings_payload(caught)
        text = comm.broadcast_text(json.dumps(payload))
    else:
        text = comm.broadcast_text(None)
    got = json.loads(text)
    _warn(got["warnings"])
    if failed is not None:
        raise failed
    if "error" in got:
        raise _shared_error(got["error"])
    return StrategyMap.from_dict(got["map"])


class WorldSpread:
    """The ranks of the world (a stage's, inside a stage) as the workers of a search
    (:class:`~simpar.search.dimensions.Spread`): item ``i`` runs on rank ``i % size``, and
    every rank gets every item's value (JSON over :func:`~simpar.comm.allgather_text`), the
    warnings each gave, in item order, and the first error one raised (by item order; the
    rank that ran it raises it as it was)."""

    def map(self, work: Callable[[int], Any], count: int) -> list[Any]:
        rank, size = comm.get_rank(), comm.get_group_size()
        mine: dict[int, dict[str, Any]] = {}
        failed: dict[int, Exception] = {}
        for i in range(rank, count, size):
            with warnings.catch_warnings(record=True) as caught:
                try:
                    mine[i] = {"value": work(i)}
                except Exception as e:   # every rank must hear of it
                    failed[i], mine[i] = e, {"error": _error_payload(e)}
            mine[i]["warnings"] = _warnings_payload(caught)
            if i in failed:
                break   # the others wait for this rank: it plans nothing more
        got: dict[int, dict[str, Any]] = {}
        for text in comm.allgather_text(json.dumps({str(i): v for i, v in mine.items()})):
            got.update((int(i), v) for i, v in json.loads(text).items())
        for i in range(count):
            _warn(got[i]["warnings"])
            if "error" in got[i]:
                raise failed.get(i) or _shared_error(got[i]["error"])
        return [got[i]["value"] for i in range(count)]


def _error_payload(e: Exception) -> dict[str, Any]:
    """What every rank needs to raise ``e`` again (:func:`_shared_error`); never raises."""
    try:
        search = getattr(e, "search", None)
        return {"type": _shared_type(e), "message": str(e),
                "memory": getattr(e, "memory", None),
                "search": None if search is None else search.to_dict()}
    except Exception:   # (an error that cannot be described must still reach every rank)
        return {"type": "RuntimeError", "message": repr(e), "memory": None, "search": None}


def _warnings_payload(caught: Sequence[warnings.WarningMessage]) -> list[list[str]]:
    return [[w.category.__name__, str(w.message)] for w in caught]


def _warn(sent: Sequence[Sequence[str]]) -> None:
    """Give the warnings another rank's planning gave (category by name, as it sent them)."""
    for name, message in sent:
        warnings.warn(message, _SHARED_WARNINGS.get(name, UserWarning), stacklevel=3)


def _shared_type(e: Exception) -> str:
    """The name ``e`` is sent under: its class's, or its first base class's that every rank
    raises again by name (:data:`_SHARED_ERRORS`)."""
    return next((c.__name__ for c in type(e).__mro__ if _SHARED_ERRORS.get(c.__name__) is c),
                type(e).__name__)


def _shared_error(error: Mapping[str, Any]) -> Exception:
    """The exception another rank's planning raised, as that rank sent it."""
    kind, message = _SHARED_ERRORS.get(error["type"]), str(error["message"])
    if kind is NoAvailableCost:
        out: Exception = NoAvailableCost(message, error["memory"])
        if error["search"] is not None:
            out.search = DimensionSearch.from_dict(error["search"])  # type: ignore[attr-defined]
        return out
    if kind is None:
        return RuntimeError(f"planning failed on another rank with {error['type']}: "
                            f"{message}")
    return kind(message)
