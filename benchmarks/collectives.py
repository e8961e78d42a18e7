"""simpar.comm's collectives against the same raw mpi4py call on the same buffers.

    mpirun -n 8 python benchmarks/collectives.py            # the simpar-vs-raw table
    python benchmarks/collectives.py --wait-policy-compare   # launches mpirun twice: spin, yield

"size" is the local input buffer of each rank, float32: 1 MiB is 262144 elements per rank.
So all_gather's output is p times that, reduce_scatter's is 1/p of it, and all_to_all_v sends
pieces that add up to it (uneven: the piece for group rank j is proportional to j + 1; the
piece a rank keeps is copied locally, by simpar and by the raw side alike); all_to_all_single
is the same exchange in its packed form (one buffer and row counts, like the raw call).

Each rep runs raw, raw plus a hand-written agreement check, and simpar with validation on and
off, interleaved and rotated; a rep's time is the slowest rank's; the table shows the median
rep, and each ratio is the median over reps of simpar / raw within the rep. Before timing,
simpar's result is checked against raw's on every rank. Both sides run on the same input
arrays into pre-allocated contiguous buffers (raw: ``COMM_WORLD.Allreduce(send, recv)``;
simpar: its ``out=``). benchmarks/agreement_check.py prices other designs of the check.

The wait-policy comparison runs ``mpirun -n 8`` with ``SIMPAR_WAIT_POLICY=spin`` and then
``=yield`` (simpar/_env.py applies it before MPI_Init) and measures one collective plus a GEMM
that rank 0 runs while ranks 1..7 wait in a Barrier. Tables go to benchmarks/RESULTS.md under
"## collectives".
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

# The environment as launched, before simpar/_env.py adds its thread and wait-policy variables:
# the mpirun jobs of --wait-policy-compare must choose for themselves.
_LAUNCH_ENV = dict(os.environ)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar.comm as comm
from simpar import _env

import numpy as np
from _common import (
    host_line,
    interleaved_times,
    markdown_table,
    median,
    paired_ratio,
    today,
    write_section,
)

MIB = 2**20
SIZES = (1 * MIB, 16 * MIB)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "all_to_all_v",
         "all_to_all_single")
GEMM_N, GEMM_COUNT = 1024, 6          # 6 float32 GEMMs of 1024^3: 150-190 ms on one core here
SCRIPT = "python benchmarks/collectives.py"


def _mpi() -> Any:
    comm.init()                       # simpar starts MPI, after choosing threads and wait policy
    from mpi4py import MPI

    return MPI


def _barrier() -> None:
    _mpi().COMM_WORLD.Barrier()


def _max_over_ranks(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    _mpi().COMM_WORLD.Allreduce(x, out, op=_mpi().MAX)
    return out


@dataclass(frozen=True)
class Pair:
    """One collective on one rank's input, both ways: ``simpar()`` and ``raw()``, with raw's
    result buffer. Raw is ``COMM_WORLD.<mpi_name>(*mpi_args)`` followed by ``after`` (the
    local copy of the piece all_to_all_v keeps), so other benchmarks can vary the raw call
    (its nonblocking form: "I" + mpi_name, lower-cased first letter)."""

    simpar: Callable[[], object]
    raw_out: np.ndarray
    mpi_name: str
    mpi_args: tuple[Any, ...]
    after: Callable[[], None] | None = None

    @property
    def raw(self) -> Callable[[], None]:
        call, args, after = getattr(_mpi().COMM_WORLD, self.mpi_name), self.mpi_args, self.after
        if after is None:
            return lambda: call(*args)

        def raw_then_after() -> None:
            call(*args)
            after()
        return raw_then_after


def make_pair(kind: str, nbytes: int) -> Pair:
    """The :class:`Pair` for ``kind`` on this rank's ``nbytes`` of float32 input."""
    MPI = _mpi()
    world = MPI.COMM_WORLD
    p, rank = world.Get_size(), world.Get_rank()
    n = nbytes // 4
    x = np.random.default_rng(rank).standard_normal(n, dtype=np.float32)
    if kind == "all_reduce":
        out, mine = np.empty_like(x), np.empty_like(x)
        return Pair(lambda: comm.all_reduce(x, out=mine), out, "Allreduce", (x, out, MPI.SUM))
    if kind == "all_gather":
        out, mine = np.empty((p, n), np.float32), np.empty(p * n, np.float32)
        return Pair(lambda: comm.all_gather(x, out=mine), out, "Allgather", (x, out))
    if kind == "reduce_scatter":
        out, mine = np.empty(n // p, np.float32), np.empty(n // p, np.float32)
        return Pair(lambda: comm.reduce_scatter(x, out=mine), out, "Reduce_scatter_block",
                    (x, out, MPI.SUM))
    if kind == "all_to_all":
        out, mine = np.empty_like(x), np.empty_like(x)
        return Pair(lambda: comm.all_to_all(x, split_axis=0, concat_axis=0, out=mine), out,
                    "Alltoall", (x, out))
    if kind == "broadcast":
        buf, mine = x.copy(), x.copy()
        return Pair(lambda: comm.broadcast(mine, root=0, out=mine), buf, "Bcast", (buf, 0))
    if kind in ("all_to_all_v", "all_to_all_single"):
        # Piece for rank j has (j+1) units; every rank sends the same split, so rank r receives
        # (r+1) units from everyone. The units add up to this rank's n elements. Like simpar,
        # raw keeps its own piece out of MPI (count 0) and copies it with numpy.
        unit = n // (p * (p + 1) // 2)
        counts = np.array([(j + 1) * unit for j in range(p)], dtype=np.int64)
        displ = np.concatenate(([0], np.cumsum(counts)[:-1]))
        send = x[:int(counts.sum())]
        pieces = [send[displ[j]:displ[j] + counts[j]] for j in range(p)]
        shapes = [((rank + 1) * unit,)] * p
        rcounts = np.full(p, (rank + 1) * unit, dtype=np.int64)
        rdispl = np.concatenate(([0], np.cumsum(rcounts)[:-1]))
        recv = np.empty(int(rcounts.sum()), np.float32)
        scounts, rcounts_mpi = counts.copy(), rcounts.copy()
        scounts[rank] = rcounts_mpi[rank] = 0
        own = recv[rdispl[rank]:rdispl[rank] + rcounts[rank]]

        def keep_own() -> None:
            own[...] = pieces[rank]
        mine = np.empty(int(rcounts.sum()), np.float32)
        args = ([send, (scounts, displ)], [recv, (rcounts_mpi, rdispl)])
        if kind == "all_to_all_single":  # the same exchange, packed: rows of x by counts
            sc, rc = [int(c) for c in counts], [int(c) for c in rcounts]
            return Pair(lambda: comm.all_to_all_single(send, sc, rc, out=mine), recv,
                        "Alltoallv", args, keep_own)
        return Pair(lambda: comm.all_to_all_v(pieces, shapes, out=mine), recv, "Alltoallv",
                    args, keep_own)
    raise ValueError(f"unknown collective {kind!r}")


def _check_same(kind: str, got: object, raw_call: Callable[[], object],
                raw_out: np.ndarray) -> None:
    """Fail on every rank unless simpar's result equals raw's on every rank."""
    raw_call()
    parts = got if isinstance(got, list) else [got]
    mine = np.concatenate([np.asarray(a).reshape(-1) for a in parts if a is not None])
    same = mine.shape == raw_out.reshape(-1).shape and np.allclose(mine, raw_out.reshape(-1),
                                                                   rtol=1e-5, atol=1e-5)
    if _max_over_ranks(np.array([0.0 if same else 1.0]))[0]:
        raise RuntimeError(f"{kind}: simpar's result differs from raw mpi4py's on some rank")


def _with_check(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` preceded by the agreement check written by hand: one 8-byte BXOR Allreduce, the
    collective simpar's validation adds (its hashing and the rest of its Python excluded)."""
    MPI = _mpi()
    world = MPI.COMM_WORLD
    claims, total = np.zeros(1, np.int64), np.zeros(1, np.int64)

    def call() -> object:
        world.Allreduce(claims, total, op=MPI.BXOR)
        return fn()
    return call


def _with_validation(on: bool, fn: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        comm.set_validation(on)
        try:
            return fn()
        finally:
            comm.set_validation(True)
    return call


def compare(kinds: tuple[str, ...], sizes: tuple[int, ...], reps: dict[int, int]
            ) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        for kind in kinds:
            pair = make_pair(kind, size)
            simpar_call, raw_call = pair.simpar, pair.raw
            _check_same(kind, simpar_call(), raw_call, pair.raw_out)
            times = interleaved_times(
                {"raw": raw_call, "raw_checked": _with_check(raw_call),
                 "on": _with_validation(True, simpar_call),
                 "off": _with_validation(False, simpar_call)},
                reps=reps[size], warmup=2, barrier=_barrier, max_over_ranks=_max_over_ranks)
            rows.append({"kind": kind, "size": size,
                         **{k: float(np.median(t)) for k, t in times.items()},
                         "ratio_off": paired_ratio(times["off"], times["raw"]),
                         "ratio_on": paired_ratio(times["on"], times["raw"]),
                         "ratio_check": paired_ratio(times["raw_checked"], times["raw"]),
                         "ratio_on_checked": paired_ratio(times["on"], times["raw_checked"])})
    return rows


def _fmt_size(size: int) -> str:
    return f"{size // MIB} MiB"


def _settings_line() -> str:
    s = _env.SETTINGS
    return (f"ranks {comm.get_group_size()}, BLAS threads per rank {s['blas_threads']} "
            f"({s['threads_from']}), wait policy {s['wait_policy']} ({s['wait_policy_from']}), "
            f"malloc {s.get('malloc', '?')}")


def main_table(reps: dict[int, int], kinds: tuple[str, ...] = KINDS) -> None:
    load = host_line()
    rows = compare(kinds, SIZES, reps)
    if comm.get_rank() != 0:
        return
    table = markdown_table(
        ["collective", "size / rank", "raw ms", "simpar ms, validation off", "ratio off",
         "raw + check ms", "ratio raw + check", "simpar ms, validation on", "ratio on",
         "ratio on / (raw + check)"],
        [[r["kind"], _fmt_size(r["size"]), f"{r['raw'] * 1e3:.3f}", f"{r['off'] * 1e3:.3f}",
          f"{r['ratio_off']:.3f}", f"{r['raw_checked'] * 1e3:.3f}", f"{r['ratio_check']:.3f}",
          f"{r['on'] * 1e3:.3f}", f"{r['ratio_on']:.3f}", f"{r['ratio_on_checked']:.3f}"]
         for r in rows])
    print(table, flush=True)
    if kinds != KINDS:
        print("\n(--kinds given: RESULTS.md not written)")
        return

    def over(key: str) -> str:
        bad = [f"{r['kind']} {_fmt_size(r['size'])} {r[key]:.3f}" for r in rows if r[key] > 1.10]
        return "; ".join(bad) if bad else "none"
    reps_text = ", ".join(f"{_fmt_size(s)}: {n}" for s, n in reps.items())
    body = "\n".join([
        f"Command: `mpirun -n {comm.get_group_size()} {SCRIPT}` · date: {today()}",
        "",
        f"Size is the local input buffer of each rank (float32). Median of reps ({reps_text}); "
        "each rep is the slowest rank's time after a barrier; the four variants interleaved "
        "and rotated. Ratios: median over reps of the per-rep ratio. Raw is the same mpi4py "
        "upper-case call on pre-allocated contiguous buffers; simpar gets pre-allocated "
        "buffers of its own too, through each call's out= argument. Raw + check is raw "
        "preceded by the one 8-byte BXOR Allreduce that simpar's validation adds, written "
        "by hand: it prices the check itself, with none of simpar's Python.",
        "",
        table,
        "",
        "The target, simpar within 1.10x of the same raw call, is judged on the validation-"
        "off column: that is how simpar's own runtime and redistribution call the "
        "collectives (each plan is checked once, then runs unchecked). Per-call validation, "
        "the default for direct use of simpar.comm, adds one synchronisation of the group per "
        "call; the other columns price it (set_validation(False) or SIMPAR_COMM_CHECK=0 turn "
        "it off).",
        "",
        f"Target missed (validation off, over 1.10): {over('ratio_off')}.",
        f"For information, over 1.10 with validation on vs raw: {over('ratio_on')}; "
        f"raw + check vs raw (the check alone): {over('ratio_check')}; validation on vs raw + "
        f"check: {over('ratio_on_checked')}.",
        "",
        "The host is shared: repeated runs move single ratios by about +-0.05 (more for the "
        "shortest calls).",
        "",
        f"{_settings_line()}; {load}.",
    ])
    write_section("collectives", body, subheading="simpar vs raw mpi4py")
    print("\nwritten to benchmarks/RESULTS.md (## collectives / ### simpar vs raw mpi4py)")


# ---------------------------------------------------------------- wait policy


def _gemm() -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((GEMM_N, GEMM_N), dtype=np.float32)
    b = rng.standard_normal((GEMM_N, GEMM_N), dtype=np.float32)
    a @ b
    start = perf_counter()
    for _ in range(GEMM_COUNT):
        a @ b
    return perf_counter() - start


def wait_probe(reps: int) -> None:
    """Under mpirun: one collective both ways, then rank 0's GEMM while the others wait."""
    rows = compare(("all_reduce", "all_gather"), (MIB,), {MIB: reps})
    gemm = []
    for _ in range(5):
        _barrier()
        if comm.get_rank() == 0:
            gemm.append(_gemm())
        _barrier()
    if comm.get_rank() == 0:
        print("WAIT-PROBE " + json.dumps({"settings": _env.SETTINGS, "rows": rows,
                                          "gemm": median(gemm)}), flush=True)


def wait_policy_compare(ranks: int, reps: int) -> None:
    from threadpoolctl import threadpool_limits

    load = host_line()
    results, commands = {}, []
    for policy in ("spin", "yield"):
        cmd = ["mpirun", "-n", str(ranks), sys.executable, str(Path(__file__).resolve()),
               "--wait-probe", "--reps", str(reps)]
        commands.append(f"SIMPAR_WAIT_POLICY={policy} mpirun -n {ranks} {SCRIPT} "
                        f"--wait-probe --reps {reps}")
        env = dict(_LAUNCH_ENV, SIMPAR_WAIT_POLICY=policy)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("WAIT-PROBE ")]
        if out.returncode != 0 or not line:
            sys.exit(f"{shlex.join(cmd)} failed (exit {out.returncode}):\n{out.stdout}\n"
                     f"{out.stderr}")
        results[policy] = json.loads(line[0][len("WAIT-PROBE "):])
    with threadpool_limits(limits=1):
        alone = median([_gemm() for _ in range(3)])
    rows = []
    for policy, res in results.items():
        s = res["settings"]
        assert s["wait_policy"] == policy, s
        by = {r["kind"]: r for r in res["rows"]}
        rows.append([policy, s["blas_threads"],
                     f"{res['gemm'] * 1e3:.1f}", f"{res['gemm'] / alone:.2f}",
                     f"{by['all_reduce']['on'] * 1e3:.3f}", f"{by['all_reduce']['raw'] * 1e3:.3f}",
                     f"{by['all_gather']['on'] * 1e3:.3f}", f"{by['all_gather']['raw'] * 1e3:.3f}"])
    table = markdown_table(
        ["wait policy", "BLAS threads", "rank-0 GEMM ms (7 ranks in Barrier)", "vs alone",
         "all_reduce 1 MiB simpar ms", "raw ms", "all_gather 1 MiB simpar ms", "raw ms"], rows)
    print(table, flush=True)
    body = "\n".join([
        f"Command: `{SCRIPT} --wait-policy-compare` · date: {today()}, which runs",
        "",
        *[f"    {c}" for c in commands],
        "",
        f"GEMM: {GEMM_COUNT} float32 products of {GEMM_N}x{GEMM_N} on rank 0, one BLAS "
        f"thread, while ranks 1..{ranks - 1} wait in MPI_Barrier; median of 5. Alone (the same "
        f"GEMMs in one process, no MPI job running): {alone * 1e3:.1f} ms. Collectives: median "
        f"of {reps} interleaved reps, validation on, slowest rank per rep.",
        "",
        table,
        "",
        f"{load}.",
    ])
    write_section("collectives", body, subheading="MPICH wait policy: spin vs yield")
    print("\nwritten to benchmarks/RESULTS.md (## collectives / ### MPICH wait policy)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wait-policy-compare", action="store_true",
                    help="run without mpirun: launches mpirun with each wait policy")
    ap.add_argument("--wait-probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=8, help="ranks for --wait-policy-compare")
    ap.add_argument("--reps", type=int, default=None,
                    help="reps per measurement (default 100 at 1 MiB, 20 at 16 MiB)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="comma-separated collectives to time (a subset is not recorded)")
    args = ap.parse_args()
    if args.wait_policy_compare:
        wait_policy_compare(args.ranks, args.reps or 30)
    elif args.wait_probe:
        wait_probe(args.reps or 30)
    else:
        kinds = tuple(k for k in args.kinds.split(",") if k)
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            ap.error(f"--kinds: unknown collectives {unknown}; choose from {list(KINDS)}")
        main_table({MIB: args.reps or 100, 16 * MIB: args.reps or 20}, kinds)


if __name__ == "__main__":
    main()
