"""MindSpore's rank table: which server each rank's device sits in, built the way mpirun places
ranks (:func:`build_rank_table`), read back checked (:func:`read_rank_table`) and written in
MindSpore's own layout (:func:`write_rank_table`).

Every value is a string, as MindSpore writes them (see the package docstring for an example).
A server holds at most :data:`DEVICES_PER_SERVER` devices; a host with more ranks is cut into
several simulated servers, ``host#0``, ``host#1``, ...
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simpar import _checks as checks

__all__ = ["DEVICES_PER_SERVER", "RankTable", "RankTableDevice", "RankTableServer",
           "build_rank_table", "hosts_text", "read_rank_table", "write_rank_table"]

DEVICES_PER_SERVER = 8
"""Devices in one simulated server: an Ascend 910 server holds 8."""


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
        """Number of devices (ranks) in the table."""
        return len(self._server_by_rank)

    @property
    def server_count(self) -> int:
        """Number of servers, MindSpore's ``server_count``."""
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
    checks.positive_int(device_num, "device_num")
    checks.positive_int(devices_per_server, "devices_per_server")
    if hosts is None:
        hosts = [(socket.gethostname() or "localhost", device_num)]
    total = sum(slots for _, slots in hosts)
    if total < device_num:
        raise ValueError(f"the hosts have {total} slots in total, fewer than the {device_num} "
                         f"devices asked for ({hosts_text(hosts)})")
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


def hosts_text(hosts: Sequence[tuple[str, int]]) -> str:
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
