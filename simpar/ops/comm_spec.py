"""An op's own collectives: described without running them (:class:`CommSpec`), listed for a
redistribution plan (:func:`plan_comm`), and run mid-kernel through what the runtime hands
the kernel (:class:`Collectives`).

simpar.ops does not run collectives: a kernel that needs one (the split statistics of
Softmax and LayerNorm, ReduceMax over a split axis, the vocabulary-parallel cross entropy)
calls the :class:`Collectives` its ``local_forward``/``local_backward`` is given, which
:mod:`simpar.runtime` implements over :mod:`simpar.comm`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import numpy as np

from simpar.collective_kinds import traffic
from simpar.cotangent import Action
from simpar.mesh import DeviceMesh
from simpar.redistribution import LOCAL_KINDS, RedistributionPlan, Step, StepKind

__all__ = ["ONE_DEVICE", "CommSpec", "Collectives", "action_comm", "plan_comm"]


@dataclass(frozen=True, slots=True)
class CommSpec:
    """One collective an op runs, described without running it.

    ``device_axes`` index ``device_matrix`` from the left; rank r's group is
    ``DeviceMesh(device_matrix).group_of(r, device_axes)``. ``elements`` is the local input
    buffer of the collective (per rank), ``step`` the redistribution step when it is one (run
    backwards when ``adjoint``), ``how`` an AllReduce's reduction ("sum" or "max").
    """

    kind: StepKind
    device_matrix: tuple[int, ...]
    device_axes: tuple[int, ...]
    elements: int
    reason: str = ""
    step: Step | None = None
    on_output: bool = False  # the buffer has the output's dtype (else the input's)
    how: str = "sum"
    adjoint: bool = False

    @classmethod
    def from_step(cls, step: Step, reason: str, on_output: bool = False) -> CommSpec:
        return cls(step.kind, step.src.device_matrix, step.device_axes, step.src.local_size(),
                   reason, step, on_output)

    @classmethod
    def adjoint_of(cls, step: Step, reason: str, on_output: bool = False) -> CommSpec:
        """The collective that runs ``step`` backwards (AllGather's is a ReduceScatter); its
        input buffer is the size of the step's output shard."""
        return cls(step.kind.adjoint, step.src.device_matrix, step.device_axes,
                   step.dst.local_size(), reason, step, on_output, adjoint=True)

    def __str__(self) -> str:
        axes = f" over device axes {list(self.device_axes)} of {list(self.device_matrix)}"
        return f"{self.kind}({self.how}){axes}: {self.reason}" if self.how != "sum" else \
            f"{self.kind}{axes}: {self.reason}"

    @property
    def runs(self) -> object:
        """What the executor announces to :mod:`simpar.schedule` when it runs this collective:
        the redistribution step, or this spec for an op's own collective."""
        return self if self.step is None else self.step

    def group(self, rank: int) -> tuple[int, ...]:
        """``rank``'s group: the ranks this collective runs over with it."""
        return _group(self.device_matrix, self.device_axes, rank)

    def groups(self) -> list[tuple[int, ...]]:
        if not self.device_axes:
            return [tuple(range(math.prod(self.device_matrix)))]
        return DeviceMesh(self.device_matrix).groups(self.device_axes)

    def recv_bytes(self, rank: int, itemsize: int) -> int:
        """Bytes ``rank`` receives, by CommTrace's convention."""
        if self.step is not None:
            # A step's adjoint receives what the step sends (AllGather's ReduceScatter, the
            # reverse direct exchange).
            return (self.step.send_bytes(rank, itemsize) if self.adjoint
                    else self.step.recv_bytes(rank, itemsize))
        return traffic(self.kind, len(self.group(rank)), self.elements * itemsize)

    def describe(self, rank: int, in_itemsize: int, out_itemsize: int) -> dict[str, Any]:
        itemsize = out_itemsize if self.on_output else in_itemsize
        return {"op": str(self.kind), "group": list(self.group(rank)),
                "groups": [list(g) for g in self.groups()],
                "bytes": self.recv_bytes(rank, itemsize), "reason": self.reason}


@lru_cache(maxsize=1 << 16)
def _group(device_matrix: tuple[int, ...], device_axes: tuple[int, ...], rank: int
           ) -> tuple[int, ...]:
    """:meth:`CommSpec.group`, worked out once per (device matrix, axes, rank): a cost model
    asks it of every candidate's collectives."""
    if not device_axes:
        return tuple(range(math.prod(device_matrix)))
    return DeviceMesh(device_matrix).group_of(rank, device_axes)


def plan_comm(p: RedistributionPlan, reason: str, on_output: bool) -> list[CommSpec]:
    """The collectives of plan ``p`` (its local steps cost nothing and are left out)."""
    return [CommSpec.from_step(s, reason, on_output) for s in p.steps
            if s.kind not in LOCAL_KINDS]


def action_comm(actions: Sequence[Action], reason: str, on_output: bool) -> list[CommSpec]:
    """The collectives of planned backward actions (:mod:`simpar.cotangent`), in order: a
    step's adjoint, or the step itself (its local ones cost nothing and are left out)."""
    return [CommSpec.adjoint_of(a.step, reason, on_output) if a.adjoint
            else CommSpec.from_step(a.step, reason, on_output)
            for a in actions if not a.local]


class Collectives(Protocol):
    """What a kernel asks of the runtime on its rank: which rank it is among the op's
    devices (``rank``: 0 when the op runs on one device), and one of the op's own
    collectives (an entry of ``internal_forward`` or ``internal_backward``) run on this
    rank's array, ``what`` naming it in the trace. On rank 5 of a Softmax split 4 ways
    along its axis on 8 devices, ``all_reduce(spec, row_max, "max")`` gives the maximum
    over ranks 4..7."""

    @property
    def rank(self) -> int: ...

    def all_reduce(self, spec: CommSpec, x: np.ndarray, what: str) -> np.ndarray: ...


class _OneDevice:
    """:class:`Collectives` of a kernel called on its own (the default): rank 0, and no
    collective but over a group of one."""

    rank = 0

    def all_reduce(self, spec: CommSpec, x: np.ndarray, what: str) -> np.ndarray:
        if len(spec.group(0)) > 1:
            raise ValueError(f"{what}: {spec} needs the ranks of its group; run the op "
                             "through simpar.runtime (run_op, a lowered program), which "
                             "hands its kernels their collectives")
        return x


#: The collectives of a kernel called outside the runtime (one device).
ONE_DEVICE: Collectives = _OneDevice()
