"""MindSpore's own cost model (the dynamic-programming search's), reproduced term by term.

MindSpore prices a strategy in *bytes of local slices*, not seconds: an operator's computation
is roughly the bytes its kernel reads, its communication the bytes of the tensor a collective
moves. This module and the two beside it reproduce those numbers so that simpar can search,
compare or explain strategies exactly as MindSpore's ``auto_parallel`` would. simpar's own time
model lives in :mod:`simpar.cost.model`; the two are separate on purpose.

Four parts, each with the MindSpore source it follows (``ccsrc`` is
``mindspore/ccsrc/frontend/parallel``); this module exports the names of all four:

1. The context, :func:`set_cost_model_context` / :func:`get_cost_model_context` /
   :func:`reset_cost_model_context` (``mindspore/parallel/_cost_model_context.py``; defaults in
   ``ccsrc/costmodel_context.{h,cc}`` and ``allreduce_fusion/allreduce_fusion.h``; ranges in
   ``CostModelContext::set_*`` and ``CostGraph::SetDeviceMemoryAndCostParameter``).
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


Context keys (``set_cost_model_context``)
-----------------------------------------

========================================================= =========== =========================
key                                                       default     allowed
========================================================= =========== =========================
device_memory_capacity                                    2**34 (16G) a float in (0, inf)
costmodel_alpha                                           1.0         a float in (0, inf)
costmodel_beta                                            400.0       a float in (0, inf)
costmodel_gamma                                           0.001       a float in [0, 1]
costmodel_communi_threshold                               2048.0      a float in [0, inf)
costmodel_communi_const                                   3072.0      a float in [0, inf)
costmodel_communi_bias                                    1024.0      a float in [0, inf)
run_phase                                                 0           an int in {0, 1}
costmodel_allreduce_fusion_algorithm                      0           an int in {0, 1, 2}
costmodel_allreduce_fusion_times                          0           an int in [0, inf)
costmodel_allreduce_fusion_tail_percent                   0.1         a float in [0, 1)
costmodel_allreduce_fusion_tail_time                      0.1         a float in [0, inf)
costmodel_allreduce_fusion_allreduce_inherent_time        0.1         a float in [0, inf)
costmodel_allreduce_fusion_allreduce_bandwidth            0.1         a float in [0, inf)
costmodel_allreduce_fusion_computation_time_parameter     0.1         a float in [0, inf)
========================================================= =========== =========================

``costmodel_beta`` is MindSpore's Ascend default; MindSpore switches it to 50.0 when the device
target is GPU (``set_costmodel_context_for_device``); simpar has no device target and keeps
400.0. Types are strict, as MindSpore's ``args_type_check`` is: ``costmodel_beta=400`` (an int)
raises ``TypeError``, and a bool is never a number. The allreduce-fusion keys are accepted and
validated but simpar does not fuse AllReduces (a :class:`~simpar.context.NotHonouredWarning`
says so once); MindSpore checks none of their ranges when they are set and silently skips
fusion for values outside them, so the ranges above are simpar's. ``multi_subgraphs`` is not a
key: MindSpore types it in ``set_cost_model_context`` but its setter map does not hold it, so
MindSpore refuses it too.
"""

from __future__ import annotations

import difflib
import math
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

from simpar.context import ContextError, ContextTypeError, NotHonouredWarning
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

__all__ = [
    "ALLGATHER_REDUCESCATTER_SCALE_FACTOR",
    "ALLTOALL_SCALE_FACTOR",
    "COST_FACTOR",
    "DROPOUT_COST_RATE",
    "EPS",
    "STEP_OPERATORS",
    "CostModelContext",
    "MindSporeCost",
    "MindSporeOpCost",
    "RedistributionCost",
    "cost_model_context",
    "edge_cost",
    "edge_objective",
    "fits",
    "get_cost_model_context",
    "keeps_output",
    "mindspore_cost_class",
    "objective",
    "op_cost",
    "redistribution_cost",
    "refine_communication",
    "reset_cost_model_context",
    "set_cost_model_context",
    "strategy_cost",
]

#: ``ops_utils.h``: below this a cost counts as zero (refinement, tie-break).
EPS = 1e-6

_TRAINING, _INFERENCE = 0, 1


# ----------------------------------------------------------------------------------------------
# 1. The context.


@dataclass(frozen=True, slots=True)
class _Key:
    """How one context key is validated: its type, default and allowed values."""

    kind: type  # int or float
    default: float
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[int, ...] = ()
    honoured: bool = True

    def allowed(self) -> str:
        noun = "an int" if self.kind is int else "a float"
        if self.choices:
            return f"{noun} in {{{', '.join(str(c) for c in self.choices)}}}"
        lo, hi = ("(" if self.lo_open else "["), (")" if self.hi_open else "]")
        return f"{noun} in {lo}{_num(self.lo)}, {_num(self.hi)}{hi}"

    def admits(self, x: float) -> bool:
        if self.choices:
            return x in self.choices
        if not math.isfinite(x):
            return False
        above = self.lo < x if self.lo_open else self.lo <= x
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below


def _num(x: float) -> str:
    return "inf" if x == math.inf else f"{x:g}"


def _positive(default: float) -> _Key:
    return _Key(float, default, lo=0.0, lo_open=True, hi_open=True)


def _non_negative(kind: type, default: float, honoured: bool = True) -> _Key:
    return _Key(kind, default, lo=0.0, hi_open=True, honoured=honoured)


_KEYS: dict[str, _Key] = {
    "device_memory_capacity": _positive(1024.0 * 1024.0 * 1024.0 * 16.0),
    "costmodel_alpha": _positive(1.0),
    "costmodel_beta": _positive(400.0),
    "costmodel_gamma": _Key(float, 0.001, lo=0.0, hi=1.0),
    "costmodel_communi_threshold": _non_negative(float, 2048.0),
    "costmodel_communi_const": _non_negative(float, 3072.0),
    "costmodel_communi_bias": _non_negative(float, 1024.0),
    "run_phase": _Key(int, 0, choices=(_TRAINING, _INFERENCE)),
    "costmodel_allreduce_fusion_algorithm": _Key(int, 0, choices=(0, 1, 2), honoured=False),
    "costmodel_allreduce_fusion_times": _non_negative(int, 0, honoured=False),
    "costmodel_allreduce_fusion_tail_percent": _Key(float, 0.1, lo=0.0, hi=1.0, hi_open=True,
                                                    honoured=False),
    "costmodel_allreduce_fusion_tail_time": _non_negative(float, 0.1, honoured=False),
    "costmodel_allreduce_fusion_allreduce_inherent_time": _non_negative(float, 0.1,
                                                                        honoured=False),
    "costmodel_allreduce_fusion_allreduce_bandwidth": _non_negative(float, 0.1, honoured=False),
    "costmodel_allreduce_fusion_computation_time_parameter": _non_negative(float, 0.1,
                                                                           honoured=False),
}


def _check_value(func: str, key: str, value: object) -> float | int:
    """``value`` as a plain Python number, or raise naming ``key``, the value and the range."""
    spec = _KEYS[key]
    if spec.kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    else:
        ok = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
    if not ok:
        raise ContextTypeError(f"{func}: {key} must be {spec.allowed()}, but got {value!r} of "
                               f"type {type(value).__name__}.")
    number = cast(float, value)
    plain = int(number) if spec.kind is int else float(number)
    if not spec.admits(plain):
        raise ContextError(f"{func}: {key} must be {spec.allowed()}, but got {plain!r}.")
    return plain


def _check_key(func: str, key: object) -> str:
    if not isinstance(key, str):
        raise ContextTypeError(f"{func}: the key must be a str, but got {key!r} of type "
                               f"{type(key).__name__}.")
    if key not in _KEYS:
        close = difflib.get_close_matches(key, list(_KEYS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ContextError(f"{func}: unknown key {key!r}{hint}; the known keys are "
                           f"{', '.join(sorted(_KEYS))}.")
    return key


@dataclass(frozen=True, slots=True)
class CostModelContext:
    """An immutable snapshot of the cost-model context; built values are validated.

    :func:`cost_model_context` returns the current one. Build your own to price with other
    weights without touching the process-wide context:

    >>> CostModelContext().costmodel_beta
    400.0
    >>> CostModelContext(costmodel_gamma=2.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    simpar.context.ContextError: ...: costmodel_gamma must be a float in [0, 1], but got 2.0.
    """

    device_memory_capacity: float = _KEYS["device_memory_capacity"].default
    costmodel_alpha: float = _KEYS["costmodel_alpha"].default
    costmodel_beta: float = _KEYS["costmodel_beta"].default
    costmodel_gamma: float = _KEYS["costmodel_gamma"].default
    costmodel_communi_threshold: float = _KEYS["costmodel_communi_threshold"].default
    costmodel_communi_const: float = _KEYS["costmodel_communi_const"].default
    costmodel_communi_bias: float = _KEYS["costmodel_communi_bias"].default
    run_phase: int = int(_KEYS["run_phase"].default)
    costmodel_allreduce_fusion_algorithm: int = int(
        _KEYS["costmodel_allreduce_fusion_algorithm"].default)
    costmodel_allreduce_fusion_times: int = int(_KEYS["costmodel_allreduce_fusion_times"].default)
    costmodel_allreduce_fusion_tail_percent: float = _KEYS[
        "costmodel_allreduce_fusion_tail_percent"].default
    costmodel_allreduce_fusion_tail_time: float = _KEYS[
        "costmodel_allreduce_fusion_tail_time"].default
    costmodel_allreduce_fusion_allreduce_inherent_time: float = _KEYS[
        "costmodel_allreduce_fusion_allreduce_inherent_time"].default
    costmodel_allreduce_fusion_allreduce_bandwidth: float = _KEYS[
        "costmodel_allreduce_fusion_allreduce_bandwidth"].default
    costmodel_allreduce_fusion_computation_time_parameter: float = _KEYS[
        "costmodel_allreduce_fusion_computation_time_parameter"].default

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name,
                               _check_value("CostModelContext", f.name, getattr(self, f.name)))

    @property
    def training(self) -> bool:
        """Whether ``run_phase`` is 0 (training), MindSpore's default."""
        return self.run_phase == _TRAINING


def _defaults() -> dict[str, float | int]:
    return {key: (int(spec.default) if spec.kind is int else spec.default)
            for key, spec in _KEYS.items()}


_state: dict[str, float | int] = _defaults()
_warned: set[str] = set()
_snapshot: CostModelContext | None = None  # the current context, built once per change


def set_cost_model_context(**kwargs: Any) -> None:
    """Set cost-model keys, as ``mindspore.set_cost_model_context`` does (keys in the module
    docstring). The whole call is validated first: if one key is unknown or one value wrong,
    a :class:`~simpar.context.ContextError` (``ValueError``) or
    :class:`~simpar.context.ContextTypeError` (``TypeError``) is raised and nothing changes.
    Setting an allreduce-fusion key away from its default warns once per key per process.

    >>> set_cost_model_context(costmodel_beta=50.0, run_phase=1)
    >>> get_cost_model_context("costmodel_beta"), get_cost_model_context("run_phase")
    (50.0, 1)
    >>> set_cost_model_context(costmodel_bet=50.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    simpar.context.ContextError: ...: unknown key 'costmodel_bet' (did you mean 'costmodel_beta'...
    >>> set_cost_model_context(costmodel_alpha=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    simpar.context.ContextTypeError: ...: costmodel_alpha must be a float in (0, inf), but got 1 ...
    >>> reset_cost_model_context()
    """
    global _state, _snapshot
    func = "set_cost_model_context"
    staged = dict(_state)
    for key, value in kwargs.items():
        _check_key(func, key)
        staged[key] = _check_value(func, key, value)
    _state, _snapshot = staged, None
    for key, value in kwargs.items():
        spec = _KEYS[key]
        if not spec.honoured and staged[key] != spec.default and key not in _warned:
            _warned.add(key)
            warnings.warn(f"{func}: {key}={value!r} is accepted but not honoured: simpar does "
                          "not fuse gradient AllReduces", NotHonouredWarning, stacklevel=2)


def get_cost_model_context(attr_key: str) -> float | int:
    """The current value of one key, as ``mindspore.get_cost_model_context`` returns it.

    >>> get_cost_model_context("device_memory_capacity") == 2.0 ** 34
    True
    >>> get_cost_model_context("costmodel_communi_threshold")
    2048.0
    """
    return _state[_check_key("get_cost_model_context", attr_key)]


def reset_cost_model_context() -> None:
    """Restore every key to MindSpore's default.

    >>> set_cost_model_context(costmodel_gamma=0.5)
    >>> reset_cost_model_context()
    >>> get_cost_model_context("costmodel_gamma")
    0.001
    """
    global _state, _snapshot
    _state, _snapshot = _defaults(), None


def cost_model_context() -> CostModelContext:
    """An immutable snapshot of the current context (what the functions below read).

    >>> cost_model_context().costmodel_communi_const
    3072.0
    """
    global _snapshot
    if _snapshot is None:  # searches price thousands of strategies: validate once per change
        _snapshot = CostModelContext(**_state)  # type: ignore[arg-type]
    return _snapshot


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
    if isinstance(device_num, bool) or not isinstance(device_num, numbers.Integral) or \
            device_num < 1:
        raise ValueError(f"{func}: device_num must be a positive int, got {device_num!r}")


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
