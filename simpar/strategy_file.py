"""Strategy files: a :class:`~simpar.search.StrategyMap` saved as MindSpore's JSON strategy
file, and loaded back, checked against the graph it is meant for.

The file is the one MindSpore writes for ``strategy_ckpt_config={"save_file": "s.json"}`` and
reads with ``build_searched_strategy`` or ``strategy_ckpt_config={"load_file": ...}``::

    {"current_stage": 1,
     "parallel_strategy_item": {
      "Default/network-Net/MatMul-op0": {"stage": 0, "parallel_strategy": [[2, 1], [1, 4]]}},
     "parallel_layout_item": {
      "w": {"dev_matrix": [2, 1, 4], "tensor_map": [1, 0], "tensor_shape": [16, 32],
            "param_split_shape": [], "indices_offset": [], "field": 0,
            "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}},
     "simpar": {"version": 1, "device_num": 8, "mode": "auto_parallel", ...}}

That is ``MatMul().shard(((2, 1), (1, 4)))`` reading the weight ``w`` as its input B. On rank 5
of that ``dev_matrix`` (coordinate (1, 0, 1)), ``w`` holds all 16 rows (map value 1 is the
size-1 device axis) and columns 8..15 (map value 0 is the last axis, of 4).

What MindSpore's readers need, and therefore what is written:

* The extension decides the format: MindSpore reads a name that does not end in ``.json`` as
  protobuf (``_build_searched_strategy``), so simpar reads and writes ``.json`` names only,
  and never anything but JSON (no pickle, no protobuf).
* ``tensor_map`` counts device axes from the right, ``-1`` for a whole dimension, one int per
  dimension: MindSpore's Python reader appends each entry to an int field, so a dimension that
  simpar splits over several consecutive device axes is written as one merged axis (the same
  block on every rank). ``field``, ``opt_weight_shard_step`` and ``opt_weight_shard_size`` are
  required ints there; ``tensor_shape`` is required by MindSpore's C++ reader (and written by its
  writer), so it is written although DESIGN.md's sketch of the format leaves it out.
* Op keys are the traced graph's MindSpore-style scope names. (MindSpore r1.0 keyed an op by its
  primitive name, ``"_"`` and the name of its first parameter, e.g. ``"MatMul_fc1.weight"``.)
  Out strategies go under MindSpore's ``parallel_out_strategy_item``.

simpar's own keys sit under ``"simpar"``, which MindSpore ignores: the format version, the
device count, the mode, the search and cost model that produced the strategies, each op's type,
the graph inputs' layouts, and, when the graph is given, :func:`graph_fingerprint` with a
one-line signature per op, parameter and input, so that loading for another graph can say which
op differs. A plain MindSpore file lacks them all and still loads: op types then come from the
graph (or the op key), the device count from ``device_num=`` or the layouts' ``dev_matrix``, and
the map has no input layouts unless ``load_strategy`` is given the ``dataset_strategy`` (as
MindSpore takes the inputs' layout from the dataset strategy rather than from the strategy
file); without one, ``lower`` holds such inputs whole.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from simpar import _checks as checks
from simpar._env import write_atomically
from simpar.graph import Graph, Node, Value
from simpar.layout import TensorLayout
from simpar.ops.strategy import StrategyError
from simpar.optimizer_parallel import ParamShard
from simpar.search import OpStrategy, Source, StrategyMap, dataset_layouts
from simpar.search.strategy_map import MAP_MODES

__all__ = ["FORMAT_VERSION", "document_strategy_map", "graph_fingerprint", "load_strategy",
           "read_strategy_document", "save_strategy", "strategy_document",
           "write_strategy_document"]

#: The version of simpar's own section; a file of a newer version is refused, not misread.
FORMAT_VERSION = 1

_OWN = "simpar"
# Dictionaries whose keys are all field names are written on one line; the others (keyed by
# op, parameter or input name) one entry per line, so that a file reads and diffs by op.
_FIELDS = frozenset({"stage", "parallel_strategy", "dev_matrix", "tensor_map", "tensor_shape",
                     "param_split_shape", "indices_offset", "field", "opt_weight_shard_step",
                     "opt_weight_shard_size", "device_matrix", "shape", "partial"})


# ---------------------------------------------------------------- the graph's signature
def _tensor(v: Value) -> str:
    return f"{v.dtype.name}{list(v.shape)}"


def _signatures(graph: Graph) -> dict[str, dict[str, str]]:
    """One line per op ("MatMul(float32[8, 16], float32[32, 16]) -> float32[8, 32]"),
    parameter and graph input: what a strategy file depends on, in trace order."""
    def op(n: Node) -> str:
        ins, outs = ", ".join(map(_tensor, n.inputs)), ", ".join(map(_tensor, n.outputs))
        return f"{n.op.name}({ins}) -> {outs}"
    return {"ops": {n.name: op(n) for n in graph.nodes},
            "params": {v.name: _tensor(v) for v in graph.params},
            "inputs": {v.name: _tensor(v) for v in graph.inputs}}


def graph_fingerprint(graph: Graph) -> str:
    """The sha256 (hex) of ``graph``'s op names, op types, input and output shapes and dtypes,
    parameter and input names, shapes and dtypes, in trace order. Two traces of the same
    network on the same input shapes agree; a changed batch size or layer width does not.

    >>> graph_fingerprint(trace(nn.MLP(16, 32, 8), [((8, 16), np.float32)]))  # doctest: +SKIP
    '3f1c…'
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"graph_fingerprint: graph must be a simpar.graph.Graph, got "
                        f"{type(graph).__name__}")
    text = json.dumps(_signatures(graph), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- arguments
def _path(func: str, path: object) -> str:
    p = checks.path(path, f"{func}: path")
    if not p.endswith(".json"):
        raise ValueError(f"{func}: path {p!r} must end in '.json': MindSpore reads any other "
                         "name as a protobuf strategy file, and simpar reads and writes JSON "
                         "only")
    return p


def _optional_str(func: str, name: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{func}: {name} must be a str or None, got {type(value).__name__} "
                        f"{value!r}")


def _check_graph(func: str, graph: object) -> None:
    if graph is not None and not isinstance(graph, Graph):
        raise TypeError(f"{func}: graph must be a simpar.graph.Graph (simpar.graph.trace) or "
                        f"None, got {type(graph).__name__}")


def _closest(name: str, names: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (closest: {close[0]!r})" if close else ""


# ---------------------------------------------------------------- saving
def save_strategy(path: str | os.PathLike[str], strategy_map: StrategyMap,
                  graph: Graph | None = None, *, search_mode: str | None = None,
                  cost_model: str | None = None, only_trainable_params: bool = True) -> None:
    """Write ``strategy_map`` to ``path`` (a ``.json`` name) as MindSpore's strategy file.

    With ``graph`` (the traced graph the map was planned for), the map must name exactly its
    ops, the file records :func:`graph_fingerprint` and every op's signature, and with
    ``only_trainable_params`` (MindSpore's default) only parameters with ``requires_grad`` get
    a layout item. ``search_mode`` and ``cost_model`` (e.g. "dynamic_programming",
    "ascend910a") are recorded for whoever reads the file.

    The write is atomic: the file is written beside ``path`` under a temporary name, flushed
    to disk and renamed over ``path``. On any error the temporary file is removed and an old
    ``path`` is left as it was, so several ranks may save the same map to the same path.

    >>> save_strategy("strategy.json", smap, g, search_mode="dynamic_programming")  # doctest: +SKIP
    """
    func = "save_strategy"
    p = _path(func, path)
    if not isinstance(strategy_map, StrategyMap):
        raise TypeError(f"{func}: strategy_map must be a simpar.search.StrategyMap, got "
                        f"{type(strategy_map).__name__}")
    _check_graph(func, graph)
    _optional_str(func, "search_mode", search_mode)
    _optional_str(func, "cost_model", cost_model)
    if not isinstance(only_trainable_params, bool):
        raise TypeError(f"{func}: only_trainable_params must be a bool, got "
                        f"{only_trainable_params!r}")
    write_strategy_document(p, strategy_document(strategy_map, graph, search_mode, cost_model,
                                                 only_trainable_params), func)


def write_strategy_document(path: str, doc: Mapping[str, Any], func: str) -> None:
    """Write a strategy file's document (:func:`strategy_document`) to ``path``, atomically;
    ``func`` names the caller in the error for a missing directory."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"{func}: the directory of {path!r} does not exist; create it first")
    write_atomically(path, _dumps(dict(doc)) + "\n")


def strategy_document(smap: StrategyMap, graph: Graph | None, search_mode: str | None,
                      cost_model: str | None, only_trainable_params: bool) -> dict[str, Any]:
    """The JSON document :func:`save_strategy` writes (see there)."""
    params = dict(smap.params)
    if graph is not None:
        _check_map_fits_graph(smap, graph)
        if only_trainable_params:
            frozen = {v.name for v in graph.params
                      if v.param is not None and not v.param.requires_grad}
            params = {name: lay for name, lay in params.items() if name not in frozen}
    doc: dict[str, Any] = {
        "current_stage": 1,
        "parallel_strategy_item": {name: _strategy_item(s.in_strategy)
                                   for name, s in smap.ops.items()},
        "parallel_layout_item": {name: _layout_item(name, lay, smap.device_num,
                                                    smap.shards.get(name))
                                 for name, lay in params.items()},
    }
    outs = {name: _strategy_item(s.out_strategy) for name, s in smap.ops.items()
            if s.out_strategy is not None}
    if outs:
        doc["parallel_out_strategy_item"] = outs
    own: dict[str, Any] = {
        "version": FORMAT_VERSION, "device_num": smap.device_num, "mode": smap.mode,
        "search_mode": search_mode, "cost_model": cost_model,
        "graph_fingerprint": graph_fingerprint(graph) if graph is not None else None,
        "op_types": {name: s.op_type for name, s in smap.ops.items()},
        "inputs": {name: lay.to_dict() for name, lay in smap.inputs.items()},
    }
    if graph is not None:
        own["graph"] = _signatures(graph)
    doc[_OWN] = own
    return doc


def _strategy_item(strategy: tuple[tuple[int, ...], ...] | None) -> dict[str, Any]:
    return {"stage": 0, "parallel_strategy": [list(cuts) for cuts in strategy or ()]}


def _check_map_fits_graph(smap: StrategyMap, graph: Graph) -> None:
    """The map was planned for ``graph``: the same op names and types, and only its
    parameters and inputs (the file would otherwise say it fits a graph it does not)."""
    nodes = {n.name: n for n in graph.nodes}
    missing = [name for name in nodes if name not in smap.ops]
    if missing:
        raise ValueError(f"save_strategy: the strategy map has no strategy for op "
                         f"{missing[0]!r} of the graph ({len(missing)} missing); save the map "
                         "with the graph it was planned for")
    for name, s in smap.ops.items():
        if name not in nodes:
            raise ValueError(f"save_strategy: the strategy map names op {name!r}, which the "
                             f"graph does not have{_closest(name, nodes)}")
        if s.op_type != nodes[name].op.name:
            raise ValueError(f"save_strategy: op {name!r} is a {nodes[name].op.name} in the "
                             f"graph, but the strategy map holds a {s.op_type} strategy")
    for table, values, what in ((smap.params, graph.params, "parameter"),
                                (smap.inputs, graph.inputs, "input")):
        shapes = {v.name: v.shape for v in values}
        for name, lay in table.items():
            if name not in shapes:
                raise ValueError(f"save_strategy: the strategy map lays out {what} {name!r}, "
                                 f"which the graph does not have{_closest(name, shapes)}")
            if lay.shape != shapes[name]:
                raise ValueError(f"save_strategy: {what} {name!r} has shape "
                                 f"{list(shapes[name])} in the graph, but its layout {lay} is "
                                 "for another shape")


def layouts_document(layouts: Mapping[str, TensorLayout], device_num: int) -> dict[str, Any]:
    """A strategy file of parameter layouts alone (``parallel_layout_item``, no op): what
    MindSpore's checkpoint tools read to place each rank's slices (a checkpoint's export,
    :mod:`simpar.checkpoint.export`)."""
    return {"current_stage": 1, "parallel_strategy_item": {},
            "parallel_layout_item": {name: _layout_item(name, lay, device_num)
                                     for name, lay in layouts.items()}}


def _layout_item(name: str, lay: TensorLayout, device_num: int,
                 shard: ParamShard | None = None) -> dict[str, Any]:
    """MindSpore's ``parallel_layout_item`` entry for a parameter held in ``lay``; under
    optimizer parallel (``shard``), ``opt_weight_shard_size`` is the number of ranks its
    slices are spread over and ``opt_weight_shard_step`` the rank stride of its repeated
    group, as MindSpore writes them (0 and 0 for a parameter kept whole)."""
    if lay.partial:
        raise ValueError(f"save_strategy: parameter {name!r} has layout {lay}, with pending "
                         f"sums (partial {list(lay.partial)}); a parameter's layout is whole")
    if lay.device_num != device_num:
        raise ValueError(f"save_strategy: parameter {name!r} has layout {lay} over "
                         f"{lay.device_num} devices, but the strategy map is for {device_num}")
    dev_matrix, tensor_map = _one_axis_per_dim(name, lay)
    step = size = 0
    if shard is not None:
        group = lay.replica_group(0)
        size, step = shard.size, (group[-1] - group[0]) // (len(group) - 1)
    return {"dev_matrix": dev_matrix, "tensor_map": tensor_map, "tensor_shape": list(lay.shape),
            "param_split_shape": [], "indices_offset": [], "field": 0,
            "opt_weight_shard_step": step, "opt_weight_shard_size": size}


def _one_axis_per_dim(name: str, lay: TensorLayout) -> tuple[list[int], list[int]]:
    """``lay``'s device matrix and tensor map with each dimension split over one device axis:
    a run of consecutive axes splitting one dimension (outer first) becomes one axis of their
    product, which gives every rank the same block. On (2, 2, 2), dim_axes ((0, 1), ()) is
    written as dev_matrix [4, 2], tensor_map [1, -1]."""
    dm = lay.device_matrix
    runs: dict[int, int] = {}  # first axis (from the left) of a multi-axis split -> its length
    for tensor_dim, axes in enumerate(lay.dim_axes):
        if len(axes) > 1:
            if list(axes) != list(range(axes[0], axes[0] + len(axes))):
                raise ValueError(f"save_strategy: parameter {name!r} has layout {lay}, which "
                                 f"splits dimension {tensor_dim} over device axes {list(axes)} "
                                 "that are not consecutive; MindSpore's strategy file holds "
                                 "one device axis per dimension")
            runs[axes[0]] = len(axes)
    merged: list[int] = []
    index: dict[int, int] = {}
    axis = 0
    while axis < len(dm):
        run = runs.get(axis, 1)
        index[axis] = len(merged)
        merged.append(math.prod(dm[axis:axis + run]))
        axis += run
    last = len(merged) - 1
    return merged, [last - index[axes[0]] if axes else -1 for axes in lay.dim_axes]


def _dumps(value: Any, indent: int = 0) -> str:
    if isinstance(value, dict) and value and not value.keys() <= _FIELDS:
        pad = " " * (indent + 1)
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    return json.dumps(value)


# ---------------------------------------------------------------- loading
def load_strategy(path: str | os.PathLike[str], graph: Graph | None = None,
                  device_num: int | None = None, *, mode: str | None = None,
                  dataset_strategy: Any = None) -> StrategyMap:
    """Read the strategy file ``path`` (simpar's or a plain MindSpore one) as a
    :class:`~simpar.search.StrategyMap` whose ops have source ``Source.FILE``.

    With ``graph``, the file must fit it: a strategy for every op and for no other, op types
    as recorded, every strategy valid for its op's input shapes on the devices, parameter
    layouts that cut their parameter's shape evenly, and the graph's fingerprint if the file
    records one (a difference names the op, parameter or input, as file versus graph).
    ``device_num``, when given, must equal the file's (``simpar.device_num``, or the device
    count of the layouts' ``dev_matrix``); a file that records neither needs it. ``mode``
    overrides the file's mode (default: the file's, else "auto_parallel").

    Without ``graph``, op types come from the file (or the op key, "…/MatMul-op0" is a MatMul)
    and parameter shapes from ``tensor_shape``. Graph inputs keep the layouts recorded under
    ``simpar.inputs``; a plain MindSpore file has none, and with ``graph`` and
    ``dataset_strategy`` they are the dataset's layouts (see the module docstring). MindSpore's
    optimizer weight sharding (``opt_weight_shard_*``) is read and ignored: it does not change
    the layout the forward reads, and simpar's optimizer parallel follows the context's
    settings when a file is loaded (``simpar.search.shard_optimizer``).

    >>> smap = load_strategy("strategy.json", graph, device_num=8)  # doctest: +SKIP
    >>> smap.ops["Default/network-MLP/fc1-Dense/MatMul-op0"].in_strategy  # doctest: +SKIP
    ((2, 1), (1, 4))
    """
    func = "load_strategy"
    p = _path(func, path)
    _check_graph(func, graph)
    if device_num is not None:
        checks.integer(device_num, f"{func}: device_num", 1, expected="an int or None")
    if mode is not None and mode not in MAP_MODES:
        raise ValueError(f"{func}: mode must be one of {list(MAP_MODES)} or None, got {mode!r}")
    smap = document_strategy_map(p, read_strategy_document(p), graph, device_num, mode)
    if graph is not None and dataset_strategy is not None and not smap.inputs:
        # A plain MindSpore file: the inputs are laid out by the dataset strategy, as there.
        layouts = dataset_layouts([v.shape for v in graph.inputs], smap.device_num,
                                  dataset_strategy)
        smap = dataclasses.replace(smap, inputs={v.name: lay
                                                 for v, lay in zip(graph.inputs, layouts)})
    return smap


def document_strategy_map(path: str, doc: dict[str, Any], graph: Graph | None,
                          device_num: int | None, mode: str | None) -> StrategyMap:
    """The map of a strategy file's document read from ``path`` (:func:`load_strategy`'s
    checks; no dataset layouts)."""
    return _Reader(path, doc).strategy_map(graph, device_num, mode)


def read_strategy_document(path: str) -> dict[str, Any]:
    """A strategy file's JSON document, refused (naming the file) unless it is one JSON
    object with no key twice."""
    return _read_json(path)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ValueError(f"load_strategy: no strategy file {path!r}")
    with open(path, "rb") as f:
        raw = f.read()
    if not raw:
        raise ValueError(f"load_strategy: the strategy file {path!r} is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"load_strategy: {path!r} is not a JSON strategy file: byte {e.start} is "
                         "not UTF-8 text (a protobuf strategy file? simpar reads JSON only)"
                         ) from None
    try:
        doc = json.loads(text, object_pairs_hook=_without_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"load_strategy: {path!r} is not valid JSON: {e}") from None
    except ValueError as e:
        raise ValueError(f"load_strategy: {path!r}: {e}") from None
    if not isinstance(doc, dict):
        raise TypeError(f"load_strategy: {path!r} must hold a JSON object with "
                        f"'parallel_strategy_item', got {_kind(doc)}")
    return doc


def _without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object; JSON readers would "
                             "silently keep one of the two")
        out[key] = value
    return out


def _kind(value: object) -> str:
    kinds = {bool: "a boolean", int: "an int", float: "a number", str: "a string",
             list: "a list", dict: "an object", type(None): "null"}
    text = json.dumps(value)
    return f"{kinds.get(type(value), type(value).__name__)} {text[:60]}{'…' * (len(text) > 60)}"


class _Reader:
    """One file's content, checked piece by piece; every error names the file and the key."""

    def __init__(self, path: str, doc: dict[str, Any]) -> None:
        self.path, self.doc = path, doc
        self.own = self._object(doc.get(_OWN, {}), f"[{_OWN!r}]", "an object of simpar's keys")

    # -- checked reads
    def _where(self, key: str) -> str:
        return f"load_strategy: {self.path!r}{key}"

    def _object(self, value: object, key: str, what: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise TypeError(f"{self._where(key)} must be {what}, got {_kind(value)}")
        return value

    def _int(self, value: object, key: str, low: int | None = None) -> int:
        return checks.integer(value, self._where(key), low, got=_kind)

    def _ints(self, value: object, key: str, what: str, low: int | None = None) -> list[int]:
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                              for v in value):
            raise TypeError(f"{self._where(key)} must be {what}, got {_kind(value)}")
        bad = [v for v in value if low is not None and v < low]
        if bad:
            raise ValueError(f"{self._where(key)} must be {what}, got {value} (holds {bad[0]})")
        return value

    def _required(self, item: dict[str, Any], field: str, key: str, needs: str) -> Any:
        if field not in item:
            raise ValueError(f"{self._where(key)} has no {field!r}; {needs}")
        return item[field]

    def _strategies(self, top: str) -> dict[str, tuple[tuple[int, ...], ...]]:
        items = self._object(self.doc.get(top, {}), f"[{top!r}]",
                             "an object {op name: {'stage': 0, 'parallel_strategy': [[...]]}}")
        needs = "each op item needs 'stage' and 'parallel_strategy'"
        out = {}
        for name, item in items.items():
            key = f"[{top!r}][{name!r}]"
            item = self._object(item, key, "an object {'stage': 0, 'parallel_strategy': [[...]]}")
            stage = self._int(self._required(item, "stage", key, needs), f"{key}['stage']")
            if stage != 0:
                raise ValueError(f"{self._where(key)} is for pipeline stage {stage}: the file "
                                 "is a pipelined plan's; load it with pipeline_stages set "
                                 "(strategy_ckpt_config's load_file under pipeline_stages)")
            cuts = self._required(item, "parallel_strategy", key, needs)
            what = "a list of lists of ints >= 1 (one list of cuts per op input)"
            if not isinstance(cuts, list):
                raise TypeError(f"{self._where(key)}['parallel_strategy'] must be {what}, got "
                                f"{_kind(cuts)}")
            out[name] = tuple(tuple(self._ints(c, f"{key}['parallel_strategy']", what, 1))
                              for c in cuts)
        return out

    def _optional_str(self, field: str) -> str | None:
        value = self.own.get(field)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{self._where(f'[{_OWN!r}][{field!r}]')} must be a string or "
                            f"null, got {_kind(value)}")
        return value

    def _names(self, value: object, key: str, what: str) -> dict[str, str]:
        table = self._object(value, key, f"an object {{{what}: string}}")
        for name, text in table.items():
            if not isinstance(text, str):
                raise TypeError(f"{self._where(f'{key}[{name!r}]')} must be a string, got "
                                f"{_kind(text)}")
        return table

    # -- the map
    def strategy_map(self, graph: Graph | None, device_num: int | None,
                     mode: str | None) -> StrategyMap:
        own = self.own
        version = self._int(own.get("version", FORMAT_VERSION), f"[{_OWN!r}]['version']", 1)
        if version > FORMAT_VERSION:
            raise ValueError(f"{self._where('')} was written by a newer simpar (format version "
                             f"{version}); this simpar reads version {FORMAT_VERSION}")
        if "current_stage" in self.doc:
            self._int(self.doc["current_stage"], "['current_stage']")
        strategies = self._strategies("parallel_strategy_item")
        outs = self._strategies("parallel_out_strategy_item")
        for name in outs:
            if name not in strategies:
                raise ValueError(f"{self._where('')}: parallel_out_strategy_item names op "
                                 f"{name!r}, which parallel_strategy_item does not")
        op_types = self._names(own.get("op_types", {}), f"[{_OWN!r}]['op_types']", "op name")
        layouts = self._layout_items()
        n = self._device_num(device_num, layouts)
        file_mode = own.get("mode", "auto_parallel")
        if file_mode not in MAP_MODES:
            mode_key = f"[{_OWN!r}]['mode']"
            raise ValueError(f"{self._where(mode_key)} must be one of {list(MAP_MODES)}, got "
                             f"{file_mode!r}")
        self._optional_str("search_mode")
        self._optional_str("cost_model")
        if graph is not None:
            self._check_graph(graph, strategies, outs, op_types, n)
            nodes = {node.name: node for node in graph.nodes}
            ops = {name: OpStrategy(nodes[name].op.name, strategies[name], outs.get(name),
                                    Source.FILE) for name in nodes}
        else:
            ops = {name: OpStrategy(op_types.get(name, _type_from_key(name)), s,
                                    outs.get(name), Source.FILE)
                   for name, s in strategies.items()}
        params = self._params(layouts, graph)
        inputs = self._inputs(graph, n)
        return StrategyMap(n, mode or file_mode, ops, params, inputs)

    def _layout_items(self) -> dict[str, dict[str, Any]]:
        top = "parallel_layout_item"
        items = self._object(self.doc.get(top, {}), f"[{top!r}]",
                             "an object {parameter name: {'dev_matrix': [...], ...}}")
        needs = "each layout item needs 'dev_matrix' and 'tensor_map'"
        for name, item in items.items():
            key = f"[{top!r}][{name!r}]"
            item = self._object(item, key, "an object {'dev_matrix': [...], 'tensor_map': [...]}")
            dm = self._ints(self._required(item, "dev_matrix", key, needs),
                            f"{key}['dev_matrix']", "a non-empty list of ints >= 1", 1)
            if not dm:
                raise ValueError(f"{self._where(key)}['dev_matrix'] must not be empty")
            self._ints(self._required(item, "tensor_map", key, needs), f"{key}['tensor_map']",
                       "a list of ints (-1: not split)", -1)
            if "tensor_shape" in item:
                self._ints(item["tensor_shape"], f"{key}['tensor_shape']", "a list of ints >= 0",
                           0)
            for field in ("field", "opt_weight_shard_step", "opt_weight_shard_size"):
                if field in item:
                    self._int(item[field], f"{key}[{field!r}]", 0)
            # The optimizer's weight sharding changes how the optimizer keeps the weight, not
            # the layout the forward reads, so simpar (which has none) reads the layout alone.
            if item.get("field", 0):
                raise ValueError(f"{self._where(key)} has field {item['field']} (a field-split "
                                 "embedding); simpar has no field split, field must be 0")
            for field in ("param_split_shape", "indices_offset"):
                if field in item and self._ints(item[field], f"{key}[{field!r}]",
                                                "a list of ints"):
                    raise ValueError(f"{self._where(key)} has {field} {item[field]} (an uneven "
                                     "manual split); simpar shards evenly, it must be []")
        return items

    def _device_num(self, device_num: int | None, layouts: dict[str, dict[str, Any]]) -> int:
        key = f"[{_OWN!r}]['device_num']"
        recorded = self._int(self.own["device_num"], key, 1) if "device_num" in self.own else None
        if device_num is not None and recorded is not None and device_num != recorded:
            raise ValueError(f"{self._where('')} was written for device_num {recorded}, but "
                             f"device_num is {device_num}; plan again for {device_num} devices")
        n = device_num if device_num is not None else recorded
        source = "argument device_num" if device_num is not None else key
        for name, item in layouts.items():
            count = math.prod(item["dev_matrix"])
            if n is None:
                n, source = count, f"the dev_matrix of parameter {name!r}"
            elif count != n:
                item_key = f"['parallel_layout_item'][{name!r}]"
                raise ValueError(f"{self._where(item_key)} has dev_matrix {item['dev_matrix']} "
                                 f"of {count} devices, but the strategy is for {n} devices "
                                 f"(from {source})")
        if n is None:
            raise ValueError(f"{self._where('')} records no device count (no simpar.device_num "
                             "and no parameter layout); pass device_num=")
        return n

    def _check_graph(self, graph: Graph, strategies: dict[str, tuple[tuple[int, ...], ...]],
                     outs: dict[str, tuple[tuple[int, ...], ...]], op_types: dict[str, str],
                     n: int) -> None:
        recorded = self.own.get("graph_fingerprint")
        if recorded is not None:
            if not isinstance(recorded, str):
                raise TypeError(f"{self._where(f'[{_OWN!r}]')}['graph_fingerprint'] must be a "
                                f"string or null, got {_kind(recorded)}")
            found = graph_fingerprint(graph)
            if recorded != found:
                raise ValueError(f"{self._where('')} was written for another graph "
                                 f"(graph_fingerprint {recorded[:12]}…, this graph's "
                                 f"{found[:12]}…): {self._differences(graph)}")
        nodes = {node.name: node for node in graph.nodes}
        missing = [name for name in nodes if name not in strategies]
        if missing:
            raise ValueError(f"{self._where('')}: parallel_strategy_item has no strategy for op "
                             f"{missing[0]!r} ({len(missing)} of the graph's {len(nodes)} ops "
                             "are missing); the file was written for another graph")
        for name in strategies:
            if name not in nodes:
                raise ValueError(f"{self._where('')}: parallel_strategy_item names op {name!r}, "
                                 f"which the graph does not have{_closest(name, nodes)}")
        for name, node in nodes.items():
            if name in op_types and op_types[name] != node.op.name:
                raise ValueError(f"{self._where('')}: op {name!r} is a {node.op.name} in the "
                                 f"graph, but the file holds a {op_types[name]} strategy for it")
            shapes = [v.shape for v in node.inputs]
            try:
                node.op.sharding(shapes, n, strategies[name], outs.get(name))
            except (StrategyError, ValueError, TypeError) as e:
                raise ValueError(f"{self._where('')}: op {name!r}: strategy "
                                 f"{[list(c) for c in strategies[name]]} does not fit input "
                                 f"shapes {[list(s) for s in shapes]} on {n} devices: {e}"
                                 ) from None

    def _differences(self, graph: Graph) -> str:
        """What differs between the graph the file describes and ``graph``, by name."""
        key = f"[{_OWN!r}]['graph']"
        stored = self._object(self.own.get("graph", {}), key, "an object of signatures")
        if not stored:
            return "the file does not describe its graph, so which op differs is unknown"
        now = _signatures(graph)
        found: list[str] = []
        for part, what in (("ops", "op"), ("params", "parameter"), ("inputs", "input")):
            old = self._names(stored.get(part, {}), f"{key}[{part!r}]", f"{what} name")
            new = now[part]
            for name, sig in new.items():
                if name not in old:
                    found.append(f"{what} {name!r} ({sig}) is in the graph but not the file")
                elif old[name] != sig:
                    found.append(f"{what} {name!r} is {old[name]} in the file but {sig} in the "
                                 "graph")
            found += [f"{what} {name!r} ({old[name]}) is in the file but not the graph"
                      for name in old if name not in new]
        if not found:
            return "every op, parameter and input reads alike, in another order"
        more = f"; and {len(found) - 3} more differences" if len(found) > 3 else ""
        return "; ".join(found[:3]) + more

    def _params(self, layouts: dict[str, dict[str, Any]], graph: Graph | None
                ) -> dict[str, TensorLayout]:
        shapes = {v.name: v.shape for v in graph.params} if graph is not None else None
        out = {}
        for name, item in layouts.items():
            where = f"{self._where('')}: parameter {name!r}"
            stated = tuple(item["tensor_shape"]) if "tensor_shape" in item else None
            if shapes is None:
                if stated is None:
                    raise ValueError(f"{where} has no tensor_shape; pass graph= so that its "
                                     "shape comes from the graph")
                shape = stated
            else:
                if name not in shapes:
                    raise ValueError(f"{where} is not a parameter of the graph"
                                     f"{_closest(name, shapes)}")
                shape = shapes[name]
                if stated is not None and stated != shape:
                    raise ValueError(f"{where} has tensor_shape {list(stated)} in the file but "
                                     f"shape {list(shape)} in the graph")
            try:
                out[name] = TensorLayout(item["dev_matrix"], item["tensor_map"], shape)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where}: dev_matrix {item['dev_matrix']} and tensor_map "
                                 f"{item['tensor_map']} do not fit its shape {list(shape)}: "
                                 f"{e}") from None
        return out

    def _inputs(self, graph: Graph | None, n: int) -> dict[str, TensorLayout]:
        key = f"[{_OWN!r}]['inputs']"
        table = self._object(self.own.get("inputs", {}), key, "an object {input name: layout}")
        shapes = {v.name: v.shape for v in graph.inputs} if graph is not None else None
        out = {}
        for name, d in table.items():
            where = self._where(f"{key}[{name!r}]")
            try:
                lay = TensorLayout.from_dict(self._object(d, f"{key}[{name!r}]", "a layout"))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where} is not a layout: {e}") from None
            if shapes is not None and name not in shapes:
                raise ValueError(f"{where} names an input the graph does not have"
                                 f"{_closest(name, shapes)}")
            if shapes is not None and lay.shape != shapes[name]:
                raise ValueError(f"{where} is for shape {list(lay.shape)}, but the graph's "
                                 f"input has shape {list(shapes[name])}")
            if lay.device_num != n:
                raise ValueError(f"{where} spans {lay.device_num} devices, not {n}")
            out[name] = lay
        return out


def _type_from_key(name: str) -> str:
    """The op type in a MindSpore-style op name: ".../fc1-Dense/MatMul-op0" is a MatMul."""
    return name.rsplit("/", 1)[-1].rsplit("-op", 1)[0]
