"""Every kind of collective simpar runs, in one table: what a rank moves, in how many latency
rounds, what runs it backwards, and which :mod:`simpar.comm` function runs it.

Traffic follows CommTrace's convention (``simpar/comm/trace.py``): what one rank exchanges with
the *other* ranks of a group of ``p`` in the bandwidth-optimal (ring) algorithm, for a local
buffer of ``n`` (bytes or elements alike). Rounds are the latency rounds of that algorithm,
what :meth:`simpar.cost.DeviceProfile.collective_seconds` charges the link's latency for and
``simpar.calibrate`` fits it against:

============= ================== ============== ================ =========================
kind          traffic            rounds         adjoint          simpar.comm
============= ================== ============== ================ =========================
AllReduce     ``2 (p-1)/p n``    ``2 (p-1)``    AllReduce        ``all_reduce``
AllGather     ``(p-1) n``        ``p-1``        ReduceScatter    ``all_gather``
ReduceScatter ``(p-1)/p n``      ``p-1``        AllGather        ``reduce_scatter``
AllToAll      ``(p-1)/p n``      ``p-1``        AllToAll         ``all_to_all``
AllToAllV     its pieces         ``p-1``        AllToAllV        ``all_to_all_v``
Broadcast     ``n`` (non-root)   ``ceil log2 p`` (none)          ``broadcast``
Slice, Zero   local: nothing     0              Slice, Zero      (none)
============= ================== ============== ================ =========================

The adjoints are DESIGN.md's "Backward through collectives" (a Slice runs backwards as
zero-padding, a Zero as itself). :class:`StepKind` names the kinds a redistribution step can
be; :data:`KINDS` maps every kind's name (a StepKind member is its own name) to its
:class:`CollectiveKind`. Everything that prices, records or runs a collective reads it: the
redistribution planner and executor, the op sharding rules, the collectives in
``simpar.comm``, the cost model, ``simpar.calibrate`` and the planners' bulk pricing.

The same rounds serve every estimate: :func:`latency_rounds` and :func:`seconds` (the default
link :meth:`simpar.redistribution.Step.seconds` estimates with) read the table as the device
profiles do.

A leaf module: it imports only :mod:`simpar._enums`, so every layer may use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simpar._enums import StrEnum

__all__ = ["ALPHA_SECONDS", "BANDWIDTH_BYTES_PER_S", "KINDS", "CollectiveKind", "StepKind",
           "broadcast_traffic", "by_function", "kind_of", "latency_rounds", "sample_ranks",
           "seconds", "traffic"]

# Default link model (one Ascend 910 HCCS link, roughly): latency per collective round and
# bandwidth per rank. Device profiles pass calibrated numbers.
ALPHA_SECONDS = 5e-6
BANDWIDTH_BYTES_PER_S = 25e9


class StepKind(StrEnum):
    """What one redistribution step does: a collective (named as MindSpore and CommTrace name
    them) or a local operation. Members compare equal to their values
    (``StepKind.SLICE == "Slice"``)."""

    SLICE = "Slice"             # local: keep a sub-block of the shard
    ZERO = "Zero"               # local: zero all but one replica of a value becoming partial
    ALL_GATHER = "AllGather"
    ALL_TO_ALL = "AllToAll"
    ALL_TO_ALL_V = "AllToAllV"  # the direct exchange (simpar.comm.all_to_all_v)
    REDUCE_SCATTER = "ReduceScatter"
    ALL_REDUCE = "AllReduce"

    @property
    def local(self) -> bool:
        """True for steps that move nothing between ranks."""
        return _LOCAL[self]

    @property
    def adjoint(self) -> StepKind:
        """The step that runs this one backwards (AllGather's is a ReduceScatter)."""
        return _ADJOINT[self]

    @property
    def facts(self) -> CollectiveKind:
        """This kind's row of :data:`KINDS`."""
        return KINDS[self.value]


#: The keyword arguments a step's collective takes from the step (its ``tensor_dim``,
#: ``concat_dim``, ``gather_dims``), forwards or backwards.
Arguments = Callable[[Any], Mapping[str, int]]


def _none(step: Any) -> Mapping[str, int]:
    return {}


@dataclass(frozen=True, slots=True)
class CollectiveKind:
    """One kind of collective and what every module reads of it.

    ``name``: CommTrace's kind, and the key cost models price it by. ``function``: the
    :mod:`simpar.comm` function that runs it ("" for a local step). ``adjoint``: the kind
    that runs it backwards ("" for none). ``ring``: its traffic is ``ring[0] (p-1) n``,
    divided by ``p`` when ``ring[1]`` (None: not one formula for every rank, see
    :meth:`traffic`). ``rounds``: its latency rounds over ``p`` ranks. ``by_pieces``: a
    caller prices it on the bytes a rank receives, not its local buffer (the direct exchange).
    ``result``: the elements of its result for a local buffer of ``n`` over ``p`` ranks.
    ``in_place``: it can write its result into its input (an AllReduce sums into it).
    ``arguments``/``adjoint_arguments``: what a redistribution step passes the collective of
    ``function`` (forwards) or of ``adjoint``'s (backwards).
    """

    name: str
    function: str
    adjoint: str
    ring: tuple[int, bool] | None
    rounds: Callable[[int], int]
    local: bool = False
    by_pieces: bool = False
    in_place: bool = False
    result: Callable[[int, int], int] = lambda p, n: n
    arguments: Arguments = _none
    adjoint_arguments: Arguments = _none

    def traffic(self, p: int, n: int) -> int:
        """Bytes (or elements) one rank of ``p`` receives for a local buffer of ``n``; for a
        kind without a formula for every rank (the direct exchange: its pieces; Broadcast:
        the root sends ``(p-1) n``, the others receive ``n``) that is ``n``, what the caller
        counted."""
        if self.local:
            return 0
        if self.ring is None:
            return n
        factor, shared = self.ring
        others = p - 1
        moved = factor * others * n
        return moved // p if shared else moved

    def __str__(self) -> str:
        return self.name


def _ring(factor: int) -> Callable[[int], int]:
    """``factor`` passes around a ring of ``p >= 1``: ``factor * (p - 1)`` rounds."""
    return lambda p: factor * (p - 1)


def _tree(p: int) -> int:
    return max(1, math.ceil(math.log2(max(2, p))))


def _axis(step: Any) -> Mapping[str, int]:
    return {"axis": step.tensor_dim}


def _gather_axis(step: Any) -> Mapping[str, int]:
    return {"axis": step.gather_dims[0][0]}


def _split_concat(step: Any) -> Mapping[str, int]:
    return {"split_axis": step.tensor_dim, "concat_axis": step.concat_dim}


def _concat_split(step: Any) -> Mapping[str, int]:
    return {"split_axis": step.concat_dim, "concat_axis": step.tensor_dim}


#: Every kind, by name.
KINDS: Mapping[str, CollectiveKind] = {k.name: k for k in (
    CollectiveKind("AllReduce", "all_reduce", "AllReduce", (2, True), _ring(2), in_place=True),
    CollectiveKind("AllGather", "all_gather", "ReduceScatter", (1, False), _ring(1),
                   result=lambda p, n: p * n, arguments=_gather_axis,
                   adjoint_arguments=_gather_axis),
    CollectiveKind("ReduceScatter", "reduce_scatter", "AllGather", (1, True), _ring(1),
                   result=lambda p, n: n // p, arguments=_axis, adjoint_arguments=_axis),
    CollectiveKind("AllToAll", "all_to_all", "AllToAll", (1, True), _ring(1),
                   arguments=_split_concat, adjoint_arguments=_concat_split),
    CollectiveKind("AllToAllV", "all_to_all_v", "AllToAllV", None, _ring(1), by_pieces=True),
    CollectiveKind("Broadcast", "broadcast", "", None, _tree),
    CollectiveKind("Slice", "", "Slice", None, _ring(0), local=True),
    CollectiveKind("Zero", "", "Zero", None, _ring(0), local=True),
)}

_LOCAL = {k: KINDS[k.value].local for k in StepKind}
_ADJOINT = {k: StepKind(KINDS[k.value].adjoint) for k in StepKind}
_BY_FUNCTION = {k.function: k for k in KINDS.values() if k.function}
#: The kinds whose traffic is one formula for every rank.
_SYMMETRIC = sorted(k.name for k in KINDS.values() if k.ring is not None)


def kind_of(kind: str) -> CollectiveKind:
    """The row of ``kind`` (a :class:`StepKind` or a name such as "Broadcast")."""
    found = KINDS.get(kind)
    if found is None:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    return found


def by_function(function: str) -> CollectiveKind:
    """The row of the kind that ``simpar.comm.<function>`` runs ("all_reduce": AllReduce)."""
    return _BY_FUNCTION[function]


def traffic(kind: str, p: int, n: int) -> int:
    """What one rank of a group of ``p`` sends (and receives) in a ``kind`` collective of a
    local buffer of ``n`` bytes or elements. 8 ranks, 1 MiB AllReduce: 1.75 MiB each way.

    >>> traffic("AllReduce", 8, 2**20) == 2 * 7 * 2**20 // 8
    True
    """
    found = KINDS.get(kind)
    if found is None or found.ring is None:
        raise ValueError(f"traffic: kind must be one of {_SYMMETRIC}, got {kind!r} (an "
                         "AllToAllV's traffic is its pieces')")
    return found.traffic(p, n)


def broadcast_traffic(p: int, n: int) -> tuple[int, int]:
    """(bytes the root sends, bytes every other rank receives) broadcasting ``n`` over ``p``."""
    others = p - 1
    return others * n, KINDS["Broadcast"].traffic(p, n)


def latency_rounds(kind: str, p: int) -> int:
    """Latency rounds of one ``kind`` collective over ``p`` ranks: the table's ``rounds``,
    at least 1 (a local step still costs one launch).

    >>> latency_rounds("AllReduce", 8), latency_rounds("AllGather", 8), latency_rounds("Slice", 8)
    (14, 7, 1)
    """
    return max(1, kind_of(kind).rounds(p))


def seconds(kind: str, p: int, busiest_bytes: int, alpha: float = ALPHA_SECONDS,
            bandwidth: float = BANDWIDTH_BYTES_PER_S) -> float:
    """Alpha-beta time of one collective whose busiest rank moves ``busiest_bytes``."""
    return alpha * latency_rounds(kind, p) + busiest_bytes / bandwidth


def sample_ranks(p: int) -> Sequence[int]:
    """The ranks whose load stands for all of ``p``: every rank up to 64, else 64 spread
    evenly and the last (regular layouts load every rank alike, so this keeps planning linear
    for thousands of devices)."""
    return range(p) if p <= 64 else sorted({(k * p) // 64 for k in range(64)} | {p - 1})
