"""Conv2D, Conv2DTranspose, MaxPool, AvgPool, ReLU6, Exp, Log, Flatten, Squeeze and
ExpandDims on one device: the kernels against plain per-pixel references, every VJP against
finite differences, the output geometry of each pad mode against MindSpore's formulas, the
sharding rule's layouts against MindSpore's Conv2DInfo, and the errors of bad attributes,
shapes and strategies (the multi-rank checks are in tests/test_ops_conv_mpi.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from simpar import ops
from simpar.ops import StrategyError
from tests.ophelpers import fd_check

RNG = np.random.default_rng(32)


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def _reference_conv(x: np.ndarray, w: np.ndarray, stride: tuple[int, int],
                    dilation: tuple[int, int], pads: tuple[int, int, int, int]) -> np.ndarray:
    """Cross-correlation one output pixel at a time (the definition, slowly)."""
    t, b, left, r = pads
    xp = np.pad(x, ((0, 0), (0, 0), (t, b), (left, r)))
    o, _, kh, kw = w.shape
    oh = (xp.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (xp.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    y = np.zeros((x.shape[0], o, oh, ow))
    for p in range(oh):
        for q in range(ow):
            rows = p * stride[0] + dilation[0] * np.arange(kh)
            cols = q * stride[1] + dilation[1] * np.arange(kw)
            patch = xp[:, :, rows][:, :, :, cols]          # (N, C, kh, kw)
            y[:, :, p, q] = np.einsum("ncij,ocij->no", patch, w)
    return y


def _same_pads(size: int, k: int, s: int, d: int) -> tuple[int, int]:
    out = math.ceil(size / s)
    total = max((out - 1) * s + d * (k - 1) + 1 - size, 0)
    return total // 2, total - total // 2


CONV_CASES = [
    # (x shape, out_channel, kernel, pad_mode, pad, stride, dilation)
    ((2, 3, 7, 6), 4, 3, "valid", 0, 1, 1),
    ((2, 3, 7, 6), 4, 3, "same", 0, 2, 1),
    ((2, 3, 8, 8), 2, (3, 2), "same", 0, (1, 2), 1),
    ((1, 2, 9, 7), 3, 3, "pad", (1, 2, 0, 1), 2, 2),
    ((2, 4, 6, 6), 5, 1, "valid", 0, 2, 1),
    ((1, 2, 5, 5), 2, 2, "same", 0, 1, (2, 1)),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=[f"{c[3]}-k{c[2]}-s{c[5]}" for c in CONV_CASES])
def test_conv2d_matches_the_definition_and_finite_differences(case: tuple) -> None:
    shape, o, k, mode, pad, stride, dilation = case
    op = ops.Conv2D(o, k, pad_mode=mode, pad=pad, stride=stride, dilation=dilation)
    x, w = _r(*shape), _r(o, shape[1], *op.kernel_size)
    sh, sw = op.stride
    dh, dw = op.dilation
    if mode == "same":
        pads = (*_same_pads(shape[2], op.kernel_size[0], sh, dh),
                *_same_pads(shape[3], op.kernel_size[1], sw, dw))
    else:
        pads = op.pad
    want = _reference_conv(x, w, (sh, sw), (dh, dw), pads)
    got = op(x, w)
    assert got.shape == op.infer_shape(x.shape, w.shape) == want.shape
    if mode == "same":
        assert got.shape[2:] == (math.ceil(shape[2] / sh), math.ceil(shape[3] / sw))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    fd_check(op, [x, w])


@pytest.mark.parametrize("case", CONV_CASES[:4], ids=[c[3] for c in CONV_CASES[:4]])
def test_conv2d_transpose_is_the_input_gradient_of_conv2d(case: tuple) -> None:
    shape, o, k, mode, pad, stride, dilation = case
    conv = ops.Conv2D(o, k, pad_mode=mode, pad=pad, stride=stride, dilation=dilation)
    x, w = _r(*shape), _r(o, shape[1], *conv.kernel_size)
    y = conv(x, w)
    dy = _r(*y.shape)
    tr = ops.Conv2DTranspose(o, k, pad_mode=mode, pad=pad, stride=stride, dilation=dilation)
    got = tr(dy, w, shape)
    np.testing.assert_allclose(got, conv.vjp([x, w], y, dy)[0], rtol=1e-12, atol=1e-12)
    fd_check(tr, [dy, w])


@pytest.mark.parametrize("mode,k,s", [("valid", 2, 2), ("same", 3, 2), ("valid", 3, 1),
                                      ("same", (2, 3), (1, 2))])
def test_pools_match_the_definition_and_finite_differences(mode: str, k: object,
                                                           s: object) -> None:
    x = _r(2, 3, 7, 6)
    mx, av = ops.MaxPool(k, s, mode), ops.AvgPool(k, s, mode)
    (kh, kw), (sh, sw) = mx.kernel_size, mx.stride
    pads = (*_same_pads(7, kh, sh, 1), *_same_pads(6, kw, sw, 1)) if mode == "same" \
        else (0, 0, 0, 0)
    t, b, left, r = pads
    xp = np.pad(x, ((0, 0), (0, 0), (t, b), (left, r)), constant_values=np.nan)
    y_max, y_avg = mx(x), av(x)
    for p in range(y_max.shape[2]):
        for q in range(y_max.shape[3]):
            patch = xp[:, :, p * sh:p * sh + kh, q * sw:q * sw + kw]
            np.testing.assert_allclose(y_max[:, :, p, q], np.nanmax(patch, axis=(2, 3)))
            # 'same' leaves the padded taps out of the mean (MindSpore's rule)
            np.testing.assert_allclose(y_avg[:, :, p, q], np.nanmean(patch, axis=(2, 3)))
    fd_check(mx, [x])
    fd_check(av, [x])


def test_maxpool_gradient_goes_to_the_first_maximum_of_each_window() -> None:
    x = np.zeros((1, 1, 2, 4))
    x[0, 0, 1, 1] = 1.0
    op = ops.MaxPool(2, 2)
    dx = op.vjp([x], op(x), np.array([[[[3.0, 5.0]]]]))[0]
    want = np.zeros_like(x)
    want[0, 0, 1, 1] = 3.0          # the window's only maximum
    want[0, 0, 0, 2] = 5.0          # a window of equal values: its first tap
    np.testing.assert_array_equal(dx, want)


@pytest.mark.parametrize("make,x", [
    (ops.ReLU6, np.linspace(-2, 8, 24).reshape(4, 6) + 0.01),
    (ops.Exp, _r(3, 4)),
    (ops.Log, 0.5 + np.abs(_r(3, 4))),
])
def test_unary_ops(make: type[ops.Primitive], x: np.ndarray) -> None:
    op = make()
    want = {ops.ReLU6: lambda v: np.minimum(np.maximum(v, 0), 6), ops.Exp: np.exp,
            ops.Log: np.log}[make](x)
    np.testing.assert_array_equal(op(x), want)
    fd_check(op, [x])


def test_shape_ops() -> None:
    x = _r(2, 3, 1, 4)
    assert ops.Flatten()(x).shape == (2, 12)
    np.testing.assert_array_equal(ops.Flatten()(x), x.reshape(2, 12))
    assert ops.Squeeze()(x).shape == (2, 3, 4)
    assert ops.Squeeze(2)(x).shape == (2, 3, 4)
    assert ops.ExpandDims()(x, 0).shape == (1, 2, 3, 1, 4)
    assert ops.ExpandDims(-1)(x).shape == (2, 3, 1, 4, 1)
    for op in (ops.Flatten(), ops.Squeeze(2), ops.ExpandDims(1)):
        fd_check(op, [x])
    with pytest.raises(ValueError, match="axis 1 of shape .* has size 3"):
        ops.Squeeze(1)(x)
    with pytest.raises(ValueError, match=r"axis 5 is outside \[-5, 4\]"):
        ops.ExpandDims(5)(x)
    with pytest.raises(TypeError, match="Squeeze: axis must be an int"):
        ops.Squeeze(1.5)  # type: ignore[arg-type]


# ------------------------------------------------------------------ layouts and strategies
def test_conv2d_layouts_are_those_of_mindspore() -> None:
    """Device matrix (n, c_in, h, w, c_out); x mapped (4, 3, 2, 1), w (0, 3, -1, -1), the
    output (4, 0, 2, 1), as Conv2DInfo's tensor maps; the c_in cut leaves it partial."""
    op = ops.Conv2D(8, 3, pad_mode="same").shard(((2, 2, 1, 1), (2, 2, 1, 1)))
    sh = op.sharding([(4, 4, 6, 6), (8, 4, 3, 3)], 8)
    assert sh.device_matrix == (2, 2, 1, 1, 2)
    assert sh.in_layouts[0].tensor_map == (4, 3, 2, 1)
    assert sh.in_layouts[1].tensor_map == (0, 3, -1, -1)
    assert sh.raw_out.tensor_map == (4, 0, 2, 1)
    assert sh.raw_out.is_partial and not sh.out.is_partial
    assert [c.kind for c in sh.forward_comm] == ["AllReduce"]
    assert sh.in_layouts[0].slice_of(5) == ((2, 4), (0, 2), (0, 6), (0, 6))
    assert sh.in_layouts[1].slice_of(5) == ((4, 8), (0, 2), (0, 3), (0, 3))
    tr = ops.Conv2DTranspose(8, 3, pad_mode="same", input_size=(4, 2, 6, 6))
    tsh = tr.shard(((2, 4, 1, 1), (4, 1, 1, 1))).sharding([(4, 8, 6, 6), (8, 2, 3, 3)], 8)
    assert tsh.device_matrix == (2, 4, 1, 1, 1)   # (n, c_out, h, w, c_in)
    assert tsh.raw_out.is_partial


def test_spatial_cuts_only_where_no_window_crosses_a_slice() -> None:
    x, w3, w1 = (2, 2, 8, 8), (4, 2, 3, 3), (4, 2, 1, 1)
    with pytest.raises(StrategyError, match="cuts H into 2.*halo"):
        ops.Conv2D(4, 3, pad_mode="same").sharding([x, w3], 2, ((1, 1, 2, 1), (1, 1, 1, 1)))
    with pytest.raises(StrategyError, match="kernel size can not be split"):
        ops.Conv2D(4, 2).sharding([x, (4, 2, 2, 2)], 2, ((1, 1, 1, 1), (1, 1, 2, 1)))
    with pytest.raises(StrategyError, match="pad_mode 'pad'"):
        ops.Conv2D(4, 1, pad_mode="pad", pad=1).sharding([x, w1], 2,
                                                          ((1, 1, 2, 1), (1, 1, 1, 1)))
    with pytest.raises(StrategyError, match="not a multiple of the stride 3"):
        ops.MaxPool(3, 3).sharding([(1, 1, 10, 12)], 2, ((1, 1, 2, 1),))
    # a 1x1 kernel and non-overlapping pooling windows split H and W with nothing exchanged
    sh = ops.Conv2D(4, 1, stride=2).sharding([x, w1], 4, ((1, 1, 2, 2), (1, 1, 1, 1)))
    assert sh.out.local_shape() == (2, 4, 2, 2) and not sh.forward_comm
    sh = ops.MaxPool(2, 2).sharding([(2, 2, 8, 8)], 4, ((1, 1, 2, 2),))
    assert sh.out.local_shape() == (2, 2, 2, 2)
    cands = ops.Conv2D(4, 3, pad_mode="same").candidate_strategies([x, w3], 4, False)
    assert all(s[0][2:] == (1, 1) for s in cands) and len(cands) > 4


@pytest.mark.parametrize("make,error,match", [
    (lambda: ops.Conv2D(4, 3, group=2), ValueError, "group must be 1"),
    (lambda: ops.Conv2D(4, 3, pad_mode="full"), ValueError, "pad_mode must be one of"),
    (lambda: ops.Conv2D(4, 3, pad=1), ValueError, "pad must be 0 unless pad_mode is 'pad'"),
    (lambda: ops.Conv2D(4, (3, 3, 3)), ValueError, "kernel_size must be an int or a tuple"),
    (lambda: ops.Conv2D(4, 3, stride=(2, 2, 1, 1)), ValueError, "must start with"),
    (lambda: ops.Conv2D(0, 3), ValueError, "out_channel must be >= 1"),
    (lambda: ops.Conv2D(4, 3.0), TypeError, "kernel_size must be an int"),
    (lambda: ops.Conv2D(4, 3, data_format="NHWC"), ValueError, "data_format must be 'NCHW'"),
    (lambda: ops.MaxPool(2, 2, "pad"), ValueError, "pad_mode must be one of 'valid', 'same'"),
    (lambda: ops.Conv2D(4, 3, pad_mode="pad", pad=(1, 2)), ValueError, "tuple of 4 ints"),
])
def test_bad_attributes(make: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()  # type: ignore[operator]


def test_bad_shapes() -> None:
    op = ops.Conv2D(4, 3)
    with pytest.raises(ValueError, match=r"weight has shape \(4, 2, 3, 3\) but must be "
                                         r"\(out_channel, C_in, kh, kw\) = \(4, 3, 3, 3\)"):
        op.infer_shape((1, 3, 8, 8), (4, 2, 3, 3))
    with pytest.raises(ValueError, match="x must be 4-D"):
        op.infer_shape((3, 8, 8), (4, 3, 3, 3))
    with pytest.raises(ValueError, match="does not fit the input's H x W 2x8"):
        op.infer_shape((1, 3, 2, 8), (4, 3, 3, 3))
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        op(np.ones((1, 3, 4, 4), np.int64), np.ones((4, 3, 3, 3)))
    tr = ops.Conv2DTranspose(4, 3)
    with pytest.raises(ValueError, match="no input_size"):
        tr(_r(1, 4, 2, 2), _r(4, 3, 3, 3))
    with pytest.raises(ValueError, match=r"dout has shape \(1, 4, 3, 3\) but"):
        tr(_r(1, 4, 3, 3), _r(4, 3, 3, 3), (1, 3, 4, 4))


@pytest.mark.parametrize("case", CONV_CASES, ids=[f"{c[3]}-k{c[2]}-s{c[5]}" for c in CONV_CASES])
def test_per_tap_and_unrolled_kernels_agree(case: tuple, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """Both ways of computing a convolution (a GEMM per kernel tap; one GEMM over the
    unrolled windows, for thin products) give the same forward and weight gradient."""
    from simpar.ops import conv
    shape, o, k, mode, pad, stride, dilation = case
    op = ops.Conv2D(o, k, pad_mode=mode, pad=pad, stride=stride, dilation=dilation)
    x, w = _r(*shape), _r(o, shape[1], *op.kernel_size)
    results = []
    for thin in (0, 10**9):          # never thin: per tap; always thin: unrolled
        monkeypatch.setattr(conv, "_THIN", thin)
        y = op.kernel(x, w)
        results.append((y, *op.vjp([x, w], y, np.ones_like(y))))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
