"""Convolution and pooling over NCHW images: Conv2D, Conv2DTranspose, MaxPool and AvgPool.

The kernels are GEMMs, never Python loops over pixels: a convolution is the sum over its
``kh x kw`` kernel offsets of one batched matrix product each, ``w[:, :, i, j] @ x(i, j)``
where ``x(i, j)`` is the strided view of the padded input that offset reads (9 GEMMs for a
3 x 3 kernel, each ``(C_out, C_in) @ (C_in, H_out W_out)`` per image); its input gradient
scatters the same products back, its weight gradient contracts ``dy`` with the same views.
Where those products would be thin (few input channels, as in the stem, or few output
pixels), the windows are unrolled into one matrix and multiplied once (im2col).
Pooling takes the max or the sum over the same views.

Sharding follows MindSpore's Conv2DInfo: the strategy is ``((n, c_in, h, w), (c_out, c_in, 1,
1))`` and the device matrix ``(n, c_in, h, w, c_out)``. Cutting the batch or the output
channels is local; cutting the input channels leaves each rank a partial sum of the output,
which one AllReduce completes (or a ReduceScatter, with an ``out_strategy``). H and W may be
cut where no window crosses a slice edge (the kernel's span at most its stride, each slice a
multiple of the stride, MindSpore's condition for splitting without exchanging overlaps):
every rank then convolves its own rows. A cut whose windows would need a neighbour's rows
(MindSpore's NeighborExchangeV2 halo) is refused with a ValueError naming the cut, never
computed wrong. Group convolutions are not supported (``group`` must be 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from simpar.ops._base import OpSharding, Primitive, register
from simpar.ops.comm_spec import ONE_DEVICE, Collectives
from simpar.ops.facts import CostClass
from simpar.ops.kernels import Tape, gradient_needed
from simpar.ops.strategy import IterSpace, Strategy, StrategyError

__all__ = ["AvgPool", "Conv2D", "Conv2DTranspose", "MaxPool"]

_PAD_MODES = ("valid", "same", "pad")


# ------------------------------------------------------------------ attributes
def _positive(op: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{op}: {name} must be >= 1, got {value}")
    return int(value)


def _pair(op: str, name: str, value: object, four: bool = False) -> tuple[int, int]:
    """An int or a tuple of 2 ints (of 4 with ``four``, MindSpore's ``(1, 1, h, w)``) as
    ``(h, w)``, each >= 1."""
    if isinstance(value, (tuple, list)):
        allowed = (2, 4) if four else (2,)
        if len(value) not in allowed:
            raise ValueError(f"{op}: {name} must be an int or a tuple of "
                             f"{' or '.join(map(str, allowed))} ints, got {value!r}")
        if len(value) == 4:
            if tuple(value[:2]) != (1, 1):
                raise ValueError(f"{op}: a 4-tuple {name} must start with (1, 1) (N and C "
                                 f"are not strided), got {value!r}")
            value = value[2:]
        return (_positive(op, name, value[0]), _positive(op, name, value[1]))
    n = _positive(op, name, value)
    return n, n


def _pad_mode(op: str, pad_mode: object, allowed: Sequence[str] = _PAD_MODES) -> str:
    if not isinstance(pad_mode, str) or pad_mode.lower() not in allowed:
        raise ValueError(f"{op}: pad_mode must be one of {', '.join(map(repr, allowed))}, got "
                         f"{pad_mode!r}")
    return pad_mode.lower()


def _pads(op: str, pad: object, pad_mode: str) -> tuple[int, int, int, int]:
    """``pad`` as (top, bottom, left, right); non-zero only with pad_mode 'pad'."""
    raw = (pad,) * 4 if not isinstance(pad, (tuple, list)) else tuple(pad)
    if len(raw) != 4:
        raise ValueError(f"{op}: pad must be an int or a tuple of 4 ints (top, bottom, left, "
                         f"right), got {pad!r}")
    for p in raw:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise TypeError(f"{op}: pad must hold ints, got {pad!r}")
        if p < 0:
            raise ValueError(f"{op}: pad must be >= 0, got {pad!r}")
    if pad_mode != "pad" and any(raw):
        raise ValueError(f"{op}: pad must be 0 unless pad_mode is 'pad', got pad={pad!r} with "
                         f"pad_mode={pad_mode!r}")
    return tuple(int(p) for p in raw)  # type: ignore[return-value]


def _check_float(op: str, what: str, x: np.ndarray) -> None:
    if x.dtype.kind != "f":
        raise TypeError(f"{op}: {what} must be a floating-point array, got dtype {x.dtype}")


# ------------------------------------------------------------------ geometry
@dataclass(frozen=True, slots=True)
class _Axis:
    """One spatial dimension of a window op: input ``size``, window ``kernel`` taps
    ``dilation`` apart, moved by ``stride``; ``lo``/``hi`` rows of padding; ``out`` windows."""

    size: int
    kernel: int
    stride: int
    dilation: int
    lo: int
    hi: int
    out: int

    @property
    def span(self) -> int:
        """Rows one window covers, its dilation included."""
        return self.dilation * (self.kernel - 1) + 1

    def taps(self, k: int) -> slice:
        """The padded rows that tap ``k`` of every window reads, one per window."""
        start = k * self.dilation
        return slice(start, start + self.stride * (self.out - 1) + 1, self.stride)


def _axis(size: int, kernel: int, stride: int, dilation: int, mode: str,
          pads: tuple[int, int]) -> _Axis:
    span = dilation * (kernel - 1) + 1
    if mode == "same":
        out = -(-size // stride)
        total = max((out - 1) * stride + span - size, 0)
        lo, hi = total // 2, total - total // 2
    else:
        lo, hi = pads if mode == "pad" else (0, 0)
        out = (size + lo + hi - span) // stride + 1 if size + lo + hi >= span else 0
    return _Axis(size, kernel, stride, dilation, lo, hi, out)


class _Window(Primitive):
    """What convolution and pooling share: the window attributes, the output geometry, and
    the sharding rule of an NCHW window op (spatial cuts only where no window crosses a
    slice)."""

    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)
    pad_mode: str
    pad: tuple[int, int, int, int] = (0, 0, 0, 0)

    def _axes(self, h: int, w: int) -> tuple[_Axis, _Axis]:
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        t, b, left, r = self.pad
        return (_axis(h, kh, sh, dh, self.pad_mode, (t, b)),
                _axis(w, kw, sw, dw, self.pad_mode, (left, r)))

    def _geometry(self, x: tuple[int, ...]) -> tuple[_Axis, _Axis]:
        if len(x) != 4:
            raise ValueError(f"{self.name}: x must be 4-D (N, C, H, W), got shape {tuple(x)}")
        ah, aw = self._axes(x[2], x[3])
        if ah.out < 1 or aw.out < 1:
            raise ValueError(
                f"{self.name}: the {ah.span}x{aw.span} window (kernel {self.kernel_size}, "
                f"dilation {self.dilation}) does not fit the input's H x W {x[2]}x{x[3]} "
                f"with pad_mode {self.pad_mode!r} and pad {self.pad}")
        return ah, aw

    def _check_spatial_cuts(self, x: tuple[int, ...], cuts: tuple[int, ...]) -> None:
        """Refuse an H or W cut whose windows would cross a slice edge."""
        axes = self._geometry(x)
        for name, cut, a in zip("HW", cuts, axes):
            if cut == 1:
                continue
            slice_rows = a.size // cut
            why = None
            if self.pad_mode == "pad" and (a.lo or a.hi):
                why = "pad_mode 'pad' pads the image's edges, not each slice's"
            elif a.span > a.stride:
                why = (f"a window spans {a.span} rows but moves {a.stride}, so windows at a "
                       "slice edge read the neighbour's rows (MindSpore exchanges that halo "
                       "with NeighborExchangeV2; simpar does not)")
            elif slice_rows % a.stride:
                why = f"a slice of {slice_rows} rows is not a multiple of the stride {a.stride}"
            elif a.out % cut:
                why = f"the output's {a.out} rows do not divide into {cut}"
            if why is not None:
                raise StrategyError(f"{self.name}: the strategy cuts {name} into {cut}, which "
                                    f"this op cannot compute on slices: {why}. Cut N or the "
                                    f"channels instead, or leave {name} whole")

    def _image(self, shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        """The (N, C, H, W) whose rows the windows walk: input 0 (Conv2DTranspose: its
        output)."""
        return shapes[0]

    def _strategy_allowed(self, strat: Strategy, shapes: tuple[tuple[int, ...], ...],
                          slice_align: int) -> bool:
        """Candidate strategies cut H and W only where :meth:`_check_spatial_cuts` allows."""
        try:
            self._check_spatial_cuts(self._image(shapes), strat[0][2:])
        except StrategyError:
            return False
        return True

    def attrs(self) -> dict[str, Any]:
        return {"kernel_size": self.kernel_size, "stride": self.stride,
                "dilation": self.dilation, "pad_mode": self.pad_mode, "pad": self.pad}


def _padded(x: np.ndarray, ah: _Axis, aw: _Axis, fill: float = 0.0) -> np.ndarray:
    if not (ah.lo or ah.hi or aw.lo or aw.hi):
        return x
    return np.pad(x, ((0, 0), (0, 0), (ah.lo, ah.hi), (aw.lo, aw.hi)), constant_values=fill)


def _padded_size(image: tuple[int, ...], ah: _Axis, aw: _Axis) -> int:
    """Elements of :func:`_padded`'s copy of ``image`` (0: no padding, no copy)."""
    if not (ah.lo or ah.hi or aw.lo or aw.hi):
        return 0
    return image[0] * image[1] * (ah.lo + ah.size + ah.hi) * (aw.lo + aw.size + aw.hi)


def _taps(ah: _Axis, aw: _Axis) -> list[tuple[int, int, slice, slice]]:
    return [(i, j, ah.taps(i), aw.taps(j)) for i in range(ah.kernel) for j in range(aw.kernel)]


# ------------------------------------------------------------------ convolution kernels
#: Below this many input channels or output pixels per image, a convolution is one GEMM over
#: its unrolled windows (im2col) instead of one per kernel tap: a tap's product would be too
#: thin for BLAS (ResNet's 3-channel stem, its 7 x 7 last stage). Measured in
#: benchmarks/conv.py.
_THIN = 64


def _thin(channels: int, ah: _Axis, aw: _Axis) -> bool:
    return min(channels, ah.out * aw.out) < _THIN


def _conv_workspace(image: tuple[int, ...], ah: _Axis, aw: _Axis, other: int) -> int:
    """Elements the convolution kernels over ``image`` (N, C, H, W) hold beside their
    operands, the larger of forward and backward: the padded copy (or the input gradient's
    padded buffer), the unrolled windows (im2col: ``kh * kw`` times the output pixels' share
    of the image) or one tap's slice, and a product of ``other`` elements (the output side:
    im2col's GEMM result before it is laid out NCHW, the weight gradient's rows of dy)."""
    n, c = image[:2]
    taps = ah.kernel * aw.kernel if _thin(c, ah, aw) else 1
    return _padded_size(image, ah, aw) + n * ah.out * aw.out * c * taps + other


def _unrolled(xp: np.ndarray, ah: _Axis, aw: _Axis) -> np.ndarray:
    """The padded input's windows as rows: (N * H_out * W_out, C * kh * kw), one copy."""
    n, c = xp.shape[:2]
    sn, sc, sh, sw = xp.strides
    windows = np.lib.stride_tricks.as_strided(
        xp, (n, ah.out, aw.out, c, ah.kernel, aw.kernel),
        (sn, sh * ah.stride, sw * aw.stride, sc, sh * ah.dilation, sw * aw.dilation),
        writeable=False)
    return windows.reshape(n * ah.out * aw.out, c * ah.kernel * aw.kernel)


def _conv(x: np.ndarray, w: np.ndarray, ah: _Axis, aw: _Axis) -> np.ndarray:
    """``y[n, o] = sum_{c, i, j} w[o, c, i, j] * x_padded[n, c, tap i, tap j]``."""
    n, c = x.shape[:2]
    xp = _padded(x, ah, aw)
    pixels = ah.out * aw.out
    o = w.shape[0]
    if _thin(c, ah, aw):
        y2 = _unrolled(xp, ah, aw) @ w.reshape(o, -1).T
        return np.ascontiguousarray(y2.reshape(n, ah.out, aw.out, o).transpose(0, 3, 1, 2))
    y = np.zeros((n, o, pixels), np.result_type(x, w))
    for i, j, rows, cols in _taps(ah, aw):
        y += np.matmul(w[:, :, i, j], xp[:, :, rows, cols].reshape(n, c, pixels))
    return y.reshape(n, o, ah.out, aw.out)


def _conv_input_grad(dy: np.ndarray, w: np.ndarray, ah: _Axis, aw: _Axis) -> np.ndarray:
    """The gradient of :func:`_conv` with respect to x (of H x W ``ah.size`` x ``aw.size``):
    each tap's ``w^T @ dy`` added back onto the rows that tap read."""
    n, c = dy.shape[0], w.shape[1]
    dyf = dy.reshape(n, dy.shape[1], -1)
    dxp = np.zeros((n, c, ah.lo + ah.size + ah.hi, aw.lo + aw.size + aw.hi),
                   np.result_type(dy, w))
    for i, j, rows, cols in _taps(ah, aw):
        dxp[:, :, rows, cols] += np.matmul(w[:, :, i, j].T, dyf).reshape(n, c, ah.out, aw.out)
    if not (ah.lo or ah.hi or aw.lo or aw.hi):
        return dxp
    return np.ascontiguousarray(dxp[:, :, ah.lo:ah.lo + ah.size, aw.lo:aw.lo + aw.size])


def _conv_weight_grad(dy: np.ndarray, x: np.ndarray, kernel: tuple[int, int], ah: _Axis,
                      aw: _Axis) -> np.ndarray:
    """The gradient of :func:`_conv` with respect to w: per tap, ``dy`` contracted with the
    rows that tap read, over the images and the output pixels."""
    n, c = x.shape[:2]
    xp = _padded(x, ah, aw)
    o = dy.shape[1]
    if _thin(c, ah, aw):
        rows_dy = dy.transpose(0, 2, 3, 1).reshape(-1, o)
        return (rows_dy.T @ _unrolled(xp, ah, aw)).reshape((o, c) + kernel)
    dyf = dy.reshape(n, o, -1)
    dw = np.empty((o, c) + kernel, np.result_type(dy, x))
    for i, j, rows, cols in _taps(ah, aw):
        taps = xp[:, :, rows, cols].reshape(n, c, -1)
        dw[:, :, i, j] = np.add.reduce(np.matmul(dyf, taps.transpose(0, 2, 1)), axis=0)
    return dw


# ------------------------------------------------------------------ Conv2D
class _ConvBase(_Window):
    """MindSpore's Conv2D attributes, checked as MindSpore checks them."""

    n_inputs = 2

    def __init__(self, out_channel: int, kernel_size: int | tuple[int, int], mode: int = 1,
                 pad_mode: str = "valid", pad: int | tuple[int, int, int, int] = 0,
                 stride: int | tuple[int, ...] = 1, dilation: int | tuple[int, ...] = 1,
                 group: int = 1, data_format: str = "NCHW") -> None:
        super().__init__()
        op = self.name
        self.out_channel = _positive(op, "out_channel", out_channel)
        self.kernel_size = _pair(op, "kernel_size", kernel_size)
        if mode != 1:
            raise ValueError(f"{op}: mode must be 1 (cross-correlation, MindSpore's only "
                             f"mode), got {mode!r}")
        self.mode = 1
        self.pad_mode = _pad_mode(op, pad_mode)
        self.pad = _pads(op, pad, self.pad_mode)
        self.stride = _pair(op, "stride", stride, four=True)
        self.dilation = _pair(op, "dilation", dilation, four=True)
        if _positive(op, "group", group) != 1:
            raise ValueError(f"{op}: group must be 1 (simpar has no grouped or depthwise "
                             f"convolution), got {group}")
        self.group = 1
        if data_format != "NCHW":
            raise ValueError(f"{op}: data_format must be 'NCHW' (the only format MindSpore "
                             f"shards), got {data_format!r}")
        self.data_format = data_format

    def attrs(self) -> dict[str, Any]:
        return {"out_channel": self.out_channel, **super().attrs(), "group": self.group,
                "data_format": self.data_format}

    def _check_weight(self, w: tuple[int, ...], channels: int, what: str) -> None:
        want = (self.out_channel, channels) + self.kernel_size
        if tuple(w) != want:
            raise ValueError(f"{self.name}: the weight has shape {tuple(w)} but must be "
                             f"(out_channel, {what}, kh, kw) = {want}")

    def _check_strategy(self, strat: Strategy, image: tuple[int, ...]) -> None:
        if strat[1][2:] != (1, 1):
            raise StrategyError(f"{self.name}: the kernel size can not be split, but the "
                                f"strategy for it is {strat[1][2:]} (strategy {strat})")
        self._check_spatial_cuts(image, strat[0][2:])


@register(mindspore_cost=CostClass.BATCH_PARALLEL, elementwise=False)
class Conv2D(_ConvBase):
    """MindSpore's ``Conv2D(out_channel, kernel_size, mode=1, pad_mode="valid", pad=0,
    stride=1, dilation=1, group=1, data_format="NCHW")``: x (N, C_in, H, W) and weight
    (C_out, C_in, kh, kw) give (N, C_out, H_out, W_out). ``pad_mode`` 'valid' pads nothing,
    'same' pads so that ``H_out = ceil(H / stride)`` (the odd row at the bottom), 'pad' pads
    by ``pad`` (an int or (top, bottom, left, right)).

    Strategy ``((n, c_in, h, w), (c_out, c_in, 1, 1))``, device matrix ``(n, c_in, h, w,
    c_out)`` as in MindSpore. ``Conv2D(8, 3, pad_mode="same").shard(((2, 2, 1, 1), (2, 2, 1,
    1)))`` on 8 devices, x (4, 4, 6, 6): rank 5 (coordinate (1, 0, 0, 0, 1)) holds images
    2..3, input channels 0..1 and output filters 4..7; its output is a partial sum over its
    two input channels, completed by an AllReduce over ranks [5, 7] (the c_in axis) of its
    (2, 4, 6, 6) block. ``((1, 1, 2, 1), ...)`` with a 3 x 3 kernel is refused (a window at
    the slice edge needs the neighbour's row); a 1 x 1 kernel, or a 2 x 2 one of stride 2,
    splits H freely.
    """

    tape = Tape.INPUTS

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x, w = (tuple(s) for s in shapes)
        ah, aw = self._geometry(x)
        self._check_weight(w, x[1], "C_in")
        return (x[0], self.out_channel, ah.out, aw.out)

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        self.infer_shape(*shapes)
        return IterSpace((("n", "i", "h", "w"), ("o", "i", None, None)), ("n", "o", "h", "w"),
                         ("n", "i", "h", "w", "o"))

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x, w = xs
        _check_float(self.name, "x", x)
        _check_float(self.name, "the weight", w)
        ah, aw = self._geometry(x.shape)
        return _conv(x, w, ah, aw)

    def vjp(self, xs: Sequence[np.ndarray], y: Any, dy: Any) -> tuple[np.ndarray | None, ...]:
        x, w = xs
        ah, aw = self._geometry(x.shape)
        dx = _conv_input_grad(dy, w, ah, aw) if gradient_needed(0) else None
        dw = _conv_weight_grad(dy, x, self.kernel_size, ah, aw) if gradient_needed(1) else None
        return dx, dw

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        (_, c, _, _), (_, _, kh, kw) = local_in
        return 2 * math.prod(local_out) * c * kh * kw

    def workspace(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]
                  ) -> int:
        ah, aw = self._geometry(local_in[0])
        return _conv_workspace(local_in[0], ah, aw, math.prod(local_out))

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        self._check_strategy(strat, self._image(shapes))
        return super()._sharding(shapes, strat, out_strategy, device_num, enable_alltoall)


@register(mindspore_cost=CostClass.BATCH_PARALLEL, elementwise=False)
class Conv2DTranspose(_ConvBase):
    """MindSpore's ``Conv2DTranspose`` (``Conv2DBackpropInput``): the gradient of a Conv2D
    with respect to its input, used as an upsampling layer. ``op(dout, weight, input_size)``
    with dout (N, C_out, h, w), weight (C_out, C_in, kh, kw) and ``input_size`` the (N, C_in,
    H, W) the matching Conv2D would read (also ``Conv2DTranspose(..., input_size=...)``);
    the attributes are that Conv2D's, and ``h, w`` must be what it gives for ``H, W``.

    Strategy ``((n, c_out, h, w), (c_out, c_in, 1, 1))``, device matrix ``(n, c_out, h, w,
    c_in)`` as MindSpore's Conv2DBackpropInputInfo: a c_out cut leaves each rank a partial
    sum of the output, completed by an AllReduce over the c_out axis. ``.shard(((2, 4, 1, 1),
    (4, 1, 1, 1)))`` on 8 devices: rank 5 holds images of batch half 1 and output channels
    of dout 2..3 (with 8 of them) and sums its part of the (N/2, C_in, H, W) output with
    ranks [4, 5, 6, 7].
    """

    tape = Tape.INPUTS

    def __init__(self, out_channel: int, kernel_size: int | tuple[int, int], mode: int = 1,
                 pad_mode: str = "valid", pad: int | tuple[int, int, int, int] = 0,
                 stride: int | tuple[int, ...] = 1, dilation: int | tuple[int, ...] = 1,
                 group: int = 1, data_format: str = "NCHW",
                 input_size: Sequence[int] | None = None) -> None:
        super().__init__(out_channel, kernel_size, mode, pad_mode, pad, stride, dilation, group,
                         data_format)
        self.input_size = None if input_size is None else self._input_size(input_size)

    def _input_size(self, size: object) -> tuple[int, int, int, int]:
        if not isinstance(size, (tuple, list)) or len(size) != 4:
            raise ValueError(f"{self.name}: input_size must be a tuple of 4 ints (N, C_in, H, "
                             f"W), got {size!r}")
        return tuple(_positive(self.name, "input_size", n) for n in size)  # type: ignore

    def __call__(self, *xs: Any) -> Any:
        if len(xs) == 3:
            self.input_size = self._input_size(xs[2])
            xs = xs[:2]
        return super().__call__(*xs)

    def attrs(self) -> dict[str, Any]:
        return {**super().attrs(), "input_size": self.input_size}

    def _out(self) -> tuple[int, int, int, int]:
        if self.input_size is None:
            raise ValueError(f"{self.name}: no input_size; call op(dout, weight, input_size) "
                             "or give Conv2DTranspose(..., input_size=(N, C_in, H, W))")
        return self.input_size

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        dout, w = (tuple(s) for s in shapes)
        out = self._out()
        ah, aw = self._geometry(out)
        want = (out[0], self.out_channel, ah.out, aw.out)
        if dout != want:
            raise ValueError(f"{self.name}: dout has shape {dout} but a Conv2D of these "
                             f"attributes maps input_size {out} to {want}")
        self._check_weight(w, out[1], "C_in")
        return out

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        self.infer_shape(*shapes)
        return IterSpace((("n", "o", "h", "w"), ("o", "i", None, None)), ("n", "i", "h", "w"),
                         ("n", "o", "h", "w", "i"))

    def _image(self, shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        return self._out()

    def _local_axes(self, dout: tuple[int, ...]) -> tuple[_Axis, _Axis]:
        """The geometry of the Conv2D whose input gradient this computes, for a shard whose
        H and W are ``dout``'s times the stride (a spatial cut, where allowed) or whole."""
        out = self._out()
        h, wd = out[2], out[3]
        ah, aw = self._axes(h, wd)
        if ah.out != dout[2]:
            h = dout[2] * ah.stride
        if aw.out != dout[3]:
            wd = dout[3] * aw.stride
        return self._axes(h, wd)

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        dout, w = xs
        _check_float(self.name, "dout", dout)
        _check_float(self.name, "the weight", w)
        ah, aw = self._local_axes(dout.shape)
        return _conv_input_grad(dout, w, ah, aw)

    def vjp(self, xs: Sequence[np.ndarray], y: Any, dy: Any) -> tuple[np.ndarray | None, ...]:
        dout, w = xs
        ah, aw = self._local_axes(dout.shape)
        g_dout = _conv(dy, w, ah, aw) if gradient_needed(0) else None
        g_w = _conv_weight_grad(dout, dy, self.kernel_size, ah, aw) if gradient_needed(1) \
            else None
        return g_dout, g_w

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        dout, (_, _, kh, kw) = local_in
        return 2 * math.prod(dout) * local_out[1] * kh * kw

    def workspace(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]
                  ) -> int:
        # The image its windows walk is its output (the Conv2D's input it is the gradient of).
        ah, aw = self._local_axes(local_in[0])
        return _conv_workspace(local_out, ah, aw, math.prod(local_in[0]))

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        self._check_strategy(strat, self._image(shapes))
        return super()._sharding(shapes, strat, out_strategy, device_num, enable_alltoall)


# ------------------------------------------------------------------ pooling
class _Pool(_Window):
    """MindSpore's ``MaxPool``/``AvgPool(kernel_size=1, strides=1, pad_mode="valid",
    data_format="NCHW")``; strategy ``((n, c, h, w),)``."""

    n_inputs = 1

    def __init__(self, kernel_size: int | tuple[int, ...] = 1, strides: int | tuple[int, ...] = 1,
                 pad_mode: str = "valid", data_format: str = "NCHW") -> None:
        super().__init__()
        self.kernel_size = _pair(self.name, "kernel_size", kernel_size, four=True)
        self.stride = _pair(self.name, "strides", strides, four=True)
        self.pad_mode = _pad_mode(self.name, pad_mode, ("valid", "same"))
        if data_format != "NCHW":
            raise ValueError(f"{self.name}: data_format must be 'NCHW', got {data_format!r}")
        self.data_format = data_format

    def attrs(self) -> dict[str, Any]:
        return {"kernel_size": self.kernel_size, "strides": self.stride,
                "pad_mode": self.pad_mode, "data_format": self.data_format}

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x = tuple(shapes[0])
        ah, aw = self._geometry(x)
        return (x[0], x[1], ah.out, aw.out)

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        self.infer_shape(*shapes)
        names = ("n", "c", "h", "w")
        return IterSpace((names,), names, names)

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        self._check_spatial_cuts(shapes[0], strat[0][2:])
        return super()._sharding(shapes, strat, out_strategy, device_num, enable_alltoall)

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return math.prod(local_out) * math.prod(self.kernel_size)

    def workspace(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]
                  ) -> int:
        """The padded copy (the backward's padded input gradient) and one output-sized
        temporary (a tap's window, its share of dy)."""
        ah, aw = self._geometry(local_in[0])
        return _padded_size(local_in[0], ah, aw) + math.prod(local_out)


@register(mindspore_cost=CostClass.GELU, elementwise=False)
class MaxPool(_Pool):
    """The max over each ``kernel_size`` window, moved by ``strides``; 'same' pads with
    -inf. The gradient goes to the first maximum of each window (numpy's argmax order, row
    by row), summed where windows overlap. The forward keeps each window's argmax (one byte
    per output element for windows of up to 256 taps), not the input.

    ``MaxPool(3, 2, "same").shard(((4, 2, 1, 1),))`` on 8 devices is local: rank 5 pools
    images 2..3 of its channel half. H or W may be cut only where windows do not overlap
    (``kernel_size <= strides``, slices a multiple of the stride)."""

    tape = Tape.MASK

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        return self._forward(xs[0])[0]

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _check_float(self.name, "x", x)
        ah, aw = self._geometry(x.shape)
        xp = _padded(x, ah, aw, -np.inf)
        taps = _taps(ah, aw)
        y = xp[:, :, taps[0][2], taps[0][3]].copy()
        arg = np.zeros(y.shape, np.uint8 if len(taps) <= 256 else np.int32)
        for k, (_, _, rows, cols) in enumerate(taps[1:], start=1):
            v = xp[:, :, rows, cols]
            better = v > y
            np.copyto(y, v, where=better)
            arg[better] = k
        return y, arg

    def vjp(self, xs: Sequence[np.ndarray], y: Any, dy: Any) -> tuple[np.ndarray | None, ...]:
        _, arg = self._forward(xs[0])
        return (self._backward(arg, dy, xs[0].shape),)

    def _backward(self, arg: np.ndarray, dy: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        ah, aw = self._geometry(shape)
        dxp = np.zeros(shape[:2] + (ah.lo + ah.size + ah.hi, aw.lo + aw.size + aw.hi),
                       dy.dtype)
        for k, (_, _, rows, cols) in enumerate(_taps(ah, aw)):
            dxp[:, :, rows, cols] += np.where(arg == k, dy, 0)
        return np.ascontiguousarray(dxp[:, :, ah.lo:ah.lo + ah.size, aw.lo:aw.lo + aw.size])

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        y, arg = self._forward(xs[0])
        return y, (arg, xs[0].shape)

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        arg, shape = saved
        return (self._backward(arg, dy, shape),)


@register(mindspore_cost=CostClass.GELU, elementwise=False)
class AvgPool(_Pool):
    """The mean over each ``kernel_size`` window, moved by ``strides``. With 'same', the
    padded taps are left out of each window's count (MindSpore's and TensorFlow's rule;
    PyTorch's ``count_include_pad=True`` default counts them). The backward reads only the
    shapes; the forward keeps nothing.

    ``AvgPool(2, 2).shard(((2, 1, 2, 2),))`` on 8 devices: non-overlapping windows, so each
    rank pools its own quarter of the image's rows and columns."""

    tape = Tape.NOTHING

    def _counts(self, ah: _Axis, aw: _Axis, dtype: np.dtype) -> np.ndarray | float:
        """How many real (unpadded) taps each window holds: one number without padding."""
        if not (ah.lo or ah.hi or aw.lo or aw.hi):
            return float(ah.kernel * aw.kernel)

        def per_axis(a: _Axis) -> np.ndarray:
            real = np.zeros(a.lo + a.size + a.hi)
            real[a.lo:a.lo + a.size] = 1
            return np.add.reduce([real[a.taps(k)] for k in range(a.kernel)], axis=0)

        return np.multiply.outer(per_axis(ah), per_axis(aw)).astype(dtype)

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x = xs[0]
        _check_float(self.name, "x", x)
        ah, aw = self._geometry(x.shape)
        xp = _padded(x, ah, aw)
        y = np.zeros(x.shape[:2] + (ah.out, aw.out), x.dtype)
        for _, _, rows, cols in _taps(ah, aw):
            y += xp[:, :, rows, cols]
        y /= self._counts(ah, aw, x.dtype)
        return y

    def vjp(self, xs: Sequence[np.ndarray], y: Any, dy: Any) -> tuple[np.ndarray | None, ...]:
        return (self._backward(dy, xs[0].shape),)

    def _backward(self, dy: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        ah, aw = self._geometry(shape)
        share = dy / self._counts(ah, aw, dy.dtype)
        dxp = np.zeros(shape[:2] + (ah.lo + ah.size + ah.hi, aw.lo + aw.size + aw.hi),
                       dy.dtype)
        for _, _, rows, cols in _taps(ah, aw):
            dxp[:, :, rows, cols] += share
        return np.ascontiguousarray(dxp[:, :, ah.lo:ah.lo + ah.size, aw.lo:aw.lo + aw.size])

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        return self.kernel(*xs), xs[0].shape

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        return (self._backward(dy, saved),)
