"""Convolutional layers, shaped like MindSpore's: ``nn.Conv2d``, ``nn.Conv2dTranspose``,
``nn.MaxPool2d``, ``nn.AvgPool2d``, ``nn.Flatten``, ``nn.ReLU``, ``nn.ReLU6`` and
``nn.SequentialCell``. Each holds its primitives under MindSpore's attribute names
(``conv.conv2d``, ``conv.bias_add``, ``pool.max_pool``), so a strategy is set the MindSpore
way: ``net.conv1.conv2d.shard(((8, 1, 1, 1), (1, 1, 1, 1)))``; parameters are named as
MindSpore names them (``conv1.weight``, ``layer1.0.bn1.moving_mean``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from simpar import ops
from simpar.nn.cell import Cell, Parameter, initializer
from simpar.nn.layers import _check_sizes

__all__ = ["AvgPool2d", "Conv2d", "Conv2dTranspose", "Flatten", "MaxPool2d", "ReLU", "ReLU6",
           "SequentialCell"]

#: MindSpore 2.x's default convolution weight init: HeUniform(negative_slope=sqrt(5)).
_CONV_SLOPE = math.sqrt(5.0)


def _weight(init: str | np.ndarray | None, shape: tuple[int, ...], dtype: Any) -> Any:
    if init is None:
        return initializer("he_uniform", shape, dtype, negative_slope=_CONV_SLOPE)
    if isinstance(init, np.ndarray):
        if init.shape != shape:
            raise ValueError(f"weight_init has shape {init.shape} but the weight is {shape}")
        return np.array(init, dtype=dtype)
    return initializer(init, shape, dtype)


class _Conv(Cell):
    """What Conv2d and Conv2dTranspose share: sizes, the bias, the checks."""

    def _common(self, in_channels: int, out_channels: int, has_bias: bool) -> None:
        name = type(self).__name__
        _check_sizes(name, in_channels=in_channels, out_channels=out_channels)
        if not isinstance(has_bias, bool):
            raise TypeError(f"{name}: has_bias must be a bool, got {has_bias!r}")
        self.in_channels, self.out_channels, self.has_bias = in_channels, out_channels, has_bias

    def _parameters(self, weight: tuple[int, ...], weight_init: str | np.ndarray | None,
                    bias_init: str | None, dtype: Any) -> None:
        """The weight, then (with ``has_bias``) the bias and its BiasAdd, in MindSpore's
        order."""
        self.weight = Parameter(_weight(weight_init, weight, dtype))
        if self.has_bias:
            self.bias = Parameter(initializer(bias_init or "zeros", (self.out_channels,),
                                              dtype))
            self.bias_add = ops.BiasAdd()

    def _biased(self, y: Any) -> Any:
        return self.bias_add(y, self.bias) if self.has_bias else y


class Conv2d(_Conv):
    """MindSpore's ``nn.Conv2d(in_channels, out_channels, kernel_size, stride=1,
    pad_mode="same", padding=0, dilation=1, group=1, has_bias=False, weight_init=None,
    bias_init=None, data_format="NCHW")``: weight (out, in, kh, kw) initialised
    HeUniform(sqrt(5)) as MindSpore 2.x does, the primitive ``conv2d`` and, with a bias,
    ``bias_add``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, pad_mode: str = "same",
                 padding: int | tuple[int, int, int, int] = 0,
                 dilation: int | tuple[int, int] = 1, group: int = 1, has_bias: bool = False,
                 weight_init: str | np.ndarray | None = None, bias_init: str | None = None,
                 data_format: str = "NCHW", dtype: Any = np.float32) -> None:
        super().__init__()
        self._common(in_channels, out_channels, has_bias)
        self.conv2d = ops.Conv2D(out_channels, kernel_size, pad_mode=pad_mode, pad=padding,
                                 stride=stride, dilation=dilation, group=group,
                                 data_format=data_format)
        self.kernel_size = self.conv2d.kernel_size
        self._parameters((out_channels, in_channels) + self.kernel_size, weight_init,
                         bias_init, dtype)

    def construct(self, x: Any) -> Any:
        return self._biased(self.conv2d(x, self.weight))


class Conv2dTranspose(_Conv):
    """MindSpore's ``nn.Conv2dTranspose(in_channels, out_channels, kernel_size, stride=1,
    pad_mode="same", padding=0, dilation=1, group=1, has_bias=False, ...)``: the weight is
    (in_channels, out_channels, kh, kw), the primitive ``conv2d_transpose``
    (:class:`~simpar.ops.Conv2DTranspose` of ``out_channel=in_channels``). The output's H is
    ``H * stride`` ('same'), ``(H - 1) * stride + span`` ('valid') or that less the padding
    ('pad'), span being ``dilation * (kh - 1) + 1``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, pad_mode: str = "same",
                 padding: int | tuple[int, int, int, int] = 0,
                 dilation: int | tuple[int, int] = 1, group: int = 1, has_bias: bool = False,
                 weight_init: str | np.ndarray | None = None, bias_init: str | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        self._common(in_channels, out_channels, has_bias)
        self.conv2d_transpose = ops.Conv2DTranspose(in_channels, kernel_size,
                                                    pad_mode=pad_mode, pad=padding,
                                                    stride=stride, dilation=dilation,
                                                    group=group)
        self.kernel_size = self.conv2d_transpose.kernel_size
        self._parameters((in_channels, out_channels) + self.kernel_size, weight_init,
                         bias_init, dtype)

    def _out_size(self, n: int, h: int, w: int) -> tuple[int, int, int, int]:
        op = self.conv2d_transpose
        sizes = []
        for d, (size, k, s, dil) in enumerate(zip((h, w), op.kernel_size, op.stride,
                                                  op.dilation)):
            span = dil * (k - 1) + 1
            if op.pad_mode == "same":
                sizes.append(size * s)
            else:
                pads = op.pad[2 * d] + op.pad[2 * d + 1]
                sizes.append((size - 1) * s + span - pads)
        return (n, self.out_channels, sizes[0], sizes[1])

    def construct(self, x: Any) -> Any:
        if len(x.shape) != 4:
            raise ValueError(f"Conv2dTranspose: x must be (N, C, H, W), got shape "
                             f"{tuple(x.shape)}")
        size = self._out_size(x.shape[0], x.shape[2], x.shape[3])
        return self._biased(self.conv2d_transpose(x, self.weight, size))


class _Pool2d(Cell):
    """A pooling layer: its primitive (``primitive``, a pooling op class) under MindSpore's
    attribute name (``attr``), and the check that the input is NCHW."""

    primitive: ClassVar[type[ops.Primitive]]
    attr: ClassVar[str]

    def __init__(self, kernel_size: int | tuple[int, int] = 1, stride: int | tuple[int, int] = 1,
                 pad_mode: str = "valid", data_format: str = "NCHW") -> None:
        super().__init__()
        self.kernel_size, self.stride, self.pad_mode = kernel_size, stride, pad_mode
        setattr(self, self.attr, self.primitive(kernel_size, stride, pad_mode,  # type: ignore
                                                data_format))

    def construct(self, x: Any) -> Any:
        if len(x.shape) != 4:
            raise ValueError(f"{type(self).__name__}: x must be (N, C, H, W), got shape "
                             f"{tuple(x.shape)}")
        return getattr(self, self.attr)(x)


class MaxPool2d(_Pool2d):
    """MindSpore's ``nn.MaxPool2d(kernel_size=1, stride=1, pad_mode="valid",
    data_format="NCHW")``, primitive ``max_pool``."""

    primitive = ops.MaxPool
    attr = "max_pool"


class AvgPool2d(_Pool2d):
    """MindSpore's ``nn.AvgPool2d(kernel_size=1, stride=1, pad_mode="valid",
    data_format="NCHW")``, primitive ``avg_pool``."""

    primitive = ops.AvgPool
    attr = "avg_pool"


class Flatten(Cell):
    """MindSpore's ``nn.Flatten(start_dim=1, end_dim=-1)``: dims ``start_dim..end_dim``
    merged into one; primitive ``flatten`` (:class:`~simpar.ops.Flatten`) for the default
    dims, else ``reshape``."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        for name, v in (("start_dim", start_dim), ("end_dim", end_dim)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"Flatten: {name} must be an int, got {v!r}")
        self.start_dim, self.end_dim = int(start_dim), int(end_dim)
        self.flatten = ops.Flatten()
        self.reshape = ops.Reshape()

    def construct(self, x: Any) -> Any:
        n = len(x.shape)
        lo, hi = (d + n if d < 0 else d for d in (self.start_dim, self.end_dim))
        if not 0 <= lo <= hi < n:
            raise ValueError(f"Flatten: start_dim {self.start_dim} and end_dim "
                             f"{self.end_dim} do not name dims in order of an input of rank "
                             f"{n}")
        if (lo, hi) == (1, n - 1):
            return self.flatten(x)
        shape = tuple(x.shape)
        return self.reshape(x, shape[:lo] + (math.prod(shape[lo:hi + 1]),) + shape[hi + 1:])


class ReLU(Cell):
    """MindSpore's ``nn.ReLU()``, primitive ``relu``."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = ops.ReLU()

    def construct(self, x: Any) -> Any:
        return self.relu(x)


class ReLU6(Cell):
    """MindSpore's ``nn.ReLU6()``, primitive ``relu6``."""

    def __init__(self) -> None:
        super().__init__()
        self.relu6 = ops.ReLU6()

    def construct(self, x: Any) -> Any:
        return self.relu6(x)


class SequentialCell(Cell):
    """MindSpore's ``nn.SequentialCell(cells)``: the cells run in order, named ``0``, ``1``,
    ... (a parameter of the second is ``<name>.1.weight``)."""

    def __init__(self, cells: Sequence[Cell]) -> None:
        super().__init__()
        if not isinstance(cells, (list, tuple)) or not all(isinstance(c, Cell) for c in cells):
            raise TypeError(f"SequentialCell: cells must be a list of Cells, got {cells!r}")
        self._order: list[Cell] = []
        for k, cell in enumerate(cells):
            setattr(self, str(k), cell)
            self._order.append(cell)

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, k: int) -> Cell:
        return self._order[k]

    def __iter__(self) -> Iterator[Cell]:
        return iter(self._order)

    def construct(self, x: Any) -> Any:
        for cell in self._order:
            x = cell(x)
        return x
