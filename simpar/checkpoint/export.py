"""A simpar checkpoint in the files MindSpore's tools read: safetensors
(``format="safetensors"`` in MindSpore's ``save_checkpoint`` and ``load_checkpoint``).

* Per rank (:func:`export_per_rank`): ``OUT/rank_{r}/checkpoint_{r}.safetensors`` for every
  rank ``r`` of the saved world, each holding that rank's slice of every tensor it held, as
  MindSpore's distributed training saves them and as its ``transform_checkpoints`` and
  ``load_distributed_checkpoint`` expect them (a ``rank_{r}`` folder per rank), and
  ``OUT/strategy.json``, the strategy file with every tensor's layout
  (``parallel_layout_item``) that those tools take with them.
* Merged (:func:`export_merged`): one ``.safetensors`` file of every tensor whole, which
  ``load_checkpoint(..., format="safetensors")`` reads on one device.

Tensors take MindSpore's names (:func:`mindspore_names`): a parameter its own
(``fc1.weight``), an optimizer's state its slot's prefix (``moments.fc1.weight``).

simpar's own checkpoint saves each distinct block once (a replicated tensor by one of its
holders, see :func:`~simpar.checkpoint.writer_rank`); MindSpore's per-rank files hold every
rank's whole slice, copies included. The per-rank export therefore writes each copy into each
holder's file, so that every ``rank_{r}`` file is complete on its own, as MindSpore's tools
read it.

The files are written by simpar, atomically: a safetensors file is an 8-byte little-endian
header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}}`` and the raw
little-endian data (``safetensors.numpy.load_file`` reads it back); with ``file_format="ckpt"``
(or an ``OUT.ckpt``), MindSpore's own ``.ckpt``, a protobuf ``Checkpoint`` message encoded
here (:func:`ckpt_bytes`; the protobuf library parses it back against that schema).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping

import numpy as np

from simpar import _checks as checks
from simpar._env import write_atomically
from simpar.checkpoint.load import load_shard, load_tensor
from simpar.checkpoint.manifest import read_manifest
from simpar.layout import TensorLayout
from simpar.strategy_file import layouts_document

__all__ = ["CKPT_DTYPES", "MINDSPORE_SLOTS", "SAFETENSORS_DTYPES", "ckpt_bytes",
           "export_merged", "export_per_rank", "mindspore_names", "safetensors_bytes"]

#: numpy's dtypes and the safetensors format's names for them.
SAFETENSORS_DTYPES = {"float16": "F16", "float32": "F32", "float64": "F64", "int8": "I8",
                      "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8",
                      "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}


#: The prefix MindSpore's optimizers give each state slot's copy of a parameter
#: (``params.clone(prefix=...)``), by simpar optimizer and slot.
MINDSPORE_SLOTS = {"Momentum": {"v": "moments"}, "SGD": {"v": "accum"},
                   "Adam": {"m": "moment1", "v": "moment2"},
                   "AdamW": {"m": "adam_m", "v": "adam_v"}}


def mindspore_names(names: list[str], optimizer: str | None) -> dict[str, str]:
    """{simpar checkpoint tensor name: MindSpore's}: ``params/fc1.weight`` is
    ``fc1.weight``; ``opt/fc1.weight/v`` of Momentum is ``moments.fc1.weight`` (MindSpore's
    slot prefixes, :data:`MINDSPORE_SLOTS`; a slot it does not name keeps simpar's)."""
    slots = MINDSPORE_SLOTS.get(optimizer or "", {})
    out = {}
    for name in names:
        parts = name.split("/")
        if parts[0] == "params" and len(parts) == 2:
            out[name] = parts[1]
        elif parts[0] == "opt" and len(parts) == 3:
            out[name] = f"{slots.get(parts[2], parts[2])}.{parts[1]}"
        else:
            out[name] = name
    clash = {v for v in out.values() if list(out.values()).count(v) > 1}
    if clash:
        raise ValueError(f"mindspore_names: tensors would share MindSpore's names "
                         f"{sorted(clash)}; rename the parameters")
    return out


def safetensors_bytes(tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> bytes:
    """``tensors`` ({name: array}) as the bytes of one safetensors file, in name order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks, offset = [], 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        kind = SAFETENSORS_DTYPES.get(array.dtype.name)
        if kind is None:
            raise ValueError(f"safetensors: tensor {name!r} has dtype {array.dtype.name}, which "
                             f"the format does not hold (it holds {sorted(SAFETENSORS_DTYPES)})")
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


#: numpy's dtypes and the ``tensor_type`` names of MindSpore's ``.ckpt`` for them.
CKPT_DTYPES = {"float16": "Float16", "float32": "Float32", "float64": "Float64", "int8": "Int8",
               "int16": "Int16", "int32": "Int32", "int64": "Int64", "uint8": "UInt8",
               "uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64", "bool": "Bool"}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def ckpt_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
    """``tensors`` as MindSpore's ``.ckpt``: its protobuf ``Checkpoint`` (``repeated Value
    value = 1``; a Value holds ``string tag = 1`` and ``TensorProto tensor = 2``; a
    TensorProto ``repeated int64 dims = 1``, ``string tensor_type = 2`` and ``bytes
    tensor_content = 3``), in name order, a 0-d tensor with dims [0] as MindSpore saves it."""
    out = bytearray()
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        kind = CKPT_DTYPES.get(array.dtype.name)
        if kind is None:
            raise ValueError(f"ckpt: tensor {name!r} has dtype {array.dtype.name}, which "
                             f"MindSpore's checkpoint does not hold (it holds "
                             f"{sorted(CKPT_DTYPES)})")
        dims = b"".join(_varint(1 << 3 | 0) + _varint(d) for d in (array.shape or (0,)))
        content = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        tensor = dims + _field(2, kind.encode()) + _field(3, content)
        out += _field(1, _field(1, name.encode()) + _field(2, tensor))
    return bytes(out)


def export_per_rank(directory: str | os.PathLike[str], out: str | os.PathLike[str], *,
                    progress: Callable[[str], None] | None = None,
                    file_format: str = "safetensors") -> list[str]:
    """Write the per-rank files and the strategy file of the module docstring; returns the
    files written. ``out`` must not exist yet (a directory is made)."""
    func = "export_per_rank"
    target = checks.path(out, f"{func}: out")
    if file_format not in ("safetensors", "ckpt"):
        raise ValueError(f"{func}: file_format must be 'safetensors' or 'ckpt', got "
                         f"{file_format!r}")
    if os.path.exists(target):
        raise ValueError(f"{func}: {target!r} exists; export into a new directory")
    manifest = read_manifest(directory)
    world = manifest.world_size
    layouts: dict[str, TensorLayout] = {}
    for name, entry in manifest.tensors.items():
        if entry.ranks is not None:
            raise ValueError(f"{func}: tensor {name!r} lives on the ranks {list(entry.ranks)} "
                             "of one pipeline stage; the per-rank export writes whole-world "
                             "layouts only (export_merged writes every tensor whole)")
        layouts[name] = entry.layout
    names = mindspore_names(list(layouts), manifest.extra.get("optimizer"))
    os.makedirs(target)
    written = []
    for rank in range(world):
        tensors = {names[name]: load_shard(directory, name, lay, rank)
                   for name, lay in layouts.items()}
        folder = os.path.join(target, f"rank_{rank}")
        os.makedirs(folder)
        path = os.path.join(folder, f"checkpoint_{rank}.{file_format}")
        write_atomically(path, ckpt_bytes(tensors) if file_format == "ckpt" else
                         safetensors_bytes(tensors, {"producer": "simpar",
                                                     "step": str(manifest.step),
                                                     "rank": str(rank)}))
        written.append(path)
        if progress is not None:
            progress(f"rank {rank}: {len(tensors)} tensors -> {path}")
    strategy = os.path.join(target, "strategy.json")
    doc = layouts_document({names[n]: lay for n, lay in layouts.items()}, world)
    write_atomically(strategy, json.dumps(doc, indent=1) + "\n")
    return [*written, strategy]


def export_merged(directory: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  progress: Callable[[str], None] | None = None) -> str:
    """Write every tensor of the checkpoint whole into the one file ``out``: safetensors
    (``.safetensors``) or MindSpore's ``.ckpt``."""
    target = checks.path(out, "export_merged: out")
    if not target.endswith((".safetensors", ".ckpt")):
        raise ValueError(f"export_merged: out must end in '.safetensors' or '.ckpt', got "
                         f"{target!r}")
    manifest = read_manifest(directory)
    names = mindspore_names(list(manifest.tensors), manifest.extra.get("optimizer"))
    tensors = {names[name]: load_tensor(directory, name) for name in manifest.tensors}
    write_atomically(target, ckpt_bytes(tensors) if target.endswith(".ckpt") else
                     safetensors_bytes(tensors, {"producer": "simpar",
                                                 "step": str(manifest.step)}))
    if progress is not None:
        progress(f"{len(tensors)} tensors -> {target}")
    return target
