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

The modules, one concept each: :mod:`~simpar.checkpoint.manifest` (the format, and reading it
back checked), :mod:`~simpar.checkpoint.save`, :mod:`~simpar.checkpoint.load` (loading,
resharding, merging), :mod:`~simpar.checkpoint.training` (a training cell's checkpoints) and
:mod:`~simpar.checkpoint.cli` (the command line).
"""

from simpar.checkpoint.cli import main
from simpar.checkpoint.export import export_merged, export_per_rank, safetensors_bytes
from simpar.checkpoint.load import (
    load_shard,
    load_tensor,
    merge_checkpoint,
    shard_sources,
    transform_checkpoint,
)
from simpar.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    ShardFile,
    StoredFile,
    TensorEntry,
    check_against,
    latest_checkpoint,
    read_manifest,
)
from simpar.checkpoint.save import finish_checkpoint, save_shards, writer_rank
from simpar.checkpoint.training import load_training, save_training

__all__ = ["FORMAT_VERSION", "MANIFEST", "Manifest", "ShardFile", "StoredFile", "TensorEntry",
           "export_merged", "export_per_rank", "safetensors_bytes",
           "check_against", "finish_checkpoint", "latest_checkpoint", "load_shard", "load_tensor",
           "load_training", "main", "merge_checkpoint", "read_manifest", "save_shards",
           "save_training", "shard_sources", "transform_checkpoint", "writer_rank"]
