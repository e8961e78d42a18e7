"""The convolutional layers and ResNet on one device: MindSpore's parameter names and shapes
(ResNet-50's 25,557,032 trainable values), the layers' output shapes and errors, and a tiny
ResNet's loss falling while its BatchNorms' moving statistics follow the batches (the
multi-rank checks are in tests/test_resnet_mpi.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from simpar import nn


def test_resnet50_has_the_names_and_size_of_mindspore() -> None:
    net = nn.resnet50(num_classes=1000)
    params = dict(net.parameters_and_names())
    trainable = sum(math.prod(p.shape) for p in params.values() if p.requires_grad)
    assert trainable == 25_557_032          # ResNet-50 as published (torchvision counts alike)
    for name in ("conv1.weight", "bn1.moving_mean", "layer1.0.conv2.weight",
                 "layer1.0.down_sample_layer.0.weight", "layer2.0.down_sample_layer.1.gamma",
                 "layer4.2.bn3.moving_variance", "end_point.weight", "end_point.bias"):
        assert name in params, name
    assert params["conv1.weight"].shape == (64, 3, 7, 7)
    assert params["layer3.5.conv3.weight"].shape == (1024, 256, 1, 1)
    assert params["end_point.weight"].shape == (1000, 2048)
    r18 = dict(nn.resnet18(num_classes=10).parameters_and_names())
    assert r18["layer2.0.conv1.weight"].shape == (128, 64, 3, 3)
    assert "layer1.0.down_sample_layer.0.weight" not in r18    # 64 -> 64, stride 1
    assert sum(math.prod(p.shape) for p in r18.values() if p.requires_grad) == 11_181_642


def test_tiny_resnet_learns_and_tracks_its_batch_statistics() -> None:
    net = nn.resnet(50, num_classes=4, width=4, layer_nums=(1, 1, 1, 1), dtype=np.float64)
    train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                                nn.Momentum(net.trainable_params(), 0.05, 0.9))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 3, 16, 16))
    y = rng.integers(0, 4, 8).astype(np.int32)
    losses = [train(x, y) for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0]
    # the stem's BatchNorm sees the same batch every step: its moving mean approaches the
    # batch mean as 1 - 0.9^steps
    assert not np.allclose(train.params["bn1.moving_mean"], 0.0)


@pytest.mark.parametrize("mode,stride,size,want", [
    ("same", 2, 5, 10), ("valid", 2, 5, 11), ("pad", 2, 5, 9), ("same", 1, 6, 6)])
def test_conv2d_transpose_output_size_inverts_conv2d(mode: str, stride: int, size: int,
                                                     want: int) -> None:
    pad = 1 if mode == "pad" else 0
    up = nn.Conv2dTranspose(4, 2, 3, stride=stride, pad_mode=mode, padding=pad,
                            dtype=np.float64)
    out = up(np.ones((1, 4, size, size)))
    assert out.shape == (1, 2, want, want)
    down = nn.Conv2d(2, 4, 3, stride=stride, pad_mode=mode, padding=pad, dtype=np.float64)
    assert down(out).shape == (1, 4, size, size)


def test_layers_shapes_and_errors() -> None:
    x = np.ones((2, 3, 8, 8))
    assert nn.MaxPool2d(3, 2, "same")(x).shape == (2, 3, 4, 4)
    assert nn.AvgPool2d(2, 2)(x).shape == (2, 3, 4, 4)
    assert nn.Flatten()(x).shape == (2, 192)
    assert nn.Flatten(2)(x).shape == (2, 3, 64)
    seq = nn.SequentialCell([nn.Conv2d(3, 4, 1, has_bias=True, dtype=np.float64), nn.ReLU6()])
    assert [n for n, _ in seq.parameters_and_names()] == ["0.weight", "0.bias"]
    assert seq(x).shape == (2, 4, 8, 8) and len(seq) == 2
    with pytest.raises(TypeError, match="SequentialCell: cells must be a list of Cells"):
        nn.SequentialCell([np.ones(2)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="MaxPool2d: x must be"):
        nn.MaxPool2d(2)(np.ones((2, 3, 8)))
    with pytest.raises(ValueError, match="depth must be one of"):
        nn.resnet(20)
    with pytest.raises(ValueError, match="Conv2D: group must be 1"):
        nn.Conv2d(4, 4, 3, group=2)


def test_label_smoothed_loss_is_that_of_mindspore() -> None:
    from simpar.nn.resnet import CrossEntropySmooth
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 5, 6).astype(np.int32)
    labels = np.full((6, 5), 0.1 / 4)
    labels[np.arange(6), y] = 0.9
    log_p = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    want = -(labels * log_p).sum(axis=1).mean()
    assert CrossEntropySmooth(smooth_factor=0.1, num_classes=5)(x, y) == pytest.approx(want)
    dense = nn.SoftmaxCrossEntropyWithLogits(sparse=False, reduction="sum")
    assert dense(x, labels) == pytest.approx(-(labels * log_p).sum())
    assert nn.SoftmaxCrossEntropyWithLogits(sparse=False)(x, np.eye(5)[y]) == pytest.approx(
        nn.SoftmaxCrossEntropyWithLogits()(x, y))
    with pytest.raises(ValueError, match=r"smooth_factor must be a float in \[0, 1\)"):
        CrossEntropySmooth(smooth_factor=1.0)


def test_an_op_of_scalars_plans_on_one_device() -> None:
    """The dense cross entropy ends with a product of two 0-d values: on one device its
    device matrix is one axis of one device (it had none, and no strategy was valid)."""
    from simpar import ops
    assert ops.Mul().sharding([(), ()], 1, ((), ())).device_matrix == (1,)
    net = nn.Dense(4, 3, dtype=np.float64)
    train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(
        sparse=False)), nn.SGD(net.trainable_params(), 0.1))
    assert np.isfinite(train(np.ones((2, 4)), np.eye(3)[[0, 1]]))


def test_a_written_value_laid_out_unlike_its_parameter_is_refused_at_lowering() -> None:
    """graph.update_parameter's value must be laid out as its parameter is stored: lowering
    refuses, naming both layouts, rather than every step moving it."""
    import simpar
    from simpar import graph, ops
    from simpar.runtime.lowering import build_program

    class Writes(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(np.zeros(4), requires_grad=False)
            self.mul = ops.Mul().shard(((1, 2), (2,)))
            self.total = ops.ReduceSum(axis=0).shard(((1, 1),))

        def construct(self, x: object) -> object:
            graph.update_parameter(self.p, self.total(x), 0.5)
            return self.mul(x, self.p)

    g = graph.trace(Writes(), [((4, 4), np.float64)])
    try:
        with pytest.raises(ValueError, match=r"lower: p is stored as .* but the value the "
                                             r"forward writes into it is laid out as"):
            build_program(g, 2, "semi_auto_parallel", "full_batch")
    finally:
        simpar.reset_auto_parallel_context()
