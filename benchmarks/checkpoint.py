"""Distributed checkpoints: save and load throughput for a GPT on 8 ranks, against writing the
same bytes with plain numpy in one process, and the bytes each rank reads when resharding.

    mpirun -n 8 python benchmarks/checkpoint.py             # writes "## checkpoint"
    mpirun -n 8 python benchmarks/checkpoint.py --reps 1 --no-write

The GPT (d_model 256, 4 layers, sequence 64, vocabulary 512, float64, Adam) trains one step
under Megatron's hybrid strategy (dp 2 x mp 4), then, ``--reps`` times each, interleaved:

* simpar save: ``simpar.checkpoint.save_training`` (each rank writes its own blocks, one
  writer per set of replicas, every file fsynced, index, strategy file, manifest last); the
  time is the slowest rank's, from a barrier to a barrier;
* numpy, one process: rank 0 alone writes the same blocks (the same bytes, the same number of
  files) with ``np.save`` and an fsync per file, the floor for these bytes on this disk;
* simpar load: ``load_training`` into a fresh cell under the same strategy (checksums
  verified).

Resharding: a cell under another strategy (Megatron over all 8 ranks) loads every tensor with
``load_shard(..., stats=...)``; each rank's ``bytes_read`` must equal its own shards' bytes
(what overlaps), never whole tensors.
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar.comm as comm
from simpar import _env

import numpy as np
from _common import host_line, markdown_table, today, write_section

import simpar
from simpar import nn
from simpar.checkpoint import load_shard, load_training, read_manifest, save_training
from simpar.nn import presets

D_MODEL, LAYERS, SEQ, VOCAB, BATCH = 256, 4, 64, 512, 8


def _train(dp: int, mp: int) -> nn.TrainOneStepCell:
    net = nn.GPT(VOCAB, SEQ, D_MODEL, LAYERS, 8, dtype=np.float64)
    loss = nn.SoftmaxCrossEntropyWithLogits()
    presets.megatron_gpt(net, dp, mp, loss)
    return nn.TrainOneStepCell(nn.WithLossCell(net, loss), nn.Adam(net.trainable_params(), 1e-3),
                               parallel_mode="semi_auto_parallel", seed=1)


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    return ids[:, :-1], ids[:, 1:]


def _timed(fn: object) -> float:
    """The slowest rank's seconds for ``fn()`` between two barriers."""
    comm.barrier()
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    comm.barrier()
    mine = np.array([time.perf_counter() - t0])
    return float(comm.all_gather(mine).max())


def _numpy_floor(blocks: list[np.ndarray], directory: str) -> None:
    """Rank 0 alone writes ``blocks`` with np.save, one fsynced file each."""
    if comm.get_rank() != 0:
        return
    os.makedirs(directory, exist_ok=True)
    for k, block in enumerate(blocks):
        path = os.path.join(directory, f"{k}.npy")
        with open(path, "wb") as f:
            np.save(f, block, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/checkpoint.py", description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    comm.init()
    n, rank = comm.get_group_size(), comm.get_rank()
    if n != 8:
        raise SystemExit("run under mpirun -n 8")
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                     dataset_strategy=((2, 1), (2, 1)))
    data, label = _batch()
    train = _train(2, 4)
    train(data, label)
    work = tempfile.mkdtemp(prefix="simpar-ckpt-bench-") if rank == 0 else ""
    buf = np.zeros(512, dtype=np.int32)
    if rank == 0:
        raw = work.encode()
        buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    work = bytes(comm.broadcast(buf, root=0).astype(np.uint8)).rstrip(b"\0").decode()
    first = save_training(train, os.path.join(work, "probe"))
    manifest = read_manifest(first)
    total = manifest.total_bytes
    # The blocks the checkpoint holds, gathered on rank 0 for the numpy floor (untimed).
    blocks = [np.load(os.path.join(first, f.path), allow_pickle=False) if rank == 0 else
              np.zeros(0) for f in manifest.files]
    saves, floors, loads = [], [], []
    fresh = _train(2, 4)
    fresh.build(data, label)
    for r in range(args.reps):
        target, floor = os.path.join(work, f"save_{r}"), os.path.join(work, f"numpy_{r}")
        saves.append(_timed(lambda t=target: save_training(train, t)))
        floors.append(_timed(lambda f=floor: _numpy_floor(blocks, f)))
        loads.append(_timed(lambda t=target: load_training(fresh, t)))
    for name, value in train.params.items():
        assert np.array_equal(fresh.params[name], value), name
    # Resharding: Megatron over all 8 ranks reads only what overlaps its own blocks.
    simpar.set_auto_parallel_context(dataset_strategy="full_batch")
    other = _train(1, 8)
    other.build(data, label)
    assert other.program is not None
    stats: dict[str, int] = {}
    need = full = 0
    for name, lay in other.program.param_layouts.items():
        load_shard(first, f"params/{name}", lay, rank, stats=stats)
        itemsize = manifest.tensors[f"params/{name}"].dtype.itemsize
        need += lay.local_size() * itemsize
        full += math.prod(lay.shape) * itemsize
    got = comm.all_gather(np.array([stats.get("bytes_read", 0), need, full], dtype=np.int64))
    got = got.reshape(n, 3)
    assert (got[:, 0] == got[:, 1]).all(), got
    mb = total / 2**20
    rows = [["simpar save (8 ranks)", f"{np.median(saves):.3f}", f"{mb / np.median(saves):.0f}",
             f"{np.median(saves) / np.median(floors):.2f}"],
            ["numpy np.save + fsync (rank 0 alone)", f"{np.median(floors):.3f}",
             f"{mb / np.median(floors):.0f}", "1.00"],
            ["simpar load (8 ranks, checksums verified)", f"{np.median(loads):.3f}",
             f"{mb / np.median(loads):.0f}", f"{np.median(loads) / np.median(floors):.2f}"]]
    table = markdown_table(["what", "median s", "MiB/s", "vs numpy"], rows)
    reshard = markdown_table(
        ["rank", "bytes read", "its blocks' bytes (the overlap)", "whole parameters' bytes"],
        [[r, int(a), int(b), int(c)] for r, (a, b, c) in enumerate(got)])
    if rank == 0:
        print(table)
        print(reshard)
        shutil.rmtree(work, ignore_errors=True)
        if not args.no_write:
            command = "mpirun -n 8 python benchmarks/checkpoint.py " + " ".join(
                argv if argv is not None else sys.argv[1:])
            body = (f"Command: `{command.strip()}` · date: {today()}\n\n"
                    f"GPT d_model {D_MODEL}, {LAYERS} layers, sequence {SEQ}, vocabulary "
                    f"{VOCAB}, float64, Adam, Megatron dp 2 x mp 4 on 8 ranks: the checkpoint "
                    f"holds {mb:.1f} MiB (parameters and Adam's two moments, each block once), "
                    f"{len(manifest.files)} files; {args.reps} reps, interleaved.\n\n{table}\n\n"
                    "Resharding to Megatron over all 8 ranks (dp 1 x mp 8), parameters only: "
                    f"bytes each rank read against its blocks' bytes.\n\n{reshard}\n\n"
                    f"{host_line()}. BLAS threads {_env.SETTINGS.get('blas_threads')}.\n")
            write_section("checkpoint", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
