"""The checkpoint format: file names, the manifest and per-rank index documents as values,
and reading a manifest back with every field checked.

A tensor's block is saved as ``rank_{r}/{file_name(name)}`` (``params/fc1.weight`` ->
``params%2Ffc1.weight.npy``); each rank lists its blocks in ``rank_{r}/index.json``; rank 0
writes ``manifest.json`` last, so its presence marks a complete checkpoint. Every JSON file is
read with :class:`JsonDoc`, whose errors name the file and the key; a manifest's blocks must
tile each tensor exactly once (:func:`coverage_problem`).
"""

from __future__ import annotations

import bisect
import difflib
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any
from urllib.parse import quote

import numpy as np

from simpar import _checks as checks
from simpar.layout import TensorLayout

__all__ = ["Block", "DTYPE_KINDS", "FORMAT", "FORMAT_VERSION", "INDEX", "INDEX_FORMAT", "JsonDoc",
           "MANIFEST", "Manifest", "STRATEGY", "ShardFile", "StoredFile", "TensorEntry",
           "check_against", "coverage_problem", "device_of", "existing_directory", "file_name",
           "latest_checkpoint", "load_json", "name_problem", "param_of", "path_inside",
           "read_manifest", "size_text", "tensor_entry"]

#: The version of the manifest and index format; a newer one is refused, not misread.
#: Version 2 adds a tensor's ``ranks`` (a pipeline stage's); a checkpoint without them is
#: written as version 1, which every simpar reads.
FORMAT_VERSION = 2
#: The file whose presence marks a complete checkpoint.
MANIFEST = "manifest.json"
# The "format" of the manifest and of a rank's index, the index's and the strategy's names.
FORMAT = "simpar-checkpoint"
INDEX_FORMAT = "simpar-checkpoint-index"
INDEX = "index.json"
STRATEGY = "strategy.json"
# dtype kinds a .npy file holds without pickle and numpy reads back as plain numbers:
# bool, signed and unsigned ints, floats, complex.
DTYPE_KINDS = "biufc"
# File names stay well under the common 255-byte limit, with room for the temporary suffix.
_MAX_FILE_NAME = 180
# Coverage is checked on the grid of all block boundaries; this many cells is far beyond
# any even layout (whose grid has one cell per block) and bounds a hand-made manifest.
_MAX_GRID_CELLS = 1 << 24

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
    and the files whose blocks tile it exactly once. ``ranks`` are the world ranks the
    layout's devices are, in order, when they are not all of them (a pipeline stage's: its
    parameters live on its ranks only); None for every rank."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    layout: TensorLayout
    files: tuple[ShardFile, ...]
    ranks: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def __str__(self) -> str:
        return (f"{self.name} {list(self.shape)} {self.dtype.name} {self.layout} "
                f"{len(self.files)} file{'s' * (len(self.files) != 1)} {size_text(self.nbytes)}")


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
                f"{size_text(self.total_bytes)}")


def tensor_entry(func: str, manifest: Manifest, name: str) -> TensorEntry:
    """The entry of tensor ``name``; the error names the closest one."""
    if name not in manifest.tensors:
        close = difflib.get_close_matches(name, list(manifest.tensors), n=1)
        hint = f" (closest: {close[0]!r})" if close else ""
        raise ValueError(f"{func}: checkpoint {manifest.directory!r} has no tensor {name!r}"
                         f"{hint}; it holds {len(manifest.tensors)} tensors")
    return manifest.tensors[name]


def param_of(name: str) -> str:
    """The parameter a checkpoint tensor belongs to: "params/<p>" and "opt/<p>/<slot>" are
    parameter p's; any other name is its own."""
    if name.startswith("params/"):
        return name[len("params/"):]
    if name.startswith("opt/") and name.count("/") >= 2:
        return name[len("opt/"):name.rindex("/")]
    return name


def device_of(ranks: Sequence[int] | None, rank: int) -> int | None:
    """The layout device that world rank ``rank`` is among ``ranks`` (a tensor's
    :attr:`TensorEntry.ranks`; None: every rank, in order), or None if it holds no block."""
    if ranks is None:
        return rank
    return ranks.index(rank) if rank in ranks else None


def size_text(nbytes: int) -> str:
    """A byte count as people read it: ``size_text(1536)`` is ``'1.5 KiB'``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------- names and blocks
def existing_directory(func: str, what: str, value: object) -> str:
    """``value``, a path (``str`` or ``os.PathLike``) that names a directory."""
    path = checks.path(value, f"{func}: {what}")
    if not os.path.isdir(path):
        raise ValueError(f"{func}: {what} {path!r} is not a directory")
    return path


def name_problem(name: object) -> str | None:
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


def file_name(name: str) -> str:
    """The file a tensor's block is saved in: every character other than letters, digits,
    '.', '_', '-' and '~' percent-encoded ("params/fc1.weight" -> "params%2Ffc1.weight.npy"),
    so the name is one path component and two names never share a file; a very long name
    keeps its start and gets a hash of the whole."""
    text = quote(name, safe="")
    if len(text) > _MAX_FILE_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        text = f"{text[:_MAX_FILE_NAME - 17]}-{digest}"
    return text + ".npy"


def coverage_problem(shape: Sequence[int], blocks: Sequence[Block]) -> str | None:
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
def load_json(path: str) -> Any:
    """The JSON document in ``path``; a key given twice in one object is refused."""
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


class JsonDoc:
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
        if dtype is None or dtype.kind not in DTYPE_KINDS or dtype.fields is not None:
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


def path_inside(root: str, rel: str, where: str) -> str:
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
    root = existing_directory(func, "directory", directory)
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
    doc = JsonDoc(os.path.join(root, MANIFEST), load_json(os.path.join(root, MANIFEST)))
    top = doc.top(FORMAT)
    step = doc.integer(top.get("step"), "['step']", 0)
    world = doc.integer(top.get("world_size"), "['world_size']", 1)
    tensors: dict[str, TensorEntry] = {}
    for name, item in doc.obj(top.get("tensors"), "['tensors']").items():
        key = f"['tensors'][{name!r}]"
        problem = name_problem(name)
        if problem:
            raise doc.fail(key, f"names a tensor that {problem}")
        item = doc.obj(item, key)
        shape = tuple(doc.integers(item.get("shape"), f"{key}['shape']", 0))
        dtype = doc.dtype(item.get("dtype"), f"{key}['dtype']")
        try:
            lay = TensorLayout.from_dict(doc.obj(item.get("layout"), f"{key}['layout']"))
        except (ValueError, TypeError) as e:
            raise doc.fail(f"{key}['layout']", f"is not a layout: {e}") from None
        ranks = None
        if "ranks" in item:
            ranks = tuple(doc.integers(item["ranks"], f"{key}['ranks']", 0))
            if len(set(ranks)) != len(ranks) or any(r >= world for r in ranks):
                raise doc.fail(f"{key}['ranks']", f"must be distinct ranks below the world "
                               f"size {world}, got {list(ranks)}")
        devices = world if ranks is None else len(ranks)
        if lay.shape != shape or lay.partial or lay.device_num != devices:
            raise doc.fail(f"{key}['layout']", f"{lay} does not fit: the tensor has shape "
                           f"{list(shape)} and {devices} devices hold it, without pending "
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
        problem = coverage_problem(shape, [f.block for f in files])
        if problem is None and not files:
            problem = "it has no file"
        if problem:
            raise doc.fail(key, f"(shape {list(shape)}) is not saved exactly once: {problem}")
        tensors[name] = TensorEntry(name, shape, dtype, lay, tuple(files), ranks)
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
    checks.instance(manifest, Manifest, f"{func}: manifest", "a Manifest (read_manifest)")
    checks.instance(expected, Mapping, f"{func}: expected",
                    "a mapping {tensor name: layout, shape or (shape, dtype)}")
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


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The complete checkpoint under ``root`` with the highest step (ties: the later
    directory name), or None if there is none or ``root`` does not exist yet. Subdirectories
    without ``manifest.json`` (a save that did not finish) are skipped; a manifest that is
    there but broken raises, rather than silently resuming from an older checkpoint.

    >>> latest_checkpoint("ckpt")  # step_000010 complete, step_000020 not  # doctest: +SKIP
    'ckpt/step_000010'
    """
    func = "latest_checkpoint"
    base = checks.path(root, f"{func}: root")
    if not os.path.exists(base):
        return None
    existing_directory(func, "root", base)
    best: tuple[int, str] | None = None
    for entry in sorted(os.listdir(base)):
        path = os.path.join(base, entry)
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        key = (read_manifest(path).step, entry)
        if best is None or key > best:
            best = key
    return None if best is None else os.path.join(base, best[1])
