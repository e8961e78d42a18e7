"""MindSpore's cost of a redistribution, reproduced term by term: what simpar's planned steps
would cost as the operators MindSpore's own redistribution runs, in bytes of local slices
(``ccsrc/frontend/parallel/tensor_layout/tensor_redistribution.cc``: ``ComputeCost``,
``ComputePermuteCost``, ``ComputeConcatCost``; ``redistribution_operator_infer.cc``).
The refined cost and objective of an edge are :func:`simpar.cost.mindspore.edge_cost` and
:func:`~simpar.cost.mindspore.edge_objective`.

Redistribution: simpar's step kinds and MindSpore's operators
-------------------------------------------------------------

With ``n`` the elements of the slice entering a step and ``d`` the devices it spans
(:data:`STEP_OPERATORS`), forward communication / backward communication / computation:

* Slice: SplitByAxis (StridedSlice), one per newly split dim, each on the slice as it is
  then: 0 / 0 / ``n`` per split dim.
* AllGather: ConcatByAxis, one per gathered dim: AllGather, plus Split and Concat when the dim
  is not 0: ``0.5 n d`` / ``0.5 n`` / ``n`` on dim 0, else ``n + 2 n d``.
* AllToAll: PermuteByAxis (AlltoAll): ``2 n`` / ``2 n`` / ``n`` when the gathered (concat) dim
  is 0, else ``n + 2 n d``.
* AllToAllV (simpar's direct exchange) has no MindSpore twin; it is charged as a
  PermuteByAxis without the split and concat: ``2 n`` / ``2 n`` / ``n``.
* AllReduce and ReduceScatter resolve pending sums, which MindSpore never redistributes: it
  charges them inside the operator that made them (MatMulCost, ReduceSumCost: the output slice
  in forward communication and in computation). simpar charges a plan's step the same way,
  with ``m`` the elements of its output slice: ``m`` / 0 / ``m``.
* Zero (simpar's local zeroing of all but one replica) has no MindSpore twin and is free.

Without ``enable_alltoall`` MindSpore turns a permute into ConcatByAxis + SplitByAxis, and
simpar's planner into AllGather + Slice, so charging simpar's steps one by one gives
MindSpore's number in both modes. The factors 2.0 and 0.5 are ``ALLTOALL_SCALE_FACTOR`` and
``ALLGATHER_REDUCESCATTER_SCALE_FACTOR``. Every term is multiplied by the element size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

from simpar import _checks as checks
from simpar.redistribution import RedistributionPlan, Step

__all__ = [
    "ALLGATHER_REDUCESCATTER_SCALE_FACTOR",
    "ALLTOALL_SCALE_FACTOR",
    "STEP_OPERATORS",
    "RedistributionCost",
    "redistribution_cost",
]

#: ``tensor_redistribution.h``: an AlltoAll is charged as twice its input slice.
ALLTOALL_SCALE_FACTOR = 2.0
#: ``tensor_redistribution.h``: an AllGather / ReduceScatter as half of its output slice.
ALLGATHER_REDUCESCATTER_SCALE_FACTOR = 0.5


def _check_itemsize(func: str, itemsize: object) -> int:
    return checks.positive_int(itemsize, "itemsize", " (bytes per element)", func)


class RedistributionCost(NamedTuple):
    """A redistribution's MindSpore costs in bytes: ``(forward, backward, computation)``."""

    forward: float
    backward: float
    computation: float


_StepTerms = tuple[float, float, float]  # elements: forward, backward, computation


def _slice(step: Step) -> _StepTerms:
    n, comp = step.src.local_size(), 0.0
    for before, after in zip(step.src.cuts, step.dst.cuts):
        if after > before:  # one SplitByAxis per dim, each on the slice as it is then
            comp += n
            n //= after // before
    return 0.0, 0.0, comp


def _all_gather(step: Step) -> _StepTerms:
    dm = step.src.device_matrix
    n = float(step.src.local_size())
    fwd = bwd = comp = 0.0
    for tensor_dim, axes in sorted(step.gather_dims):  # one ConcatByAxis per dim
        d = math.prod(dm[a] for a in axes)
        fwd += ALLGATHER_REDUCESCATTER_SCALE_FACTOR * n * d
        bwd += ALLGATHER_REDUCESCATTER_SCALE_FACTOR * n
        comp += n if tensor_dim == 0 else n + 2 * n * d
        n *= d
    return fwd, bwd, comp


def _all_to_all(step: Step) -> _StepTerms:
    n = float(step.src.local_size())
    comp = n if step.concat_dim == 0 else n + 2 * n * step.group_size
    return ALLTOALL_SCALE_FACTOR * n, ALLTOALL_SCALE_FACTOR * n, comp


def _all_to_all_v(step: Step) -> _StepTerms:
    n = float(step.src.local_size())
    return ALLTOALL_SCALE_FACTOR * n, ALLTOALL_SCALE_FACTOR * n, n


def _reduce_scatter(step: Step) -> _StepTerms:
    m = float(step.dst.local_size())
    return m, 0.0, m


def _all_reduce(step: Step) -> _StepTerms:
    n = float(step.src.local_size())
    return n, 0.0, n


def _zero(step: Step) -> _StepTerms:
    return 0.0, 0.0, 0.0


#: simpar's step kinds (the values of :class:`simpar.redistribution.StepKind`) and the
#: MindSpore operator each is charged as.
STEP_OPERATORS: Mapping[str, str] = {
    "Slice": "SplitByAxis (StridedSlice), once per newly split dim",
    "AllGather": "ConcatByAxis (AllGather, plus Split and Concat off dim 0), once per dim",
    "AllToAll": "PermuteByAxis (AlltoAll)",
    "AllToAllV": "no MindSpore twin; charged as PermuteByAxis without split/concat",
    "ReduceScatter": "no twin in a redistribution; charged as an operator's ReduceScatter",
    "AllReduce": "no twin in a redistribution; charged as an operator's AllReduce",
    "Zero": "no MindSpore twin; free",
}

_STEP_RULES: dict[str, Callable[[Step], _StepTerms]] = {
    "Slice": _slice, "AllGather": _all_gather, "AllToAll": _all_to_all,
    "AllToAllV": _all_to_all_v, "ReduceScatter": _reduce_scatter, "AllReduce": _all_reduce,
    "Zero": _zero,
}


def redistribution_cost(plan: RedistributionPlan, itemsize: int = 4) -> RedistributionCost:
    """MindSpore's ``(forward communication, backward communication, computation)`` of a plan,
    in bytes, before refinement (``TensorRedistribution::ComputeCost`` times the type length).

    S(0) -> S(1) of a (2048, 2048) float32 tensor on 8 devices; each rank holds n = 256 x 2048
    elements. With AlltoAll: 2n forward and backward, computation n. Without it (MindSpore's
    default): an AllGather of dim 0 (0.5 n 8 forward, 0.5 n backward, n computation) and a
    StridedSlice of the whole tensor (8 n computation):

    >>> from simpar.layout import TensorLayout
    >>> from simpar.redistribution import plan
    >>> s0 = TensorLayout((8,), (0, -1), (2048, 2048))
    >>> s1 = TensorLayout((8,), (-1, 0), (2048, 2048))
    >>> redistribution_cost(plan(s0, s1, enable_alltoall=True))
    RedistributionCost(forward=4194304.0, backward=4194304.0, computation=2097152.0)
    >>> redistribution_cost(plan(s0, s1))
    RedistributionCost(forward=8388608.0, backward=1048576.0, computation=18874368.0)
    """
    size = _check_itemsize("redistribution_cost", itemsize)
    fwd = bwd = comp = 0.0
    for step in plan.steps:
        kind = str(step.kind)
        if kind not in _STEP_RULES:
            raise ValueError(f"redistribution_cost: step kind {kind!r} has no MindSpore charge; "
                             f"known kinds are {', '.join(_STEP_RULES)}")
        f, b, c = _STEP_RULES[kind](step)
        fwd, bwd, comp = fwd + f, bwd + b, comp + c
    return RedistributionCost(fwd * size, bwd * size, comp * size)
