"""simpar.ops: MindSpore primitives with kernels, VJPs and sharding rules.

Each family lives in its own module and registers its primitives (``registry()``). A new
operator is one class in one module: kernel, vjp, and an iteration space or its own rule.
"""

from simpar.ops._base import (
    CommSpec,
    IterSpace,
    OpSharding,
    Primitive,
    Strategy,
    StrategyError,
    register,
    registry,
)
from simpar.ops.array_ops import Concat, Reshape, Split, Transpose
from simpar.ops.elementwise import (
    GELU,
    Add,
    BiasAdd,
    Cast,
    GeLU,
    Mul,
    RealDiv,
    ReLU,
    Sigmoid,
    Sub,
    Tanh,
)
from simpar.ops.matmul import BatchMatMul, MatMul

__all__ = [
    "GELU",
    "Add",
    "BatchMatMul",
    "BiasAdd",
    "Cast",
    "CommSpec",
    "Concat",
    "GeLU",
    "IterSpace",
    "MatMul",
    "Mul",
    "OpSharding",
    "Primitive",
    "RealDiv",
    "ReLU",
    "Reshape",
    "Sigmoid",
    "Split",
    "Strategy",
    "StrategyError",
    "Sub",
    "Tanh",
    "Transpose",
    "register",
    "registry",
]
