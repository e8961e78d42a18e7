"""ResNet, built as MindSpore's model zoo builds it (``official/cv/ResNet/src/resnet.py``):
the same cells, attribute names and order, so parameter names line up with a MindSpore
checkpoint or strategy file (``conv1.weight``, ``layer2.0.down_sample_layer.1.gamma``,
``end_point.weight``).

* :class:`ResidualBlock`: the bottleneck of ResNet-50/101/152 (1x1, 3x3 of the block's
  stride, 1x1 expanding 4 times, each followed by a BatchNorm2d), and
  :class:`ResidualBlockBase`, the basic block of ResNet-18/34 (two 3x3);
* :class:`ResNet`: a 7x7 stride-2 stem, BatchNorm, ReLU, a 3x3 stride-2 max pool, four stages
  of blocks, the global average (ReduceMean over H and W, keep_dims), Flatten and the
  ``end_point`` Dense classifier;
* :func:`resnet50`, :func:`resnet18` and :func:`resnet`, with ``width`` (the stem's channels,
  64 in the paper; every stage scales with it) and ``layer_nums`` (blocks per stage)
  configurable, so that a network of the same structure fits a test.

:func:`shard_classifier` is the ``semi_auto_parallel`` preset that cuts the classifier's
classes over ``mp`` devices (its weight rows and the loss's class axis), the rest data
parallel over ``dp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from simpar import ops
from simpar.nn.cell import Cell
from simpar.nn.conv_layers import Conv2d, Flatten, MaxPool2d, ReLU, SequentialCell
from simpar.nn.layers import BatchNorm2d, Dense, _check_sizes
from simpar.nn.loss import SoftmaxCrossEntropyWithLogits

__all__ = ["CrossEntropySmooth", "ResNet", "ResidualBlock", "ResidualBlockBase", "resnet",
           "resnet18", "resnet50", "shard_classifier"]


def _conv(cin: int, cout: int, k: int, stride: int, dtype: Any) -> Conv2d:
    if k == 7:   # the stem: MindSpore pads 3 on every side
        return Conv2d(cin, cout, 7, stride=stride, pad_mode="pad", padding=3, dtype=dtype)
    return Conv2d(cin, cout, k, stride=stride, pad_mode="same", dtype=dtype)


class ResidualBlock(Cell):
    """The bottleneck block: ``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) +
    identity)``, ``identity`` being x or, where the stride or the width changes,
    ``down_sample_layer(x)`` (a strided 1x1 convolution and a BatchNorm2d)."""

    expansion = 4

    def __init__(self, in_channel: int, out_channel: int, stride: int = 1,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        channel = out_channel // self.expansion
        self.conv1 = _conv(in_channel, channel, 1, 1, dtype)
        self.bn1 = BatchNorm2d(channel, dtype=dtype)
        self.conv2 = _conv(channel, channel, 3, stride, dtype)
        self.bn2 = BatchNorm2d(channel, dtype=dtype)
        self.conv3 = _conv(channel, out_channel, 1, 1, dtype)
        self.bn3 = BatchNorm2d(out_channel, dtype=dtype)
        self._shortcut(in_channel, out_channel, stride, dtype)

    def _shortcut(self, in_channel: int, out_channel: int, stride: int, dtype: Any) -> None:
        """The ReLU, the residual Add, and where the stride or the width changes the
        ``down_sample_layer`` (after the branch's cells, in MindSpore's order)."""
        self.relu = ReLU()
        self.add = ops.Add()
        self.down_sample = stride != 1 or in_channel != out_channel
        if self.down_sample:
            self.down_sample_layer = SequentialCell([_conv(in_channel, out_channel, 1, stride,
                                                           dtype),
                                                     BatchNorm2d(out_channel, dtype=dtype)])

    def _branch(self, x: Any) -> Any:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.bn3(self.conv3(out))

    def construct(self, x: Any) -> Any:
        identity = self.down_sample_layer(x) if self.down_sample else x
        return self.relu(self.add(self._branch(x), identity))


class ResidualBlockBase(ResidualBlock):
    """The basic block of ResNet-18/34: two 3x3 convolutions (the first of the block's
    stride), each with a BatchNorm2d, and the same shortcut."""

    expansion = 1

    def __init__(self, in_channel: int, out_channel: int, stride: int = 1,
                 dtype: Any = np.float32) -> None:
        Cell.__init__(self)
        self.conv1 = _conv(in_channel, out_channel, 3, stride, dtype)
        self.bn1d = BatchNorm2d(out_channel, dtype=dtype)
        self.conv2 = _conv(out_channel, out_channel, 3, 1, dtype)
        self.bn2d = BatchNorm2d(out_channel, dtype=dtype)
        self._shortcut(in_channel, out_channel, stride, dtype)

    def _branch(self, x: Any) -> Any:
        return self.bn2d(self.conv2(self.relu(self.bn1d(self.conv1(x)))))


class ResNet(Cell):
    """MindSpore's ``ResNet(block, layer_nums, in_channels, out_channels, strides,
    num_classes)``: stage k has ``layer_nums[k]`` blocks from ``in_channels[k]`` to
    ``out_channels[k]`` channels, its first block of stride ``strides[k]``. ``width`` is the
    stem's channels (64 in every published ResNet); ``image_channels`` the input's (3)."""

    def __init__(self, block: type[ResidualBlock], layer_nums: Sequence[int],
                 in_channels: Sequence[int], out_channels: Sequence[int],
                 strides: Sequence[int], num_classes: int, width: int = 64,
                 image_channels: int = 3, dtype: Any = np.float32) -> None:
        super().__init__()
        lengths = [len(v) for v in (layer_nums, in_channels, out_channels, strides)]
        if lengths != [4] * 4:
            raise ValueError("ResNet: layer_nums, in_channels, out_channels and strides must "
                             f"each list the 4 stages, got lengths {lengths}")
        _check_sizes("ResNet", num_classes=num_classes, width=width,
                     image_channels=image_channels,
                     **{f"layer_nums[{k}]": n for k, n in enumerate(layer_nums)})
        self.conv1 = _conv(image_channels, width, 7, 2, dtype)
        self.bn1 = BatchNorm2d(width, dtype=dtype)
        self.relu = ReLU()
        self.maxpool = MaxPool2d(kernel_size=3, stride=2, pad_mode="same")
        self.stages: list[SequentialCell] = []
        for k in range(4):
            blocks = [block(in_channels[k] if b == 0 else out_channels[k], out_channels[k],
                            strides[k] if b == 0 else 1, dtype=dtype)
                      for b in range(layer_nums[k])]
            stage = SequentialCell(blocks)
            setattr(self, f"layer{k + 1}", stage)
            self.stages.append(stage)
        self.mean = ops.ReduceMean(keep_dims=True, axis=(2, 3))
        self.flatten = Flatten()
        self.end_point = Dense(out_channels[3], num_classes, dtype=dtype,
                               weight_init="normal")
        self.num_classes = num_classes

    def construct(self, x: Any) -> Any:
        if len(x.shape) != 4:
            raise ValueError(f"ResNet: x must be images (N, C, H, W), got shape "
                             f"{tuple(x.shape)}")
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in self.stages:
            x = stage(x)
        return self.end_point(self.flatten(self.mean(x)))


def resnet(depth: int, num_classes: int = 1000, width: int = 64,
           layer_nums: Sequence[int] | None = None, image_channels: int = 3,
           dtype: Any = np.float32) -> ResNet:
    """A ResNet of the structure of ResNet-``depth`` (18 or 34: basic blocks; 50, 101 or
    152: bottlenecks), every width scaled by ``width / 64``, with ``layer_nums`` blocks per
    stage (default: the paper's for ``depth``)."""
    paper = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3),
             152: (3, 8, 36, 3)}
    if depth not in paper:
        raise ValueError(f"resnet: depth must be one of {sorted(paper)}, got {depth!r}")
    _check_sizes("resnet", width=width)
    block = ResidualBlockBase if depth < 50 else ResidualBlock
    w = width
    if block is ResidualBlockBase:
        ins, outs = (w, w, 2 * w, 4 * w), (w, 2 * w, 4 * w, 8 * w)
    else:
        ins, outs = (w, 4 * w, 8 * w, 16 * w), (4 * w, 8 * w, 16 * w, 32 * w)
    return ResNet(block, tuple(layer_nums or paper[depth]), ins, outs, (1, 2, 2, 2),
                  num_classes, width, image_channels, dtype)


def resnet50(num_classes: int = 1000, width: int = 64, dtype: Any = np.float32) -> ResNet:
    """ResNet-50 (bottlenecks, 3-4-6-3 blocks; 2048 features into the classifier)."""
    return resnet(50, num_classes, width, dtype=dtype)


def resnet18(num_classes: int = 1000, width: int = 64, dtype: Any = np.float32) -> ResNet:
    """ResNet-18 (basic blocks, 2-2-2-2; 512 features into the classifier)."""
    return resnet(18, num_classes, width, dtype=dtype)


class CrossEntropySmooth(Cell):
    """The loss MindSpore's ResNet trains with (its model zoo's ``CrossEntropySmooth(sparse,
    reduction, smooth_factor, num_classes)``): integer labels one-hot encoded (``onehot``,
    :class:`~simpar.ops.OneHot`) with ``1 - smooth_factor`` at the label and
    ``smooth_factor / (num_classes - 1)`` elsewhere, then the dense
    :class:`~simpar.nn.SoftmaxCrossEntropyWithLogits` (``ce``). With ``sparse=False`` the
    labels are already rows of probabilities."""

    def __init__(self, sparse: bool = True, reduction: str = "mean",
                 smooth_factor: float = 0.0, num_classes: int = 1000) -> None:
        super().__init__()
        _check_sizes("CrossEntropySmooth", num_classes=num_classes)
        if isinstance(smooth_factor, bool) or not isinstance(smooth_factor, (int, float)) or \
                not 0.0 <= smooth_factor < 1.0:
            raise ValueError(f"CrossEntropySmooth: smooth_factor must be a float in [0, 1), "
                             f"got {smooth_factor!r}")
        self.sparse, self.num_classes = sparse, num_classes
        self.on_value = 1.0 - smooth_factor
        self.off_value = smooth_factor / (num_classes - 1) if num_classes > 1 else 0.0
        self.onehot = ops.OneHot()
        self.ce = SoftmaxCrossEntropyWithLogits(sparse=False, reduction=reduction)

    def construct(self, logit: Any, label: Any) -> Any:
        if self.sparse:
            dtype = np.dtype(logit.dtype)
            label = self.onehot(label, self.num_classes, np.asarray(self.on_value, dtype),
                                np.asarray(self.off_value, dtype))
        return self.ce(logit, label)


def shard_classifier(net: ResNet, dp: int, mp: int, loss: Any = None) -> ResNet:
    """The classifier model parallel: ``end_point``'s weight rows (the classes) cut ``mp``
    ways, its input's rows ``dp`` ways, the loss's class axis ``mp`` ways (no logits
    gathered: the sparse cross entropy's ``ce``, or :class:`CrossEntropySmooth`'s one-hot
    labels and dense cross entropy); every convolution and BatchNorm data parallel over
    ``dp`` (on the batch)."""
    for _, cell in net.cells_and_names():
        if isinstance(cell, Conv2d):
            cell.conv2d.shard(((dp, 1, 1, 1), (1, 1, 1, 1)))
        elif isinstance(cell, BatchNorm2d):
            for bn in (cell.bn_train, cell.bn_infer):
                bn.shard(((dp, 1, 1, 1),) + ((1,),) * 4)
    net.end_point.matmul.shard(((dp, 1), (mp, 1)))
    net.end_point.bias_add.shard(((dp, mp), (mp,)))
    rows = ((dp, mp),)
    if isinstance(loss, CrossEntropySmooth):
        loss.onehot.shard((rows[0], (), ()))
        dense = loss.ce
        dense.log_softmax.shard(rows)
        dense.mul.shard(rows * 2)
        dense.sum_classes.shard(rows)
    elif loss is not None:
        loss.ce.shard(((dp, mp), (dp,)))
    return net
