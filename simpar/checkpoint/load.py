"""Loading and resharding: any rank of any strategy or device count reads its shard by opening
only the saved blocks that overlap it (:func:`shard_sources`, :func:`load_shard`); whole
checkpoints are rewritten for another layout (:func:`transform_checkpoint`) or merged
(:func:`merge_checkpoint`).

Every file opened is first checked against the manifest: its size, then its sha256 (once per
file per process, see :func:`verify_file`).
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Callable, Mapping

import numpy as np

from simpar import _checks as checks
from simpar._env import atomic_file
from simpar.checkpoint.manifest import (
    MANIFEST,
    Block,
    Manifest,
    ShardFile,
    TensorEntry,
    check_against,
    path_inside,
    read_manifest,
    size_text,
    tensor_entry,
)
from simpar.checkpoint.save import (
    checked_layouts,
    finish_checkpoint,
    new_checkpoint_directory,
    save_rank,
)
from simpar.layout import TensorLayout

__all__ = ["load_shard", "load_tensor", "merge_checkpoint", "shard_sources", "transform_checkpoint",
           "verify_file"]

_HASH_CHUNK = 1 << 20
_PROGRESS_EVERY = 50  # tensors (or shards) between two progress lines
# Files whose sha256 this process has checked: (real path, device, inode, size, mtime, sha).
_VERIFIED: set[tuple[str, int, int, int, int, str]] = set()


def verify_file(path: str, shard: ShardFile, stats: dict[str, int] | None) -> None:
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
    entry = tensor_entry(func, manifest, name)
    checks.instance(layout, TensorLayout, f"{func}: layout", "a TensorLayout")
    if layout.shape != entry.shape:
        raise ValueError(f"{func}: layout {layout} is for shape {list(layout.shape)}, but "
                         f"tensor {name!r} has shape {list(entry.shape)} in the checkpoint")
    if layout.partial:
        raise ValueError(f"{func}: layout {layout} has pending sums (partial "
                         f"{list(layout.partial)}); a checkpoint loads whole values only")
    rank = checks.integer(rank, f"{func}: rank", 0)
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
    sha256, which reads the whole file once per process (:func:`verify_file`). A
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
        path = path_inside(manifest.directory, shard.path,
                           os.path.join(manifest.directory, MANIFEST))
        if verify:
            verify_file(path, shard, stats)
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
    entry = tensor_entry("load_tensor", read_manifest(directory), name)
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
    lays = checked_layouts(func, dst_layouts)
    check_against(manifest, lays)
    world = checks.integer(dst_world_size, f"{func}: dst_world_size", 1)
    for name, lay in lays.items():
        if lay.device_num != world:
            raise ValueError(f"{func}: tensor {name!r} has layout {lay} over {lay.device_num} "
                             f"devices, but dst_world_size is {world}")
    dst = new_checkpoint_directory(func, "dst_dir", dst_dir)
    stats: dict[str, int] = {}
    done = 0

    for rank in range(world):
        def shard_of(name: str, rank: int = rank) -> np.ndarray:
            nonlocal done
            done += 1
            if progress is not None and done % _PROGRESS_EVERY == 0:
                progress(f"transform: {done} shards written (rank {rank} of {world}), "
                         f"{size_text(stats.get('bytes_read', 0))} read")
            return load_shard(manifest.directory, name, lays[name], rank, stats=stats)

        save_rank(dst, rank, lays, shard_of, manifest.step, manifest.extra_json)
    finish_checkpoint(dst, world, lays, step=manifest.step, strategy_file=strategy_file,
                      extra=manifest.extra)
    if progress is not None:
        progress(f"transform: done, {done} shards on {world} rank{'s' * (world != 1)}, "
                 f"{size_text(stats.get('bytes_read', 0))} read")
    return stats


def merge_checkpoint(directory: str | os.PathLike[str], out: str | os.PathLike[str], *,
                     progress: Callable[[str], None] | None = None) -> None:
    """Write every tensor of the checkpoint whole. ``out`` ending in ``.npz`` gives one
    uncompressed ``.npz`` (keys are the tensor names; read it with ``np.load(out,
    allow_pickle=False)``); any other ``out`` becomes a one-device checkpoint, whose
    ``rank_0/*.npy`` are the whole tensors and which :func:`load_shard` reads like any other.
    """
    func = "merge_checkpoint"
    target = checks.path(out, f"{func}: out")
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
