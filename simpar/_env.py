"""Process-level settings that must be made before numpy's BLAS or MPI start.

Two measurements on a 2-core machine drive this module:

* 8 ranks each running numpy's default BLAS threads reached 44 GFLOP/s of float32 GEMM in
  total, against 255 GFLOP/s with one thread per rank. So each rank gets its share of the
  cores: ``max(1, cores // local_ranks)`` threads.
* MPICH's waiting ranks spin. While 7 ranks waited in a Barrier, rank 0's 147 ms GEMM took
  617 ms; with ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1 MPIR_CVAR_POLLS_BEFORE_YIELD=1`` it took 213 ms.
  So when ranks outnumber cores, simpar turns yielding on, before MPI_Init reads its CVARs.
* Every collective returns a new array. glibc serves each allocation above its mmap threshold
  (128 KiB, rising to at most 32 MiB) with a fresh mmap, so every call page-faults its output
  in again. On 2 ranks, ``np.empty_like`` + ``Allreduce`` of 1 MiB took 1.55x the same call on a
  reused buffer; with ``M_MMAP_THRESHOLD`` = 256 MiB and ``M_TRIM_THRESHOLD`` = 512 MiB it
  took 0.84-0.98x, and a 1-128 MiB array costs 0 page faults instead of 24-576. So on glibc
  simpar sets both with ``mallopt``. Freed blocks are kept for reuse, so a rank's resident
  memory stays near its peak instead of shrinking.

All three are skipped where the user already chose: ``SIMPAR_NUM_THREADS`` (or any of
``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS``/``MKL_NUM_THREADS``) fixes the threads, and any
``MPIR_CVAR_ENABLE_HEAVY_YIELD``/``MPIR_CVAR_POLLS_BEFORE_YIELD`` in the environment fixes the wait
policy. ``SIMPAR_WAIT_POLICY=spin|yield`` forces one. ``SIMPAR_MALLOC=system`` (or any
``MALLOC_*_`` variable, or ``glibc.malloc`` tunables) keeps glibc's own malloc settings. The
choice made is recorded in
:data:`SETTINGS` so that the launcher, ``train`` and benchmarks can print it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import pathlib
import secrets
import sys
import warnings
from collections.abc import Iterator
from typing import IO, NoReturn, TextIO

__all__ = ["RANK_VARS", "RankZeroParser", "SETTINGS", "apply", "atomic_file", "launcher_rank",
           "local_ranks", "sync_directory", "unwritable_file", "usable_cores",
           "write_atomically"]

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
_YIELD_VARS = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}

_MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                "MALLOC_MMAP_MAX_")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3          # glibc's mallopt parameter numbers
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 256 * 2**20, 512 * 2**20

SETTINGS: dict[str, object] = {}


# Where launchers put a process's rank: MPICH/Hydra, Open MPI, PMIx, MVAPICH, Slurm.
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
             "SLURM_PROCID")


def launcher_rank() -> int:
    """This process's rank as its launcher announced it (0 when started without one), read
    without starting MPI: for "only rank 0 prints" decisions made before MPI_Init."""
    for var in RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def local_ranks() -> int:
    """Ranks of this MPI job on this host, read from the launcher's environment (1 if none)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                "SLURM_NTASKS_PER_NODE", "PMI_SIZE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def local_rank() -> int:
    """This process's rank among the job's ranks on its host, read from the launcher's
    environment (0 if none)."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                "SLURM_LOCALID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def _threads_wanted(cores: int, ranks: int) -> tuple[int, str]:
    override = os.environ.get("SIMPAR_NUM_THREADS", "")
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"SIMPAR_NUM_THREADS must be a positive integer, got {override!r}")
        return int(override), "SIMPAR_NUM_THREADS"
    for var in _THREAD_VARS[:3]:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var]), var
    return max(1, cores // ranks), f"{cores} cores / {ranks} local ranks"


def _tune_malloc() -> tuple[str, str]:
    """Raise glibc's mmap and trim thresholds so that freed arrays are reused, not unmapped."""
    choice = os.environ.get("SIMPAR_MALLOC", "").strip().lower()
    if choice not in ("", "tuned", "system"):
        raise ValueError(f"SIMPAR_MALLOC must be 'tuned' or 'system', got {choice!r}")
    user_set = [v for v in _MALLOC_VARS if v in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        user_set.append("GLIBC_TUNABLES")
    if choice == "system" or (user_set and not choice):
        return "system", ("SIMPAR_MALLOC" if choice else
                          "set in the environment: " + ", ".join(user_set))
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "system", "not glibc"
    if not (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
            and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        return "system", "glibc refused mallopt"
    return (f"mmap_threshold={_MMAP_THRESHOLD >> 20}MiB trim_threshold={_TRIM_THRESHOLD >> 20}MiB",
            "SIMPAR_MALLOC" if choice else "default: outputs reuse freed memory")


def apply() -> dict[str, object]:
    """Choose BLAS threads, the MPI wait policy and malloc thresholds for this process
    (idempotent)."""
    if SETTINGS:
        return SETTINGS
    cores, ranks = usable_cores(), local_ranks()
    threads, why = _threads_wanted(cores, ranks)
    for var in _THREAD_VARS:
        os.environ.setdefault(var, str(threads))
    if "numpy" in sys.modules:
        # numpy came first, so its BLAS already read the environment: limit it at run time.
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=threads)

    policy = os.environ.get("SIMPAR_WAIT_POLICY", "").strip().lower()
    if policy not in ("", "spin", "yield"):
        raise ValueError(f"SIMPAR_WAIT_POLICY must be 'spin' or 'yield', got {policy!r}")
    user_set = [v for v in _YIELD_VARS if v in os.environ]
    if user_set and not policy:
        wait, wait_why = "user", "set in the environment: " + ", ".join(user_set)
    elif policy == "yield" or (not policy and ranks > cores):
        for var, value in _YIELD_VARS.items():
            os.environ[var] = value
        wait = "yield"
        wait_why = "SIMPAR_WAIT_POLICY" if policy else f"{ranks} ranks > {cores} cores"
    else:
        wait = "spin"
        wait_why = "SIMPAR_WAIT_POLICY" if policy else f"{ranks} ranks <= {cores} cores"
    malloc, malloc_why = _tune_malloc()
    _show_warnings_once_on_rank_zero()
    SETTINGS.update(cores=cores, local_ranks=ranks, blas_threads=threads, threads_from=why,
                    wait_policy=wait, wait_policy_from=wait_why, malloc=malloc,
                    malloc_from=malloc_why)
    return SETTINGS


_SIMPAR_DIR = os.path.dirname(os.path.abspath(__file__))


def _show_warnings_once_on_rank_zero() -> None:
    """simpar's own warnings (of a class of its own, or raised from a file of this package)
    are shown by rank 0 only,
    once per message, as one line without the source line: an 8-rank job says a thing
    once, not eight times with a line of simpar's code. Other warnings, and warnings caught
    by ``warnings.catch_warnings`` or ``pytest.warns``, are left as they are."""
    shown: set[tuple[type, str]] = set()
    original = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        ours = category.__module__.startswith("simpar.") or \
            os.path.abspath(filename).startswith(_SIMPAR_DIR + os.sep)
        if not ours:
            original(message, category, filename, lineno, file, line)
            return
        key = (category, str(message))
        if launcher_rank() != 0 or key in shown:
            return
        shown.add(key)
        print(f"simpar: {category.__name__}: {message}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show


class RankZeroParser(argparse.ArgumentParser):
    """argparse for commands that every rank of an mpirun job parses (``simpar.train``,
    ``simpar.calibrate``): usage, errors and --help are printed on rank 0 only, and every
    rank exits with the same code."""

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:  # type: ignore[override]
        if launcher_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
        """One line, no usage block: the mistake, and where the options are listed."""
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def unwritable_file(path: pathlib.Path) -> str | None:
    """Why a file cannot be written at ``path`` (a directory, a missing or read-only parent),
    or None: the command-line tools refuse an ``--out`` before any work."""
    if path.is_dir():
        return "is a directory; give a file name"
    parent = path.parent
    if not parent.is_dir():
        return f"directory {str(parent)!r} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {str(parent)!r} is not writable"
    return None


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[IO[bytes]]:
    """A binary file that appears at ``path`` complete or not at all: written under a
    temporary name of this process's own beside it (created exclusively, with the umask's
    permissions), flushed to disk, then renamed over ``path``. On any error the temporary file
    is removed and ``path`` is left as it was. (:func:`sync_directory` makes the rename
    survive a crash.)"""
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def sync_directory(directory: str) -> None:
    """Record the renames in ``directory`` on disk. The files are in place already, so a
    filesystem that cannot sync a directory is no error."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomically(path: str, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one,
    never part of it (:func:`atomic_file`), and sync the directory."""
    with atomic_file(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    sync_directory(os.path.dirname(os.path.abspath(path)))
