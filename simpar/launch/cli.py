"""simrun's command line (:func:`main`) and the rank wrapper's: each bad argument is one
:class:`LaunchError` line and exit status 2; a good one becomes a :class:`Job`, run by
:func:`~simpar.launch.supervisor.run_job`."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from simpar.launch.mpi import (
    LaunchError,
    detect_mpi_flavor,
    find_mpirun,
    parse_hostfile,
    with_abort_on_exception,
)
from simpar.launch.rank_table import (
    RankTable,
    build_rank_table,
    hosts_text,
    read_rank_table,
    write_rank_table,
)
from simpar.launch.rank_wrapper import run_rank
from simpar.launch.supervisor import FAILURE_GRACE_S, Job, run_job

__all__ = ["main"]


class _ArgParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit; main() prints and returns 2
        raise LaunchError(message)


def _parser() -> argparse.ArgumentParser:
    p = _ArgParser(prog="simrun", description="Run a command on N simulated devices (MPI ranks), "
                   "one log per rank, with a MindSpore rank table.",
                   epilog="example: simrun -n 8 -- python -m simpar.train")
    p.add_argument("-n", "--nproc", type=int, required=True, metavar="N",
                   help="number of ranks (simulated devices)")
    p.add_argument("--hostfile", metavar="H", help="MPI hostfile: MPICH 'host:8' lines or "
                   "Open MPI 'host slots=8' lines (default: this machine only)")
    p.add_argument("--log-dir", default="logs", metavar="D",
                   help="where rank_{i}.log and rank_table.json go (default: ./logs)")
    p.add_argument("--rank-table-file", metavar="F",
                   help="use this MindSpore rank table instead of writing D/rank_table.json")
    p.add_argument("--mpirun", metavar="PATH", help="mpirun to use (default: $SIMPAR_MPIRUN, "
                   "else the one next to this Python, else PATH)")
    p.add_argument("--mpirun-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for mpirun, repeatable (write --mpirun-arg=-v)")
    p.add_argument("--join", action="store_true",
                   help="show every rank's output on the console, prefixed by [rank i]")
    p.add_argument("--grace", type=float, default=FAILURE_GRACE_S, metavar="S",
                   help="seconds the other ranks get to end once one has failed, before "
                   f"simrun kills them (default {FAILURE_GRACE_S:g})")
    p.add_argument("--no-abort-on-exception", action="store_true",
                   help="run a Python command as given, not under 'python -m mpi4py'")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    return p


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, None


def _job_from_args(argv: list[str]) -> Job:
    options, command = _split_command(argv)
    args = _parser().parse_args(options)
    if command is None:
        command = list(args.command)
    elif args.command:
        raise LaunchError(f"unexpected arguments before '--': {' '.join(args.command)!r}")
    if args.nproc < 1:
        raise LaunchError(f"-n must be at least 1, got {args.nproc}")
    if not command:
        raise LaunchError("no command given; put it after '--', e.g. "
                          "simrun -n 8 -- python -m simpar.train")
    if not 0 <= args.grace <= 3600:
        raise LaunchError(f"--grace must be between 0 and 3600 seconds, got {args.grace:g}")
    log_dir = Path(args.log_dir).resolve()
    if log_dir.exists() and not log_dir.is_dir():
        raise LaunchError(f"--log-dir {args.log_dir!r} exists and is not a directory")
    if args.hostfile is not None and not Path(args.hostfile).is_file():
        raise LaunchError(f"--hostfile {args.hostfile!r} does not exist")
    mpirun = find_mpirun(args.mpirun)
    flavor = detect_mpi_flavor(mpirun)

    hostfile: Path | None = None
    hosts: tuple[tuple[str, int], ...] | None = None
    if args.hostfile is not None:
        hostfile = Path(args.hostfile).resolve()
        if flavor == "unknown":
            raise LaunchError(f"--hostfile needs a known mpirun, but the --version of {mpirun} "
                              "names neither MPICH Hydra (-f H) nor Open MPI (--hostfile H)")
        hosts = parse_hostfile(hostfile, flavor)
        total = sum(slots for _, slots in hosts)
        if total < args.nproc:
            raise LaunchError(f"--hostfile {args.hostfile!r} has {total} slots "
                              f"({hosts_text(hosts)}), fewer than -n {args.nproc}; add slots "
                              "or lower -n")

    table: RankTable | None = None
    if args.rank_table_file is not None:
        rank_table_file = Path(args.rank_table_file).resolve()
        try:
            given = read_rank_table(rank_table_file)
        except ValueError as exc:
            raise LaunchError(f"--rank-table-file: {exc}") from None
        if given.device_num != args.nproc:
            raise LaunchError(f"--rank-table-file {args.rank_table_file!r} describes "
                              f"{given.device_num} devices, but -n is {args.nproc}")
    else:
        rank_table_file = log_dir / "rank_table.json"
        table = build_rank_table(args.nproc, hosts)

    if not args.no_abort_on_exception:
        command = with_abort_on_exception(command)
    job = Job(nproc=args.nproc, command=tuple(command), log_dir=log_dir,
               rank_table_file=rank_table_file, mpirun=mpirun, flavor=flavor,
               hostfile=hostfile, join=args.join, mpirun_args=tuple(args.mpirun_arg),
               grace_s=args.grace)
    _prepare_log_dir(job, table)
    return job


def _prepare_log_dir(job: Job, table: RankTable | None) -> None:
    """Create the log dir, drop last run's rank logs (so none is mistaken for this run's)."""
    try:
        job.log_dir.mkdir(parents=True, exist_ok=True)
        for old in job.log_dir.glob("rank_*.log"):
            if re.fullmatch(r"rank_\d+\.log", old.name):
                old.unlink()
        if table is not None:
            write_rank_table(table, job.rank_table_file)
    except OSError as exc:
        raise LaunchError(f"--log-dir {str(job.log_dir)!r} cannot be written: "
                          f"{exc.strerror or exc}") from exc


def _wrapper_main(argv: list[str]) -> int:
    p = _ArgParser(prog="simrun rank wrapper")
    p.add_argument("--log-dir", required=True)
    p.add_argument("--rank-table-file", required=True)
    p.add_argument("--join", action="store_true")
    options, command = _split_command(argv)
    args = p.parse_args(options)
    if not command:
        raise LaunchError("the rank wrapper needs a command after '--'")
    return run_rank(Path(args.log_dir), args.rank_table_file, args.join, command)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``simrun`` and ``python -m simpar.launch``; returns the exit status.

    ``main(["-n", "2", "--", "python", "-c", "print(1)"])`` runs the command on 2 ranks and
    returns 0; ``main(["-n", "0", "--", "true"])`` prints
    ``simrun: error: -n must be at least 1, got 0`` and returns 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["--_rank-wrapper"]:
            return _wrapper_main(argv[1:])
        job = _job_from_args(argv)
    except LaunchError as exc:
        print(f"simrun: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    return run_job(job)
