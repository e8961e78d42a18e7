"""Distributed checkpoints: every rank saves only its own shards, and any rank of any other
strategy or device count loads its shard by reading only the saved pieces that overlap it.

A checkpoint is one directory, in MindSpore's ``rank_N`` convention, of ``.npy`` files and
JSON (never pickle)::

    D/step_000010/rank_0/params%2Ffc1.weight.npy   rank 0's block of "params/fc1.weight"
    D/step_000010/rank_0/index.json                what rank 0 wrote: blocks, sizes, sha256
    D/step_000010/rank_4/...
    D/step_000010/strategy.json                    (optional) the strategy it was saved under
    D/step_000010/manifest.json                    written last: the checkpoint is complete

Saving, on every rank of an MPI job (``comm`` is the caller's business; nothing here talks
MPI)::

    save_shards(d, rank, layouts, shards, step=10)      # every rank: its blocks + index.json
    comm.barrier()
    if rank == 0:
        finish_checkpoint(d, world_size, layouts, step=10)   # checks coverage, then manifest
    comm.barrier()

Of the ranks holding one block (replicas along the layout's replica axes), only the lowest
writes it (:func:`writer_rank`): with ``TensorLayout((2, 4), (1, -1), (8, 16))`` ranks 0 and
4 write rows 0..3 and 4..7, and ranks 1-3 and 5-7 write nothing for that tensor.

Loading, on rank 5 of another strategy: ``load_shard(d, "params/fc1.weight", new_layout, 5)``
reads from the manifest which saved blocks overlap rank 5's slice (MindSpore's
``rank_list_for_transform``), memory-maps those files and copies out only the overlap. Every
file it opens is first checked against the manifest: its size, then its sha256. The checksum
covers the whole file, so verifying reads a file once in full; that happens once per file per
process (a cache keyed by the file's identity, size and modification time), and
``stats["bytes_hashed"]`` reports it apart from the ``bytes_read`` of the shard itself.

Atomicity: each file is written to a temporary name, flushed to disk and renamed;
``manifest.json`` is written last, only after every rank's blocks are known to tile every
tensor exactly once. A crash leaves a directory without a manifest, which :func:`read_manifest`
refuses and :func:`latest_checkpoint` skips, so save each checkpoint into a directory of its
own (``D/step_000010``) and the previous one stays loadable.

The command line: ``python -m simpar.checkpoint inspect DIR [--verify]``,
``... merge DIR OUT`` (``OUT`` a directory, or a ``.npz`` file) and
``... transform SRC DST --strategy FILE.json``.
"""

from __future__ import annotations

import argparse
import bisect
import difflib
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import IO, Any, NoReturn
from urllib.parse import quote

import numpy as np

from simpar import comm
from simpar._env import atomic_file, sync_directory
from simpar.layout import TensorLayout
from simpar.nn.wrap import TrainOneStepCell
from simpar.strategy_file import load_strategy, save_strategy

__all__ = ["FORMAT_VERSION", "MANIFEST", "Manifest", "ShardFile", "StoredFile", "TensorEntry",
           "check_against", "finish_checkpoint", "latest_checkpoint", "load_shard", "load_tensor",
           "load_training", "main", "merge_checkpoint", "read_manifest", "save_shards",
           "save_training", "shard_sources", "transform_checkpoint", "writer_rank"]

#: The version of the manifest and index format; a newer one is refused, not misread.
FORMAT_VERSION = 1
#: The file whose presence marks a complete checkpoint.
MANIFEST = "manifest.json"

_FORMAT = "simpar-checkpoint"
_INDEX = "index.json"
_INDEX_FORMAT = "simpar-checkpoint-index"
_STRATEGY = "strategy.json"
_PROG = "python -m simpar.checkpoint"
# dtype kinds a .npy file holds without pickle and numpy reads back as plain numbers:
# bool, signed and unsigned ints, floats, complex.
_DTYPE_KINDS = "biufc"
# File names stay well under the common 255-byte limit, with room for the temporary suffix.
_MAX_FILE_NAME = 180
# Coverage is checked on the grid of all block boundaries; this many cells is far beyond
# any even layout (whose grid has one cell per block) and bounds a hand-made manifest.
_MAX_GRID_CELLS = 1 << 24
_HASH_CHUNK = 1 << 20
_PROGRESS_EVERY = 50

Block = tuple[tuple[int, int], ...]


# ---------------------------------------------------------------- the manifest, as values
@dataclass(frozen=True, slots=True)
class ShardFile:
    """One saved block: ``path`` (relative to the checkpoint directory, "/"-separated) holds
    ``block`` (per tensor dimension ``(start, stop)``) of its tensor, written by ``rank``."""

    path: str
    rank: int
    block: Block
    nbytes: int
    sha256: str

    def __str__(self) -> str:
        region = ",".join(f"{a}:{b}" for a, b in self.block)
        return f"{self.path} [{region}] {self.nbytes} B"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the checkpoint: its global shape and dtype, the layout it was saved under,
    and the files whose blocks tile it exactly once."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    layout: TensorLayout
    files: tuple[ShardFile, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def __str__(self) -> str:
        return (f"{self.name} {list(self.shape)} {self.dtype.name} {self.layout} "
                f"{len(self.files)} file{'s' * (len(self.files) != 1)} {_size(self.nbytes)}")


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A file of the checkpoint other than a shard (the strategy file): path, size, sha256."""

    path: str
    nbytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """A complete checkpoint, as read and checked by :func:`read_manifest`. ``directory`` is
    its real path; ``extra`` is the caller's JSON data, a fresh copy on every access."""

    directory: str
    version: int
    step: int
    world_size: int
    tensors: Mapping[str, TensorEntry]
    strategy_file: StoredFile | None
    extra_json: str

    @property
    def extra(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.extra_json)
        return value

    @property
    def files(self) -> tuple[ShardFile, ...]:
        return tuple(f for t in self.tensors.values() for f in t.files)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __str__(self) -> str:
        return (f"checkpoint {self.directory}: step {self.step}, world size {self.world_size}, "
                f"{len(self.tensors)} tensors, {len(self.files)} files, "
                f"{_size(self.total_bytes)}")


def _entry(func: str, manifest: Manifest, name: str) -> TensorEntry:
    """The entry of tensor ``name``; the error names the closest one."""
    if name not in manifest.tensors:
        close = difflib.get_close_matches(name, list(manifest.tensors), n=1)
        hint = f" (closest: {close[0]!r})" if close else ""
        raise ValueError(f"{func}: checkpoint {manifest.directory!r} has no tensor {name!r}"
                         f"{hint}; it holds {len(manifest.tensors)} tensors")
    return manifest.tensors[name]


# ---------------------------------------------------------------- arguments
def _path(func: str, what: str, value: object) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{func}: {what} must be a str or os.PathLike, got "
                        f"{type(value).__name__} {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{func}: {what} must be given as text, got bytes {path!r}")
    return path


def _directory(func: str, what: str, value: object) -> str:
    path = _path(func, what, value)
    if not os.path.isdir(path):
        raise ValueError(f"{func}: {what} {path!r} is not a directory")
    return path


def _new_checkpoint_directory(func: str, what: str, value: object) -> str:
    """``value`` as the directory of a checkpoint being written (created when saving). One
    that is complete already is refused: rewriting it in place would break it."""
    path = _path(func, what, value)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{func}: {what} {path!r} exists and is not a directory")
    if os.path.exists(os.path.join(path, MANIFEST)):
        raise ValueError(f"{func}: {what} {path!r} already holds a complete checkpoint "
                         f"({MANIFEST}); save each checkpoint into a new directory, e.g. "
                         "D/step_000010")
    return path


def _int(func: str, what: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{func}: {what} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{func}: {what} must be >= {low}, got {value}")
    return int(value)


def _name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a tensor, or None. Names are "/"-separated like paths
    ("opt/fc1.weight/m") and must not look like a way out of the directory."""
    if not isinstance(name, str):
        return f"must be a str, got {type(name).__name__}"
    if not name:
        return "must not be empty"
    if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        return ("has an empty, '.' or '..' component or a leading '/'; names are '/'-separated "
                "like 'params/fc1.weight' and may not point outside the checkpoint")
    return None


def _layouts(func: str, layouts: object) -> dict[str, TensorLayout]:
    if not isinstance(layouts, Mapping):
        raise TypeError(f"{func}: layouts must be a mapping {{tensor name: TensorLayout}}, got "
                        f"{type(layouts).__name__}")
    out: dict[str, TensorLayout] = {}
    files: dict[str, str] = {}
    for name, lay in layouts.items():
        problem = _name_problem(name)
        if problem:
            raise ValueError(f"{func}: tensor name {name!r} {problem}")
        if not isinstance(lay, TensorLayout):
            raise TypeError(f"{func}: layouts[{name!r}] must be a TensorLayout, got "
                            f"{type(lay).__name__}")
        if lay.partial:
            raise ValueError(f"{func}: tensor {name!r} has layout {lay}, with pending sums "
                             f"(partial {list(lay.partial)}); only whole values can be "
                             "checkpointed: complete the sums first")
        file = _file_name(name)
        if file in files:
            raise ValueError(f"{func}: tensor names {files[file]!r} and {name!r} map to one file "
                             f"name {file!r}; rename one")
        files[file] = name
        out[name] = lay
    return out


def _extra(func: str, extra: object) -> str:
    if extra is None:
        return "{}"
    if not isinstance(extra, Mapping):
        raise TypeError(f"{func}: extra must be a mapping of JSON values or None, got "
                        f"{type(extra).__name__}")
    try:
        return json.dumps(dict(extra), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{func}: extra must hold JSON values only (str, int, finite float, "
                        f"bool, None, lists and dicts of them): {e}") from None


def _file_name(name: str) -> str:
    """The file a tensor's block is saved in: every character other than letters, digits,
    '.', '_', '-' and '~' percent-encoded ("params/fc1.weight" -> "params%2Ffc1.weight.npy"),
    so the name is one path component and two names never share a file; a very long name
    keeps its start and gets a hash of the whole."""
    text = quote(name, safe="")
    if len(text) > _MAX_FILE_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        text = f"{text[:_MAX_FILE_NAME - 17]}-{digest}"
    return text + ".npy"


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
    if not isinstance(layout, TensorLayout):
        raise TypeError(f"writer_rank: layout must be a TensorLayout, got "
                        f"{type(layout).__name__}")
    rank = _int("writer_rank", "rank", rank, 0)
    mesh = layout.mesh
    coordinate = list(mesh.coordinate(rank))
    if math.prod(layout.shape) == 0:
        return 0
    for axis in layout.replica_axes:
        coordinate[axis] = 0
    return mesh.rank_of(coordinate)


def save_shards(directory: str | os.PathLike[str], rank: int,
                layouts: Mapping[str, TensorLayout], arrays: Mapping[str, np.ndarray], *,
                step: int, extra: Mapping[str, Any] | None = None) -> list[str]:
    """Save this rank's blocks into ``directory/rank_{rank}/``, and its ``index.json``.

    ``arrays`` holds this rank's shard of every tensor in ``layouts`` (shape
    ``layout.local_shape()``; a bool, int, float or complex dtype). Of the ranks holding one
    block, only :func:`writer_rank` writes it, so a replicated tensor is saved once, not once
    per rank. ``extra`` (JSON values) is recorded in the index. Every file is written
    atomically. Returns the block files written, relative to ``directory``.

    Call it on every rank, then :func:`finish_checkpoint` once. On 8 ranks with
    ``TensorLayout((2, 4), (1, -1), (8, 16))`` for "params/w", rank 4 writes
    ``["rank_4/params%2Fw.npy"]`` (rows 4..7) and rank 5 writes nothing.
    """
    func = "save_shards"
    rank = _int(func, "rank", rank, 0)
    step = _int(func, "step", step, 0)
    lays = _layouts(func, layouts)
    extra_json = _extra(func, extra)
    root = _new_checkpoint_directory(func, "directory", directory)
    if not isinstance(arrays, Mapping):
        raise TypeError(f"{func}: arrays must be a mapping {{tensor name: numpy array}}, got "
                        f"{type(arrays).__name__}")
    unknown = sorted(set(arrays) - set(lays))
    if unknown:
        raise ValueError(f"{func}: arrays has tensor {unknown[0]!r}, which layouts does not "
                         f"name ({len(unknown)} such); give every tensor a layout")
    for name, lay in lays.items():
        if rank >= lay.device_num:
            raise ValueError(f"{func}: rank {rank} is outside layout {lay} of tensor {name!r} "
                             f"({lay.device_num} devices)")
        if name not in arrays:
            raise ValueError(f"{func}: arrays has no shard of tensor {name!r}; give this "
                             "rank's shard of every tensor in layouts")
        _check_shard(func, name, arrays[name], lay)
    return _save_rank(root, rank, lays, arrays.__getitem__, step, extra_json)


def _check_shard(func: str, name: str, array: object, lay: TensorLayout) -> None:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{func}: arrays[{name!r}] must be a numpy array, got "
                        f"{type(array).__name__}")
    if array.shape != lay.local_shape():
        raise ValueError(f"{func}: arrays[{name!r}] has shape {array.shape}, but layout {lay} "
                         f"gives each rank a shard of shape {lay.local_shape()}")
    if array.dtype.kind not in _DTYPE_KINDS or array.dtype.fields is not None:
        raise TypeError(f"{func}: arrays[{name!r}] has dtype {array.dtype}; allowed are bool, "
                        "int, uint, float and complex (others would need pickle)")


def _save_rank(root: str, rank: int, layouts: Mapping[str, TensorLayout],
               shard_of: Callable[[str], np.ndarray], step: int, extra_json: str) -> list[str]:
    """Write ``rank``'s blocks (asking ``shard_of`` only for the tensors it writes), then its
    index. The caller has checked every argument."""
    rank_dir = os.path.join(root, f"rank_{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    entries: dict[str, dict[str, Any]] = {}
    for name, lay in layouts.items():
        if writer_rank(lay, rank) != rank:
            continue
        array = shard_of(name)
        rel = f"rank_{rank}/{_file_name(name)}"
        nbytes, sha = _write_npy(os.path.join(root, rel), array)
        entries[name] = {"shape": list(lay.shape), "dtype": array.dtype.str,
                         "block": [list(b) for b in lay.slice_of(rank)], "path": rel,
                         "bytes": nbytes, "sha256": sha}
    sync_directory(rank_dir)
    _write_json(os.path.join(rank_dir, _INDEX),
                {"format": _INDEX_FORMAT, "version": FORMAT_VERSION, "rank": rank, "step": step,
                 "extra": json.loads(extra_json), "tensors": entries})
    sync_directory(rank_dir)
    return [e["path"] for e in entries.values()]


def finish_checkpoint(directory: str | os.PathLike[str], world_size: int,
                      layouts: Mapping[str, TensorLayout], *, step: int,
                      strategy_file: str | os.PathLike[str] | None = None,
                      extra: Mapping[str, Any] | None = None) -> None:
    """Complete the checkpoint in ``directory``: write ``manifest.json``, last and atomically.

    Call it once (on rank 0), after every rank's :func:`save_shards` (the caller barriers).
    It reads every rank's ``index.json`` and checks that each was saved for ``step`` under
    ``layouts`` (every layout over ``world_size`` devices), that every block file is there
    with the recorded size, and that every tensor's blocks tile its shape exactly once; an
    error names the tensor and the region missing or held twice. ``strategy_file`` (a strategy
    file for ``world_size`` devices) is copied in as ``strategy.json``; ``extra`` (JSON values)
    is recorded in the manifest.
    """
    func = "finish_checkpoint"
    world_size = _int(func, "world_size", world_size, 1)
    step = _int(func, "step", step, 0)
    lays = _layouts(func, layouts)
    extra_json = _extra(func, extra)
    for name, lay in lays.items():
        if lay.device_num != world_size:
            raise ValueError(f"{func}: tensor {name!r} has layout {lay} over {lay.device_num} "
                             f"devices, but world_size is {world_size}")
    strategy = None if strategy_file is None else _path(func, "strategy_file", strategy_file)
    root = _new_checkpoint_directory(func, "directory", _directory(func, "directory", directory))
    real_root = os.path.realpath(root)
    files: dict[str, list[ShardFile]] = {name: [] for name in lays}
    dtypes: dict[str, np.dtype[Any]] = {}
    for rank in range(world_size):
        for name, dtype, shard in _read_index(func, real_root, rank, step, lays):
            if dtypes.setdefault(name, dtype) != dtype:
                raise ValueError(f"{func}: rank {rank} saved tensor {name!r} as {dtype}, but "
                                 f"rank {files[name][0].rank} saved it as {dtypes[name]}")
            files[name].append(shard)
    for name, lay in lays.items():
        problem = _coverage_problem(lay.shape, [f.block for f in files[name]])
        if problem is None and name not in dtypes:
            problem = "no rank saved it"
        if problem:
            raise ValueError(f"{func}: tensor {name!r} (shape {list(lay.shape)}) is not saved "
                             f"exactly once: {problem}")
    stored = None if strategy is None else _copy_strategy(func, strategy, real_root, world_size)
    doc: dict[str, Any] = {
        "format": _FORMAT, "version": FORMAT_VERSION, "step": step, "world_size": world_size,
        "strategy_file": stored, "extra": json.loads(extra_json),
        "tensors": {name: {"shape": list(lay.shape), "dtype": dtypes[name].str,
                           "layout": lay.to_dict(),
                           "files": [{"path": f.path, "rank": f.rank,
                                      "block": [list(b) for b in f.block], "bytes": f.nbytes,
                                      "sha256": f.sha256} for f in files[name]]}
                    for name, lay in lays.items()},
    }
    _write_json(os.path.join(real_root, MANIFEST), doc)
    sync_directory(real_root)


def _read_index(func: str, root: str, rank: int, step: int,
                layouts: Mapping[str, TensorLayout]
                ) -> Iterator[tuple[str, np.dtype[Any], ShardFile]]:
    """Rank ``rank``'s index, checked against ``step``, ``layouts`` and the files on disk."""
    path = os.path.join(root, f"rank_{rank}", _INDEX)
    if not os.path.isfile(path):
        raise ValueError(f"{func}: rank {rank} has not saved: there is no {path!r} (did every "
                         "rank call save_shards before finish_checkpoint?)")
    doc = _Doc(path, _load_json(path))
    top = doc.top(_INDEX_FORMAT)
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
        if shard.block != lay.slice_of(rank):
            raise doc.fail(key, f"holds block {list(shard.block)}, but under layout {lay} rank "
                           f"{rank} holds {list(lay.slice_of(rank))}; it was saved under "
                           "another layout")
        real = _inside(root, shard.path, doc.path)
        if not os.path.isfile(real):
            raise doc.fail(f"{key}['path']", f"{shard.path!r} does not exist")
        size = os.path.getsize(real)
        if size != shard.nbytes:
            raise ValueError(f"{func}: file {shard.path!r} has the wrong size: {size} bytes on "
                             f"disk, {shard.nbytes} recorded in {doc.path!r}")
        yield name, dtype, shard


def _copy_strategy(func: str, path: str, root: str, world_size: int) -> dict[str, Any]:
    """Copy the strategy file into the checkpoint (so a transform of it needs nothing else),
    after checking that it reads as a strategy for ``world_size`` devices."""
    try:
        load_strategy(path, device_num=world_size)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{func}: strategy_file {path!r} is not a strategy file for "
                         f"world_size {world_size}: {e}") from None
    with open(path, "rb") as f:
        data = f.read()
    with atomic_file(os.path.join(root, _STRATEGY)) as out:
        out.write(data)
    return {"path": _STRATEGY, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _coverage_problem(shape: Sequence[int], blocks: Sequence[Block]) -> str | None:
    """None if ``blocks`` tile ``shape`` exactly once, else the first region missing or held
    twice. Counts are kept per cell of the grid of all block boundaries, which for an even
    layout has one cell per block."""
    for block in blocks:
        if len(block) != len(shape) or any(not 0 <= a <= b <= n
                                           for (a, b), n in zip(block, shape)):
            return f"block {[list(b) for b in block]} is not inside shape {list(shape)}"
    if math.prod(shape) == 0:
        return None
    bounds = [sorted({0, n, *(b[d][0] for b in blocks), *(b[d][1] for b in blocks)})
              for d, n in enumerate(shape)]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells > _MAX_GRID_CELLS:
        return f"{len(blocks)} blocks cut it into {cells} irregular pieces, too many to check"
    counts = np.zeros([len(b) - 1 for b in bounds], dtype=np.int64)
    for block in blocks:
        counts[tuple(slice(bisect.bisect_left(bd, a), bisect.bisect_left(bd, b))
                     for bd, (a, b) in zip(bounds, block))] += 1
    for bad, what in ((counts > 1, "is held by more than one file"), (counts == 0, "is missing")):
        if bad.any():
            cell = np.argwhere(bad)[0]
            region = [[bd[i], bd[i + 1]] for bd, i in zip(bounds, cell)]
            return f"region {region} {what}"
    return None


# ---------------------------------------------------------------- reading JSON, checked
def _load_json(path: str) -> Any:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_without_duplicates)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path!r} is not JSON: byte {e.start} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    except ValueError as e:
        raise ValueError(f"{path!r}: {e}") from None


def _without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


_SHA256 = re.compile(r"[0-9a-f]{64}")


class _Doc:
    """One JSON file's content, read piece by piece; every error names the file and key."""

    def __init__(self, path: str, doc: Any) -> None:
        self.path, self.doc = path, doc

    def fail(self, key: str, message: str) -> ValueError:
        return ValueError(f"{self.path!r}{key} {message}")

    def top(self, fmt: str) -> dict[str, Any]:
        top = self.obj(self.doc, "")
        if top.get("format") != fmt:
            raise self.fail("", f"is not a simpar checkpoint file: its 'format' is "
                            f"{top.get('format')!r}, expected {fmt!r}")
        version = self.integer(top.get("version"), "['version']", 1)
        if version > FORMAT_VERSION:
            raise self.fail("", f"was written by a newer simpar (format version {version}); "
                            f"this simpar reads version {FORMAT_VERSION}")
        return top

    def obj(self, value: object, key: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a JSON object, got {json.dumps(value)[:60]}")
        return value

    def integer(self, value: object, key: str, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.fail(key, f"must be an int >= {low}, got {json.dumps(value)[:60]}")
        return value

    def integers(self, value: object, key: str, low: int) -> list[int]:
        if not isinstance(value, list):
            raise self.fail(key, f"must be a list of ints >= {low}, got "
                            f"{json.dumps(value)[:60]}")
        return [self.integer(v, key, low) for v in value]

    def dtype(self, value: object, key: str) -> np.dtype[Any]:
        try:
            dtype = np.dtype(value) if isinstance(value, str) else None
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or dtype.kind not in _DTYPE_KINDS or dtype.fields is not None:
            raise self.fail(key, f"is {value!r}; allowed are numpy dtype strings of bool, int, "
                            "uint, float and complex, e.g. '<f4'")
        return dtype

    def relpath(self, value: object, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty path string, got {value!r}")
        if os.path.isabs(value) or value.startswith(("/", "\\")) or re.match(r"[A-Za-z]:",
                                                                           value):
            raise self.fail(key, f"path {value!r} is absolute; checkpoint paths are relative to "
                            "the checkpoint directory")
        if "\\" in value or any(p in ("", ".", "..") for p in value.split("/")):
            raise self.fail(key, f"path {value!r} leaves the checkpoint directory or is not "
                            "normal (no '..', '.', empty parts or backslashes)")
        return value

    def shard_file(self, item: dict[str, Any], key: str, ndim: int, rank: int) -> ShardFile:
        block = item.get("block")
        if (not isinstance(block, list) or len(block) != ndim
                or any(not isinstance(b, list) or len(b) != 2 for b in block)):
            raise self.fail(f"{key}['block']", f"must be {ndim} [start, stop] pairs, got "
                            f"{json.dumps(block)[:60]}")
        pairs = tuple((self.integer(a, f"{key}['block']", 0), self.integer(b, f"{key}['block']", 0))
                      for a, b in block)
        sha = item.get("sha256")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise self.fail(f"{key}['sha256']", f"must be 64 lowercase hex digits, got {sha!r}")
        return ShardFile(self.relpath(item.get("path"), f"{key}['path']"), rank, pairs,
                         self.integer(item.get("bytes"), f"{key}['bytes']", 0), sha)


def _inside(root: str, rel: str, where: str) -> str:
    """The real path of ``rel`` under the real directory ``root``; a path that resolves
    (through symbolic links) outside it is refused, naming ``where`` it was found."""
    real = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([real, root]) != root:
        raise ValueError(f"{where!r}: path {rel!r} resolves to {real!r}, outside the "
                         f"checkpoint directory {root!r}")
    return real


# ---------------------------------------------------------------- the manifest
def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """The checked manifest of the checkpoint in ``directory``.

    Refused with a ValueError: a directory without ``manifest.json`` ("not a complete
    checkpoint": a save that did not finish), a manifest that is not JSON, of another format
    or of a newer version, a path that is absolute or leaves the directory, a layout that
    does not fit its tensor, and blocks that do not tile a tensor exactly once. A manifest is
    read once per process while its file is unchanged (it is immutable once written).
    """
    func = "read_manifest"
    root = _directory(func, "directory", directory)
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{func}: {root!r} is not a complete checkpoint (no {MANIFEST}): its "
                         "save did not finish, or it is not a checkpoint directory")
    st = os.stat(path)
    return _read_manifest(os.path.realpath(root), st.st_dev, st.st_ino, st.st_size,
                          st.st_mtime_ns)


@lru_cache(maxsize=16)
def _read_manifest(root: str, dev: int, ino: int, size: int, mtime_ns: int) -> Manifest:
    """The manifest of ``root``, keyed by the manifest file's identity, size and time."""
    doc = _Doc(os.path.join(root, MANIFEST), _load_json(os.path.join(root, MANIFEST)))
    top = doc.top(_FORMAT)
    step = doc.integer(top.get("step"), "['step']", 0)
    world = doc.integer(top.get("world_size"), "['world_size']", 1)
    tensors: dict[str, TensorEntry] = {}
    for name, item in doc.obj(top.get("tensors"), "['tensors']").items():
        key = f"['tensors'][{name!r}]"
        problem = _name_problem(name)
        if problem:
            raise doc.fail(key, f"names a tensor that {problem}")
        item = doc.obj(item, key)
        shape = tuple(doc.integers(item.get("shape"), f"{key}['shape']", 0))
        dtype = doc.dtype(item.get("dtype"), f"{key}['dtype']")
        try:
            lay = TensorLayout.from_dict(doc.obj(item.get("layout"), f"{key}['layout']"))
        except (ValueError, TypeError) as e:
            raise doc.fail(f"{key}['layout']", f"is not a layout: {e}") from None
        if lay.shape != shape or lay.partial or lay.device_num != world:
            raise doc.fail(f"{key}['layout']", f"{lay} does not fit: the tensor has shape "
                           f"{list(shape)} and the checkpoint {world} devices, without pending "
                           "sums")
        listed = item.get("files")
        if not isinstance(listed, list):
            raise doc.fail(f"{key}['files']", "must be a list of files")
        files = []
        for i, f in enumerate(listed):
            fkey = f"{key}['files'][{i}]"
            f = doc.obj(f, fkey)
            rank = doc.integer(f.get("rank"), f"{fkey}['rank']", 0)
            if rank >= world:
                raise doc.fail(f"{fkey}['rank']", f"is {rank}, outside world size {world}")
            files.append(doc.shard_file(f, fkey, len(shape), rank))
        problem = _coverage_problem(shape, [f.block for f in files])
        if problem is None and not files:
            problem = "it has no file"
        if problem:
            raise doc.fail(key, f"(shape {list(shape)}) is not saved exactly once: {problem}")
        tensors[name] = TensorEntry(name, shape, dtype, lay, tuple(files))
    stored = top.get("strategy_file")
    strategy = None
    if stored is not None:
        stored = doc.obj(stored, "['strategy_file']")
        sha = stored.get("sha256")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise doc.fail("['strategy_file']['sha256']", f"must be 64 hex digits, got {sha!r}")
        strategy = StoredFile(doc.relpath(stored.get("path"), "['strategy_file']['path']"),
                              doc.integer(stored.get("bytes"), "['strategy_file']['bytes']", 0),
                              sha)
    extra = json.dumps(doc.obj(top.get("extra", {}), "['extra']"))
    return Manifest(root, doc.integer(top["version"], "['version']", 1), step, world,
                    MappingProxyType(tensors), strategy, extra)


def check_against(manifest: Manifest,
                  expected: Mapping[str, TensorLayout | Sequence[int]
                                    | tuple[Sequence[int], Any]]) -> None:
    """Refuse a checkpoint saved for another graph: ``expected`` names every tensor the caller
    will load, each with a TensorLayout or a shape (its global shape), or a pair (shape,
    dtype). The ValueError lists what differs: tensors missing from the checkpoint, tensors
    it has that are not expected, and shapes or dtypes, as expected versus found.

    >>> check_against(read_manifest(d), {"params/w": (8, 16)})  # doctest: +SKIP
    ValueError: check_against: checkpoint '…' does not fit: tensor 'params/w' has shape
    [16, 8] in the checkpoint, expected [8, 16]
    """
    func = "check_against"
    if not isinstance(manifest, Manifest):
        raise TypeError(f"{func}: manifest must be a Manifest (read_manifest), got "
                        f"{type(manifest).__name__}")
    if not isinstance(expected, Mapping):
        raise TypeError(f"{func}: expected must be a mapping {{tensor name: layout, shape or "
                        f"(shape, dtype)}}, got {type(expected).__name__}")
    found: list[str] = []
    for name, spec in expected.items():
        shape, dtype = _shape_and_dtype(func, name, spec)
        if name not in manifest.tensors:
            found.append(f"tensor {name!r} is missing from the checkpoint")
            continue
        entry = manifest.tensors[name]
        if entry.shape != shape:
            found.append(f"tensor {name!r} has shape {list(entry.shape)} in the checkpoint, "
                         f"expected {list(shape)}")
        if dtype is not None and entry.dtype != dtype:
            found.append(f"tensor {name!r} has dtype {entry.dtype} in the checkpoint, expected "
                         f"{dtype}")
    found += [f"tensor {name!r} is in the checkpoint but not expected"
              for name in manifest.tensors if name not in expected]
    if found:
        more = f"; and {len(found) - 5} more" if len(found) > 5 else ""
        raise ValueError(f"{func}: checkpoint {manifest.directory!r} does not fit: "
                         + "; ".join(found[:5]) + more)


def _shape_and_dtype(func: str, name: str, spec: object
                     ) -> tuple[tuple[int, ...], np.dtype[Any] | None]:
    if isinstance(spec, TensorLayout):
        return spec.shape, None
    what = "a TensorLayout, a shape (ints) or a pair (shape, dtype)"
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        if len(spec) == 2 and isinstance(spec[0], Sequence):
            try:
                dtype = np.dtype(spec[1])
            except TypeError:
                raise TypeError(f"{func}: expected[{name!r}] has dtype {spec[1]!r}, which is "
                                "not a numpy dtype") from None
            return _shape_and_dtype(func, name, spec[0])[0], dtype
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in spec):
            return tuple(int(v) for v in spec), None
    raise TypeError(f"{func}: expected[{name!r}] must be {what}, got {spec!r}")


# ---------------------------------------------------------------- loading
# Files whose sha256 this process has checked: (real path, device, inode, size, mtime, sha).
_VERIFIED: set[tuple[str, int, int, int, int, str]] = set()


def _verify(path: str, shard: ShardFile, stats: dict[str, int] | None) -> None:
    """Check the file against the manifest: its size, then its sha256 (once per process
    while the file's identity, size and time stay the same)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size != shard.nbytes:
            raise ValueError(f"checkpoint file {shard.path!r} has the wrong size: {st.st_size} "
                             f"bytes on disk, {shard.nbytes} in the manifest (truncated or "
                             "replaced?)")
        key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, shard.sha256)
        if key in _VERIFIED:
            return
        digest = hashlib.sha256()
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    if stats is not None:
        stats["bytes_hashed"] = stats.get("bytes_hashed", 0) + st.st_size
    if digest.hexdigest() != shard.sha256:
        raise ValueError(f"checkpoint file {shard.path!r} fails its checksum: sha256 "
                         f"{digest.hexdigest()[:16]}… on disk, {shard.sha256[:16]}… in the "
                         "manifest (the file is corrupt)")
    _VERIFIED.add(key)


def _overlap(a: Block, b: Block) -> Block | None:
    """The intersection of two blocks, or None if it holds no element."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _target(func: str, manifest: Manifest, name: str, layout: TensorLayout, rank: int
            ) -> tuple[TensorEntry, Block]:
    entry = _entry(func, manifest, name)
    if not isinstance(layout, TensorLayout):
        raise TypeError(f"{func}: layout must be a TensorLayout, got {type(layout).__name__}")
    if layout.shape != entry.shape:
        raise ValueError(f"{func}: layout {layout} is for shape {list(layout.shape)}, but "
                         f"tensor {name!r} has shape {list(entry.shape)} in the checkpoint")
    if layout.partial:
        raise ValueError(f"{func}: layout {layout} has pending sums (partial "
                         f"{list(layout.partial)}); a checkpoint loads whole values only")
    rank = _int(func, "rank", rank, 0)
    if rank >= layout.device_num:
        raise ValueError(f"{func}: rank {rank} is outside layout {layout} "
                         f"({layout.device_num} devices)")
    return entry, layout.slice_of(rank)


def shard_sources(manifest: Manifest, name: str, layout: TensorLayout, rank: int
                  ) -> tuple[ShardFile, ...]:
    """The saved files that ``rank`` needs for its shard of ``name`` under ``layout``: those
    whose blocks overlap its slice (MindSpore's ``rank_list_for_transform``).

    Saved on 8 ranks split by rows (rank r wrote rows 2r, 2r+1 of a (16, 4) tensor), rank 1 of
    ``TensorLayout((4,), (0, -1), (16, 4))`` (rows 4..7) needs the files of ranks 2 and 3.
    """
    entry, block = _target("shard_sources", manifest, name, layout, rank)
    return tuple(f for f in entry.files if _overlap(f.block, block) is not None)


def load_shard(directory: str | os.PathLike[str], name: str, layout: TensorLayout, rank: int,
               *, stats: dict[str, int] | None = None, verify: bool = True) -> np.ndarray:
    """Rank ``rank``'s shard of tensor ``name`` under ``layout``, from the checkpoint in
    ``directory``. ``layout`` may differ from the saved one (another strategy, another device
    count); only the files of :func:`shard_sources` are opened, each memory-mapped, and only
    the overlap is copied out of it.

    Each file opened is first checked against the manifest (``verify``): its size, then its
    sha256, which reads the whole file once per process (see the module docstring). A
    mismatch raises a ValueError naming the file and "size" or "checksum". ``stats``, if
    given, gains ``bytes_read`` (data bytes sliced out of the files: exactly the shard's
    size), ``files_read`` and ``bytes_hashed``.

    >>> lay = TensorLayout((2, 2), (1, 0), (8, 16))        # 4 ranks, rows and columns split
    >>> load_shard("ckpt/step_10", "params/w", lay, 3).shape  # doctest: +SKIP
    (4, 8)
    """
    func = "load_shard"
    manifest = read_manifest(directory)
    entry, block = _target(func, manifest, name, layout, rank)
    out = np.empty(layout.local_shape(), dtype=entry.dtype)
    copied = 0
    for shard in entry.files:
        part = _overlap(shard.block, block)
        if part is None:
            continue
        path = _inside(manifest.directory, shard.path, os.path.join(manifest.directory,
                                                                    MANIFEST))
        if verify:
            _verify(path, shard, stats)
        saved = np.load(path, mmap_mode="r", allow_pickle=False)
        want = tuple(b - a for a, b in shard.block)
        if saved.shape != want or saved.dtype != entry.dtype:
            raise ValueError(f"{func}: checkpoint file {shard.path!r} holds {saved.dtype} "
                             f"{saved.shape}, the manifest says {entry.dtype} {want}")
        piece = saved[tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in
                            zip(part, shard.block))]
        out[tuple(slice(lo - d0, hi - d0) for (lo, hi), (d0, _) in zip(part, block))] = piece
        copied += piece.size
        if stats is not None:
            stats["bytes_read"] = stats.get("bytes_read", 0) + piece.nbytes
            stats["files_read"] = stats.get("files_read", 0) + 1
        del saved, piece  # unmap before opening the next file
    assert copied == out.size, (copied, out.size)  # the manifest's blocks tile the tensor
    return out


def load_tensor(directory: str | os.PathLike[str], name: str, *,
                stats: dict[str, int] | None = None) -> np.ndarray:
    """The whole tensor ``name`` (every saved block of it, verified): ``load_shard`` of a
    layout that holds it whole on one device."""
    entry = _entry("load_tensor", read_manifest(directory), name)
    whole = TensorLayout((1,), [-1] * len(entry.shape), entry.shape)
    return load_shard(directory, name, whole, 0, stats=stats)


# ---------------------------------------------------------------- whole checkpoints
def transform_checkpoint(src_dir: str | os.PathLike[str], dst_dir: str | os.PathLike[str],
                         dst_layouts: Mapping[str, TensorLayout], dst_world_size: int, *,
                         strategy_file: str | os.PathLike[str] | None = None,
                         progress: Callable[[str], None] | None = None) -> dict[str, int]:
    """Rewrite the checkpoint in ``src_dir`` into ``dst_dir`` for ``dst_layouts`` (every
    tensor of the checkpoint, each laid out over ``dst_world_size`` devices), destination
    rank by destination rank, each reading only the saved blocks that overlap its own
    (:func:`load_shard`); then :func:`finish_checkpoint`, with the source's step and extra.
    ``progress`` receives a line every few tensors. Returns the reading ``stats``.
    """
    func = "transform_checkpoint"
    manifest = read_manifest(src_dir)
    lays = _layouts(func, dst_layouts)
    check_against(manifest, lays)
    world = _int(func, "dst_world_size", dst_world_size, 1)
    for name, lay in lays.items():
        if lay.device_num != world:
            raise ValueError(f"{func}: tensor {name!r} has layout {lay} over {lay.device_num} "
                             f"devices, but dst_world_size is {world}")
    dst = _new_checkpoint_directory(func, "dst_dir", dst_dir)
    stats: dict[str, int] = {}
    done = 0

    for rank in range(world):
        def shard_of(name: str, rank: int = rank) -> np.ndarray:
            nonlocal done
            done += 1
            if progress is not None and done % _PROGRESS_EVERY == 0:
                progress(f"transform: {done} shards written (rank {rank} of {world}), "
                         f"{_size(stats.get('bytes_read', 0))} read")
            return load_shard(manifest.directory, name, lays[name], rank, stats=stats)

        _save_rank(dst, rank, lays, shard_of, manifest.step, manifest.extra_json)
    finish_checkpoint(dst, world, lays, step=manifest.step, strategy_file=strategy_file,
                      extra=manifest.extra)
    if progress is not None:
        progress(f"transform: done, {done} shards on {world} rank{'s' * (world != 1)}, "
                 f"{_size(stats.get('bytes_read', 0))} read")
    return stats


def merge_checkpoint(directory: str | os.PathLike[str], out: str | os.PathLike[str], *,
                     progress: Callable[[str], None] | None = None) -> None:
    """Write every tensor of the checkpoint whole. ``out`` ending in ``.npz`` gives one
    uncompressed ``.npz`` (keys are the tensor names; read it with ``np.load(out,
    allow_pickle=False)``); any other ``out`` becomes a one-device checkpoint, whose
    ``rank_0/*.npy`` are the whole tensors and which :func:`load_shard` reads like any other.
    """
    func = "merge_checkpoint"
    target = _path(func, "out", out)
    manifest = read_manifest(directory)
    if not target.endswith(".npz"):
        whole = {name: TensorLayout((1,), [-1] * len(t.shape), t.shape)
                 for name, t in manifest.tensors.items()}
        transform_checkpoint(manifest.directory, target, whole, 1, progress=progress)
        return
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(parent):
        raise ValueError(f"{func}: the directory of out {target!r} does not exist")
    # One tensor at a time into the zip, as np.savez lays it out ("<name>.npy" members).
    with atomic_file(target) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED,
                                               allowZip64=True) as zf:
        for i, name in enumerate(manifest.tensors, 1):
            with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, load_tensor(manifest.directory, name),
                                          allow_pickle=False)
            if progress is not None and i % _PROGRESS_EVERY == 0:
                progress(f"merge: {i} of {len(manifest.tensors)} tensors")


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The complete checkpoint under ``root`` with the highest step (ties: the later
    directory name), or None if there is none or ``root`` does not exist yet. Subdirectories
    without ``manifest.json`` (a save that did not finish) are skipped; a manifest that is
    there but broken raises, rather than silently resuming from an older checkpoint.

    >>> latest_checkpoint("ckpt")  # step_000010 complete, step_000020 not  # doctest: +SKIP
    'ckpt/step_000010'
    """
    func = "latest_checkpoint"
    base = _path(func, "root", root)
    if not os.path.exists(base):
        return None
    _directory(func, "root", base)
    best: tuple[int, str] | None = None
    for entry in sorted(os.listdir(base)):
        path = os.path.join(base, entry)
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        key = (read_manifest(path).step, entry)
        if best is None or key > best:
            best = key
    return None if best is None else os.path.join(base, best[1])


# ---------------------------------------------------------------- command line
def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


class _UsageError(Exception):
    """A bad command line: main prints it on one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=_PROG, description="Inspect, merge or transform a simpar distributed "
                "checkpoint (a directory with manifest.json and rank_N/*.npy).")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inspect = sub.add_parser("inspect", help="print step, world size, tensors, files, bytes")
    inspect.add_argument("directory", metavar="DIR")
    inspect.add_argument("--verify", action="store_true",
                         help="also check every file's size and sha256")
    merge = sub.add_parser("merge", help="write every tensor whole")
    merge.add_argument("directory", metavar="DIR")
    merge.add_argument("out", metavar="OUT", help="a new directory, or a .npz file")
    transform = sub.add_parser("transform", help="rewrite for another strategy or device count")
    transform.add_argument("src", metavar="SRC")
    transform.add_argument("dst", metavar="DST")
    transform.add_argument("--strategy", required=True, metavar="FILE.json",
                           help="the destination's strategy file (simpar or MindSpore JSON)")
    return p


def _param_of(name: str) -> str:
    """The parameter a checkpoint tensor belongs to: "params/<p>" and "opt/<p>/<slot>" are
    parameter p's; any other name is its own."""
    if name.startswith("params/"):
        return name[len("params/"):]
    if name.startswith("opt/") and name.count("/") >= 2:
        return name[len("opt/"):name.rindex("/")]
    return name


def _strategy_layouts(manifest: Manifest, params: Mapping[str, TensorLayout],
                      world: int) -> dict[str, TensorLayout]:
    """The destination layout of every tensor: its parameter's layout from the strategy file
    (optimizer state follows its parameter), or held whole on every rank if the file does not
    lay out its parameter."""
    out = {}
    for name, entry in manifest.tensors.items():
        lay = params.get(_param_of(name))
        if lay is None:
            out[name] = TensorLayout((world,), [-1] * len(entry.shape), entry.shape)
        elif lay.shape != entry.shape:
            raise ValueError(f"tensor {name!r} has shape {list(entry.shape)} in the checkpoint, "
                             f"but the strategy lays out parameter {_param_of(name)!r} with "
                             f"shape {list(lay.shape)}")
        else:
            out[name] = lay
    return out


def _inspect(directory: str, verify: bool) -> None:
    manifest = read_manifest(directory)
    print(manifest)
    if manifest.strategy_file is not None:
        print(f"  strategy file {manifest.strategy_file.path}")
    for entry in manifest.tensors.values():
        print(f"  {entry}")
    if verify:
        for shard in manifest.files:
            _verify(_inside(manifest.directory, shard.path, manifest.directory), shard, None)
        print(f"verified {len(manifest.files)} files: sizes and sha256 match the manifest")


# ---------------------------------------------------------------- a training cell's checkpoints
def _training_layouts(train: TrainOneStepCell) -> dict[str, TensorLayout]:
    """The tensors of a built training cell's checkpoint: every parameter
    (``params/<name>``) and every optimizer state slot (``opt/<name>/<slot>``, in its
    parameter's layout)."""
    program = train.program
    if program is None:
        raise ValueError("TrainOneStepCell checkpoint: the cell has not been built; call it "
                         "(or build) on a batch first")
    out = {f"params/{name}": lay for name, lay in program.param_layouts.items()}
    for name, slots in train.optimizer.state.items():
        for slot in slots:
            out[f"opt/{name}/{slot}"] = program.param_layouts[name]
    return out


def _training_arrays(train: TrainOneStepCell) -> dict[str, np.ndarray]:
    arrays = {f"params/{n}": a for n, a in train.params.items()}
    arrays.update({f"opt/{n}/{slot}": a for n, slots in train.optimizer.state.items()
                   for slot, a in slots.items()})
    return arrays


def _agree(what: str, problem: str | None, collective: bool) -> None:
    """Raise on every rank if any rank had a problem, with the first such rank's message: a
    rank that went on alone would wait forever in the next collective. The agreement runs on
    raw MPI (``comm.world()``), outside simpar's CommTrace: it is no training traffic. A
    one-device cell (``collective`` False) agrees with nobody."""
    if not collective or comm.get_group_size() == 1:
        if problem is not None:
            raise ValueError(f"{what}: {problem}")
        return
    raw = (problem or "").encode("utf-8")
    if len(raw) > _MESSAGE_BYTES:
        raw = raw[:_MESSAGE_BYTES - 3] + b"..."
    mine = np.zeros(_MESSAGE_BYTES + 1, dtype=np.int32)
    mine[0] = len(raw) if problem is not None else -1
    mine[1:1 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    every = np.zeros((comm.get_group_size(), _MESSAGE_BYTES + 1), dtype=np.int32)
    comm.world().Allgather(mine, every)
    for rank, row in enumerate(every):
        if row[0] >= 0:
            text = bytes(row[1:1 + row[0]].astype(np.uint8)).decode("utf-8", "replace")
            raise ValueError(f"{what}: rank {rank}: {text}")


_MESSAGE_BYTES = 1024


def _failed(e: BaseException) -> str:
    return str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"


def save_training(train: TrainOneStepCell, directory: str | os.PathLike[str],
                  extra: Mapping[str, Any] | None = None) -> str:
    """Save a built training cell's state into ``directory`` (collective: every rank of a
    parallel cell calls): each rank its own blocks of the parameters and the optimizer state
    (one writer per set of replicas), the strategy file beside them, and ``manifest.json``
    last, so that a save cut short leaves no checkpoint there and the previous one stays the
    latest. ``extra`` (JSON values, e.g. the losses so far) is kept in the manifest. Returns
    the directory. Any failure raises on every rank, with the failing rank's message."""
    layouts = _training_layouts(train)
    program = train.program
    assert program is not None
    parallel = program.device_num > 1
    rank = comm.get_rank() if parallel else 0
    step = train.step_count
    info = {**(extra or {}), "optimizer": type(train.optimizer).__name__,
            "optimizer_t": train.optimizer.t}
    root = os.fspath(directory)
    problem = None
    try:
        if rank == 0:
            os.makedirs(root, exist_ok=True)
    except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
        problem = f"cannot create {root!r}: {_failed(e)}"
    _agree("save_training", problem, parallel)
    try:
        save_shards(root, rank, layouts, _training_arrays(train), step=step, extra=info)
    except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
        problem = _failed(e)
    _agree("save_training", problem, parallel)
    if rank == 0:
        try:
            assert program.strategy_map is not None
            with tempfile.TemporaryDirectory(dir=root) as scratch:
                strategy = os.path.join(scratch, "strategy.json")
                save_strategy(strategy, program.strategy_map, program.graph,
                              only_trainable_params=False)
                finish_checkpoint(root, program.device_num, layouts, step=step,
                                  strategy_file=strategy, extra=info)
        except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
            problem = _failed(e)
    _agree("save_training", problem, parallel)
    return root


def load_training(train: TrainOneStepCell, directory: str | os.PathLike[str]) -> int:
    """Restore a built training cell from the checkpoint in ``directory`` (collective for a
    parallel cell): its parameters, optimizer state and step count. The cell may run another
    strategy or another number of ranks than the one that saved: each rank reads only the
    saved blocks that overlap its own. A checkpoint of another network, another optimizer or
    another dtype, or a damaged file, raises on every rank, naming what is wrong. Returns the
    step the checkpoint was taken after."""
    layouts = _training_layouts(train)
    program = train.program
    assert program is not None
    parallel = program.device_num > 1
    rank = comm.get_rank() if parallel else 0
    arrays = _training_arrays(train)
    problem = None
    restored: dict[str, np.ndarray] = {}
    manifest = None
    try:
        manifest = read_manifest(directory)
        kind = manifest.extra.get("optimizer")
        if kind != type(train.optimizer).__name__:
            raise ValueError(f"the checkpoint holds {kind} state, but the cell trains with "
                             f"{type(train.optimizer).__name__}")
        check_against(manifest, {name: (lay.shape, arrays[name].dtype)
                                 for name, lay in layouts.items()})
        for name, lay in layouts.items():
            restored[name] = load_shard(directory, name, lay, rank)
    except Exception as e:  # noqa: BLE001 - agreed below and raised on every rank
        problem = _failed(e)
    _agree("load_training", problem, parallel)
    assert manifest is not None
    for name in train.params:
        train.params[name] = restored[f"params/{name}"]
    for name, slots in train.optimizer.state.items():
        for slot in slots:
            slots[slot] = restored[f"opt/{name}/{slot}"]
    train.optimizer.t = int(manifest.extra.get("optimizer_t", manifest.step))
    train.step_count = manifest.step
    return manifest.step


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m simpar.checkpoint``; returns the exit status: 0, or 2 with one line on
    stderr for a bad command line or a checkpoint that cannot be read or written."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(args_list)
    except _UsageError as e:
        print(f"{_PROG}: error: {e} (--help lists the commands)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if args.command == "inspect":
            _inspect(args.directory, args.verify)
        elif args.command == "merge":
            merge_checkpoint(args.directory, args.out, progress=progress)
            print(f"merged {args.directory} into {args.out}")
        else:
            smap = load_strategy(args.strategy)
            manifest = read_manifest(args.src)
            layouts = _strategy_layouts(manifest, smap.params, smap.device_num)
            stats = transform_checkpoint(args.src, args.dst, layouts, smap.device_num,
                                         strategy_file=args.strategy, progress=progress)
            print(f"transformed {args.src} ({manifest.world_size} ranks) into {args.dst} "
                  f"({smap.device_num} ranks), {_size(stats.get('bytes_read', 0))} read")
    except (ValueError, TypeError, OSError) as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
