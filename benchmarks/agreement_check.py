"""What a cross-rank agreement check costs, in each design that could implement it.

    mpirun -n 8 python benchmarks/agreement_check.py   # 8 ranks on this host's 2 cores
    mpirun -n 2 python benchmarks/agreement_check.py   # one rank per core

simpar.comm checks, before every collective, that all ranks of the group called the same
collective with the same shape, dtype and arguments (one 8-byte XOR word per rank; see
simpar/comm/collectives.py). Whatever carries that word, every rank has to hear from every
other rank before its collective may run: a mismatched MPI collective can hang or write
garbage, so the check cannot trail it. This benchmark prices the designs, on raw mpi4py only
(no simpar code in the timed calls), for each collective at 1 MiB of float32 per rank:

- blocking: ``MPI_Allreduce(BXOR)`` of the word, then the collective (simpar's design);
- overlapped: ``MPI_Iallreduce`` of the word and the nonblocking collective started together;
  wait for the word, then for the collective (a mismatch would leave the collective pending);
  priced against the nonblocking collective alone, which is shown against raw too;
- shared memory: each rank writes its word and a sequence number into an MPI-3 shared window
  and polls the others' (no messages; ranks on one host only), then the collective.

The collective and the buffers are benchmarks/collectives.py's raw side. Each rep runs every
variant once, interleaved and rotated, after a barrier; a rep's time is the slowest rank's;
ratios are medians over reps of variant / raw within the rep. The table is recorded in
benchmarks/RESULTS.md under "## collectives".
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar.comm as comm
from simpar import _env

import numpy as np
from _common import host_line, interleaved_times, markdown_table, paired_ratio, today, write_section
from collectives import MIB, Pair, make_pair

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
         "all_to_all_single")
SCRIPT = "python benchmarks/agreement_check.py"


def _mpi() -> Any:
    comm.init()
    from mpi4py import MPI

    return MPI


class SharedWordCheck:
    """The agreement word through an MPI-3 shared-memory window: rank ``i`` writes (word,
    sequence number) into its slot and waits until every slot shows the sequence number, then
    XORs the words. Two alternating slot sets keep a rank that is one check ahead from
    overwriting a word that a slower rank has still to read (it cannot be two ahead: the next
    check waits for everyone)."""

    def __init__(self, world: Any, yield_while_waiting: bool) -> None:
        MPI = _mpi()
        self.p, self.me = world.Get_size(), world.Get_rank()
        nbytes = 2 * self.p * 2 * 8 if self.me == 0 else 0
        self.win = MPI.Win.Allocate_shared(nbytes, 8, comm=world)
        buf, _ = self.win.Shared_query(0)
        self.slots = np.ndarray((2, self.p, 2), dtype=np.int64, buffer=buf)
        if self.me == 0:
            self.slots[...] = 0
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.win.Sync()
        world.Barrier()
        self.win.Sync()
        self.seq = 0
        self.wait = os.sched_yield if yield_while_waiting else (lambda: None)

    def __call__(self, word: int) -> int:
        self.seq += 1
        slots = self.slots[self.seq & 1]
        slots[self.me, 1] = word
        self.win.Sync()  # the word is visible before the sequence number that announces it
        slots[self.me, 0] = self.seq
        seqs = slots[:, 0]
        while seqs.min() < self.seq:
            self.wait()
        self.win.Sync()
        return int(np.bitwise_xor.reduce(slots[:, 1]))

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()


def _variants(pair: Pair, shared: SharedWordCheck | None) -> dict[str, Callable[[], object]]:
    MPI = _mpi()
    world = MPI.COMM_WORLD
    word, total = np.zeros(1, np.int64), np.zeros(1, np.int64)
    raw = pair.raw
    name = pair.mpi_name
    start = getattr(world, "I" + name[0].lower() + name[1:])
    args, after = pair.mpi_args, pair.after

    def refuse() -> None:
        raise RuntimeError("the agreement word is nonzero: the ranks disagree")

    def blocking() -> None:
        world.Allreduce(word, total, op=MPI.BXOR)
        if total[0]:
            refuse()
        raw()

    def nonblocking_alone() -> None:
        start(*args).Wait()
        if after is not None:
            after()

    def overlapped() -> None:
        check = world.Iallreduce(word, total, op=MPI.BXOR)
        request = start(*args)
        check.Wait()
        if total[0]:
            refuse()  # the collective stays pending: a real design must recover from that
        request.Wait()
        if after is not None:
            after()

    variants = {"raw": raw, "blocking": blocking, "nonblocking alone": nonblocking_alone,
                "overlapped": overlapped}
    if shared is not None:
        def shared_memory() -> None:
            if shared(0):
                refuse()
            raw()
        variants["shared memory"] = shared_memory
    return variants


def study(reps: int) -> list[dict[str, Any]]:
    MPI = _mpi()
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    one_host = world.allreduce(node.Get_size(), op=MPI.MIN) == world.Get_size()
    node.Free()
    shared = (SharedWordCheck(world, _env.SETTINGS["wait_policy"] == "yield")
              if one_host else None)
    rows = []
    for kind in KINDS:
        variants = _variants(make_pair(kind, MIB), shared)
        times = interleaved_times(variants, reps=reps, warmup=3,
                                  barrier=world.Barrier, max_over_ranks=_max_over_ranks)
        rows.append({"kind": kind, "raw": float(np.median(times["raw"])),
                     **{k: paired_ratio(t, times["raw"]) for k, t in times.items() if k != "raw"},
                     "overlapped vs nonblocking": paired_ratio(times["overlapped"],
                                                               times["nonblocking alone"])})
    if shared is not None:
        shared.free()
    return rows


def _max_over_ranks(x: np.ndarray) -> np.ndarray:
    MPI = _mpi()
    out = np.empty_like(x)
    MPI.COMM_WORLD.Allreduce(x, out, op=MPI.MAX)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100, help="reps per collective (default 100)")
    args = ap.parse_args()
    if args.reps < 5:
        ap.error(f"--reps must be at least 5, got {args.reps}")
    load = host_line()
    rows = study(args.reps)
    if comm.get_rank() != 0:
        return
    p = comm.get_group_size()

    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.3f}" if key in r else "—"
    table = markdown_table(
        ["collective (1 MiB / rank)", "raw ms", "blocking check", "nonblocking alone",
         "overlapped check", "overlapped / nonblocking alone", "shared-memory check"],
        [[r["kind"], f"{r['raw'] * 1e3:.3f}", ratio(r, "blocking"),
          ratio(r, "nonblocking alone"), ratio(r, "overlapped"),
          ratio(r, "overlapped vs nonblocking"), ratio(r, "shared memory")] for r in rows])
    print(table, flush=True)
    def spread(key: str) -> str:
        values = [r[key] for r in rows if key in r]
        return f"{min(values):.2f}-{max(values):.2f}x" if values else "not run (ranks on >1 host)"
    s = _env.SETTINGS
    body = "\n".join([
        f"Command: `mpirun -n {p} {SCRIPT}` · date: {today()}",
        "",
        f"Raw mpi4py only: each collective of benchmarks/collectives.py's raw side, alone and "
        f"behind each design of the 8-byte agreement check (see the script's docstring). "
        f"Ratios are per-rep medians against raw ({args.reps} reps, slowest rank per rep); "
        "all_to_all_single is the packed MPI_Alltoallv.",
        "",
        table,
        "",
        f"Across the collectives, raw behind the blocking check runs {spread('blocking')} "
        f"raw; the overlapped check {spread('overlapped')} raw, which is "
        f"{spread('overlapped vs nonblocking')} the nonblocking collective alone; the "
        f"shared-memory check {spread('shared memory')} raw.",
        "",
        f"ranks {p}, BLAS threads per rank {s['blas_threads']}, wait policy "
        f"{s['wait_policy']} ({s['wait_policy_from']}); {load}.",
    ])
    write_section("collectives", body, subheading=f"Pricing the agreement check, {p} ranks")
    print(f"\nwritten to benchmarks/RESULTS.md (## collectives / ### Pricing the agreement "
          f"check, {p} ranks)")


if __name__ == "__main__":
    main()
