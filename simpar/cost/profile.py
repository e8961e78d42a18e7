"""Device profiles: what one device computes, holds and moves, for the cost model.

A :class:`DeviceProfile` is frozen and round-trips through JSON. simpar ships three
(``simpar/cost/profiles/*.json``): ``ascend910a`` and ``ascend910b`` (every figure labelled
with its public source or marked as an assumption) and ``cpu-local``, measured on the machine
that wrote it by ``python -m simpar.calibrate``. :func:`load_profile` takes a shipped name or
a path.

Collectives cost alpha-beta with the rounds and traffic of their kind's row of
:data:`simpar.collective_kinds.KINDS` (:meth:`DeviceProfile.collective_seconds`): a
group inside one server uses the intra-server link; a group that spans servers pays the
inter-server link, the slowest it crosses. Servers hold ``devices_per_server`` consecutive
ranks unless a rank table (``server_of``: the server index of every rank, e.g. from
``simpar.launch.read_rank_table``) says otherwise.
"""

from __future__ import annotations

import json
import math
import numbers
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from simpar.collective_kinds import KINDS, CollectiveKind, kind_of

__all__ = ["DeviceProfile", "Link", "load_profile", "profile_names"]

PROFILE_DIR = pathlib.Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of link: latency per ring round (s), bandwidth per rank (bytes/s), and a fixed
    cost per call (s: software, synchronisation), so a call of ``rounds`` rounds moving
    ``nbytes`` takes ``overhead + rounds * latency + nbytes / bandwidth``."""

    latency: float
    bandwidth: float
    overhead: float = 0.0

    def seconds(self, rounds: int, nbytes: float) -> float:
        return self.overhead + rounds * self.latency + nbytes / self.bandwidth


#: The figures a profile file must give, with what each means (for error messages).
_FIGURES = {
    "peak_flops": "peak floating-point operations per second, per dtype name",
    "memory_capacity": "device memory in bytes",
    "memory_bandwidth": "device memory bandwidth in bytes/s",
    "intra_server": "link inside a server: {latency (s), bandwidth (bytes/s)}",
    "inter_server": "link between servers: {latency (s), bandwidth (bytes/s)}",
    "devices_per_server": "devices in one server",
}
#: Optional figures (default 0): fixed software costs.
_OPTIONAL = {
    "kernel_overhead": "seconds per local kernel call inside a training step (launch, "
                       "framework dispatch, the Python around it)",
    "step_overhead": "seconds per training step besides its kernels and collectives",
    "array_op_overhead": "seconds per plain array operation outside the executor (the "
                         "optimizer's updates)",
    "compute_scale": "measured / roofline time of a training step's kernels, their "
                     "per-call overhead apart (1: the roofline alone)",
    "sync_overhead": "seconds per collective inside a training step beyond the link's time "
                     "(waiting for the slowest rank; negative, down to minus the link's "
                     "per-call overhead, when calls inside a step cost less than calls timed "
                     "one by one after a barrier)",
}


@dataclass(frozen=True)
class DeviceProfile:
    """One device model. ``peak_flops`` maps dtype names ("float16", "float32", ...) to
    FLOP/s; a dtype without an entry uses the slowest listed. ``sources`` maps each figure's
    name to where it comes from, or to "assumption: ..." when it is one.

    >>> p = load_profile("ascend910a")
    >>> p.devices_per_server, p.server_of(9)
    (8, 1)
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_capacity: int
    memory_bandwidth: float
    intra_server: Link
    inter_server: Link
    devices_per_server: int
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    server_map: tuple[int, ...] | None = None  # server index of each rank, from a rank table
    kernel_overhead: float = 0.0
    step_overhead: float = 0.0
    array_op_overhead: float = 0.0
    compute_scale: float = 1.0
    sync_overhead: float = 0.0

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"profile: name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ValueError(f"{where}: peak_flops must map dtype names to FLOP/s, got "
                             f"{self.peak_flops!r}")
        for dtype, value in self.peak_flops.items():
            try:
                ok = np.dtype(dtype).kind == "f" and np.dtype(dtype).name == dtype
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"{where}: peak_flops key {dtype!r} is not a floating-point "
                                 "dtype name; use float16, float32 or float64")
            _positive(value, f"{where}: peak_flops[{dtype!r}]")
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        _positive(self.memory_capacity, f"{where}: memory_capacity")
        if isinstance(self.memory_capacity, bool) or int(self.memory_capacity) != \
                self.memory_capacity:
            raise ValueError(f"{where}: memory_capacity must be a whole number of bytes, got "
                             f"{self.memory_capacity!r}")
        object.__setattr__(self, "memory_capacity", int(self.memory_capacity))
        _positive(self.memory_bandwidth, f"{where}: memory_bandwidth")
        for key in ("intra_server", "inter_server"):
            link = getattr(self, key)
            if not isinstance(link, Link):
                raise TypeError(f"{where}: {key} must be a Link, got {type(link).__name__}")
            _positive(link.bandwidth, f"{where}: {key}.bandwidth")
            _non_negative(link.latency, f"{where}: {key}.latency")
            _non_negative(link.overhead, f"{where}: {key}.overhead")
        for key in [k for k in _OPTIONAL if k != "sync_overhead"]:
            _non_negative(getattr(self, key), f"{where}: {key}")
        sync = _number(self.sync_overhead, f"{where}: sync_overhead")
        floor = -min(self.intra_server.overhead, self.inter_server.overhead)
        if not (math.isfinite(sync) and sync >= floor):   # a call never costs less than 0
            raise ValueError(f"{where}: sync_overhead must be >= minus the links' per-call "
                             f"overhead ({floor!r}), got {self.sync_overhead!r}")
        _positive(self.compute_scale, f"{where}: compute_scale")
        if isinstance(self.devices_per_server, bool) or not isinstance(
                self.devices_per_server, int) or self.devices_per_server < 1:
            raise ValueError(f"{where}: devices_per_server must be an int >= 1, got "
                             f"{self.devices_per_server!r}")
        object.__setattr__(self, "sources", dict(self.sources))
        if self.server_map is not None:
            object.__setattr__(self, "server_map", _server_map(self.server_map, where))

    # -------------------------------------------------------------------- queries
    def flops_per_second(self, dtype: Any) -> float:
        """Peak FLOP/s for ``dtype`` (a numpy dtype or its name)."""
        key = getattr(dtype, "name", None)   # a numpy dtype: its name, without converting
        if not isinstance(key, str):
            try:
                key = np.dtype(dtype).name
            except TypeError:
                key = str(dtype)
        found = self.peak_flops.get(key)
        return found if found is not None else min(self.peak_flops.values())

    def server_of(self, rank: int) -> int:
        """The server index of ``rank``'s device."""
        if self.server_map is not None:
            if not 0 <= rank < len(self.server_map):
                raise ValueError(f"profile {self.name!r}: rank {rank} is not in its rank table "
                                 f"of {len(self.server_map)} devices")
            return self.server_map[rank]
        return rank // self.devices_per_server

    def link(self, group: Sequence[int]) -> Link:
        """The link a collective over ``group`` runs at: intra-server when every rank sits in
        one server, else inter-server (the slowest it crosses)."""
        if self.server_map is None and group:  # servers: runs of devices_per_server ranks
            per = self.devices_per_server
            one = min(group) // per == max(group) // per
        else:
            one = len({self.server_of(r) for r in group}) <= 1
        return self.intra_server if one else self.inter_server

    def collective_seconds(self, kind: str, group: Sequence[int], nbytes: int) -> float:
        """Alpha-beta time of a ``kind`` collective of a local buffer of ``nbytes`` over
        ``group``: its latency rounds times the latency plus its traffic over the bandwidth,
        both from the kind's row of :data:`simpar.collective_kinds.KINDS` (a ring's rounds
        and traffic; "AllToAllV" takes ``nbytes`` as the rank's traffic itself; "Broadcast"
        is a tree of ``ceil(log2 p)`` rounds in which every rank receives the whole buffer)."""
        p = len(group)
        if p < 2:
            return 0.0
        return self._seconds(KINDS.get(kind) or kind_of(kind), group, p, nbytes)

    def step_collective_seconds(self, kind: str, group: Sequence[int], buffer_bytes: int,
                                recv_bytes: int) -> float:
        """One collective inside a training step: its time (a direct exchange on the bytes
        it receives, the others on their local buffer) plus the wait for the slowest rank
        (``sync_overhead``); 0 over one rank. Both cost models price collectives with it."""
        p = len(group)
        if p < 2:
            return 0.0
        facts = KINDS.get(kind) or kind_of(kind)   # (kind_of raises, naming the kinds)
        nbytes = recv_bytes if facts.by_pieces else buffer_bytes
        return self._seconds(facts, group, p, nbytes) + self.sync_overhead

    def step_collectives_seconds(self, kind: str, groups: Sequence[Sequence[int]],
                                 which: np.ndarray, buffer_bytes: np.ndarray) -> np.ndarray:
        """:meth:`step_collective_seconds` of many collectives of one kind at once, bit for
        bit: collective ``n`` runs over ``groups[which[n]]`` on a local buffer of
        ``buffer_bytes[n]`` (not a direct exchange)."""
        facts = KINDS.get(kind) or kind_of(kind)
        if facts.by_pieces:
            raise ValueError(f"step_collectives_seconds: {kind} is priced on the bytes each "
                             "rank receives; use step_collective_seconds")
        sizes = np.array([len(g) for g in groups], dtype=np.int64)
        rounds = np.array([facts.rounds(int(p)) for p in sizes], dtype=np.int64)[which]
        links = [self.link(g) for g in groups]
        inner = np.array([link is self.intra_server for link in links], dtype=bool)[which]
        p = sizes[which]
        traffic = np.asarray(facts.traffic(p, buffer_bytes))  # type: ignore[arg-type]
        out = np.zeros(len(which))
        for link, rows in ((self.intra_server, inner), (self.inter_server, ~inner)):
            if rows.any():
                out[rows] = link.seconds(rounds[rows], traffic[rows]) + self.sync_overhead
        return np.where(p < 2, 0.0, out)

    def _seconds(self, facts: CollectiveKind, group: Sequence[int], p: int, nbytes: int
                 ) -> float:
        return self.link(group).seconds(facts.rounds(p), facts.traffic(p, nbytes))

    def compute_seconds(self, flops: float, memory_bytes: float, dtype: Any) -> float:
        """Time of one kernel call: its dispatch (``kernel_overhead``) plus ``compute_scale``
        times its roofline, the slower of its FLOPs at peak and its bytes at the memory
        bandwidth."""
        roofline = max(flops / self.flops_per_second(dtype),
                       memory_bytes / self.memory_bandwidth)
        return self.kernel_overhead + self.compute_scale * roofline

    def with_rank_table(self, table: Any) -> DeviceProfile:
        """This profile with servers as a rank table lays them out: the launcher's
        ``RankTable`` (``simpar.launch.read_rank_table(path)``), or a sequence giving the
        server index of every rank."""
        if hasattr(table, "server_of") and hasattr(table, "device_num"):
            table = [table.server_of(r) for r in range(table.device_num)]
        return replace(self, server_map=_server_map(table, "with_rank_table"))

    # -------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "peak_flops": dict(self.peak_flops),
                "memory_capacity": self.memory_capacity,
                "memory_bandwidth": self.memory_bandwidth,
                "intra_server": _link_dict(self.intra_server),
                "inter_server": _link_dict(self.inter_server),
                "devices_per_server": self.devices_per_server,
                **({"server_map": list(self.server_map)} if self.server_map else {}),
                "kernel_overhead": self.kernel_overhead, "step_overhead": self.step_overhead,
                "array_op_overhead": self.array_op_overhead,
                "compute_scale": self.compute_scale, "sync_overhead": self.sync_overhead,
                "sources": dict(self.sources)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "profile") -> DeviceProfile:
        """Build from :meth:`to_dict`'s layout; every missing, negative or non-numeric figure
        raises naming it."""
        if not isinstance(d, Mapping):
            raise TypeError(f"{where}: a profile must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIGURES) - set(_OPTIONAL)
                         - {"name", "sources", "server_map"})
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; a profile has name, sources, "
                             f"{sorted(_FIGURES)} and optionally {sorted(_OPTIONAL)}")
        missing = [k for k in ("name", *_FIGURES) if k not in d]
        if missing:
            raise ValueError(f"{where}: missing {missing[0]!r} "
                             f"({_FIGURES.get(missing[0], 'the profile name')})")
        name = d["name"]
        flops = d["peak_flops"]
        if not isinstance(flops, Mapping) or not flops:
            raise ValueError(f"{where}: peak_flops must map dtype names to FLOP/s, got "
                             f"{flops!r}")
        links = {}
        for key in ("intra_server", "inter_server"):
            link = d[key]
            if not isinstance(link, Mapping) or not {"latency", "bandwidth"} <= set(link) or \
                    not set(link) <= {"latency", "bandwidth", "overhead"}:
                raise ValueError(f"{where}: {key} must be {{\"latency\": s, \"bandwidth\": "
                                 f"bytes/s[, \"overhead\": s]}}, got {link!r}")
            links[key] = Link(_number(link["latency"], f"{where}: {key}.latency"),
                              _number(link["bandwidth"], f"{where}: {key}.bandwidth"),
                              _number(link.get("overhead", 0.0), f"{where}: {key}.overhead"))
        sources = d.get("sources", {})
        if not isinstance(sources, Mapping):
            raise ValueError(f"{where}: sources must map figure names to text, got {sources!r}")
        capacity = _number(d["memory_capacity"], f"{where}: memory_capacity")
        _positive(capacity, f"{where}: memory_capacity")
        return cls(name, {str(k): _number(v, f"{where}: peak_flops[{k!r}]")
                          for k, v in flops.items()},
                   capacity,  # type: ignore[arg-type]  # checked whole in __post_init__
                   _number(d["memory_bandwidth"], f"{where}: memory_bandwidth"),
                   links["intra_server"], links["inter_server"], d["devices_per_server"],
                   {str(k): str(v) for k, v in sources.items()},
                   None if d.get("server_map") is None else tuple(d["server_map"]),
                   _number(d.get("kernel_overhead", 0.0), f"{where}: kernel_overhead"),
                   _number(d.get("step_overhead", 0.0), f"{where}: step_overhead"),
                   _number(d.get("array_op_overhead", 0.0), f"{where}: array_op_overhead"),
                   _number(d.get("compute_scale", 1.0), f"{where}: compute_scale"),
                   _number(d.get("sync_overhead", 0.0), f"{where}: sync_overhead"))

    def save(self, path: str | pathlib.Path) -> None:
        """Write the profile as JSON (to a temporary file first: no half-written profile)."""
        target = pathlib.Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(target)


def _server_map(server_of: Sequence[object], where: str) -> tuple[int, ...]:
    """A rank table's server index per rank, checked: ints >= 0, at least one rank."""
    table = tuple(server_of)
    bad = [s for s in table if isinstance(s, bool) or not isinstance(s, (int, np.integer))
           or s < 0]
    if not table or bad:
        raise ValueError(f"{where}: the server map must list a server index (an int >= 0) for "
                         f"every rank, got {list(table)[:8]}")
    return tuple(int(s) for s in table)  # type: ignore[call-overload]


def _link_dict(link: Link) -> dict[str, float]:
    return {"latency": link.latency, "bandwidth": link.bandwidth, "overhead": link.overhead}


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a number, got {value!r}")
    return float(value)


def _positive(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"{where} must be a finite number > 0, got {value!r}")


def _non_negative(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(float(value)) or value < 0:
        raise ValueError(f"{where} must be a finite number >= 0, got {value!r}")


def profile_names() -> tuple[str, ...]:
    """The profiles shipped with simpar."""
    return tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))


def load_profile(name_or_path: str | pathlib.Path | DeviceProfile) -> DeviceProfile:
    """A shipped profile by name ("ascend910a", "ascend910b", "cpu-local"), a profile JSON
    file by path, or a profile (returned as is)."""
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    if not isinstance(name_or_path, (str, pathlib.Path)):
        raise TypeError(f"load_profile: expected a profile name or a path, got "
                        f"{type(name_or_path).__name__} {name_or_path!r}")
    path = pathlib.Path(name_or_path)
    if path.suffix != ".json":
        if str(name_or_path) not in profile_names():
            raise ValueError(f"load_profile: unknown profile {str(name_or_path)!r}; shipped "
                             f"profiles are {list(profile_names())}, or give a path to a "
                             ".json profile")
        path = PROFILE_DIR / f"{name_or_path}.json"
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"load_profile: cannot read {str(path)!r}: {error.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"load_profile: {str(path)!r} is not valid JSON: {error}") from None
    return DeviceProfile.from_dict(data, where=f"profile {str(path)!r}")
