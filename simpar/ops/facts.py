"""What an op declares about itself for the layers above it: its *facts*.

Each primitive class says, where it registers (or in its own body), which MindSpore cost
class prices it and whether MindSpore counts it elementwise::

    @register(mindspore_cost=CostClass.SQRT, elementwise=True)
    class ReLU(_Unary):
        ...

The op owns the membership ("ReLU is priced by SqrtCost"); the cost model owns what a class
means (SqrtCost's formulas, in :mod:`simpar.cost.mindspore_ops`), and the searches read
``op.elementwise``. A fact is not inherited: a subclass is another op (its name is its class
name, as MindSpore keys its tables by name), so it declares its facts again or gets the
defaults (:data:`DEFAULTS`). Every registered op declares every fact, the default included
(tests/test_op_facts.py). This module imports only :mod:`simpar._enums`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from simpar._enums import StrEnum

__all__ = ["DEFAULTS", "CostClass", "undeclared"]


class CostClass(StrEnum):
    """A MindSpore ``OperatorCost`` subclass (``operator_costmodel.h``): the class whose
    formulas price an op, as the op's ``OperatorInfo`` picks it. The value is MindSpore's
    class name; ``DEFAULT`` is simpar's rule for an op MindSpore has no class for.

    >>> str(CostClass.MATMUL), CostClass("GeLUCost") is CostClass.GELU
    ('MatMulCost', True)
    """

    MATMUL = "MatMulCost"
    SQRT = "SqrtCost"
    GELU = "GeLUCost"
    RELU6 = "ReLU6Cost"
    CAST = "CastCost"
    CONCAT = "ConcatCost"
    SPLIT = "SplitCost"
    TRANSPOSE = "TransposeCost"
    SOFTMAX = "SoftmaxCost"
    TENSOR_ADD = "TensorAddCost"
    SUB = "SubCost"
    BIAS_ADD = "BiasAddCost"
    MUL = "MulCost"
    DIV = "DivCost"
    FLOOR_DIV = "FloorDivCost"
    ASSIGN = "AssignCost"
    PRELU = "PReLUCost"
    BATCH_NORM = "BatchNormCost"
    REDUCE_SUM = "ReduceSumCost"
    REDUCE_MEAN = "ReduceMeanCost"
    REDUCE_MAX = "ReduceMaxCost"
    SOFTMAX_CROSS_ENTROPY = "SparseSoftmaxCrossEntropyWithLogitsCost"
    BATCH_PARALLEL = "BatchParallelCost"
    ONE_HOT = "OneHotCost"
    LAYER_NORM = "LayerNormCost"
    GATHER = "GatherV2PCost"
    DROPOUT = "DropOutCost"
    RESHAPE = "ReshapeCost"
    DEFAULT = "simpar default"


#: Every fact an op declares, with the value an op that does not declare it gets.
#: ``mindspore_cost``: the :class:`CostClass` that prices the op. ``elementwise``: MindSpore's
#: ``IsElementWiseOperator`` (the unary ones), whose out-edges become identity edges under
#: ``set_algo_parameters(elementwise_op_strategy_follow=True)``.
DEFAULTS: Mapping[str, object] = MappingProxyType({
    "mindspore_cost": CostClass.DEFAULT,
    "elementwise": False,
})


def undeclared(cls: type) -> tuple[str, ...]:
    """The facts that ``cls``'s own body does not declare (inherited ones do not count).

    >>> class Op:
    ...     elementwise = True
    >>> undeclared(Op)
    ('mindspore_cost',)
    """
    return tuple(fact for fact in DEFAULTS if fact not in vars(cls))
