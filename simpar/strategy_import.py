"""Strategy files MindSpore wrote, applied to simpar's traced graph.

MindSpore names an op by its own graph (``Default/network-WithLossCell/_backbone-Net/
MatMul-op3``, numbered in its compile order), so the op keys of a file it wrote seldom match
the ops simpar traces. What does carry over is keyed by name on both sides: the parameters'
layouts (``parallel_layout_item``). So a file without simpar's own section, whose op keys do
not all match the graph, is applied this way (:func:`plan_with_file`):

* every parameter layout of the file whose parameter the graph has is kept, as a
  ``parameter_plan`` (the cuts its ``dev_matrix`` and ``tensor_map`` give each dimension);
  a parameter is found by its exact name, else by its name without the wrapper's prefix
  (``_backbone.``, ``network.``: MindSpore's ``WithLossCell`` adds none), and a key from
  ``merge_pipeline_strategys`` (``"1-fc1.weight"``: the stage, a dash, the name) by the name
  after the stage;
* every op strategy whose key the graph has is kept, as if set with ``.shard()``;
* the rest is planned as the mode plans it (the fill-in in semi_auto_parallel, the search in
  auto_parallel) around those;
* the file's op keys that match no op are named in one warning
  (:class:`UnmatchedStrategyWarning`), with how many of the graph's ops were planned, not
  refused one by one.

A file that simpar wrote, or whose op keys all match, loads exactly as before
(:func:`simpar.strategy_file.load_strategy`).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

from simpar.search import PlanRequest, StrategyMap, complete_plan, plan_request
from simpar.strategy_file import load_strategy, read_strategy_document

__all__ = ["UnmatchedStrategyWarning", "file_parameter_plan", "plan_with_file"]

#: The prefixes a simpar parameter name may carry that MindSpore's does not.
_WRAPPER_PREFIXES = ("_backbone.", "network.", "_network.")
_STAGE = re.compile(r"^(\d+)-(.+)$")


class UnmatchedStrategyWarning(UserWarning):
    """A strategy file names ops the traced graph does not have (a file MindSpore wrote)."""


def _bare(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _cuts(item: dict[str, Any], ndim: int) -> tuple[int, ...] | None:
    """The cut of each dimension a layout item gives (None when it does not fit ``ndim``)."""
    dm, tmap = list(item["dev_matrix"]), list(item["tensor_map"])
    if len(tmap) != ndim:
        return None
    return tuple(1 if m == -1 else int(dm[len(dm) - 1 - m]) for m in tmap)


def file_parameter_plan(doc: dict[str, Any], params: dict[str, tuple[int, ...]]
                        ) -> dict[str, tuple[int, ...]]:
    """{graph parameter name: cuts} of the file's layout items whose parameters ``params``
    ({name: shape}) has, matched as the module docstring says."""
    by_bare: dict[str, str] = {}
    for param in params:
        by_bare.setdefault(_bare(param), param)
    plan: dict[str, tuple[int, ...]] = {}
    for key, item in doc.get("parallel_layout_item", {}).items():
        staged = _STAGE.match(key)
        for candidate in (key, *([staged.group(2)] if staged else [])):
            name: str | None = candidate if candidate in params else by_bare.get(
                _bare(candidate))
            if name is not None:
                cuts = _cuts(item, len(params[name]))
                if cuts is not None and all(n % c == 0 for n, c in zip(params[name], cuts)):
                    plan[name] = cuts
                break
    return plan


def plan_with_file(path: str, request: PlanRequest, dataset_strategy: Any = None
                   ) -> StrategyMap:
    """The plan ``request`` gets from the strategy file ``path``, completed
    (:func:`~simpar.search.complete_plan`): the file's own map when it is simpar's or matches
    every op, else the file's parameter layouts and matching op strategies with the rest
    planned around them (module docstring)."""
    doc = read_strategy_document(path)
    graph = request.graph
    nodes = {node.name: node for node in graph.nodes}
    items = doc.get("parallel_strategy_item", {})
    if "simpar" in doc or not isinstance(items, dict) or set(items) >= set(nodes):
        return complete_plan(request, load_strategy(path, graph, request.device_num,
                                                    mode=request.mode,
                                                    dataset_strategy=dataset_strategy))
    matched = {name: item for name, item in items.items() if name in nodes}
    unmatched = sorted(set(items) - set(matched))
    params = {v.name: tuple(v.shape) for v in graph.params}
    plan = {**file_parameter_plan(doc, params), **dict(request.parameter_plan)}
    graphs = [graph, *(g for g in (request.micro_graphs or {}).values() if g is not graph)]
    for name, item in matched.items():
        strategy = tuple(tuple(int(c) for c in s) for s in item["parallel_strategy"])
        for g in graphs:   # every micro-batch count's graph that auto_parallel may choose
            for node in g.nodes:
                if node.name == name:
                    node.op.shard(strategy)
    if unmatched:
        shown = ", ".join(repr(n) for n in unmatched[:5]) + (
            f" and {len(unmatched) - 5} more" if len(unmatched) > 5 else "")
        warnings.warn(
            f"load_strategy: {path!r} holds {len(unmatched)} op strategies this graph has no "
            f"op for ({shown}): a file MindSpore wrote names ops by its own graph. Applied: "
            f"{len(matched)} op strategies and {len(plan)} parameter layouts of the file; "
            f"the other {len(nodes) - len(matched)} of the graph's {len(nodes)} ops are "
            f"planned around them ({request.mode})", UnmatchedStrategyWarning, stacklevel=3)
    return plan_request(dataclasses.replace(request, parameter_plan=plan))
