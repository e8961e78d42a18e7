"""MindSpore's own cost model (the dynamic-programming search's), reproduced term by term.

MindSpore prices a strategy in *bytes of local slices*, not seconds: an operator's computation
is roughly the bytes its kernel reads, its communication the bytes of the tensor a collective
moves. This module and the two beside it reproduce those numbers so that simpar can search,
compare or explain strategies exactly as MindSpore's ``auto_parallel`` would. simpar's own time
model lives in :mod:`simpar.cost.model`; the two are separate on purpose.

Four parts, each with the MindSpore source it follows (``ccsrc`` is
``mindspore/ccsrc/frontend/parallel``); this module exports the names of all four:

1. The context, a :class:`~simpar.cost_model_context.CostModelContext` value that every
   function below takes (``ctx``; left out, the process's ``set_cost_model_context``, for a
   call by hand: a plan request carries its own). Its keys live in
   :mod:`simpar.cost_model_context`.
2. Operator costs and memory, :func:`~simpar.cost.mindspore_ops.op_cost`
   (:mod:`simpar.cost.mindspore_ops`; ``ccsrc/auto_parallel/operator_costmodel.{h,cc}``).
3. The objective, :func:`objective` (``OperatorInfo::SetCostUnderStrategyBase``,
   ``BreakingTiesForPreferringDataParallel``, ``RefineForPracticalCost`` in
   ``auto_parallel/costmodel.cc``, ``CostGraph::SelectCostWithMin{Training,Inference}Time``),
   and a redistribution's, :func:`edge_objective` (``Edge::GetRedistributionCost``).
4. Redistribution costs, :func:`~simpar.cost.mindspore_redistribution.redistribution_cost`
   (:mod:`simpar.cost.mindspore_redistribution`; ``tensor_layout/tensor_redistribution.cc``).

The facts are MindSpore's; the code is not. The cost package sits above :mod:`simpar.ops`
and :mod:`simpar.redistribution` (the collective kinds it prices live below both, in
:mod:`simpar.collective_kinds`), so it imports what it prices directly.

"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from simpar import _checks as checks
from simpar.cost.mindspore_ops import (
    COST_FACTOR,
    DROPOUT_COST_RATE,
    MindSporeOpCost,
    keeps_output,
    mindspore_cost_class,
    op_cost,
)
from simpar.cost.mindspore_redistribution import (
    ALLGATHER_REDUCESCATTER_SCALE_FACTOR,
    ALLTOALL_SCALE_FACTOR,
    STEP_OPERATORS,
    RedistributionCost,
    redistribution_cost,
)
from simpar.cost_model_context import CostModelContext, cost_model_context

__all__ = [
    "ALLGATHER_REDUCESCATTER_SCALE_FACTOR",
    "ALLTOALL_SCALE_FACTOR",
    "COST_FACTOR",
    "DROPOUT_COST_RATE",
    "EPS",
    "STEP_OPERATORS",
    "MindSporeCost",
    "MindSporeOpCost",
    "RedistributionCost",
    "edge_cost",
    "edge_objective",
    "fits",
    "keeps_output",
    "mindspore_cost_class",
    "objective",
    "op_cost",
    "redistribution_cost",
    "refine_communication",
    "strategy_cost",
]

#: ``ops_utils.h``: below this a cost counts as zero (refinement, tie-break).
EPS = 1e-6

# ----------------------------------------------------------------------------------------------
# 3. The objective.


@dataclass(frozen=True, slots=True)
class MindSporeCost:
    """MindSpore's ``Cost`` entry after the tie-break and the practical refinement: what its
    searches add up and compare. ``communication_with_partial_para`` is
    ``without_parameter + gamma * (communication - without_parameter)``;
    ``communication_forward`` is what inference weighs."""

    computation: float
    communication: float
    communication_without_parameter: float
    communication_with_partial_para: float
    communication_forward: float
    memory: float

    def value(self, ctx: CostModelContext | None = None) -> float:
        """``alpha * computation + beta * communication_with_partial_para`` when training,
        ``alpha * computation + beta * communication_forward`` for inference
        (``SelectCostWithMinTrainingTime`` / ``SelectCostWithMinInferenceTime``)."""
        c = cost_model_context() if ctx is None else ctx
        comm = self.communication_with_partial_para if c.training else self.communication_forward
        return c.costmodel_alpha * self.computation + c.costmodel_beta * comm


def refine_communication(c: float, ctx: CostModelContext | None = None) -> float:
    """MindSpore's practical refinement of one communication cost: a cost in
    ``(EPS, threshold]`` becomes ``communi_const``, a larger one gains ``communi_bias``.

    >>> refine_communication(0.0), refine_communication(2048.0), refine_communication(4096.0)
    (0.0, 3072.0, 5120.0)
    """
    k = cost_model_context() if ctx is None else ctx
    if EPS < c <= k.costmodel_communi_threshold:
        return k.costmodel_communi_const
    if c > k.costmodel_communi_threshold:
        return c + k.costmodel_communi_bias
    return c


def strategy_cost(cost: MindSporeOpCost, strategy: Sequence[Sequence[int]], device_num: int,
                  ctx: CostModelContext | None = None) -> MindSporeCost:
    """The ``Cost`` MindSpore records for an operator's strategy (``SetCostUnderStrategyBase``).

    1. computation = forward computation; communication = forward + backward;
       without_parameter = forward; with_partial_para = forward + gamma * backward.
    2. Tie-break toward data parallelism: when ``strategy[0][0] == device_num``, 1.0 is taken
       from each of these four that exceeds 1.0.
    3. Refinement (``RefineForPracticalCost``, operator case): only the forward communication
       is refined; the backward (parameter) part is kept, and communication and
       with_partial_para are rebuilt from the refined forward (when they exceed EPS).

    Memory is the training or inference memory per ``run_phase``.

    >>> c = MindSporeOpCost("MatMul", "MatMulCost", 3072.0, 2048.0, 0.0, 2048.0, 0.0, 512.0)
    >>> s = strategy_cost(c, ((8, 1), (1, 1)), 8)
    >>> s.computation, s.communication, s.communication_with_partial_para
    (3071.0, 2047.0, 2.047)
    """
    k = cost_model_context() if ctx is None else ctx
    _check_device_num("strategy_cost", device_num)
    comp = cost.computation
    comm = cost.communication
    without = cost.communication_without_parameter
    partial = without + k.costmodel_gamma * (comm - without)
    if strategy and strategy[0] and strategy[0][0] == device_num:
        comp, comm, partial, without = (x - 1.0 if x > 1.0 else x
                                        for x in (comp, comm, partial, without))
    backward = comm - without if abs(comm - without) > EPS else 0.0
    without = refine_communication(without, k)
    if comm > EPS:
        comm = without + backward
    if partial > EPS:
        partial = without + k.costmodel_gamma * backward
    memory = cost.memory if k.training else cost.inference_memory
    return MindSporeCost(comp, comm, without, partial, without, memory)


def objective(cost: MindSporeOpCost, strategy: Sequence[Sequence[int]], device_num: int,
              ctx: CostModelContext | None = None) -> float:
    """The number MindSpore's search minimises for one operator's strategy.

    Training (``run_phase`` 0):
    ``alpha * computation + beta * (without_parameter + gamma * (communication -
    without_parameter))``, inference: ``alpha * computation + beta * forward communication``,
    both on the tie-broken, refined values of :func:`strategy_cost`.

    The MatMul of :func:`op_cost` (k split, B a replicated Parameter): computation 3584,
    forward 2048 (refined to the constant 3072), backward 512, so
    ``3584 + 400 * (3072 + 0.001 * 512)``:

    >>> c = MindSporeOpCost("MatMul", "MatMulCost", 3584.0, 512.0, 2048.0, 512.0, 1536.0, 0.0)
    >>> round(objective(c, ((2, 4), (4, 1)), 8), 3)
    1232588.8
    """
    return strategy_cost(cost, strategy, device_num, ctx).value(ctx)


def fits(cost: MindSporeOpCost | MindSporeCost | float, ctx: CostModelContext | None = None
         ) -> bool:
    """Whether ``cost``'s memory is within ``device_memory_capacity`` (MindSpore keeps only
    such costs, and fails with "No available cost" when none is left). For an op cost the
    training or inference memory is used, per ``run_phase``; a number is a memory in bytes.

    >>> fits(2.0 ** 34), fits(2.0 ** 34 + 1)
    (True, False)
    """
    k = cost_model_context() if ctx is None else ctx
    if isinstance(cost, MindSporeOpCost):
        memory = cost.memory if k.training else cost.inference_memory
    elif isinstance(cost, MindSporeCost):
        memory = cost.memory
    else:
        memory = float(cost)
    return memory <= k.device_memory_capacity


def _check_device_num(func: str, device_num: object) -> None:
    checks.positive_int(device_num, "device_num", where=func)


def edge_cost(cost: RedistributionCost, ctx: CostModelContext | None = None) -> MindSporeCost:
    """The ``Cost`` MindSpore records for a redistribution (``Edge::InitNotIdentityEdgeCost``):
    forward and backward are refined separately, communication is their sum, and all of it
    counts fully (gamma does not apply to redistribution). Memory is not modelled (0).

    >>> edge_cost(RedistributionCost(1000.0, 4096.0, 10.0)).communication
    8192.0
    """
    k = cost_model_context() if ctx is None else ctx
    fwd = refine_communication(cost.forward, k)
    bwd = refine_communication(cost.backward, k)
    comm = fwd + bwd
    return MindSporeCost(cost.computation, comm, comm, comm, fwd, 0.0)


def edge_objective(cost: RedistributionCost, ctx: CostModelContext | None = None) -> float:
    """The objective of one redistribution: ``alpha * computation + beta * (refined forward +
    refined backward)`` when training, ``alpha * computation + beta * refined forward`` for
    inference.

    >>> edge_objective(RedistributionCost(1000.0, 4096.0, 10.0))
    3276810.0
    """
    return edge_cost(cost, ctx).value(ctx)
