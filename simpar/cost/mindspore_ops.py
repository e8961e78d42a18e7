"""MindSpore's operator costs and memory rules, reproduced term by term
(``ccsrc/frontend/parallel/auto_parallel/operator_costmodel.{h,cc}``): :func:`op_cost`.

Which class prices an op is the op's own fact (``op.mindspore_cost``, a
:class:`simpar.ops.facts.CostClass`); what each class charges is this module's table.
The objective that weighs these costs is :mod:`simpar.cost.mindspore`.

Operator cost classes
---------------------

Each simpar primitive is priced by the MindSpore ``OperatorCost`` subclass its
``OperatorInfo`` uses, which the op declares (``mindspore_cost``; :func:`mindspore_cost_class`).
``bytes(x)`` is the bytes of the local slice of ``x``; ``rep(i)`` is ``bytes(input i)`` when
input ``i`` is a Parameter that is not split over every device (its gradient then needs an
AllReduce), else 0. Forward computation / forward communication / backward communication:

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
  (LayerNorm): the sum of ``bytes(inputs)`` / 0 / the sum of ``rep(i)``. Conv2D and
  Conv2DTranspose, whose MindSpore class is BatchParallelCost too, add the sum of ``rep(i)``
  as backward computation (MindSpore's formula) and ``bytes(out)`` of forward communication
  when C_in (Conv2DTranspose: C_out) is split, a cut MindSpore's search never generates.
* ``OneHotCost`` (OneHot): ``bytes(indices)`` / 0 / 0; it keeps nothing.
* ``GeLUCost`` also prices MaxPool and AvgPool (MindSpore's ``MaxPoolCost``);
  ``ReLU6Cost`` ReLU6, Exp and Log; ``CastCost`` Squeeze and ExpandDims.
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
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from simpar.cost.mindspore_redistribution import (
    RedistributionCost,
    _check_itemsize,
    redistribution_cost,
)
from simpar.ops import OpSharding, Primitive, registry
from simpar.ops.facts import CostClass

__all__ = [
    "COST_FACTOR",
    "DROPOUT_COST_RATE",
    "MindSporeOpCost",
    "keeps_output",
    "mindspore_cost_class",
    "op_cost",
]

#: ``ops_utils.h``: the reshape term of a Reshape's redistribution.
COST_FACTOR = 2.0
#: ``operator_costmodel.h``: Dropout also generates its mask (12.5 % more memory traffic).
DROPOUT_COST_RATE = 1.125
_GATHER_WEIGHTS = (3.0, 7.0, 2.0, 6.0)  # GATHERV2_COST_WEIGHT0..3


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


def _batch_parallel(v: _View) -> _Terms:
    """BatchParallelCost (Conv2D, Conv2DTranspose): every input read once, every replicated
    Parameter's gradient reduced, and its slices again as backward computation. MindSpore's
    Conv2DInfo generates batch-parallel strategies only; a channel-contraction cut, which
    simpar also runs, is charged the AllReduce of its output as MatMulCost charges a split k."""
    reps = sum(v.rep(i) for i in range(len(v.inputs)))
    fwd_comm = (v.bytes_out() if v.reduced_split() else 0.0) + v.own_collectives()
    return sum(v.bytes_in(i) for i in range(len(v.inputs))), reps, fwd_comm, reps


def _one_hot(v: _View) -> _Terms:
    """OneHotCost: the index slice read once; nothing communicated."""
    return v.bytes_in(0), 0.0, 0.0, 0.0


def _in_nothing(n: int, p: _Flags, inv: _Flags, prev: _Flags) -> _Flags:
    return frozenset()


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
    """One MindSpore cost class: its formulas and its memory rules."""

    terms: Callable[[_View], _Terms]
    keeps_output: Callable[[int, _Flags, _Flags, _Flags], bool]
    keeps_inputs: Callable[[int, _Flags, _Flags, _Flags], _Flags]


_CAST = _Rule(_cast, _out_never, _in_first_param)
_SUB = _Rule(_sub, _out_never, _in_params)

#: What each MindSpore cost class charges; the op declares its class (``op.mindspore_cost``,
#: a :class:`simpar.ops.facts.CostClass`). tests/test_op_facts.py checks every member has a row.
_RULES: Mapping[CostClass, _Rule] = {
    CostClass.MATMUL: _Rule(_matmul, _out_never, _in_pair),
    CostClass.SQRT: _Rule(_cast, _out_if_involved(0), _in_first_param),
    CostClass.GELU: _Rule(_cast, _out_if_involved(0), _in_own_if_needed),
    CostClass.RELU6: _Rule(_cast, _out_never, _in_own_if_needed),
    CostClass.CAST: _CAST, CostClass.CONCAT: _CAST, CostClass.SPLIT: _CAST,
    CostClass.TRANSPOSE: _CAST,
    CostClass.SOFTMAX: _Rule(_softmax, _out_if_involved(0), _in_first_param),
    CostClass.TENSOR_ADD: _SUB, CostClass.SUB: _SUB, CostClass.BIAS_ADD: _SUB,
    CostClass.FLOOR_DIV: _SUB,
    CostClass.MUL: _Rule(_sub, _out_never, _in_pair),
    CostClass.DIV: _Rule(_sub, _out_if_involved(1), _in_div),
    CostClass.ASSIGN: _Rule(_sub, _out_never, _in_assign),
    CostClass.PRELU: _Rule(_prelu, _out_never, _in_both_if_involved),
    CostClass.BATCH_NORM: _Rule(_batch_norm, _out_always, _in_first_always),
    CostClass.REDUCE_SUM: _Rule(_reduce(1.0), _out_never, _in_first_param),
    CostClass.REDUCE_MEAN: _Rule(_reduce(2.0), _out_never, _in_first_param),
    CostClass.REDUCE_MAX: _Rule(_reduce(1.0), _out_if_involved(0), _in_first_param),
    CostClass.SOFTMAX_CROSS_ENTROPY: _Rule(_all_inputs, _out_if_involved(0), _in_params),
    CostClass.BATCH_PARALLEL: _Rule(_batch_parallel, _out_never, _in_pair),
    CostClass.ONE_HOT: _Rule(_one_hot, _out_never, _in_nothing),
    CostClass.LAYER_NORM: _Rule(_all_inputs, _out_if_involved(0, 1, 2), _in_layer_norm),
    CostClass.GATHER: _Rule(_gather, _out_never, _in_gather),
    CostClass.DROPOUT: _Rule(_dropout, _out_if_involved(0), _in_first_param),
    CostClass.RESHAPE: _Rule(_reshape, _out_never, _in_first_param),
    CostClass.DEFAULT: _Rule(_default, _out_never, _in_params),
}


def _cost_class(func: str, op: object) -> CostClass:
    """The cost class ``op`` (a primitive, its class or a registered op's name) declares."""
    if isinstance(op, str):
        ops = registry()
        if op not in ops:
            raise ValueError(f"{func}: op {op!r} is not a registered op; registered ops are "
                             f"{', '.join(sorted(ops))}")
        op = ops[op]
    cost: CostClass | None = getattr(op, "mindspore_cost", None)
    if cost is None:
        raise TypeError(f"{func}: op must be a primitive, a primitive class or a registered "
                        f"op's name, got {op!r} of type {type(op).__name__}")
    return cost


def _name(op: Primitive | type[Primitive] | str) -> str:
    return op if isinstance(op, str) else op.__name__ if isinstance(op, type) else op.name


def mindspore_cost_class(op: Primitive | type[Primitive] | str) -> str:
    """The MindSpore ``OperatorCost`` class whose formulas price ``op`` (a primitive, its
    class or a registered op's name), as the op declares it (``mindspore_cost``);
    ``"simpar default"`` for an op that declares none (see the module docstring).

    >>> from simpar.ops import Add, GeLU, registry
    >>> mindspore_cost_class(GeLU), mindspore_cost_class(Add()), mindspore_cost_class("MatMul")
    ('GeLUCost', 'TensorAddCost', 'MatMulCost')
    """
    return _cost_class("mindspore_cost_class", op).value


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


def keeps_output(op: Primitive | type[Primitive] | str, n_inputs: int,
                 parameters: Collection[int] = frozenset(),
                 involved: Collection[int] | None = None,
                 prev_in_memory: Collection[int] = frozenset()) -> bool:
    """Whether MindSpore's cost class of ``op`` (a primitive or its class) keeps its output
    for the backward (``is_output_in_memory``), given which inputs are Parameters,
    parameter-involved and already kept by their producers: its consumers then do not count
    it again.

    >>> from simpar.ops import MatMul, ReLU
    >>> keeps_output(ReLU, 1, involved={0}), keeps_output(ReLU(), 1), keeps_output(MatMul, 2)
    (True, False, False)
    """
    func = "keeps_output"
    rule = _RULES[_cost_class(func, op)]
    op_name = _name(op)
    params = _positions(func, op_name, "parameters", parameters, n_inputs)
    inv = params if involved is None else _positions(func, op_name, "involved", involved,
                                                     n_inputs)
    prev = _positions(func, op_name, "prev_in_memory", prev_in_memory, n_inputs)
    return rule.keeps_output(n_inputs, params, inv, prev)


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
    cost_class = _cost_class(func, sh.op)
    rule = _RULES[cost_class]
    fc, bc, fm, bm = rule.terms(view)
    outputs = float(sum(view.outputs) * size)
    kept = rule.keeps_inputs(n, params, inv, prev)
    memory = sum(view.bytes_in(i) for i in kept)
    if rule.keeps_output(n, params, inv, prev):
        memory += outputs
    return MindSporeOpCost(name, cost_class.value, fc, bc, fm, bm, memory,
                           outputs if output_critical else 0.0)
