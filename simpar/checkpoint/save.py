"""Saving: every rank writes its own blocks and its ``index.json``
(:func:`save_shards`), then rank 0 checks that the blocks tile every tensor exactly once and
writes ``manifest.json`` (:func:`finish_checkpoint`).

Of the ranks holding one block (replicas along the layout's replica axes), only the lowest
writes it (:func:`writer_rank`). Every file is written to a temporary name, flushed and
renamed; a crash leaves no manifest, so no half checkpoint is ever read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

import numpy as np

from simpar import _checks as checks
from simpar._env import atomic_file, sync_directory
from simpar.checkpoint.manifest import (
    DTYPE_KINDS,
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    INDEX_FORMAT,
    MANIFEST,
    STRATEGY,
    JsonDoc,
    ShardFile,
    coverage_problem,
    device_of,
    existing_directory,
    file_name,
    load_json,
    name_problem,
    path_inside,
)
from simpar.layout import TensorLayout
from simpar.strategy_file import load_strategy, read_strategy_document

__all__ = ["checked_extra", "checked_layouts", "checked_ranks", "finish_checkpoint",
           "new_checkpoint_directory", "save_rank", "save_shards", "writer_rank"]


# ---------------------------------------------------------------- arguments
def new_checkpoint_directory(func: str, what: str, value: object) -> str:
    """``value`` as the directory of a checkpoint being written (created when saving). One
    that is complete already is refused: rewriting it in place would break it."""
    path = checks.path(value, f"{func}: {what}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{func}: {what} {path!r} exists and is not a directory")
    if os.path.exists(os.path.join(path, MANIFEST)):
        raise ValueError(f"{func}: {what} {path!r} already holds a complete checkpoint "
                         f"({MANIFEST}); save each checkpoint into a new directory, e.g. "
                         "D/step_000010")
    return path


def checked_layouts(func: str, layouts: object) -> dict[str, TensorLayout]:
    """``layouts``, checked: names a checkpoint can hold, each in its own file, and layouts
    of whole values (no pending sums)."""
    given: Mapping[Any, Any] = checks.instance(layouts, Mapping, f"{func}: layouts",
                                               "a mapping {tensor name: TensorLayout}")
    out: dict[str, TensorLayout] = {}
    files: dict[str, str] = {}
    for name, lay in given.items():
        problem = name_problem(name)
        if problem:
            raise ValueError(f"{func}: tensor name {name!r} {problem}")
        checks.instance(lay, TensorLayout, f"{func}: layouts[{name!r}]", "a TensorLayout")
        if lay.partial:
            raise ValueError(f"{func}: tensor {name!r} has layout {lay}, with pending sums "
                             f"(partial {list(lay.partial)}); only whole values can be "
                             "checkpointed: complete the sums first")
        file = file_name(name)
        if file in files:
            raise ValueError(f"{func}: tensor names {files[file]!r} and {name!r} map to one file "
                             f"name {file!r}; rename one")
        files[file] = name
        out[name] = lay
    return out


def checked_ranks(func: str, ranks: object, layouts: Mapping[str, TensorLayout]
                  ) -> dict[str, tuple[int, ...]]:
    """``ranks`` (None, or {tensor name: the world ranks its layout's devices are}) checked
    against ``layouts``: one distinct rank per device of the tensor's layout."""
    if ranks is None:
        return {}
    given: Mapping[str, object] = checks.instance(ranks, Mapping, f"{func}: ranks",
                                                  "a mapping {tensor name: world ranks}")
    out = {}
    for name, listed in given.items():
        if name not in layouts:
            raise ValueError(f"{func}: ranks names tensor {name!r}, which layouts does not")
        where = f"{func}: ranks[{name!r}]"
        if isinstance(listed, (str, bytes)) or not isinstance(listed, Sequence):
            raise TypeError(f"{where} must be a sequence of ranks, got {listed!r}")
        placed = tuple(checks.integer(r, where, 0) for r in listed)
        if len(set(placed)) != len(placed) or len(placed) != layouts[name].device_num:
            raise ValueError(f"{where} must be {layouts[name].device_num} distinct ranks, one "
                             f"per device of its layout {layouts[name]}, got {list(placed)}")
        out[name] = placed
    return out


def checked_extra(func: str, extra: object) -> str:
    """The caller's ``extra`` data (JSON values, or None) as JSON text."""
    if extra is None:
        return "{}"
    given: Mapping[str, Any] = checks.instance(extra, Mapping, f"{func}: extra",
                                               "a mapping of JSON values or None")
    try:
        return json.dumps(dict(given), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{func}: extra must hold JSON values only (str, int, finite float, "
                        f"bool, None, lists and dicts of them): {e}") from None


# ---------------------------------------------------------------- writing
class _HashingWriter:
    """A write-only file that counts and hashes what passes through it. numpy writes an
    array to anything with ``write`` in chunks of at most 16 MiB, so memory stays bounded."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.hash, self.nbytes = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.f.write(view)
        self.nbytes += view.nbytes
        return view.nbytes


def _write_npy(path: str, array: np.ndarray) -> tuple[int, str]:
    """Write ``array`` to ``path`` as ``.npy``, atomically; its size and sha256."""
    with atomic_file(path) as f:
        out = _HashingWriter(f)
        np.lib.format.write_array(out, array, allow_pickle=False)
    return out.nbytes, out.hash.hexdigest()


def _write_json(path: str, doc: Mapping[str, Any]) -> None:
    with atomic_file(path) as f:
        f.write(json.dumps(doc, indent=1).encode() + b"\n")


# ---------------------------------------------------------------- saving
def writer_rank(layout: TensorLayout, rank: int) -> int:
    """The rank that saves the block ``rank`` holds under ``layout``: the lowest rank holding
    the same block, i.e. ``rank`` with its coordinate on every replica axis set to 0 (O(number
    of device axes), no scan). A tensor with no elements is saved once, by rank 0.

    >>> lay = TensorLayout((2, 4), (1, -1), (8, 16))   # rows split in 2, replicated over 4
    >>> writer_rank(lay, 6), writer_rank(lay, 4)        # rank 6 holds rows 4..7, as rank 4 does
    (4, 4)
    """
    checks.instance(layout, TensorLayout, "writer_rank: layout", "a TensorLayout")
    rank = checks.integer(rank, "writer_rank: rank", 0)
    mesh = layout.mesh
    coordinate = list(mesh.coordinate(rank))
    if math.prod(layout.shape) == 0:
        return 0
    for axis in layout.replica_axes:
        coordinate[axis] = 0
    return mesh.rank_of(coordinate)


def save_shards(directory: str | os.PathLike[str], rank: int,
                layouts: Mapping[str, TensorLayout], arrays: Mapping[str, np.ndarray], *,
                step: int, extra: Mapping[str, Any] | None = None,
                ranks: Mapping[str, Sequence[int]] | None = None) -> list[str]:
    """Save this rank's blocks into ``directory/rank_{rank}/``, and its ``index.json``.

    ``arrays`` holds this rank's shard of every tensor in ``layouts`` (shape
    ``layout.local_shape()``; a bool, int, float or complex dtype). Of the ranks holding one
    block, only :func:`writer_rank` writes it, so a replicated tensor is saved once, not once
    per rank. ``extra`` (JSON values) is recorded in the index. Every file is written
    atomically. Returns the block files written, relative to ``directory``.

    ``ranks`` gives, for a tensor that lives on some ranks only (a pipeline stage's
    parameter), the world ranks its layout's devices are, in order: ``rank`` must be one of
    them, and its block is that of its place among them.

    Call it on every rank, then :func:`finish_checkpoint` once. On 8 ranks with
    ``TensorLayout((2, 4), (1, -1), (8, 16))`` for "params/w", rank 4 writes
    ``["rank_4/params%2Fw.npy"]`` (rows 4..7) and rank 5 writes nothing.
    """
    func = "save_shards"
    rank = checks.integer(rank, f"{func}: rank", 0)
    step = checks.integer(step, f"{func}: step", 0)
    lays = checked_layouts(func, layouts)
    extra_json = checked_extra(func, extra)
    root = new_checkpoint_directory(func, "directory", directory)
    checks.instance(arrays, Mapping, f"{func}: arrays", "a mapping {tensor name: numpy array}")
    unknown = sorted(set(arrays) - set(lays))
    if unknown:
        raise ValueError(f"{func}: arrays has tensor {unknown[0]!r}, which layouts does not "
                         f"name ({len(unknown)} such); give every tensor a layout")
    placed = checked_ranks(func, ranks, lays)
    for name, lay in lays.items():
        if device_of(placed.get(name), rank) is None:
            raise ValueError(f"{func}: rank {rank} is not among the ranks "
                             f"{list(placed[name])} that hold tensor {name!r}")
        if rank >= lay.device_num and name not in placed:
            raise ValueError(f"{func}: rank {rank} is outside layout {lay} of tensor {name!r} "
                             f"({lay.device_num} devices)")
        if name not in arrays:
            raise ValueError(f"{func}: arrays has no shard of tensor {name!r}; give this "
                             "rank's shard of every tensor in layouts")
        _check_shard(func, name, arrays[name], lay)
    return save_rank(root, rank, lays, arrays.__getitem__, step, extra_json, placed)


def _check_shard(func: str, name: str, value: object, lay: TensorLayout) -> None:
    array: np.ndarray = checks.instance(value, np.ndarray, f"{func}: arrays[{name!r}]",
                                        "a numpy array")
    if array.shape != lay.local_shape():
        raise ValueError(f"{func}: arrays[{name!r}] has shape {array.shape}, but layout {lay} "
                         f"gives each rank a shard of shape {lay.local_shape()}")
    if array.dtype.kind not in DTYPE_KINDS or array.dtype.fields is not None:
        raise TypeError(f"{func}: arrays[{name!r}] has dtype {array.dtype}; allowed are bool, "
                        "int, uint, float and complex (others would need pickle)")


def save_rank(root: str, rank: int, layouts: Mapping[str, TensorLayout],
              shard_of: Callable[[str], np.ndarray], step: int, extra_json: str,
              ranks: Mapping[str, Sequence[int]] | None = None) -> list[str]:
    """Write ``rank``'s blocks (asking ``shard_of`` only for the tensors it writes), then its
    index. The caller has checked every argument."""
    rank_dir = os.path.join(root, f"rank_{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    entries: dict[str, dict[str, Any]] = {}
    for name, lay in layouts.items():
        device = device_of((ranks or {}).get(name), rank)
        if device is None or writer_rank(lay, device) != device:
            continue
        array = shard_of(name)
        rel = f"rank_{rank}/{file_name(name)}"
        nbytes, sha = _write_npy(os.path.join(root, rel), array)
        entries[name] = {"shape": list(lay.shape), "dtype": array.dtype.str,
                         "block": [list(b) for b in lay.slice_of(device)], "path": rel,
                         "bytes": nbytes, "sha256": sha}
    sync_directory(rank_dir)
    _write_json(os.path.join(rank_dir, INDEX),
                {"format": INDEX_FORMAT, "version": FORMAT_VERSION, "rank": rank, "step": step,
                 "extra": json.loads(extra_json), "tensors": entries})
    sync_directory(rank_dir)
    return [e["path"] for e in entries.values()]


def finish_checkpoint(directory: str | os.PathLike[str], world_size: int,
                      layouts: Mapping[str, TensorLayout], *, step: int,
                      strategy_file: str | os.PathLike[str] | None = None,
                      extra: Mapping[str, Any] | None = None,
                      ranks: Mapping[str, Sequence[int]] | None = None) -> None:
    """Complete the checkpoint in ``directory``: write ``manifest.json``, last and atomically.

    Call it once (on rank 0), after every rank's :func:`save_shards` (the caller barriers).
    It reads every rank's ``index.json`` and checks that each was saved for ``step`` under
    ``layouts`` (every layout over ``world_size`` devices), that every block file is there
    with the recorded size, and that every tensor's blocks tile its shape exactly once; an
    error names the tensor and the region missing or held twice. ``strategy_file`` (a strategy
    file for ``world_size`` devices) is copied in as ``strategy.json``; ``extra`` (JSON values)
    is recorded in the manifest. ``ranks``, as for :func:`save_shards`: the world ranks that
    hold a tensor living on some ranks only (its layout is over as many devices).
    """
    func = "finish_checkpoint"
    world_size = checks.integer(world_size, f"{func}: world_size", 1)
    step = checks.integer(step, f"{func}: step", 0)
    lays = checked_layouts(func, layouts)
    extra_json = checked_extra(func, extra)
    placed = checked_ranks(func, ranks, lays)
    for name, lay in lays.items():
        if name in placed and max(placed[name]) >= world_size:
            raise ValueError(f"{func}: tensor {name!r} is held by ranks {list(placed[name])}, "
                             f"but world_size is {world_size}")
        if name not in placed and lay.device_num != world_size:
            raise ValueError(f"{func}: tensor {name!r} has layout {lay} over {lay.device_num} "
                             f"devices, but world_size is {world_size}")
    strategy = (None if strategy_file is None
                else checks.path(strategy_file, f"{func}: strategy_file"))
    root = new_checkpoint_directory(func, "directory",
                                    existing_directory(func, "directory", directory))
    real_root = os.path.realpath(root)
    files: dict[str, list[ShardFile]] = {name: [] for name in lays}
    dtypes: dict[str, np.dtype[Any]] = {}
    for rank in range(world_size):
        for name, dtype, shard in _read_index(func, real_root, rank, step, lays, placed):
            if dtypes.setdefault(name, dtype) != dtype:
                raise ValueError(f"{func}: rank {rank} saved tensor {name!r} as {dtype}, but "
                                 f"rank {files[name][0].rank} saved it as {dtypes[name]}")
            files[name].append(shard)
    for name, lay in lays.items():
        problem = coverage_problem(lay.shape, [f.block for f in files[name]])
        if problem is None and name not in dtypes:
            problem = "no rank saved it"
        if problem:
            raise ValueError(f"{func}: tensor {name!r} (shape {list(lay.shape)}) is not saved "
                             f"exactly once: {problem}")
    stored = None if strategy is None else _copy_strategy(func, strategy, real_root, world_size)
    tensors: dict[str, Any] = {}
    for name, lay in lays.items():
        tensors[name] = {"shape": list(lay.shape), "dtype": dtypes[name].str,
                         "layout": lay.to_dict()}
        if name in placed:
            tensors[name]["ranks"] = list(placed[name])
        tensors[name]["files"] = [{"path": f.path, "rank": f.rank,
                                   "block": [list(b) for b in f.block], "bytes": f.nbytes,
                                   "sha256": f.sha256} for f in files[name]]
    doc: dict[str, Any] = {
        "format": FORMAT, "version": 2 if placed else 1, "step": step,
        "world_size": world_size, "strategy_file": stored, "extra": json.loads(extra_json),
        "tensors": tensors}
    _write_json(os.path.join(real_root, MANIFEST), doc)
    sync_directory(real_root)


def _read_index(func: str, root: str, rank: int, step: int,
                layouts: Mapping[str, TensorLayout], ranks: Mapping[str, tuple[int, ...]]
                ) -> Iterator[tuple[str, np.dtype[Any], ShardFile]]:
    """Rank ``rank``'s index, checked against ``step``, ``layouts`` and the files on disk."""
    path = os.path.join(root, f"rank_{rank}", INDEX)
    if not os.path.isfile(path):
        raise ValueError(f"{func}: rank {rank} has not saved: there is no {path!r} (did every "
                         "rank call save_shards before finish_checkpoint?)")
    doc = JsonDoc(path, load_json(path))
    top = doc.top(INDEX_FORMAT)
    if doc.integer(top.get("rank"), "['rank']", 0) != rank:
        raise doc.fail("['rank']", f"is {top.get('rank')}, but the file is rank {rank}'s")
    saved_step = doc.integer(top.get("step"), "['step']", 0)
    if saved_step != step:
        raise doc.fail("['step']", f"is {saved_step}, but this checkpoint is for step {step}; "
                       "the directory holds another step's save")
    for name, item in doc.obj(top.get("tensors"), "['tensors']").items():
        key = f"['tensors'][{name!r}]"
        if name not in layouts:
            raise doc.fail(key, "is a tensor that the layouts given to finish_checkpoint do not "
                           "name")
        lay = layouts[name]
        item = doc.obj(item, key)
        shape = tuple(doc.integers(item.get("shape"), f"{key}['shape']", 0))
        if shape != lay.shape:
            raise doc.fail(key, f"has shape {list(shape)}, but its layout {lay} is for shape "
                           f"{list(lay.shape)}")
        dtype = doc.dtype(item.get("dtype"), f"{key}['dtype']")
        shard = doc.shard_file(item, key, len(shape), rank)
        if not shard.path.startswith(f"rank_{rank}/"):
            raise doc.fail(f"{key}['path']", f"{shard.path!r} is not in rank_{rank}/, the "
                           "directory of the rank that saved it")
        device = device_of(ranks.get(name), rank)
        if device is None:
            raise doc.fail(key, f"is saved by rank {rank}, which is not among the ranks "
                           f"{list(ranks[name])} that hold it")
        if shard.block != lay.slice_of(device):
            raise doc.fail(key, f"holds block {list(shard.block)}, but under layout {lay} rank "
                           f"{rank} holds {list(lay.slice_of(device))}; it was saved under "
                           "another layout")
        real = path_inside(root, shard.path, doc.path)
        if not os.path.isfile(real):
            raise doc.fail(f"{key}['path']", f"{shard.path!r} does not exist")
        size = os.path.getsize(real)
        if size != shard.nbytes:
            raise ValueError(f"{func}: file {shard.path!r} has the wrong size: {size} bytes on "
                             f"disk, {shard.nbytes} recorded in {doc.path!r}")
        yield name, dtype, shard


def _copy_strategy(func: str, path: str, root: str, world_size: int) -> dict[str, Any]:
    """Copy the strategy file into the checkpoint (so a transform of it needs nothing else),
    after checking that it reads as a strategy for ``world_size`` devices (a pipelined plan's:
    its stages' devices make ``world_size``)."""
    try:
        found = read_strategy_document(path).get("simpar")
        own: dict[str, Any] = found if isinstance(found, dict) else {}
        stages = own.get("pipeline_stages", 1)
        if stages == 1:
            load_strategy(path, device_num=world_size)
        elif not isinstance(stages, int) or own.get("device_num", 0) * stages != world_size:
            raise ValueError(f"its {stages} pipeline stages of device_num "
                             f"{own.get('device_num')} are not {world_size} devices")
    except (ValueError, TypeError) as e:
        raise ValueError(f"{func}: strategy_file {path!r} is not a strategy file for "
                         f"world_size {world_size}: {e}") from None
    with open(path, "rb") as f:
        data = f.read()
    with atomic_file(os.path.join(root, STRATEGY)) as out:
        out.write(data)
    return {"path": STRATEGY, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
