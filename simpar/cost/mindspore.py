"""MindSpore's own cost model (the dynamic-programming search's), reproduced term by term.

MindSpore prices a strategy in *bytes of local slices*, not seconds: an operator's computation
is roughly the bytes its kernel reads, its communication the bytes of the tensor a collective
moves. This module reproduces those numbers so that simpar can search, compare or explain
strategies exactly as MindSpore's ``auto_parallel`` would. simpar's own time model lives in
:mod:`simpar.cost.model`; the two are separate on purpose.

Four parts, each with the MindSpore source it follows (``ccsrc`` is
``mindspore/ccsrc/frontend/parallel``):

1. The context, a :class:`~simpar.cost_model_context.CostModelContext` value that every
   function below takes (``ctx``; left out, the process's ``set_cost_model_context``, for a
   call by hand: a plan request carries its own). Its keys live in
   :mod:`simpar.cost_model_context`.
2. Operator costs, :func:`op_cost` (``ccsrc/auto_parallel/operator_costmodel.{h,cc}``).
3. The objective, :func:`objective` (``OperatorInfo::SetCostUnderStrategyBase``,
   ``BreakingTiesForPreferringDataParallel``, ``RefineForPracticalCost`` in
   ``auto_parallel/costmodel.cc``, ``CostGraph::SelectCostWithMin{Training,Inference}Time``).
4. Redistribution costs, :func:`redistribution_cost` and :func:`edge_objective`
   (``tensor_layout/tensor_redistribution.cc``: ``ComputeCost``, ``ComputePermuteCost``,
   ``ComputeConcatCost``; ``redistribution_operator_infer.cc``; ``Edge::GetRedistributionCost``).

The facts are MindSpore's; the code is not. Imports: only :mod:`simpar.cost_model_context` at
run time. Shardings and plans are read by attribute (their classes are imported for type
checking only), so that ``simpar.cost`` can re-export this module without an import cycle through
``simpar.cost.collective``, which ``simpar.ops`` and ``simpar.redistribution`` import.

Operator cost classes
---------------------

Each simpar primitive is priced by the MindSpore ``OperatorCost`` subclass its
``OperatorInfo`` uses (:func:`mindspore_cost_class`). ``bytes(x)`` is the bytes of the local
slice of ``x``; ``rep(i)`` is ``bytes(input i)`` when input ``i`` is a Parameter that is not
split over every device (its gradient then needs an AllReduce), else 0. Forward computation /
forward communication / backward communication:

* ``MatMulCost`` (MatMul, BatchMatMul): ``bytes(A) + bytes(B)``, plus ``bytes(out)`` when k is
  split / ``bytes(out)`` when k is split (the AllReduce of partial sums) / ``rep(1)`` only,
  since MindSpore looks at B alone. Backward computation ``rep(1)``.
* ``CastCost`` and its subclasses, which differ in memory only (``SqrtCost``: ReLU, Tanh,
  Sigmoid; ``GeLUCost``: GeLU; ``ReLU6Cost``: Abs, Square; ``CastCost``: Cast, Identity;
  ``TransposeCost``, ``ConcatCost``, ``SplitCost``): ``bytes(input 0)`` / 0 / ``rep(0)``.
* ``SoftmaxCost`` (Softmax, LogSoftmax): ``bytes(output 0)`` / 0 / ``rep(0)``.
* ``SubCost`` and subclasses (``TensorAddCost``: Add; Sub; ``BiasAddCost``; ``MulCost``: Mul;
  ``DivCost``: RealDiv; ``FloorDivCost``: FloorDiv; ``AssignCost``: Assign): ``bytes(A) +
  bytes(B)`` / 0 / ``rep(0) + rep(1)``, and the same again as backward computation. (MindSpore
  r1.0 priced these with one ``ArithmeticCost``, whose formulas are the same.)
* ``PReLUCost`` (PReLU): ``bytes(x) + bytes(weight)`` / 0 / ``rep(1)``, backward computation
  ``rep(1)``.
* ``BatchNormCost`` (BatchNorm): the sum of ``bytes(inputs)`` / ``bytes(x)`` when x's channel
  dimension is split, else 0 (MindSpore's formula: it charges the channel split, not the
  N, H or W split whose statistics its SyncBatchNorm AllReduces) / the sum of ``rep(i)`` over
  scale, bias, mean and variance. MindSpore r1.0 had no BatchNormInfo: it ran BatchNorm batch
  parallel only, priced by ``BatchParallelCost``; simpar follows the later BatchNormInfo.
* ``ReduceSumCost`` (ReduceSum; ``ReduceMaxCost``, a subclass: ReduceMax) and
  ``ReduceMeanCost`` (ReduceMean): ``bytes(in)``, plus ``bytes(out)`` (ReduceMean: twice)
  when a reduced dim is split / ``bytes(out)`` when a reduced dim is split / ``rep(0)``.
* ``BatchParallelCost`` (SparseSoftmaxCrossEntropyWithLogits) and ``LayerNormCost``
  (LayerNorm): the sum of ``bytes(inputs)`` / 0 / the sum of ``rep(i)``.
* ``GatherV2PCost`` (Gather), with the table's gathered axis unsplit: ``bytes(P) + bytes(I)``
  / 0 / the sum of ``rep(i)``, backward computation ``bytes(out)``; split:
  ``3 bytes(P) + 7 bytes(I)`` / the bytes of the index slice (times P's other slice dim when
  P is 2-D) / the sum of ``rep(i)``, backward computation ``2 bytes(out) + 6 bytes(I)``.
* ``DropOutCost`` (Dropout): ``1.125 bytes(input)`` (the mask generation) / 0 / 0.
* ``ReshapeCost`` (Reshape): the computation of its redistribution (below) plus
  ``2.0 x bytes(input)`` for the reshape itself / that redistribution's forward plus backward
  communication / ``rep(0)``.

Backward computation is 0 where not said. MindSpore's ``OperatorCost`` base class is abstract,
so it has no default; an op with no class above gets simpar's rule: the sum of
``bytes(inputs)`` / ``bytes(out)`` when a contracted or reduced dimension is split / the sum of
``rep(i)``, and that sum again as backward computation. Where simpar's sharding runs
collectives of its own that MindSpore's class cannot see, because MindSpore rejects the
strategy (a split Softmax or LayerNorm axis, a split class dimension), each is charged as the
bytes of its buffer on top of the class's forward communication.

Memory follows each class's ``CalculateInputsInMemory`` / ``CalculateOutputInMemory``: which
inputs (and whether the outputs) stay alive for the backward depends on which inputs are
Parameters, which are *parameter-involved* (computed from a Parameter, so they get a
gradient), and which inputs their producer already keeps (``prev_in_memory``). Inference
memory is the output slices of an op whose output is critical.

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
import numbers
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from simpar.cost_model_context import CostModelContext, cost_model_context

if TYPE_CHECKING:
    from simpar.ops import OpSharding
    from simpar.redistribution import RedistributionPlan, Step

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

#: ``tensor_redistribution.h``: an AlltoAll is charged as twice its input slice.
ALLTOALL_SCALE_FACTOR = 2.0
#: ``tensor_redistribution.h``: an AllGather / ReduceScatter as half of its output slice.
ALLGATHER_REDUCESCATTER_SCALE_FACTOR = 0.5
#: ``ops_utils.h``: the reshape term of a Reshape's redistribution.
COST_FACTOR = 2.0
#: ``ops_utils.h``: below this a cost counts as zero (refinement, tie-break).
EPS = 1e-6
#: ``operator_costmodel.h``: Dropout also generates its mask (12.5 % more memory traffic).
DROPOUT_COST_RATE = 1.125
_GATHER_WEIGHTS = (3.0, 7.0, 2.0, 6.0)  # GATHERV2_COST_WEIGHT0..3

# ----------------------------------------------------------------------------------------------
# 2. Operator costs.


@dataclass(frozen=True, slots=True)
class MindSporeOpCost:
    """One operator's costs under one strategy, in MindSpore's units (bytes of local slices).

    ``forward_communication`` is MindSpore's ``GetForwardCommCost``; ``backward_communication``
    its ``GetBackwardCommCost`` (the AllReduce of replicated Parameters' gradients); the same
    for computation. ``memory`` is the training-phase peak contribution (``GetMemoryCost``),
    ``inference_memory`` the inference one (``GetMemoryCostForInference``).
    ``cost_class`` names the MindSpore class whose formulas were used.
    """

    op: str
    cost_class: str
    forward_computation: float
    backward_computation: float
    forward_communication: float
    backward_communication: float
    memory: float
    inference_memory: float

    @property
    def computation(self) -> float:
        """What MindSpore's search weighs with alpha: the forward computation only."""
        return self.forward_computation

    @property
    def communication(self) -> float:
        """All communication, with the parameter gradients' (``GetCommCost``)."""
        return self.forward_communication + self.backward_communication

    @property
    def communication_without_parameter(self) -> float:
        """Communication without the parameter gradients' (the forward's)."""
        return self.forward_communication

    def __str__(self) -> str:
        return (f"{self.op}[{self.cost_class}]: comp {self.forward_computation:g}+"
                f"{self.backward_computation:g} comm {self.forward_communication:g}+"
                f"{self.backward_communication:g} mem {self.memory:g}")


@dataclass(frozen=True, slots=True)
class _View:
    """What a MindSpore cost class sees of one sharded op: elements of every local slice."""

    sh: OpSharding
    inputs: tuple[int, ...]           # elements of each input's local slice
    outputs: tuple[int, ...]          # elements of each output's local slice
    replicated: tuple[bool, ...]      # Parameter input i is not split over every device
    itemsize: int                     # bytes per element of the outputs
    in_itemsizes: tuple[int, ...]     # bytes per element of each input

    def bytes_in(self, i: int) -> float:
        return float(self.inputs[i] * self.in_itemsizes[i])

    def bytes_out(self, k: int = 0) -> float:
        return float(self.outputs[k] * self.itemsize)

    def rep(self, i: int) -> float:
        """Bytes of Parameter input ``i``'s slice if its gradient needs an AllReduce."""
        return self.bytes_in(i) if i < len(self.inputs) and self.replicated[i] else 0.0

    def reduced_split(self) -> bool:
        """Whether a dimension the op contracts or reduces is split (partial local results).
        MindSpore asks the same of MatMul's k and of the reduced axes; an op without an
        iteration space answers by its raw output being partial."""
        try:
            space = self.sh.op.iter_space(*self.sh.input_shapes)
        except NotImplementedError:
            return self.sh.raw_out.is_partial
        reduced = [it for it in space.order if it not in space.output]
        return bool(self.sh.device_axes_cutting(reduced))

    def own_collectives(self) -> float:
        """Bytes of the collectives simpar's sharding runs that MindSpore's class cannot see."""
        return float(sum(spec.elements for spec in self.sh.internal_forward) * self.itemsize)


# (forward computation, backward computation, forward communication, backward communication)
_Terms = tuple[float, float, float, float]


def _matmul(v: _View) -> _Terms:
    split = v.reduced_split()
    fwd_comm = v.bytes_out() if split else 0.0
    comp = v.bytes_in(0) + v.bytes_in(1) + (v.bytes_out() if split else 0.0)
    return comp, v.rep(1), fwd_comm, v.rep(1)


def _cast(v: _View) -> _Terms:
    return v.bytes_in(0), 0.0, v.own_collectives(), v.rep(0)


def _softmax(v: _View) -> _Terms:
    return v.bytes_out(0), 0.0, v.own_collectives(), v.rep(0)


def _sub(v: _View) -> _Terms:
    both = v.rep(0) + v.rep(1)
    return v.bytes_in(0) + v.bytes_in(1), both, v.own_collectives(), both


def _reduce(mean_factor: float) -> Callable[[_View], _Terms]:
    def rule(v: _View) -> _Terms:
        split = v.reduced_split()
        fwd_comm = v.bytes_out() if split else 0.0
        comp = v.bytes_in(0) + (mean_factor * v.bytes_out() if split else 0.0)
        return comp, 0.0, fwd_comm, v.rep(0)
    return rule


def _all_inputs(v: _View) -> _Terms:
    """BatchParallelCost and LayerNormCost: every input read once, every replicated
    Parameter's gradient reduced."""
    reps = sum(v.rep(i) for i in range(len(v.inputs)))
    return sum(v.bytes_in(i) for i in range(len(v.inputs))), 0.0, v.own_collectives(), reps


def _gather(v: _View) -> _Terms:
    sh = v.sh
    params_shape = sh.input_shapes[0]
    axis = sh.op.iter_space(*sh.input_shapes).inputs[0].index("v")  # the gathered table dim
    reps = sum(v.rep(i) for i in range(len(v.inputs)))
    w0, w1, w2, w3 = _GATHER_WEIGHTS
    if sh.strategy[0][axis] == 1:
        return v.bytes_in(0) + v.bytes_in(1), v.bytes_out(), 0.0, reps
    scattered = v.inputs[1]
    if len(params_shape) == 2:
        scattered *= sh.in_layouts[0].local_shape()[1 - axis]
    return (w0 * v.bytes_in(0) + w1 * v.bytes_in(1), w2 * v.bytes_out() + w3 * v.bytes_in(1),
            float(scattered * v.itemsize), reps)


def _prelu(v: _View) -> _Terms:
    return v.bytes_in(0) + v.bytes_in(1), v.rep(1), v.own_collectives(), v.rep(1)


def _batch_norm(v: _View) -> _Terms:
    """BatchNormCost: forward communication is the input slice when the channel is split."""
    fwd_comm = v.bytes_in(0) if v.sh.strategy[0][1] > 1 else 0.0
    reps = sum(v.rep(i) for i in range(1, len(v.inputs)))
    return sum(v.bytes_in(i) for i in range(len(v.inputs))), 0.0, fwd_comm, reps


def _dropout(v: _View) -> _Terms:
    return DROPOUT_COST_RATE * v.bytes_in(0), 0.0, 0.0, 0.0


def _reshape(v: _View) -> _Terms:
    plan = v.sh.inner_plan
    moved = redistribution_cost(plan, v.itemsize) if plan is not None else RedistributionCost(
        0.0, 0.0, 0.0)
    comp = moved.computation + COST_FACTOR * v.bytes_in(0)
    return comp, 0.0, moved.forward + moved.backward, v.rep(0)


def _default(v: _View) -> _Terms:
    reps = sum(v.rep(i) for i in range(len(v.inputs)))
    fwd_comm = (v.bytes_out() if v.reduced_split() else 0.0) + v.own_collectives()
    return sum(v.bytes_in(i) for i in range(len(v.inputs))), reps, fwd_comm, reps


# Memory: (output kept?, inputs kept) from is_parameter (p), is_parameter_involve (inv) and the
# inputs the producers already keep (prev), per CalculateOutputInMemory/CalculateInputsInMemory.
_Flags = frozenset[int]
_MemoryRule = Callable[[int, _Flags, _Flags, _Flags], tuple[bool, _Flags]]


def _out_never(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> bool:
    return False


def _out_if_involved(*which: int) -> Callable[[int, _Flags, _Flags, _Flags], bool]:
    def rule(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> bool:
        return any(i in inv for i in which)
    return rule


def _in_first_param(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """CastCost, SoftmaxCost, SqrtCost, ReduceSumCost on one tensor: input 0 if a Parameter."""
    return frozenset(i for i in (0,) if i in p)


def _in_params(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """SubCost, BatchParallel's sparse loss: each input that is a Parameter."""
    return frozenset(i for i in range(n) if i in p)


def _in_own_if_needed(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """ReLU6Cost, GeLUCost: dx needs x, unless the producer keeps it."""
    return frozenset({0}) if 0 in p or (0 in inv and 0 not in prev) else frozenset()


def _in_pair(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """MatMulCost, MulCost: the gradient of one input needs the other."""
    keep = set()
    for me, other in ((0, 1), (1, 0)):
        if me in p:
            keep.add(me)
        if (me in p or me in inv) and other not in prev:
            keep.add(other)
    return frozenset(keep)


def _in_div(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """DivCost: dx needs y; dy needs y (and the output)."""
    keep = set()
    if 0 in p:
        keep.add(0)
    if (0 in p or 0 in inv or 1 in inv) and 1 not in prev:
        keep.add(1)
    return frozenset(keep)


def _in_layer_norm(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """LayerNormCost: dx and dgamma need x and gamma; beta only if a Parameter."""
    keep = {i for i in (0, 1) if (0 in inv or 1 in inv) and i not in prev}
    keep |= {2} if 2 in p else set()
    return frozenset(keep)


def _in_both_if_involved(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """PReLUCost: dx and dweight each need x and the weight."""
    if 0 in inv or 1 in inv:
        return frozenset(i for i in (0, 1) if i not in prev)
    return frozenset()


def _in_assign(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """AssignCost: the variable if it is involved (unless kept already); the value only if it
    is a Parameter."""
    keep = {0} if 0 in inv and 0 not in prev else set()
    return frozenset(keep | ({1} if 1 in p else set()))


def _in_first_always(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """BatchNormCost: x, always (MindSpore's loop sets input 0 only, whatever the flags)."""
    return frozenset({0})


def _out_always(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> bool:
    return True


def _in_gather(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    """GatherV2Cost: d(params) needs the indices."""
    keep = {0} if 0 in p else set()
    if (0 in p or 0 in inv) and 1 not in prev:
        keep.add(1)
    keep |= {1} if 1 in p else set()
    return frozenset(keep)


@dataclass(frozen=True, slots=True)
class _Rule:
    cost_class: str
    terms: Callable[[_View], _Terms]
    keeps_output: Callable[[int, _Flags, _Flags, _Flags], bool]
    keeps_inputs: Callable[[int, _Flags, _Flags, _Flags], _Flags]


_SQRT = ("SqrtCost", _cast, _out_if_involved(0), _in_first_param)
_RELU6 = ("ReLU6Cost", _cast, _out_never, _in_own_if_needed)
_CAST = ("CastCost", _cast, _out_never, _in_first_param)
_SUB = ("SubCost", _sub, _out_never, _in_params)
_REDUCE_SUM = ("ReduceSumCost", _reduce(1.0), _out_never, _in_first_param)

#: The MindSpore cost class of each simpar primitive (by the OperatorInfo MindSpore uses).
_RULES: dict[str, _Rule] = {name: _Rule(*entry) for name, entry in {
    "MatMul": ("MatMulCost", _matmul, _out_never, _in_pair),
    "BatchMatMul": ("MatMulCost", _matmul, _out_never, _in_pair),
    "ReLU": _SQRT, "Tanh": _SQRT, "Sigmoid": _SQRT,
    "GeLU": ("GeLUCost", _cast, _out_if_involved(0), _in_own_if_needed),
    "Abs": _RELU6, "Square": _RELU6,
    "Cast": _CAST, "Identity": _CAST, "Concat": ("ConcatCost", *_CAST[1:]),
    "Split": ("SplitCost", *_CAST[1:]), "Transpose": ("TransposeCost", *_CAST[1:]),
    "Softmax": ("SoftmaxCost", _softmax, _out_if_involved(0), _in_first_param),
    "LogSoftmax": ("SoftmaxCost", _softmax, _out_if_involved(0), _in_first_param),
    "Add": ("TensorAddCost", *_SUB[1:]), "Sub": _SUB, "BiasAdd": ("BiasAddCost", *_SUB[1:]),
    "Mul": ("MulCost", _sub, _out_never, _in_pair),
    "RealDiv": ("DivCost", _sub, _out_if_involved(1), _in_div),
    "FloorDiv": ("FloorDivCost", *_SUB[1:]),
    "Assign": ("AssignCost", _sub, _out_never, _in_assign),
    "PReLU": ("PReLUCost", _prelu, _out_never, _in_both_if_involved),
    "BatchNorm": ("BatchNormCost", _batch_norm, _out_always, _in_first_always),
    "ReduceSum": _REDUCE_SUM,
    "ReduceMean": ("ReduceMeanCost", _reduce(2.0), _out_never, _in_first_param),
    "ReduceMax": ("ReduceMaxCost", _reduce(1.0), _out_if_involved(0), _in_first_param),
    "SparseSoftmaxCrossEntropyWithLogits": ("SparseSoftmaxCrossEntropyWithLogitsCost",
                                            _all_inputs, _out_if_involved(0), _in_params),
    "LayerNorm": ("LayerNormCost", _all_inputs, _out_if_involved(0, 1, 2), _in_layer_norm),
    "Gather": ("GatherV2PCost", _gather, _out_never, _in_gather),
    "Dropout": ("DropOutCost", _dropout, _out_if_involved(0), _in_first_param),
    "Reshape": ("ReshapeCost", _reshape, _out_never, _in_first_param),
}.items()}

_DEFAULT_RULE = _Rule("simpar default", _default, _out_never, _in_params)


def mindspore_cost_class(op_name: str) -> str:
    """The MindSpore ``OperatorCost`` class whose formulas price ``op_name``, or
    ``"simpar default"`` for an op MindSpore's table does not cover (see the module docstring).

    >>> mindspore_cost_class("GeLU"), mindspore_cost_class("Add")
    ('GeLUCost', 'TensorAddCost')
    """
    return _RULES.get(op_name, _DEFAULT_RULE).cost_class


def _positions(func: str, op: str, what: str, given: Iterable[int], n: int) -> frozenset[int]:
    out: set[int] = set()
    for i in given:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{func}: {op}: {what} must hold input positions (ints), got {i!r}")
        if not 0 <= int(i) < n:
            raise ValueError(f"{func}: {op}: {what} holds input position {i}, but the op has "
                             f"{n} inputs (positions 0..{n - 1})")
        out.add(int(i))
    return frozenset(out)


def keeps_output(op_name: str, n_inputs: int, parameters: Collection[int] = frozenset(),
                 involved: Collection[int] | None = None,
                 prev_in_memory: Collection[int] = frozenset()) -> bool:
    """Whether MindSpore's cost class of ``op_name`` keeps its output for the backward
    (``is_output_in_memory``), given which inputs are Parameters, parameter-involved and
    already kept by their producers: its consumers then do not count it again.

    >>> keeps_output("ReLU", 1, involved={0}), keeps_output("ReLU", 1), keeps_output("MatMul", 2)
    (True, False, False)
    """
    func = "keeps_output"
    params = _positions(func, op_name, "parameters", parameters, n_inputs)
    inv = params if involved is None else _positions(func, op_name, "involved", involved,
                                                     n_inputs)
    prev = _positions(func, op_name, "prev_in_memory", prev_in_memory, n_inputs)
    return _RULES.get(op_name, _DEFAULT_RULE).keeps_output(n_inputs, params, inv, prev)


def _check_itemsize(func: str, itemsize: object) -> int:
    if isinstance(itemsize, bool) or not isinstance(itemsize, numbers.Integral):
        raise TypeError(f"{func}: itemsize must be a positive int (bytes per element), got "
                        f"{itemsize!r} of type {type(itemsize).__name__}")
    if itemsize < 1:
        raise ValueError(f"{func}: itemsize must be a positive int (bytes per element), got "
                         f"{itemsize}")
    return int(itemsize)


def op_cost(sh: OpSharding, parameters: Collection[int] = frozenset(), itemsize: int = 4, *,
            involved: Collection[int] | None = None,
            prev_in_memory: Collection[int] = frozenset(),
            output_critical: bool = True,
            input_itemsizes: Sequence[int] | None = None) -> MindSporeOpCost:
    """MindSpore's costs of the op ``sh`` shards, in bytes of local slices.

    ``parameters``: the input positions that are Parameters. ``involved``: those that are
    Parameters or computed from one (MindSpore's ``is_parameter_involve``; default: the
    Parameters). ``prev_in_memory``: inputs whose producer already keeps them for the backward.
    ``output_critical``: whether the output counts in inference memory. ``itemsize``: bytes
    per element of the outputs, and of the inputs unless ``input_itemsizes`` gives each
    input's (MindSpore prices every tensor at its own type length: a Cast from float16 reads
    2-byte elements).

    MatMul (64, 32) x (32, 16) with strategy ((2, 4), (4, 1)) on 8 devices, float32, B a
    Parameter: A's slice is (32, 8) = 1024 bytes, B's (8, 16) = 512, the output's (32, 16) =
    2048. k is split, so the forward AllReduces the output (2048) and computes 1024 + 512 +
    2048; B is split over 4 of the 8 devices, so its gradient's AllReduce costs 512. Memory:
    B (a Parameter) and A (dB needs it).

    >>> from simpar.ops import MatMul
    >>> sh = MatMul().sharding([(64, 32), (32, 16)], 8, ((2, 4), (4, 1)))
    >>> print(op_cost(sh, parameters={1}))
    MatMul[MatMulCost]: comp 3584+512 comm 2048+512 mem 1536
    """
    func = "op_cost"
    name = sh.op.name
    n = len(sh.in_layouts)
    size = _check_itemsize(func, itemsize)
    if input_itemsizes is None:
        in_sizes = (size,) * n
    else:
        in_sizes = tuple(_check_itemsize(func, x) for x in input_itemsizes)
        if len(in_sizes) != n:
            raise ValueError(f"{func}: {name}: input_itemsizes has {len(in_sizes)} entries, the "
                             f"op {n} inputs")
    params = _positions(func, name, "parameters", parameters, n)
    inv = params if involved is None else _positions(func, name, "involved", involved, n)
    prev = _positions(func, name, "prev_in_memory", prev_in_memory, n)
    if not isinstance(output_critical, bool):
        raise TypeError(f"{func}: {name}: output_critical must be a bool, got "
                        f"{output_critical!r}")
    devices = math.prod(sh.device_matrix)
    view = _View(
        sh,
        tuple(lay.local_size() for lay in sh.in_layouts),
        tuple(out.local_size() for _, out, _ in sh.outputs),
        tuple(i in params and math.prod(lay.cuts) != devices
              for i, lay in enumerate(sh.in_layouts)),
        size, in_sizes)
    rule = _RULES.get(name, _DEFAULT_RULE)
    fc, bc, fm, bm = rule.terms(view)
    outputs = float(sum(view.outputs) * size)
    kept = rule.keeps_inputs(n, params, inv, prev)
    memory = sum(view.bytes_in(i) for i in kept)
    if rule.keeps_output(n, params, inv, prev):
        memory += outputs
    return MindSporeOpCost(name, rule.cost_class, fc, bc, fm, bm, memory,
                           outputs if output_critical else 0.0)


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


# ----------------------------------------------------------------------------------------------
# 4. Redistribution.


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
