"""Strategy files of a pipelined plan, as MindSpore keeps them.

MindSpore saves one strategy file per rank under ``pipeline_stages``, holding its stage's ops,
each item with its ``"stage"``; ``merge_pipeline_strategys(src_strategy_dirs,
dst_strategy_file)`` merges a directory of them into one file of every stage. simpar does the
same (:func:`pipeline_document`, :func:`merge_pipeline_strategys`), and keeps in its own
section what planning a pipeline again needs: the stage count, and per virtual stage its
stage, chunk, graph fingerprint, inputs and parameter layouts (a parameter two stages read,
a tied embedding and head, is laid out by each)::

    {"current_stage": 1,
     "parallel_strategy_item": {"…/blocks.3-Block/…/MatMul-op41": {"stage": 1, …}, …},
     "parallel_layout_item": {…},
     "simpar": {"device_num": 4, "pipeline_stages": 2,
                "virtual_stages": {"0": {"stage": 0, "chunk": 0, "graph_fingerprint": …,
                                         "inputs": {…}, "params": {…}}, …}, …}}

Loading (:func:`stage_strategy_maps`) cuts the file back into one map per virtual stage,
each checked against its stage's graph as :func:`~simpar.strategy_file.load_strategy` checks
a whole graph; an op filed under another stage than the network puts it on, an op no stage
has, and a stage the file does not cover are refused by name. A plain MindSpore file (no
``simpar`` section) loads by its op names and parameter layouts alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from simpar import _checks as checks
from simpar.runtime import ParallelProgram
from simpar.search import StrategyMap
from simpar.strategy_file import (
    document_strategy_map,
    read_strategy_document,
    strategy_document,
    write_strategy_document,
)

__all__ = ["merge_pipeline_strategys", "pipeline_document", "save_pipeline_strategy",
           "stage_strategy_maps"]

_OWN = "simpar"
_ITEMS = ("parallel_strategy_item", "parallel_out_strategy_item")
_LAYOUTS = "parallel_layout_item"


def pipeline_document(programs: Sequence[ParallelProgram], pipeline_stages: int, *,
                      stage: int | None = None, search_mode: str | None = None,
                      cost_model: str | None = None, only_trainable_params: bool = True
                      ) -> dict[str, Any]:
    """The strategy file of a pipelined plan: ``programs`` per virtual stage (chunk ``c`` of
    stage ``s`` is ``c * pipeline_stages + s``), every stage's ops, or with ``stage`` that
    stage's only (the file a rank of it saves, as MindSpore does)."""
    docs = {}
    for v, prog in enumerate(programs):
        if stage is None or v % pipeline_stages == stage:
            assert prog.strategy_map is not None
            docs[v] = strategy_document(prog.strategy_map, prog.graph, search_mode, cost_model,
                                        only_trainable_params)
    return _merged(docs, pipeline_stages, programs[0].device_num, "pipeline_document")


def _merged(docs: dict[int, dict[str, Any]], pipeline_stages: int, device_num: int,
            func: str, sources: dict[int, str] | None = None) -> dict[str, Any]:
    """One document of the virtual stages ``docs`` (each a one-stage document, its items at
    stage 0, or already a pipeline's); an op two of them give differently is refused."""
    out: dict[str, Any] = {"current_stage": 1, _ITEMS[0]: {}, _LAYOUTS: {}}
    own: dict[str, Any] = {"pipeline_stages": pipeline_stages, "virtual_stages": {},
                           "op_types": {}}
    where: dict[str, int] = {}
    for v, doc in sorted(docs.items()):
        mine = doc.get(_OWN, {})
        for key in ("version", "mode", "search_mode", "cost_model"):
            own.setdefault(key, mine.get(key))
        own["device_num"] = device_num
        own["op_types"].update(mine.get("op_types", {}))
        for top in _ITEMS:
            for name, item in doc.get(top, {}).items():
                item = {**item, "stage": v % pipeline_stages}
                found = out.setdefault(top, {}).setdefault(name, item)
                if found != item:
                    files = sources or {}
                    raise ValueError(f"{func}: op {name!r} has {top} {found} in "
                                     f"{files.get(where[name], 'one stage')} but {item} in "
                                     f"{files.get(v, 'another')}")
                where.setdefault(name, v)
        for name, item in doc.get(_LAYOUTS, {}).items():
            out[_LAYOUTS].setdefault(name, item)
        own["virtual_stages"][str(v)] = {
            "stage": v % pipeline_stages, "chunk": v // pipeline_stages,
            "graph_fingerprint": mine.get("graph_fingerprint"), "graph": mine.get("graph"),
            "inputs": mine.get("inputs", {}), "params": doc.get(_LAYOUTS, {})}
    out[_OWN] = own
    return out


def save_pipeline_strategy(path: str, programs: Sequence[ParallelProgram],
                           pipeline_stages: int, stage: int | None = None, **kw: Any) -> None:
    """Write :func:`pipeline_document` to ``path`` (atomically)."""
    p = checks.path(path, "save_strategy: path")
    write_strategy_document(p, pipeline_document(programs, pipeline_stages, stage=stage, **kw),
                            "save_strategy")


def stage_strategy_maps(path: str, graphs: Sequence[Any], pipeline_stages: int,
                        device_num: int, mode: str | None = None) -> list[StrategyMap]:
    """The file's map for each virtual stage's graph in ``graphs`` (see the module), for
    ``device_num`` devices per stage."""
    func = "load_strategy"
    p = checks.path(path, f"{func}: path")
    doc = read_strategy_document(p)
    own = doc.get(_OWN, {}) if isinstance(doc.get(_OWN, {}), dict) else {}
    recorded = own.get("virtual_stages", {}) if isinstance(own.get("virtual_stages"),
                                                           dict) else {}
    stages_in_file = own.get("pipeline_stages")
    if stages_in_file is not None and stages_in_file != pipeline_stages:
        raise ValueError(f"{func}: {p!r} is a plan of {stages_in_file} pipeline stages, but "
                         f"pipeline_stages is {pipeline_stages}")
    items = doc.get(_ITEMS[0], {}) if isinstance(doc.get(_ITEMS[0]), dict) else {}
    known = {n.name for g in graphs for n in g.nodes}
    extra = [name for name in items if name not in known]
    if extra:
        raise ValueError(f"{func}: {p!r} names op {extra[0]!r}, which no stage of the network "
                         f"has ({len(extra)} such); the file was written for another network")
    maps = []
    for v, g in enumerate(graphs):
        s = v % pipeline_stages
        names = [n.name for n in g.nodes]
        if not any(name in items for name in names):
            raise ValueError(f"{func}: {p!r} holds no strategy of pipeline stage {s}"
                             f"{f' (chunk {v // pipeline_stages})' if v >= pipeline_stages else ''}"
                             "; a pipelined plan needs every stage's: merge the stages' files "
                             "(simpar.pipeline.merge_pipeline_strategys, MindSpore's "
                             "merge_pipeline_strategys) and load the merged file")
        for name in names:
            item = items.get(name)
            filed = item.get("stage") if isinstance(item, dict) else None
            if isinstance(filed, int) and not isinstance(filed, bool) and filed != s:
                raise ValueError(f"{func}: {p!r} files op {name!r} under pipeline stage "
                                 f"{filed}, but the network runs it on stage {s}")
        mine = recorded.get(str(v), {}) if isinstance(recorded.get(str(v)), dict) else {}
        params = {v_.name for v_ in g.params}
        layouts = {**doc.get(_LAYOUTS, {}), **mine.get("params", {})}
        sub: dict[str, Any] = {"current_stage": doc.get("current_stage", 1)}
        for top in _ITEMS:
            table = doc.get(top, {}) if isinstance(doc.get(top), dict) else {}
            sub[top] = {name: {**table[name], "stage": 0} if isinstance(table[name], dict)
                        else table[name] for name in names if name in table}
        sub[_LAYOUTS] = {name: item for name, item in layouts.items() if name in params}
        sub[_OWN] = {key: own[key] for key in ("version", "device_num", "mode", "search_mode",
                                               "cost_model") if key in own}
        sub[_OWN]["op_types"] = {name: t for name, t in own.get("op_types", {}).items()
                                 if name in names}
        for key in ("graph_fingerprint", "graph", "inputs"):
            if mine.get(key) is not None:
                sub[_OWN][key] = mine[key]
        maps.append(document_strategy_map(p, sub, g, device_num, mode))
    return maps


def merge_pipeline_strategys(src_strategy_dirs: str | os.PathLike[str],
                             dst_strategy_file: str | os.PathLike[str]) -> None:
    """Merge the strategy files of every pipeline stage in ``src_strategy_dirs`` (each
    ``.json`` there, as the ranks of a pipelined job saved them) into ``dst_strategy_file``:
    MindSpore's ``merge_pipeline_strategys``. A file of no stage, two files disagreeing on
    an op, and a stage no file holds are refused by name."""
    func = "merge_pipeline_strategys"
    src = checks.path(src_strategy_dirs, f"{func}: src_strategy_dirs")
    if not os.path.isdir(src):
        raise NotADirectoryError(f"{func}: src_strategy_dirs {src!r} is not a directory")
    dst = checks.path(dst_strategy_file, f"{func}: dst_strategy_file")
    names = sorted(f for f in os.listdir(src) if f.endswith(".json"))
    if not names:
        raise ValueError(f"{func}: {src!r} holds no .json strategy file")
    docs: dict[int, dict[str, Any]] = {}
    sources: dict[int, str] = {}
    counts: set[Any] = set()
    devices: set[Any] = set()
    for name in names:
        path = os.path.join(src, name)
        doc = read_strategy_document(path)
        own = doc.get(_OWN, {}) if isinstance(doc.get(_OWN), dict) else {}
        recorded = own.get("virtual_stages")
        if not isinstance(recorded, dict) or not recorded:
            raise ValueError(f"{func}: {path!r} is not a pipeline stage's strategy file (it "
                             "records no virtual stages)")
        counts.add(own.get("pipeline_stages"))
        devices.add(own.get("device_num"))
        for key, entry in recorded.items():
            v = int(key)
            if v in docs:
                continue   # the same stage saved by another of its ranks
            ops = {top: {n: item for n, item in doc.get(top, {}).items()
                         if n in (entry.get("graph") or {}).get("ops", doc.get(top, {}))}
                   for top in _ITEMS}
            docs[v] = {**ops, _LAYOUTS: entry.get("params", {}),
                       _OWN: {**own, **{k: entry.get(k) for k in ("graph_fingerprint", "graph",
                                                                   "inputs")}}}
            sources[v] = path
    if len(counts) != 1 or len(devices) != 1:
        raise ValueError(f"{func}: the files in {src!r} are of different plans (pipeline "
                         f"stages {sorted(map(str, counts))}, devices per stage "
                         f"{sorted(map(str, devices))})")
    (found_stages,), (found_devices,) = counts, devices
    stages: int = found_stages
    per_stage: int = found_devices
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
               for n in (stages, per_stage)):
        raise ValueError(f"{func}: the files in {src!r} record pipeline_stages {stages!r} and "
                         f"device_num {per_stage!r}; both must be ints >= 1")
    missing = sorted(set(range(stages)) - {v % stages for v in docs})
    if missing:
        raise ValueError(f"{func}: no file in {src!r} holds pipeline stage(s) {missing}")
    write_strategy_document(dst, _merged(docs, stages, per_stage, func, sources), func)
