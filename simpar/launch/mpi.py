"""The MPI underneath simrun: which ``mpirun`` (:func:`find_mpirun`), which flavour it is
(:func:`detect_mpi_flavor`), its hostfile syntax (:func:`parse_hostfile`), and the environment
and command line every rank gets (:func:`job_env`, :func:`with_abort_on_exception`).

simrun never loads MPI itself: everything here runs ``mpirun`` or reads files.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from simpar import _env

__all__ = ["LaunchError", "MpiFlavor", "clean_env", "detect_mpi_flavor", "find_mpirun", "job_env",
           "parse_hostfile", "with_abort_on_exception"]

MpiFlavor = Literal["hydra", "openmpi", "unknown"]

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")


class LaunchError(ValueError):
    """A bad simrun argument or input file; simrun prints it and exits with status 2."""


def find_mpirun(explicit: str | None = None) -> str:
    """The mpirun to use: ``explicit``, ``$SIMPAR_MPIRUN``, next to ``sys.executable``, ``PATH``.

    ``explicit`` and ``$SIMPAR_MPIRUN`` may be a path or a name looked up on ``PATH``.
    """
    for value, what in ((explicit, "--mpirun"), (os.environ.get("SIMPAR_MPIRUN"), "SIMPAR_MPIRUN")):
        if value:
            found = shutil.which(value)
            if found is None:
                raise LaunchError(f"{what} {value!r} is not an executable file, nor a command "
                                  "on PATH")
            return found
    beside = Path(sys.executable).parent / "mpirun"  # not resolved: the venv's bin, not the base
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpirun")
    if found is None:
        raise LaunchError(f"no mpirun found next to {sys.executable} nor on PATH; install MPI "
                          "(pip install mpich) or pass --mpirun PATH")
    return found


def detect_mpi_flavor(mpirun: str) -> MpiFlavor:
    """``"hydra"`` (MPICH, Intel MPI, MVAPICH), ``"openmpi"`` or ``"unknown"``, from --version."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                             timeout=20, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return _flavor_from_version(out.stdout + out.stderr)


def _flavor_from_version(text: str) -> MpiFlavor:
    if re.search(r"open ?mpi|openrte|open-rte", text, re.IGNORECASE):
        return "openmpi"
    if re.search(r"hydra|intel\(r\) mpi|mpich|mvapich", text, re.IGNORECASE):
        return "hydra"
    return "unknown"


def parse_hostfile(path: str | os.PathLike[str],
                   flavor: MpiFlavor = "unknown") -> tuple[tuple[str, int], ...]:
    """``((host, slots), ...)`` from an MPI hostfile, in file order.

    Reads both syntaxes: MPICH Hydra's ``node-a:8`` and Open MPI's ``node-a slots=8``; ``#``
    starts a comment and a host without a count has 1 slot. With ``flavor`` given, a line in the
    other MPI's syntax is an error, since that mpirun would misread it.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise LaunchError(f"--hostfile {str(path)!r} cannot be read: "
                          f"{exc.strerror or exc}") from exc
    hosts: list[tuple[str, int]] = []
    for number, line in enumerate(lines, start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {str(path)!r} line {number}"
        host, colon, count = words[0].partition(":")
        slots_kw = [w.partition("=")[2] for w in words[1:] if w.startswith("slots=")]
        if colon and flavor == "openmpi":
            raise LaunchError(f"{where}: {words[0]!r} is MPICH syntax; Open MPI reads "
                              f"'{host} slots={count}'")
        if slots_kw and flavor == "hydra":
            raise LaunchError(f"{where}: {line.strip()!r} is Open MPI syntax; MPICH Hydra reads "
                              f"'{host}:{slots_kw[0]}'")
        text = count.split(":")[0] if colon else (slots_kw[0] if slots_kw else "1")
        if not text.isdecimal() or int(text) < 1:
            raise LaunchError(f"{where}: the slot count of {host!r} must be a positive integer, "
                              f"got {text!r}")
        if not host:
            raise LaunchError(f"{where}: no host name in {line.strip()!r}")
        if any(host == h for h, _ in hosts):
            raise LaunchError(f"{where}: host {host!r} appears twice; give it one line with all "
                              "its slots")
        hosts.append((host, int(text)))
    if not hosts:
        raise LaunchError(f"--hostfile {str(path)!r} names no host")
    return tuple(hosts)


def with_abort_on_exception(command: list[str]) -> list[str]:
    """``python [opts] X ...`` -> ``python [opts] -m mpi4py X ...``; other commands unchanged.

    mpi4py's runner calls ``MPI_Abort`` on an uncaught exception (or a non-zero ``sys.exit``),
    instead of letting the rank wait forever in ``MPI_Finalize`` for ranks blocked in a
    collective.
    """
    if not command or not _PYTHON.match(Path(command[0]).name):
        return command
    i = 1
    while i < len(command):
        word = command[i]
        if word in ("-m", "-c", "-") or not word.startswith("-"):
            if word == "-m" and command[i + 1:i + 2] == ["mpi4py"]:
                return command
            return [*command[:i], "-m", "mpi4py", *command[i:]]
        i += 2 if word in ("-W", "-X") else 1
    return command


def _simpar_root_on_path(env: dict[str, str]) -> None:
    """Let ``python -m simpar...`` import this simpar on every rank, from any directory."""
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds simpar/
    installed = set(site.getsitepackages()) | {site.getusersitepackages()}
    current = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in installed and root not in current:
        env["PYTHONPATH"] = os.pathsep.join([root, *current])


def clean_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the defaults simpar._env.apply() put into this process's environment.

    Importing simpar sized BLAS threads and the MPI wait policy for *this* process (one local
    rank); each rank must size them for itself, which it does only if they are not already set.
    """
    out = dict(env)
    settings = _env.SETTINGS
    if not settings:
        return out
    user_threads = ("SIMPAR_NUM_THREADS", *_env._THREAD_VARS)
    if settings.get("threads_from") not in user_threads:
        for var in _env._THREAD_VARS:
            if out.get(var) == str(settings.get("blas_threads")):
                del out[var]
    if settings.get("wait_policy") == "yield":
        for var in _env._YIELD_VARS:
            out.pop(var, None)
    return out


def job_env() -> dict[str, str]:
    """The environment mpirun starts the job in: this one, cleaned (:func:`clean_env`), with
    this simpar importable and this venv's ``python`` first on ``PATH``."""
    env = clean_env(os.environ)
    _simpar_root_on_path(env)
    if sys.prefix != sys.base_prefix:  # in a venv: "python" on the ranks means this venv's
        bin_dir = str(Path(sys.executable).parent)
        path = env.get("PATH", "").split(os.pathsep)
        if path[:1] != [bin_dir]:
            env["PATH"] = os.pathsep.join([bin_dir, *path])
    return env
