"""``simrun``: start a simpar job on N simulated devices, in the spirit of MindSpore's ``msrun``.

One host, 8 simulated Ascend devices (one MPI rank each)::

    simrun -n 8 -- python -m simpar.train --steps 20
    python -m simpar.launch -n 8 --log-dir out/logs -- python -m simpar.train
    simrun -n 8 --join -- python -m simpar.train        # every rank on the console, "[rank i] ..."

Two hosts of 8 slots each (MPI's own hostfile; see ``launch/hostfile.example``)::

    simrun -n 16 --hostfile launch/hostfile.example -- python -m simpar.train

simrun is a thin layer over ``mpirun``; it is not an MPI rank and never loads MPI itself.

* **mpirun**: ``--mpirun PATH``, else ``$SIMPAR_MPIRUN``, else the one next to ``sys.executable``
  (the venv's bundled MPICH), else the first on ``PATH``. ``mpirun --version`` tells the flavour:
  MPICH Hydra (also Intel MPI, MVAPICH) gets the hostfile as ``-f H``, Open MPI as
  ``--hostfile H`` (and ``--oversubscribe`` when there is no hostfile, since 8 simulated devices
  usually outnumber the cores). ``--mpirun-arg=-v`` passes extra arguments through.
* **logs**: each rank runs under a small wrapper (``python -m simpar.launch --_rank-wrapper``) that
  reads its rank from ``PMI_RANK`` (MPICH) or ``OMPI_COMM_WORLD_RANK`` (Open MPI) and points the
  command's stdout and stderr straight at ``D/rank_{i}.log`` (default ``D = ./logs``). The
  command writes its log itself, so a rank killed mid-line still leaves every byte it wrote.
  The wrapper follows the file to the console for rank 0, or for every rank with ``--join``.
  ``PYTHONUNBUFFERED=1`` is set (unless you set it) so Python ranks' logs are live. The wrapper
  passes SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 on to the command, reports its exit to
  simrun (a record on mpirun's stdout), and exits with its exit code, or dies by the same
  signal; on Linux the command also dies if the wrapper is killed (``PR_SET_PDEATHSIG``).
* **rank table**: ``D/rank_table.json`` in MindSpore's rank-table format (below), or
  ``--rank-table-file F`` to use an existing one. Every rank gets ``SIMPAR_RANK_TABLE_FILE``
  and ``SIMPAR_LOG_DIR``; :func:`read_rank_table` reads the table back for the cost model.
* **failure**: a Python command (``python ...``) runs as ``python -m mpi4py ...``, mpi4py's
  documented cure for the deadlock where one rank raises and then waits in ``MPI_Finalize`` for
  ranks blocked in a collective: an uncaught exception calls ``MPI_Abort`` and MPICH kills the
  job at once (``--no-abort-on-exception`` turns this off). When a rank exits non-zero and the
  MPI does not end the job, simrun waits ``--grace`` seconds (:data:`FAILURE_GRACE_S`, 5), then
  stops mpirun and kills whatever is left of the job. It then names the failing rank, prints
  the last :data:`TAIL_LINES` lines of its log, and exits with that rank's exit code. (After an
  ``MPI_Abort`` MPICH kills every wrapper at once, so no rank reports; simrun then names the
  rank whose log holds the MPI's abort message, or else a Python traceback.)
* **bad arguments** (``-n 0``, no command, a missing hostfile, fewer hostfile slots than ``-n``, a
  rank table for another device count) print one line naming the flag and the value, exit 2.

The rank table follows MindSpore's ``rank_table_file`` ("rank table Startup" in the MindSpore
tutorials, e.g. ``rank_table_2pcs.json``). Every value is a string, as MindSpore writes them::

    {"version": "1.0", "server_count": "1",
     "server_list": [{"server_id": "vm", "host_nic_ip": "reserve",
                      "device": [{"device_id": "0", "device_ip": "10.0.0.1", "rank_id": "0"},
                                 {"device_id": "1", "device_ip": "10.0.0.2", "rank_id": "1"}]}],
     "status": "completed"}

A server holds at most 8 devices (an Ascend 910 server). A host with more ranks than that is cut
into several simulated servers, named ``host#0``, ``host#1``, ... ``device_ip`` is a placeholder
in 10.0.0.0/8, unique per device: nothing ever connects to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from simpar import _env

__all__ = [
    "DEVICES_PER_SERVER",
    "FAILURE_GRACE_S",
    "TAIL_LINES",
    "LaunchError",
    "MpiFlavor",
    "RankTable",
    "RankTableDevice",
    "RankTableServer",
    "build_rank_table",
    "detect_mpi_flavor",
    "find_mpirun",
    "main",
    "parse_hostfile",
    "read_rank_table",
    "write_rank_table",
]

DEVICES_PER_SERVER = 8
"""Devices in one simulated server: an Ascend 910 server holds 8."""

FAILURE_GRACE_S = 5.0
"""Seconds the other ranks get to end by themselves once one rank has failed."""

TAIL_LINES = 20
"""Lines of the failing rank's log that simrun prints."""

_STOP_WAIT_S = 2.0  # after SIGTERM to mpirun, before SIGKILL to everything left
_POLL_S = 0.05
_EXIT_MARK = b"\x1esimpar-rank-exit "  # wrapper -> launcher record, on the wrapper's stdout
_RANK_VARS = _env.RANK_VARS
_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")
# Messages an aborting rank leaves in its own log (MPICH, Open MPI, simpar.comm's hook).
_ABORT_SIGNS = (re.compile(r"application called MPI_Abort\("),
                re.compile(r"MPI_ABORT was invoked on rank"),
                re.compile(r"\[simpar rank \d+\] uncaught"))

MpiFlavor = Literal["hydra", "openmpi", "unknown"]


class LaunchError(ValueError):
    """A bad simrun argument or input file; simrun prints it and exits with status 2."""


# --------------------------------------------------------------------------- rank table


def _count(value: object, where: str) -> int:
    """A non-negative integer written as MindSpore does ("3") or as a JSON number."""
    if isinstance(value, str) and value.isdecimal():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"{where} must be a non-negative integer (a string of digits, as MindSpore "
                     f"writes it), got {value!r}")


@dataclass(frozen=True, slots=True)
class RankTableDevice:
    """One device of a server: its number inside the server and its global rank."""

    device_id: int
    rank_id: int
    device_ip: str = ""

    def __str__(self) -> str:
        return f"device {self.device_id} (rank {self.rank_id})"


@dataclass(frozen=True, slots=True)
class RankTableServer:
    """One server (``server_list`` entry): its id and its devices, in file order."""

    server_id: str
    devices: tuple[RankTableDevice, ...]
    host_nic_ip: str = "reserve"

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(d.rank_id for d in self.devices)

    def __str__(self) -> str:
        return f"{self.server_id}{list(self.ranks)}"


@dataclass(frozen=True, slots=True)
class RankTable:
    """A MindSpore rank table: which server each rank's device sits in.

    Validated when built: server ids are distinct, device ids are distinct inside a server, and
    the rank ids are exactly ``0 .. device_num-1``. With 2 servers of 8 devices, rank 9 is
    device 1 of server 1::

        >>> t = build_rank_table(16, [("node-a", 8), ("node-b", 8)])
        >>> t.server_of(9), t.device_of(9).device_id, str(t)
        (1, 1, 'RankTable(16 devices: node-a[0..7], node-b[8..15])')
    """

    servers: tuple[RankTableServer, ...]
    version: str = "1.0"
    status: str = "completed"
    _server_by_rank: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("rank table: server_list must hold at least one server, got none")
        seen_ids: set[str] = set()
        owner: dict[int, int] = {}
        for s_index, server in enumerate(self.servers):
            where = f"rank table: server_list[{s_index}]"
            if not server.server_id:
                raise ValueError(f"{where}.server_id must be a non-empty string, got ''")
            if server.server_id in seen_ids:
                raise ValueError(f"{where}.server_id {server.server_id!r} appears twice; "
                                 "each server must have its own id")
            seen_ids.add(server.server_id)
            if not server.devices:
                raise ValueError(f"{where}.device must list at least one device, got none")
            device_ids = [d.device_id for d in server.devices]
            for d_index, device in enumerate(server.devices):
                if device_ids.index(device.device_id) != d_index:
                    raise ValueError(f"{where}.device[{d_index}].device_id {device.device_id} "
                                     f"appears twice in server {server.server_id!r}")
                if device.rank_id in owner:
                    raise ValueError(f"{where}.device[{d_index}].rank_id {device.rank_id} "
                                     "appears twice in the table")
                owner[device.rank_id] = s_index
        n = len(owner)
        missing = sorted(set(range(n)) - owner.keys())
        if missing:
            raise ValueError(f"rank table: the rank_id values must be 0..{n - 1} (one per "
                             f"device), but {missing[:8]} are missing and "
                             f"{sorted(r for r in owner if r >= n)[:8]} are out of range")
        object.__setattr__(self, "_server_by_rank", tuple(owner[r] for r in range(n)))

    @property
    def device_num(self) -> int:
        return len(self._server_by_rank)

    @property
    def server_count(self) -> int:
        return len(self.servers)

    def server_of(self, rank: int) -> int:
        """Index in :attr:`servers` of the server that holds ``rank``'s device."""
        if not 0 <= rank < self.device_num:
            raise ValueError(f"rank {rank} is not in this rank table of {self.device_num} "
                             f"devices (ranks 0..{self.device_num - 1})")
        return self._server_by_rank[rank]

    def device_of(self, rank: int) -> RankTableDevice:
        """The device entry of ``rank``."""
        server = self.servers[self.server_of(rank)]
        return next(d for d in server.devices if d.rank_id == rank)

    def to_json_dict(self) -> dict[str, Any]:
        """The table in MindSpore's JSON layout (every value a string)."""
        return {
            "version": self.version,
            "server_count": str(self.server_count),
            "server_list": [
                {"server_id": s.server_id,
                 "device": [{"device_id": str(d.device_id), "device_ip": d.device_ip,
                             "rank_id": str(d.rank_id)} for d in s.devices],
                 "host_nic_ip": s.host_nic_ip}
                for s in self.servers],
            "status": self.status,
        }

    def __str__(self) -> str:
        def span(ranks: tuple[int, ...]) -> str:
            contiguous = list(ranks) == list(range(ranks[0], ranks[0] + len(ranks)))
            if contiguous and len(ranks) > 2:
                return f"[{ranks[0]}..{ranks[-1]}]"
            return str(list(ranks))

        shown = ", ".join(f"{s.server_id}{span(s.ranks)}" for s in self.servers[:4])
        more = f", ... ({self.server_count} servers)" if self.server_count > 4 else ""
        return f"RankTable({self.device_num} devices: {shown}{more})"


def build_rank_table(device_num: int, hosts: Sequence[tuple[str, int]] | None = None,
                     devices_per_server: int = DEVICES_PER_SERVER) -> RankTable:
    """The rank table of ``device_num`` ranks placed on ``hosts`` the way mpirun places them.

    ``hosts`` is ``[(host, slots), ...]`` as read by :func:`parse_hostfile`; ``None`` means this
    machine (its hostname) with all the ranks. Ranks fill each host's slots in order, which is
    MPICH's and Open MPI's default by-slot mapping, and a host's ranks are cut into servers of
    at most ``devices_per_server`` devices. ``build_rank_table(16, [("a", 8), ("b", 8)])``
    puts ranks 0..7 on server ``a`` and 8..15 on ``b``; ``build_rank_table(16)`` on host ``vm``
    gives two simulated servers ``vm#0`` and ``vm#1``.
    """
    if isinstance(device_num, bool) or not isinstance(device_num, int) or device_num < 1:
        raise ValueError(f"device_num must be a positive int, got {device_num!r}")
    if devices_per_server < 1:
        raise ValueError(f"devices_per_server must be a positive int, got {devices_per_server!r}")
    if hosts is None:
        hosts = [(socket.gethostname() or "localhost", device_num)]
    total = sum(slots for _, slots in hosts)
    if total < device_num:
        raise ValueError(f"the hosts have {total} slots in total, fewer than the {device_num} "
                         f"devices asked for ({_hosts_text(hosts)})")
    servers: list[RankTableServer] = []
    rank = 0
    for host, slots in hosts:
        taken = min(slots, device_num - rank)
        starts = range(0, taken, devices_per_server)
        for part, start in enumerate(starts):
            count = min(devices_per_server, taken - start)
            s_index = len(servers)
            devices = tuple(
                RankTableDevice(device_id=d, rank_id=rank + start + d,
                                device_ip=f"10.{s_index // 256 % 256}.{s_index % 256}.{d + 1}")
                for d in range(count))
            server_id = host if len(starts) == 1 else f"{host}#{part}"
            servers.append(RankTableServer(server_id=server_id, devices=devices))
        rank += taken
        if rank == device_num:
            break
    return RankTable(servers=tuple(servers))


def _hosts_text(hosts: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{h}:{s}" for h, s in hosts)


def read_rank_table(path: str | os.PathLike[str]) -> RankTable:
    """Read and validate a MindSpore rank table JSON file (never pickle).

    Raises ``ValueError`` naming the file, the field (``server_list[1].device[3].rank_id``) and
    the value when something is wrong. ``status`` must be ``"completed"`` if present (MindSpore
    writes ``"initializing"`` while a table is still being filled in).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read rank table {str(path)!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"rank table {str(path)!r} is not valid JSON: not UTF-8 text "
                         f"({exc.reason} at byte {exc.start})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"rank table {str(path)!r} is not valid JSON: {exc}") from exc
    try:
        return _rank_table_from_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _rank_table_from_json(data: object) -> RankTable:
    if not isinstance(data, dict):
        raise ValueError(f"a rank table must be a JSON object, got {type(data).__name__}")
    version = data.get("version", "1.0")
    if not isinstance(version, str):
        raise ValueError(f"version must be a string such as '1.0', got {version!r}")
    status = data.get("status", "completed")
    if status != "completed":
        raise ValueError(f"status must be 'completed', got {status!r} (the table is not final)")
    server_list = data.get("server_list")
    if not isinstance(server_list, list) or not server_list:
        raise ValueError(f"server_list must be a non-empty list of servers, got {server_list!r}")
    if "server_count" not in data:
        raise ValueError("server_count is missing (it must equal the length of server_list, "
                         f"{len(server_list)})")
    server_count = _count(data["server_count"], "server_count")
    if server_count != len(server_list):
        raise ValueError(f"server_count is {data['server_count']!r}, but server_list holds "
                         f"{len(server_list)} servers")
    servers = []
    for s_index, raw in enumerate(server_list):
        where = f"server_list[{s_index}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be a JSON object, got {raw!r}")
        server_id = raw.get("server_id")
        if not isinstance(server_id, str) or not server_id:
            raise ValueError(f"{where}.server_id must be a non-empty string, got {server_id!r}")
        raw_devices = raw.get("device")
        if not isinstance(raw_devices, list) or not raw_devices:
            raise ValueError(f"{where}.device must be a non-empty list, got {raw_devices!r}")
        devices = []
        for d_index, dev in enumerate(raw_devices):
            dwhere = f"{where}.device[{d_index}]"
            if not isinstance(dev, dict):
                raise ValueError(f"{dwhere} must be a JSON object, got {dev!r}")
            for key in ("device_id", "rank_id"):
                if key not in dev:
                    raise ValueError(f"{dwhere}.{key} is missing")
            device_ip = dev.get("device_ip", "")
            if not isinstance(device_ip, str):
                raise ValueError(f"{dwhere}.device_ip must be a string, got {device_ip!r}")
            devices.append(RankTableDevice(
                device_id=_count(dev["device_id"], f"{dwhere}.device_id"),
                rank_id=_count(dev["rank_id"], f"{dwhere}.rank_id"), device_ip=device_ip))
        host_nic_ip = raw.get("host_nic_ip", "reserve")
        servers.append(RankTableServer(server_id=server_id, devices=tuple(devices),
                                       host_nic_ip=str(host_nic_ip)))
    try:
        return RankTable(servers=tuple(servers), version=version, status=status)
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix("rank table: ")) from None


def _rank_table_text(table: RankTable) -> str:
    """MindSpore's layout: one line per device, as in its rank_table_8pcs.json examples."""
    data = table.to_json_dict()
    servers = []
    for server in data["server_list"]:
        devices = ",\n".join(f"                {json.dumps(d)}" for d in server["device"])
        server_id, nic = json.dumps(server["server_id"]), json.dumps(server["host_nic_ip"])
        servers.append(f'        {{\n            "server_id": {server_id},\n'
                       f'            "device": [\n{devices}\n            ],\n'
                       f'            "host_nic_ip": {nic}\n        }}')
    server_list = ",\n".join(servers)
    return (f'{{\n    "version": {json.dumps(data["version"])},\n'
            f'    "server_count": {json.dumps(data["server_count"])},\n'
            f'    "server_list": [\n{server_list}\n    ],\n'
            f'    "status": {json.dumps(data["status"])}\n}}\n')


def write_rank_table(table: RankTable, path: str | os.PathLike[str]) -> Path:
    """Write ``table`` as MindSpore JSON, atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_rank_table_text(table))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


# --------------------------------------------------------------------------- mpirun, hostfile


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


def _with_abort_on_exception(command: list[str]) -> list[str]:
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
    root = str(Path(__file__).resolve().parent.parent)
    installed = set(site.getsitepackages()) | {site.getusersitepackages()}
    current = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in installed and root not in current:
        env["PYTHONPATH"] = os.pathsep.join([root, *current])


def _clean_env(env: Mapping[str, str]) -> dict[str, str]:
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


# --------------------------------------------------------------------------- the rank wrapper


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


def _rank_log(log_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s wrapper writes the command's output (``_prepare_log_dir`` clears
    these)."""
    return log_dir / f"rank_{rank}.log"


def _tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
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


def _rank_wrapper(log_dir: Path, rank_table: str, join: bool, command: list[str]) -> int:
    """Run ``command`` as this MPI rank, its output in ``log_dir/rank_{i}.log``; see the module."""
    rank = _rank_from_env()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = _rank_log(log_dir, rank)
    env = _clean_env(os.environ)
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
              "log": str(log_path), "tail": _tail(log_path) if returncode else []}
    with contextlib.suppress(OSError):
        sys.stdout.buffer.write(_EXIT_MARK + json.dumps(record).encode() + b"\n")
        sys.stdout.buffer.flush()


# --------------------------------------------------------------------------- the launcher


@dataclass(frozen=True, slots=True)
class _Job:
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


def _job_from_args(argv: list[str]) -> _Job:
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
                              f"({_hosts_text(hosts)}), fewer than -n {args.nproc}; add slots "
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
        command = _with_abort_on_exception(command)
    job = _Job(nproc=args.nproc, command=tuple(command), log_dir=log_dir,
               rank_table_file=rank_table_file, mpirun=mpirun, flavor=flavor,
               hostfile=hostfile, join=args.join, mpirun_args=tuple(args.mpirun_arg),
               grace_s=args.grace)
    _prepare_log_dir(job, table)
    return job


def _prepare_log_dir(job: _Job, table: RankTable | None) -> None:
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


def _job_env() -> dict[str, str]:
    env = _clean_env(os.environ)
    _simpar_root_on_path(env)
    if sys.prefix != sys.base_prefix:  # in a venv: "python" on the ranks means this venv's
        bin_dir = str(Path(sys.executable).parent)
        path = env.get("PATH", "").split(os.pathsep)
        if path[:1] != [bin_dir]:
            env["PATH"] = os.pathsep.join([bin_dir, *path])
    return env


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
        if line.startswith(_EXIT_MARK):
            with contextlib.suppress(ValueError):
                records.put(json.loads(line[len(_EXIT_MARK):]))
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


def _run(job: _Job) -> int:
    env = _job_env()
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


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _print_tail(log: Path, fallback: Sequence[str]) -> None:
    """The last lines of a rank's log: from the file, or as its wrapper sent them (other host)."""
    local = log.is_file()
    lines = _tail(log) if local else list(fallback)
    if not lines:
        print(f"simrun: {log} is {'empty' if local else 'not on this host'}", file=sys.stderr)
        return
    where = str(log) if local else f"{log} (on its host)"
    print(f"simrun: last {len(lines)} lines of {where}:", file=sys.stderr)
    for line in lines:
        print(f"    {line}", file=sys.stderr)


def _aborted_ranks(job: _Job, exits: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """Ranks whose logs show that they aborted the job.

    ``MPI_Abort`` makes MPICH SIGKILL every rank's wrapper at once, the aborting rank's too, so
    nobody reports an exit. The aborting rank's log (written by the rank itself) still holds the
    MPI's abort message or the Python traceback.
    """
    aborted, raised = [], []
    for rank in range(job.nproc):
        if rank in exits:
            continue
        tail = "\n".join(_tail(_rank_log(job.log_dir, rank), 200))
        if any(sign.search(tail) for sign in _ABORT_SIGNS):
            aborted.append(rank)
        elif "Traceback (most recent call last)" in tail:
            raised.append(rank)
    return aborted or raised


def _report(job: _Job, mpirun_rc: int, outcome: _Outcome) -> int:
    """Print why the job ended, if it failed, and return simrun's exit status."""
    stopped = " simrun stopped the remaining ranks." if outcome.stopped else ""
    if outcome.first is not None:
        rank, rc = int(outcome.first["rank"]), int(outcome.first["returncode"])
        print(f"simrun: rank {rank} failed ({_exit_text(rc)}) on "
              f"{outcome.first.get('host', '?')}.{stopped}", file=sys.stderr)
        _print_tail(_rank_log(job.log_dir, rank), outcome.first.get("tail", []))
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
        _print_tail(_rank_log(job.log_dir, aborted[0]), [])
    else:
        silent = [r for r in range(job.nproc) if r not in outcome.exits]
        print(f"simrun: mpirun ended with {_exit_text(mpirun_rc)} and no rank reported a "
              f"failure (ranks without an exit record: {silent[:16]}).{stopped}",
              file=sys.stderr)
        if silent:
            _print_tail(_rank_log(job.log_dir, silent[0]), [])
    return mpirun_rc if 0 < mpirun_rc < 256 else 1


def _wrapper_main(argv: list[str]) -> int:
    p = _ArgParser(prog="simrun rank wrapper")
    p.add_argument("--log-dir", required=True)
    p.add_argument("--rank-table-file", required=True)
    p.add_argument("--join", action="store_true")
    options, command = _split_command(argv)
    args = p.parse_args(options)
    if not command:
        raise LaunchError("the rank wrapper needs a command after '--'")
    return _rank_wrapper(Path(args.log_dir), args.rank_table_file, args.join, command)


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
    return _run(job)


if __name__ == "__main__":
    sys.exit(main())
