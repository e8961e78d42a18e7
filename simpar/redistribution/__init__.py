"""Move a tensor from one layout to another with the fewest bytes, over real MPI.

:func:`plan` is pure (no MPI): it turns ``(src, dst)`` into a short list of :class:`Step` s, each
one collective or one local operation. :func:`execute` runs a plan on this rank's shard.

* :mod:`~simpar.redistribution.step`: the values, :class:`Step` and
  :class:`RedistributionPlan`, and what each moves;
* :mod:`~simpar.redistribution.refine`: layouts over a common refinement of their device
  matrices;
* :mod:`~simpar.redistribution.planner`: :func:`plan` and the lower bound :func:`min_bytes`;
* :mod:`~simpar.redistribution.exchange`: the direct exchange's routes;
* :mod:`~simpar.redistribution.execute`: :func:`execute`, :func:`execute_adjoint`,
  :func:`execute_step` and :func:`bind_step`, one record per kind of step.

A step's kind (:class:`StepKind`) and what it costs come from
:mod:`simpar.collective_kinds`.

>>> from simpar.layout import TensorLayout
>>> src = TensorLayout((8,), (0, -1), (2048, 2048))   # S(0)
>>> dst = TensorLayout((8,), (-1, 0), (2048, 2048))   # S(1)
>>> print(plan(src, dst))                              # doctest: +SKIP
[8]:[0,-1] [2048, 2048] -> [8]:[-1,0] [2048, 2048]
  AllToAll axes=(0,) split=1 concat=0  recv/rank 1835008 el
"""

from simpar.redistribution.execute import (
    Comm,
    bind_step,
    execute,
    execute_adjoint,
    execute_step,
)
from simpar.redistribution.planner import min_bytes, plan
from simpar.redistribution.refine import common_refinement, refine
from simpar.redistribution.step import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    ALL_TO_ALL_V,
    LOCAL_KINDS,
    REDUCE_SCATTER,
    SLICE,
    ZERO,
    RedistributionPlan,
    Step,
    StepKind,
)

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "ALL_TO_ALL_V",
    "LOCAL_KINDS",
    "REDUCE_SCATTER",
    "SLICE",
    "ZERO",
    "Comm",
    "RedistributionPlan",
    "Step",
    "StepKind",
    "bind_step",
    "common_refinement",
    "execute",
    "execute_adjoint",
    "execute_step",
    "min_bytes",
    "plan",
    "refine",
]
