"""The per-rank wrapper (``python -m simpar.launch --_rank-wrapper``): it runs the command as
one MPI rank with its stdout and stderr pointed straight at ``D/rank_{i}.log``, follows that
log to the console (rank 0, or every rank with ``--join``), passes signals on to the command,
and reports the command's exit to simrun as a record on its stdout (:data:`EXIT_MARK`).

The command writes its log itself, so a rank killed mid-line still leaves every byte it wrote.
On Linux the command also dies if the wrapper is killed (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from simpar import _env
from simpar.launch.mpi import LaunchError, clean_env

__all__ = ["EXIT_MARK", "TAIL_LINES", "log_tail", "rank_log", "run_rank"]

TAIL_LINES = 20
"""Lines of the failing rank's log that simrun prints."""

EXIT_MARK = b"\x1esimpar-rank-exit "  # wrapper -> launcher record, on the wrapper's stdout
_RANK_VARS = _env.RANK_VARS


def _rank_from_env() -> int:
    for var in _RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdecimal():
            return int(value)
    raise LaunchError("cannot tell this process's rank: none of " + ", ".join(_RANK_VARS)
                      + " is set; the rank wrapper must run under mpirun (use simrun)")


def _child_setup() -> tuple[Any, bool]:
    """(preexec_fn, child has its own process group) for the wrapper's child.

    On Linux the child gets its own process group and SIGKILL when the wrapper dies
    (``PR_SET_PDEATHSIG``). MPICH signals a rank's whole process group, so with the child in the
    wrapper's group every signal would reach it twice (once from mpirun, once forwarded); in its
    own group it gets each signal once, from the wrapper, and still dies with the wrapper when
    mpirun SIGKILLs the job. Elsewhere the child stays in the wrapper's group.
    """
    if not sys.platform.startswith("linux"):
        return None, False
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None, False
    parent = os.getpid()

    def setup() -> None:
        os.setpgid(0, 0)
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the wrapper died before the line above took effect
            os._exit(128 + signal.SIGKILL)

    return setup, True


def rank_log(log_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s wrapper writes the command's output (``_prepare_log_dir`` clears
    these)."""
    return log_dir / f"rank_{rank}.log"


def log_tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of the log at ``path`` (read from its last 64 KiB, each cut at
    1000 characters); none if it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return [line[:1000] for line in data.decode("utf-8", "replace").splitlines()[-lines:]]


class _Follower:
    """Copies what the command appends to its log file onto the wrapper's stdout, line by line."""

    def __init__(self, path: Path, prefix: bytes) -> None:
        self._file = path.open("rb")
        self._prefix = prefix
        self._partial = b""
        self._out: IO[bytes] | None = sys.stdout.buffer

    def pump(self, final: bool = False) -> None:
        data = self._partial + self._file.read()
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        if lines and self._out is not None:
            try:
                self._out.write(b"".join(self._prefix + line + b"\n" for line in lines))
                self._out.flush()
            except OSError:  # the console is gone; the log file still has everything
                self._out = None
        if final:
            self._file.close()


def run_rank(log_dir: Path, rank_table: str, join: bool, command: list[str]) -> int:
    """Run ``command`` as this MPI rank, its output in ``log_dir/rank_{i}.log``; see the module."""
    rank = _rank_from_env()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = rank_log(log_dir, rank)
    env = clean_env(os.environ)
    env.update(SIMPAR_LOG_DIR=str(log_dir), SIMPAR_RANK_TABLE_FILE=rank_table)
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    setup, own_group = _child_setup()
    try:
        # close_fds=False: MPICH's PMI_FD is an inherited socket the rank must keep.
        child = subprocess.Popen(command, stdout=log_fd, stderr=log_fd, env=env,
                                 close_fds=False, preexec_fn=setup)
    except OSError as exc:
        os.write(log_fd, f"simrun: rank {rank} cannot run {command[0]!r}: {exc}\n".encode())
        os.close(log_fd)
        _report_exit(rank, 127, [], log_path)
        return 127
    os.close(log_fd)

    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if own_group:
                os.killpg(child.pid, signum)
            else:
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)

    follower = _Follower(log_path, f"[rank {rank}] ".encode() if join else b"") \
        if join or rank == 0 else None
    while True:
        try:
            returncode = child.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            if follower is not None:
                follower.pump()
    if follower is not None:
        follower.pump(final=True)
    _report_exit(rank, returncode, forwarded, log_path)
    if returncode < 0:  # died by a signal: die by the same one, so mpirun reports it
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be changed
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
        return 128 - returncode
    return returncode


def _report_exit(rank: int, returncode: int, forwarded: list[int], log_path: Path) -> None:
    record = {"rank": rank, "returncode": returncode, "host": socket.gethostname(),
              "forwarded": [signal.Signals(s).name for s in forwarded],
              "log": str(log_path), "tail": log_tail(log_path) if returncode else []}
    with contextlib.suppress(OSError):
        sys.stdout.buffer.write(EXIT_MARK + json.dumps(record).encode() + b"\n")
        sys.stdout.buffer.flush()
