"""Running the job and reporting its end: simrun starts ``mpirun`` (:func:`run_job`), copies its
output to the console while taking out the wrappers' exit records, stops what is left of the
job :data:`FAILURE_GRACE_S` seconds after a rank fails (or on Ctrl-C), and names the failing
rank with the last lines of its log.

After an ``MPI_Abort`` MPICH kills every wrapper at once, so no rank reports; simrun then names
the rank whose log holds the MPI's abort message, or else a Python traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from simpar.launch.mpi import MpiFlavor, job_env
from simpar.launch.rank_wrapper import EXIT_MARK, log_tail, rank_log

__all__ = ["FAILURE_GRACE_S", "Job", "run_job"]

FAILURE_GRACE_S = 5.0
"""Seconds the other ranks get to end by themselves once one rank has failed."""
_STOP_WAIT_S = 2.0  # after SIGTERM to mpirun, before SIGKILL to everything left
_POLL_S = 0.05
# Messages an aborting rank leaves in its own log (MPICH, Open MPI, simpar.comm's hook).
_ABORT_SIGNS = (re.compile(r"application called MPI_Abort\("),
                re.compile(r"MPI_ABORT was invoked on rank"),
                re.compile(r"\[simpar rank \d+\] uncaught"))


# --------------------------------------------------------------------------- the job
@dataclass(frozen=True, slots=True)
class Job:
    """One simrun job as its command line asked for it: what mpirun runs, where the logs go."""

    nproc: int
    command: tuple[str, ...]
    log_dir: Path
    rank_table_file: Path
    mpirun: str
    flavor: MpiFlavor
    hostfile: Path | None
    join: bool
    mpirun_args: tuple[str, ...]
    grace_s: float = FAILURE_GRACE_S

    def mpirun_argv(self, env: Mapping[str, str]) -> list[str]:
        argv = [self.mpirun, "-n", str(self.nproc)]
        if self.hostfile is not None:
            argv += ["-f" if self.flavor == "hydra" else "--hostfile", str(self.hostfile)]
        if self.flavor == "openmpi":  # Hydra passes the whole environment; Open MPI needs -x
            if self.hostfile is None:
                argv.append("--oversubscribe")
            for var in ("PATH", "PYTHONPATH", "SIMPAR_WAIT_POLICY", "SIMPAR_NUM_THREADS"):
                if var in env:
                    argv += ["-x", var]
        argv += self.mpirun_args
        argv += [sys.executable, "-m", "simpar.launch", "--_rank-wrapper",
                 "--log-dir", str(self.log_dir), "--rank-table-file", str(self.rank_table_file)]
        if self.join:
            argv.append("--join")
        return [*argv, "--", *self.command]


def _become_subreaper() -> None:
    """Make orphaned job processes re-parent to this process, so it can still end them (Linux).

    MPICH starts every rank in a session of its own, so only the process tree leads to them.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def _children() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc (empty where there is no /proc)."""
    tree: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdecimal():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                tree.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    return tree


def _descendants(roots: Sequence[int], tree: Mapping[int, list[int]]) -> list[int]:
    found: list[int] = []
    todo = list(roots)
    while todo:
        for pid in tree.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def _kill_job(mpirun: subprocess.Popen[bytes], own_children: set[int]) -> None:
    """SIGKILL mpirun and every process left of the job, then reap the orphans we inherited.

    ``own_children`` are this process's children from before the job: they are not the job's.
    """
    tree = _children()
    orphans = [p for p in tree.get(os.getpid(), []) if p != mpirun.pid and p not in own_children]
    # Once reaped, mpirun's pid may belong to someone else; its process group id cannot (Linux
    # reuses no pid while a group of that id has members), so killpg is safe either way.
    alive = [mpirun.pid] if mpirun.poll() is None else []
    for pid in [*alive, *orphans, *_descendants([*alive, *orphans], tree)]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(mpirun.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        mpirun.wait(timeout=_STOP_WAIT_S)
    give_up = time.monotonic() + _STOP_WAIT_S
    left = set(orphans)
    while left and time.monotonic() < give_up:
        for pid in list(left):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    left.discard(pid)
            except ChildProcessError:
                left.discard(pid)
        time.sleep(_POLL_S)


def _pump_output(stream: IO[bytes], records: queue.Queue[dict[str, Any]]) -> None:
    """Copy mpirun's stdout to ours, taking out the wrappers' exit records."""
    console = True  # until writing to it fails (e.g. "simrun ... | head"); keep draining then
    for line in iter(stream.readline, b""):
        if line.startswith(EXIT_MARK):
            with contextlib.suppress(ValueError):
                records.put(json.loads(line[len(EXIT_MARK):]))
            continue
        if console:
            try:
                out = getattr(sys.stdout, "buffer", None)
                if out is not None:
                    out.write(line)
                    out.flush()
                else:
                    sys.stdout.write(line.decode("utf-8", "replace"))
                    sys.stdout.flush()
            except (OSError, ValueError):
                console = False


@dataclass(slots=True)
class _Outcome:
    """What the launcher learnt while the job ran."""

    exits: dict[int, dict[str, Any]] = field(default_factory=dict)
    first: dict[str, Any] | None = None  # the first rank that failed by itself
    signals: list[int] = field(default_factory=list)  # SIGINT/SIGTERM that simrun received
    stopped: bool = False  # simrun had to stop the job

    def take(self, records: queue.Queue[dict[str, Any]]) -> bool:
        """Read new exit records; True when one is the job's first failure."""
        new_failure = False
        while not records.empty():
            record = records.get()
            self.exits[int(record["rank"])] = record
            # A rank whose wrapper forwarded it a signal was stopped, it did not fail.
            if self.first is None and record.get("returncode") and not record.get("forwarded"):
                self.first = record
                new_failure = True
        return new_failure


def run_job(job: Job) -> int:
    env = job_env()
    print(f"simrun: {job.nproc} ranks via {job.mpirun} ({job.flavor}); logs in "
          f"{job.log_dir}/rank_*.log, rank table {job.rank_table_file}", file=sys.stderr)
    sys.stderr.flush()
    _become_subreaper()
    own_children = set(_children().get(os.getpid(), []))
    try:
        mpirun = subprocess.Popen(job.mpirun_argv(env), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, env=env, start_new_session=True)
    except OSError as exc:
        print(f"simrun: error: cannot run {job.mpirun}: {exc}", file=sys.stderr)
        return 2
    assert mpirun.stdout is not None
    records: queue.Queue[dict[str, Any]] = queue.Queue()
    reader = threading.Thread(target=_pump_output, args=(mpirun.stdout, records), daemon=True)
    reader.start()

    outcome = _Outcome()
    previous = {s: signal.signal(s, lambda signum, _frame: outcome.signals.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = float("inf")
    handled = 0
    try:
        while mpirun.poll() is None:
            now = time.monotonic()
            if outcome.take(records):
                deadline = min(deadline, now + job.grace_s)
            if len(outcome.signals) > handled:
                if handled == 0:  # first Ctrl-C: ask the job to stop; mpirun passes it on
                    with contextlib.suppress(OSError):
                        mpirun.send_signal(outcome.signals[0])
                    deadline = min(deadline, now + job.grace_s)
                else:  # a second one: stop now
                    deadline = now
                handled = len(outcome.signals)
            if now >= deadline:
                outcome.stopped = True
                mpirun.terminate()  # MPICH and Open MPI pass SIGTERM on to every rank
                with contextlib.suppress(subprocess.TimeoutExpired):
                    mpirun.wait(timeout=_STOP_WAIT_S)
                break
            time.sleep(_POLL_S)
        if outcome.stopped or mpirun.returncode != 0 or outcome.signals:
            _kill_job(mpirun, own_children)
        reader.join(timeout=_STOP_WAIT_S)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    outcome.take(records)
    rc = mpirun.returncode
    return _report(job, -signal.SIGKILL if rc is None else rc, outcome)


# --------------------------------------------------------------------------- its end
def _exit_text(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _print_tail(log: Path, fallback: Sequence[str]) -> None:
    """The last lines of a rank's log: from the file, or as its wrapper sent them (other host)."""
    local = log.is_file()
    lines = log_tail(log) if local else list(fallback)
    if not lines:
        print(f"simrun: {log} is {'empty' if local else 'not on this host'}", file=sys.stderr)
        return
    where = str(log) if local else f"{log} (on its host)"
    print(f"simrun: last {len(lines)} lines of {where}:", file=sys.stderr)
    for line in lines:
        print(f"    {line}", file=sys.stderr)


def _aborted_ranks(job: Job, exits: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """Ranks whose logs show that they aborted the job.

    ``MPI_Abort`` makes MPICH SIGKILL every rank's wrapper at once, the aborting rank's too, so
    nobody reports an exit. The aborting rank's log (written by the rank itself) still holds the
    MPI's abort message or the Python traceback.
    """
    aborted, raised = [], []
    for rank in range(job.nproc):
        if rank in exits:
            continue
        tail = "\n".join(log_tail(rank_log(job.log_dir, rank), 200))
        if any(sign.search(tail) for sign in _ABORT_SIGNS):
            aborted.append(rank)
        elif "Traceback (most recent call last)" in tail:
            raised.append(rank)
    return aborted or raised


def _report(job: Job, mpirun_rc: int, outcome: _Outcome) -> int:
    """Print why the job ended, if it failed, and return simrun's exit status."""
    stopped = " simrun stopped the remaining ranks." if outcome.stopped else ""
    if outcome.first is not None:
        rank, rc = int(outcome.first["rank"]), int(outcome.first["returncode"])
        print(f"simrun: rank {rank} failed ({_exit_text(rc)}) on "
              f"{outcome.first.get('host', '?')}.{stopped}", file=sys.stderr)
        _print_tail(rank_log(job.log_dir, rank), outcome.first.get("tail", []))
        return rc if rc > 0 else 128 - rc
    if outcome.signals:
        print(f"simrun: interrupted by {signal.Signals(outcome.signals[0]).name}; the job was "
              "stopped.", file=sys.stderr)
        return 128 + outcome.signals[0]
    if mpirun_rc == 0:
        return 0
    aborted = _aborted_ranks(job, outcome.exits)
    if aborted:
        also = f" (the logs of ranks {aborted} all show a failure)" if len(aborted) > 1 else ""
        print(f"simrun: rank {aborted[0]} failed and aborted the job (mpirun "
              f"{_exit_text(mpirun_rc)}){also}.{stopped}", file=sys.stderr)
        _print_tail(rank_log(job.log_dir, aborted[0]), [])
    else:
        silent = [r for r in range(job.nproc) if r not in outcome.exits]
        print(f"simrun: mpirun ended with {_exit_text(mpirun_rc)} and no rank reported a "
              f"failure (ranks without an exit record: {silent[:16]}).{stopped}",
              file=sys.stderr)
        if silent:
            _print_tail(rank_log(job.log_dir, silent[0]), [])
    return mpirun_rc if 0 < mpirun_rc < 256 else 1
