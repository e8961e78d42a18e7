"""A plan sent from rank 0 to every rank after rank 0's search: simpar's wait against a raw
mpi4py broadcast and against the bound of rank 0's work alone.

    mpirun -n 8 python benchmarks/plan_broadcast.py
    mpirun -n 8 python benchmarks/plan_broadcast.py --text-kib 2048 --reps 9 --no-write

``plan_once`` has rank 0 search while the other ranks wait for the plan, then hands it to them
as JSON (:func:`simpar.comm.broadcast_text`). Each rep here has rank 0 run a fixed piece of
work (Python loops and small GEMMs, a search's mix) and then send a text of ``--text-kib``
KiB; a rep's time runs from a barrier to the last rank holding the text. The rows:

- ``simpar.comm.broadcast_text``: the waiting ranks test for the text's length and sleep in
  between (0.1 ms, doubling up to 2 ms), then take the text in one blocking broadcast;
- ``polls up to 20 ms``: the same with the pauses simpar used before (1 ms doubling up to
  20 ms, and the text waited for the same way), which the table measured and replaced;
- ``raw mpi4py Bcast``: ``COMM_WORLD.Bcast`` of the length and of the text, the waiting
  ranks inside MPI (spinning, or yielding under simpar's wait policy on an oversubscribed
  host);
- ``rank 0's work alone``: the bound, the other ranks asleep until rank 0 is done (they
  test for its word every 1 ms, so the bound is up to 1 ms late; no broadcast at all).

The table goes to benchmarks/RESULTS.md under "## plan broadcast".
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar.comm as comm
from simpar import _env
from simpar.comm._world import _sleep_until

import numpy as np
from _common import (
    host_line,
    interleaved_times,
    markdown_table,
    paired_ratio,
    publish,
    today,
)


def _work(gemm: np.ndarray, loops: int) -> None:
    """A search's mix: Python loops and small matrix products."""
    s = 0
    for i in range(loops):
        s += i
    for _ in range(8):
        gemm @ gemm


def _polled(world: Any, text: str | None, root: bool) -> str:
    """The design simpar replaced: both broadcasts waited for asleep, 1 ms doubling to 20 ms."""
    data = np.frombuffer(text.encode(), dtype=np.uint8) if root and text is not None else None
    size = np.array([0 if data is None else data.size], dtype=np.int64)
    _sleep_until(world.Ibcast(size, root=0), 1e-3, 0.02)
    if data is None:
        data = np.empty(int(size[0]), dtype=np.uint8)
    _sleep_until(world.Ibcast(data, root=0), 1e-3, 0.02)
    return bytes(data).decode()


def _raw(world: Any, text: str | None, root: bool) -> str:
    data = np.frombuffer(text.encode(), dtype=np.uint8) if root and text is not None else None
    size = np.array([0 if data is None else data.size], dtype=np.int64)
    world.Bcast(size, root=0)
    if data is None:
        data = np.empty(int(size[0]), dtype=np.uint8)
    world.Bcast(data, root=0)
    return bytes(data).decode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text-kib", type=int, default=256,
                    help="the plan's size in KiB (default 256)")
    ap.add_argument("--work-ms", type=float, default=60.0,
                    help="rank 0's work per rep, about this many ms (timed once at the start; "
                         "default 60)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-write", action="store_true",
                    help="print the table only, leave RESULTS.md as it is")
    args = ap.parse_args(argv)
    for name in ("text_kib", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.work_ms > 0:
        ap.error(f"--work-ms must be > 0, got {args.work_ms}")
    world = comm.world()
    rank, size = world.Get_rank(), world.Get_size()
    root = rank == 0
    text = ("{" + "x" * (args.text_kib * 1024 - 2) + "}") if root else None
    gemm = np.random.default_rng(0).random((192, 192))
    # Rank 0's loops for about ``--work-ms`` (timed while the others sleep; the table says
    # what the work took alone), and the text's length: the same on every rank.
    world.Barrier()
    shared = np.zeros(3)
    if root:
        _work(gemm, 100_000)   # warm
        for k, loops in enumerate((100_000, 200_000)):   # the GEMMs cost alike in both
            started = time.perf_counter()
            _work(gemm, loops)
            shared[k] = time.perf_counter() - started
        shared[2] = len(text or "")
    _sleep_until(world.Ibcast(shared, root=0), 1e-3, 1e-3)
    per_loop = max(shared[1] - shared[0], 1e-9) / 100_000
    gemms = max(shared[0] - 100_000 * per_loop, 0.0)
    loops = max(0, int((args.work_ms / 1e3 - gemms) / per_loop))
    expect = int(shared[2])
    done = np.zeros(1, dtype=np.uint8)

    def run(send: Callable[[Any, str | None, bool], str]) -> Callable[[], None]:
        def rep() -> None:
            if root:
                _work(gemm, loops)
            got = send(world, text, root)
            assert len(got) == expect, f"rank {rank}: {len(got)} characters, not {expect}"
        return rep

    def alone() -> None:
        if root:
            _work(gemm, loops)
            for r in range(1, size):
                world.Send(done, dest=r, tag=91)
        else:   # asleep, testing for rank 0's word every 1 ms (at most that late)
            _sleep_until(world.Irecv(done, source=0, tag=91), 1e-3, 1e-3)

    fns = {
        "simpar.comm.broadcast_text": run(lambda w, t, r: comm.broadcast_text(t)),
        "polls up to 20 ms": run(_polled),
        "raw mpi4py Bcast": run(_raw),
        "rank 0's work alone": alone,
    }
    times = interleaved_times(fns, args.reps, 2, world.Barrier, _max_over_ranks)
    if not root:
        return 0
    alone_times = times["rank 0's work alone"]
    bound = float(np.median(alone_times))
    rows = [[name, f"{np.median(t) * 1e3:.1f}", f"{(np.median(t) - bound) * 1e3:+.1f}",
             f"{paired_ratio(t, alone_times):.2f}"] for name, t in times.items()]
    command = f"mpirun -n {size} python benchmarks/plan_broadcast.py {shlex.join(sys.argv[1:])}"
    policy = _env.SETTINGS.get("wait_policy")
    body = (f"`{command.rstrip()}` ({today()}; {size} ranks, {policy} wait policy; rank 0 "
            f"works for {bound * 1e3:.1f} ms alone (the last row; --work-ms {args.work_ms:g}), "
            f"then sends {args.text_kib} KiB; median of {args.reps} reps, each from a barrier to "
            "the last rank holding the text)\n\n"
            + markdown_table(["how the ranks wait", "ms per rep", "over the bound",
                              "ratio to the bound (median per rep)"], rows)
            + f"\n\n{host_line()}")
    publish("plan broadcast", body, not args.no_write)
    return 0


def _max_over_ranks(x: np.ndarray) -> np.ndarray:
    from mpi4py import MPI
    out = np.empty_like(x)
    comm.world().Allreduce(x, out, op=MPI.MAX)
    return out


if __name__ == "__main__":
    sys.exit(main())
