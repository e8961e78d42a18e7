"""simpar.ops: MindSpore primitives with kernels, VJPs and sharding rules.

Each family lives in its own module and registers its primitives (``registry()``). A new
operator is one class in one module: kernel, vjp, an iteration space or its own rule, and its
facts (``mindspore_cost``, ``elementwise``: :mod:`simpar.ops.facts`).
"""

from simpar.ops._base import OpSharding, Primitive, register, registry
from simpar.ops.array_ops import (
    Assign,
    Concat,
    ExpandDims,
    Flatten,
    Reshape,
    Split,
    Squeeze,
    Transpose,
)
from simpar.ops.comm_spec import Collectives, CommSpec
from simpar.ops.conv import AvgPool, Conv2D, Conv2DTranspose, MaxPool
from simpar.ops.elementwise import (
    GELU,
    Abs,
    Add,
    BiasAdd,
    Cast,
    Exp,
    FloorDiv,
    GeLU,
    Identity,
    Log,
    Mul,
    PReLU,
    RealDiv,
    ReLU,
    ReLU6,
    Sigmoid,
    Square,
    Sub,
    Tanh,
)
from simpar.ops.facts import CostClass
from simpar.ops.gather_dropout import Dropout, Gather
from simpar.ops.matmul import BatchMatMul, MatMul
from simpar.ops.nn_ops import (
    BatchNorm,
    LayerNorm,
    LogSoftmax,
    Softmax,
    SparseSoftmaxCrossEntropyWithLogits,
)
from simpar.ops.one_hot import OneHot
from simpar.ops.reduce_ops import ReduceMax, ReduceMean, ReduceSum
from simpar.ops.strategy import IterSpace, Strategy, StrategyError

__all__ = [
    "GELU",
    "Abs",
    "Add",
    "Assign",
    "AvgPool",
    "BatchMatMul",
    "BatchNorm",
    "BiasAdd",
    "Cast",
    "Collectives",
    "CommSpec",
    "Concat",
    "Conv2D",
    "Conv2DTranspose",
    "CostClass",
    "Dropout",
    "Exp",
    "ExpandDims",
    "Flatten",
    "FloorDiv",
    "Gather",
    "GeLU",
    "Identity",
    "IterSpace",
    "LayerNorm",
    "Log",
    "LogSoftmax",
    "MatMul",
    "MaxPool",
    "Mul",
    "OneHot",
    "OpSharding",
    "PReLU",
    "Primitive",
    "ReLU",
    "ReLU6",
    "RealDiv",
    "ReduceMax",
    "ReduceMean",
    "ReduceSum",
    "Reshape",
    "Sigmoid",
    "Softmax",
    "SparseSoftmaxCrossEntropyWithLogits",
    "Split",
    "Square",
    "Squeeze",
    "Strategy",
    "StrategyError",
    "Sub",
    "Tanh",
    "Transpose",
    "register",
    "registry",
]
