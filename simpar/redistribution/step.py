"""A redistribution plan's values: :class:`Step` (one collective or one local operation) and
:class:`RedistributionPlan` (the steps from one layout to another), with what each moves.

A step's traffic, latency and adjoint come from its kind's row of
:data:`simpar.collective_kinds.KINDS`; the direct exchange counts its own pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simpar.collective_kinds import (
    ALPHA_SECONDS,
    BANDWIDTH_BYTES_PER_S,
    KINDS,
    StepKind,
    sample_ranks,
    seconds,
)
from simpar.layout import TensorLayout
from simpar.redistribution.exchange import exchange, held

__all__ = ["ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "ALL_TO_ALL_V", "LOCAL_KINDS",
           "REDUCE_SCATTER", "SLICE", "ZERO", "RedistributionPlan", "Step", "StepKind"]

SLICE, ZERO = StepKind.SLICE, StepKind.ZERO
ALL_GATHER, ALL_TO_ALL, ALL_TO_ALL_V = (StepKind.ALL_GATHER, StepKind.ALL_TO_ALL,
                                        StepKind.ALL_TO_ALL_V)
REDUCE_SCATTER, ALL_REDUCE = StepKind.REDUCE_SCATTER, StepKind.ALL_REDUCE
#: Kinds that cost nothing on the network.
LOCAL_KINDS = tuple(k for k in StepKind if k.local)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a plan: ``src`` becomes ``dst`` by one collective or one local operation.

    ``device_axes`` are the axes (of the refined device matrix, counted from the left) along
    which the collective's groups run; a rank's group is ``mesh.group_of(rank, device_axes)``.
    ``tensor_dim`` is the dimension scattered (ReduceScatter), split (AllToAll) or gathered
    (AllGather, several dims possible: ``gather_dims``); ``concat_dim`` is AllToAll's other side.
    """

    kind: StepKind
    src: TensorLayout
    dst: TensorLayout
    device_axes: tuple[int, ...] = ()
    tensor_dim: int = -1
    concat_dim: int = -1
    gather_dims: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StepKind(self.kind))  # "AllGather" is accepted too

    @property
    def group_size(self) -> int:
        return math.prod(self.src.device_matrix[a] for a in self.device_axes)

    def recv_elements(self, rank: int) -> int:
        """Elements this rank receives from other ranks in this step."""
        facts = KINDS[self.kind]
        if facts.by_pieces:
            # The direct exchange receives exactly the missing elements (min_bytes).
            return self.dst.local_size() - held(self.src, self.dst, rank)
        return facts.traffic(self.group_size, self.src.local_size())

    def send_elements(self, rank: int) -> int:
        """Elements this rank sends to other ranks in this step."""
        if KINDS[self.kind].by_pieces:
            return exchange(self.src, self.dst).send_elements(rank)
        return self.recv_elements(rank)

    def recv_bytes(self, rank: int, itemsize: int) -> int:
        """Bytes this rank receives, as CommTrace counts them: traffic is rounded in bytes,
        not in elements (an AllReduce of 1 int64 over 8 ranks is 14 bytes)."""
        facts = KINDS[self.kind]
        if facts.by_pieces:
            return itemsize * self.recv_elements(rank)
        return facts.traffic(self.group_size, self.src.local_size() * itemsize)

    def send_bytes(self, rank: int, itemsize: int) -> int:
        if KINDS[self.kind].by_pieces:
            return itemsize * self.send_elements(rank)
        return self.recv_bytes(rank, itemsize)

    def seconds(self, itemsize: int, alpha: float = ALPHA_SECONDS,
                bandwidth: float = BANDWIDTH_BYTES_PER_S) -> float:
        """Estimated time: latency per round plus the busiest rank's bytes over bandwidth."""
        if self.kind.local:
            return 0.0
        if not KINDS[self.kind].by_pieces:  # a collective: alike on every rank
            busiest = self.recv_elements(0)
        else:
            busiest = max(max(self.recv_elements(r), self.send_elements(r))
                          for r in sample_ranks(self.src.device_num))
        return seconds(self.kind, self.group_size, busiest * itemsize, alpha, bandwidth)

    def __str__(self) -> str:
        extra = ""
        if self.kind == ALL_TO_ALL:
            extra = f" split={self.tensor_dim} concat={self.concat_dim}"
        elif self.kind == REDUCE_SCATTER:
            extra = f" dim={self.tensor_dim}"
        elif self.kind == ALL_GATHER:
            extra = " dims=" + ",".join(str(d) for d, _ in self.gather_dims)
        axes = f" axes={self.device_axes}" if self.device_axes else ""
        recv = "" if self.kind.local else f"  recv/rank<= {self.max_recv_elements()} el"
        return f"{self.kind}{axes}{extra} -> {self.dst}{recv}"

    def max_recv_elements(self) -> int:
        if not KINDS[self.kind].by_pieces:  # a collective: alike on every rank
            return self.recv_elements(0)
        return max(self.recv_elements(r) for r in sample_ranks(self.src.device_num))


@dataclass(frozen=True, slots=True)
class RedistributionPlan:
    """The steps that turn a shard in layout ``src`` into a shard in layout ``dst``."""

    src: TensorLayout
    dst: TensorLayout
    steps: tuple[Step, ...]
    enable_alltoall: bool = False

    def recv_bytes(self, rank: int, itemsize: int) -> int:
        """Bytes ``rank`` receives from others over the whole plan."""
        return sum(s.recv_bytes(rank, itemsize) for s in self.steps)

    def send_bytes(self, rank: int, itemsize: int) -> int:
        return sum(s.send_bytes(rank, itemsize) for s in self.steps)

    def busiest_bytes(self, itemsize: int, sent: bool = False) -> int:
        """The most bytes a rank receives over the plan (plus sends, if ``sent``), over
        :func:`sample_ranks`. A collective moves as many bytes on every rank, so only a plan
        with a direct exchange is asked rank by rank."""
        if not any(KINDS[s.kind].by_pieces for s in self.steps):
            return self.recv_bytes(0, itemsize) * (2 if sent else 1)
        return max(self.recv_bytes(r, itemsize) + (self.send_bytes(r, itemsize) if sent else 0)
                   for r in sample_ranks(self.src.device_num))

    def seconds(self, itemsize: int, alpha: float = ALPHA_SECONDS,
                bandwidth: float = BANDWIDTH_BYTES_PER_S) -> float:
        return sum(s.seconds(itemsize, alpha, bandwidth) for s in self.steps)

    def collectives(self) -> list[Step]:
        """The steps that communicate."""
        return [s for s in self.steps if not s.kind.local]

    def kinds(self) -> list[str]:
        return [str(s.kind) for s in self.steps]

    def __len__(self) -> int:
        return len(self.steps)

    def __str__(self) -> str:
        head = f"{self.src} -> {self.dst}"
        if not self.steps:
            return head + "\n  (nothing to do)"
        return head + "".join(f"\n  {s}" for s in self.steps)


