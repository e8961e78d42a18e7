"""A collective's traffic and its alpha-beta time: the one place simpar writes them down.

Traffic follows CommTrace's convention (``simpar/comm/trace.py``): what one rank exchanges with
the *other* ranks of a group of ``p`` in the bandwidth-optimal (ring) algorithm, for a local
buffer of ``n`` (bytes or elements alike):

============== ==================
AllReduce      ``2 (p-1)/p n``
AllGather      ``(p-1) n``
ReduceScatter  ``(p-1)/p n``
AllToAll       ``(p-1)/p n``
============== ==================

Time is ``alpha * rounds + busiest rank's bytes / bandwidth``: ``ceil(log2 p)`` latency rounds
for the tree-shaped collectives, ``p - 1`` for a pairwise exchange (AllToAllV). Everything
that predicts communication (the redistribution planner, op sharding rules, the planners'
tie-breaks) calls these functions; the collectives in ``simpar.comm`` record traffic with them.

A leaf module: it imports nothing from simpar, so every layer may use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ALPHA_SECONDS", "BANDWIDTH_BYTES_PER_S", "broadcast_traffic", "latency_rounds",
           "sample_ranks", "seconds", "traffic"]

# Default link model (one Ascend 910 HCCS link, roughly): latency per collective round and
# bandwidth per rank. Device profiles will pass calibrated numbers.
ALPHA_SECONDS = 5e-6
BANDWIDTH_BYTES_PER_S = 25e9

_RING = {"AllReduce": (2, True), "AllGather": (1, False), "ReduceScatter": (1, True),
         "AllToAll": (1, True)}


def traffic(kind: str, p: int, n: int) -> int:
    """What one rank of a group of ``p`` sends (and receives) in a ``kind`` collective of a
    local buffer of ``n`` bytes or elements. 8 ranks, 1 MiB AllReduce: 1.75 MiB each way.

    >>> traffic("AllReduce", 8, 2**20) == 2 * 7 * 2**20 // 8
    True
    """
    if kind not in _RING:
        raise ValueError(f"traffic: kind must be one of {sorted(_RING)}, got {kind!r} (an "
                         "AllToAllV's traffic is its pieces')")
    factor, per_rank = _RING[kind]
    return factor * (p - 1) * n // p if per_rank else factor * (p - 1) * n


def broadcast_traffic(p: int, n: int) -> tuple[int, int]:
    """(bytes the root sends, bytes every other rank receives) broadcasting ``n`` over ``p``."""
    return (p - 1) * n, n


def latency_rounds(kind: str, p: int) -> int:
    """Latency rounds of one ``kind`` collective over ``p`` ranks (at least 1)."""
    if kind == "AllToAllV":
        return max(1, p - 1)
    return max(1, math.ceil(math.log2(max(2, p))))


def seconds(kind: str, p: int, busiest_bytes: int, alpha: float = ALPHA_SECONDS,
            bandwidth: float = BANDWIDTH_BYTES_PER_S) -> float:
    """Alpha-beta time of one collective whose busiest rank moves ``busiest_bytes``."""
    return alpha * latency_rounds(kind, p) + busiest_bytes / bandwidth


def sample_ranks(p: int) -> Sequence[int]:
    """The ranks whose load stands for all of ``p``: every rank up to 64, else 64 spread
    evenly and the last (regular layouts load every rank alike, so this keeps planning linear
    for thousands of devices)."""
    return range(p) if p <= 64 else sorted({(k * p) // 64 for k in range(64)} | {p - 1})
