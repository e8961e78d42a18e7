"""Neural-network operators whose reductions may run across shards: Softmax, LogSoftmax,
LayerNorm, BatchNorm and SparseSoftmaxCrossEntropyWithLogits.

Each of them reduces along some axes (the softmax axis, the normalised axes, the batch and
spatial axes of BatchNorm's statistics, the classes).
When the strategy splits such an axis, the op never gathers its input: every rank reduces its
own piece and one small AllReduce over the ranks that split the axis completes the per-row
statistic (Megatron's vocabulary-parallel cross entropy, generalised). These collectives are
the op's *internal* ones, listed as :class:`~simpar.ops._base.CommSpec` values in
``internal_forward``/``internal_backward`` so that ``get_parallel_info`` predicts the trace
exactly. When no reduced axis is split they run no collective at all.

Single-device kernels and per-rank kernels share one implementation: each takes a ``reduce``
hook that is the identity on one device and an AllReduce over the splitting group on a shard,
so the two can only differ by the order of floating-point summation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from simpar import _checks as checks
from simpar.ops._base import OpSharding, Primitive, register
from simpar.ops.comm_spec import ONE_DEVICE, Collectives, CommSpec
from simpar.ops.facts import CostClass
from simpar.ops.kernels import Tape
from simpar.ops.strategy import IterSpace, Strategy, dim_names
from simpar.redistribution import ALL_REDUCE, plan

__all__ = ["BatchNorm", "LayerNorm", "LogSoftmax", "Softmax",
           "SparseSoftmaxCrossEntropyWithLogits"]

# The ufuncs' own reductions: np.sum and np.max are the same C loops behind two Python layers,
# and the kernels below call them on every step.
_sum = np.add.reduce
_max = np.maximum.reduce

#: ``reduce(local_partial, how, what)``: the value over the whole reduced axis ("sum"/"max").
_Reduce = Callable[[np.ndarray, str, str], np.ndarray]


def _identity(x: np.ndarray, how: str, what: str) -> np.ndarray:
    return x


def _row_statistics(sh: OpSharding, axes: Sequence[int], rows: int,
                    forward: Sequence[tuple[str, int, str]],
                    backward: Sequence[tuple[str, int, str]]) -> OpSharding:
    """``sh`` with the AllReduces that complete per-row statistics over input 0's ``axes``
    where device axes cut them (Softmax's max and sum, LayerNorm's mean and variance): one per
    ``(what, numbers per row, how)`` of ``forward`` and ``backward``, over ``rows`` local rows,
    in the order the kernel reduces. ``sh`` itself when no device axis cuts ``axes``."""
    group = sh.device_axes_cutting([f"d{a}" for a in axes])
    if not group:
        return sh
    dm = sh.device_matrix

    def specs(items: Sequence[tuple[str, int, str]]) -> tuple[CommSpec, ...]:
        return tuple(CommSpec(ALL_REDUCE, dm, group, per_row * rows, what, how=how)
                     for what, per_row, how in items)

    return dataclasses.replace(sh, internal_forward=specs(forward),
                               internal_backward=specs(backward))


def _group_reduce(sh: OpSharding, specs: Sequence[CommSpec], collectives: Collectives
                  ) -> _Reduce:
    """The hook that completes the kernel's local reductions: its k-th call runs ``specs[k]``
    (the op's listed collectives, in the order the kernel needs them) through
    ``collectives``. Identity if none."""
    if not specs:
        return _identity
    pending = iter(specs)

    def reduce(x: np.ndarray, how: str, what: str) -> np.ndarray:
        spec = next(pending)
        assert spec.how == how, (sh.op.name, what, spec)
        return collectives.all_reduce(spec, x, what)

    return reduce


def _check_int_attr(op: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_float(op: str, what: str, x: np.ndarray) -> None:
    if x.dtype.kind != "f":
        raise TypeError(f"{op}: {what} must be a floating-point array, got dtype {x.dtype}")


# ------------------------------------------------------------------ Softmax / LogSoftmax
def _softmax(x: np.ndarray, axes: tuple[int, ...], log: bool, reduce: _Reduce) -> np.ndarray:
    # The max is only a shift for stability: the backward treats it as a constant (exactly).
    m = reduce(_max(x, axis=axes, keepdims=True), "max", "max")
    z = x - m
    if log:
        s = reduce(_sum(np.exp(z), axis=axes, keepdims=True), "sum", "sum-exp")
        z -= np.log(s)
        return z
    np.exp(z, out=z)   # in place: one array for the shift, the exponentials and the result
    z /= reduce(_sum(z, axis=axes, keepdims=True), "sum", "sum-exp")
    return z


def _softmax_grad(y: np.ndarray, dy: np.ndarray, axes: tuple[int, ...], log: bool,
                  reduce: _Reduce) -> np.ndarray:
    if log:
        t = reduce(_sum(dy, axis=axes, keepdims=True), "sum", "grad-sum")
        e = np.exp(y)
        e *= t
        return np.subtract(dy, e, out=e)
    g = y * dy
    t = reduce(_sum(g, axis=axes, keepdims=True), "sum", "grad-sum")
    np.subtract(dy, t, out=g)
    g *= y
    return g


class _SoftmaxBase(Primitive):
    """Shared rule: every dim is an iteration dim; a split softmax axis adds internal
    AllReduces (max and sum of exp forward, one sum backward) over the splitting ranks."""

    tape = Tape.OUTPUT

    n_inputs = 1
    log: bool = False

    def __init__(self, axis: int | tuple[int, ...] = -1) -> None:
        super().__init__()
        self.axis = self._check_axis(axis)

    def _check_axis(self, axis: object) -> int | tuple[int, ...]:
        return _check_int_attr(self.name, "axis", axis)

    def attrs(self) -> dict[str, Any]:
        return {"axis": self.axis}

    def _axes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        raw = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        axes = tuple(checks.axis(a, len(shape), f"{self.name}: axis") for a in raw)
        if len(set(axes)) != len(axes):
            raise ValueError(f"{self.name}: axis {self.axis} names dimension(s) more than once "
                             f"for an input of rank {len(shape)}")
        return tuple(sorted(axes))

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        self._axes(shapes[0])
        return shapes[0]

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        return IterSpace.pointwise(len(self.infer_shape(*shapes)))

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x = xs[0]
        _check_float(self.name, "the input", x)
        return _softmax(x, self._axes(x.shape), self.log, _identity)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        return (_softmax_grad(y, dy, self._axes(xs[0].shape), self.log, _identity),)

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 5 * math.prod(local_out)

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        sh = super()._sharding(shapes, strat, out_strategy, device_num, enable_alltoall)
        axes = self._axes(shapes[0])
        local = sh.in_layouts[0].local_shape()
        rows = math.prod(n for d, n in enumerate(local) if d not in axes)
        what = "sum of dy" if self.log else "sum of y*dy"
        return _row_statistics(
            sh, axes, rows,
            forward=((f"{self.name}: max over the split axis", 1, "max"),
                     (f"{self.name}: sum of exp over the split axis", 1, "sum")),
            backward=((f"{self.name}: {what} over the split axis", 1, "sum"),))

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        x = xs[0]
        _check_float(self.name, "the input", x)
        y = _softmax(x, self._axes(sh.input_shapes[0]), self.log,
                     _group_reduce(sh, sh.internal_forward, collectives))
        return y, y

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        return (_softmax_grad(saved, dy, self._axes(sh.input_shapes[0]), self.log,
                              _group_reduce(sh, sh.internal_backward, collectives)),)


@register(mindspore_cost=CostClass.SOFTMAX, elementwise=True)
class Softmax(_SoftmaxBase):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis`` (an int or a tuple of ints).

    Any axis may be split. ``Softmax().shard(((2, 4),))`` on 8 devices, x of shape (8, 16):
    device matrix [2, 4]; rank 5 (coordinate (1, 1)) holds rows 4..7 and columns 4..7. It takes
    the max of its 4 columns per row, AllReduce(max) over ranks [4, 5, 6, 7] (4 numbers), then
    the sum of its 4 exponentials per row, AllReduce(sum) over the same ranks, and divides: its
    output shard is exactly rows 4..7, columns 4..7 of the single-device softmax. Backward:
    ``dx = y * (dy - AllReduce(sum_local(y * dy)))``, again 4 numbers per rank.
    """

    def _check_axis(self, axis: object) -> int | tuple[int, ...]:
        if isinstance(axis, (tuple, list)):
            if not axis:
                raise ValueError(f"{self.name}: axis must be an int or a non-empty tuple of "
                                 "ints, got ()")
            return tuple(_check_int_attr(self.name, "axis", a) for a in axis)
        return _check_int_attr(self.name, "axis", axis)


@register(mindspore_cost=CostClass.SOFTMAX, elementwise=True)
class LogSoftmax(_SoftmaxBase):
    """``x - max - log(sum(exp(x - max)))`` along ``axis`` (an int, as in MindSpore).

    A split axis works as for :class:`Softmax` (AllReduce(max), AllReduce(sum) forward); the
    backward is ``dx = dy - exp(y) * AllReduce(sum_local(dy))``. On rank 5 of
    ``LogSoftmax().shard(((2, 4),))`` over (8, 16), each of the three AllReduces carries the 4
    per-row numbers of rows 4..7 among ranks [4, 5, 6, 7].
    """

    log = True


# ------------------------------------------------------------------ LayerNorm
def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, axes: tuple[int, ...],
                count: int, eps: float, reduce: _Reduce
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Two passes (mean, then squared deviations) rather than one fused [sum x, sum x^2]:
    # E[x^2] - E[x]^2 loses relative precision ~ eps * mean^2 / var, which float32
    # activations with a large mean cannot afford. Both AllReduces carry one number per row.
    mean = reduce(_sum(x, axis=axes, keepdims=True), "sum", "sum-x") / count
    xhat = x - mean
    var = reduce(_sum(np.square(xhat), axis=axes, keepdims=True), "sum", "sum-sq-dev") / count
    rstd = 1.0 / np.sqrt(var + eps)
    xhat *= rstd        # the centred x becomes x-hat in place
    y = xhat * gamma
    y += beta
    return y, xhat, rstd


def _layer_norm_grad(dy: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, gamma: np.ndarray,
                     axes: tuple[int, ...], lead: tuple[int, ...], count: int,
                     reduce: _Reduce) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = dy * gamma
    gx = g * xhat
    both = np.empty((2, *g.shape[:axes[0]], *(1,) * len(axes)), g.dtype)
    _sum(g, axis=axes, keepdims=True, out=both[0])
    _sum(gx, axis=axes, keepdims=True, out=both[1])
    sums = reduce(both, "sum", "grad-sums")
    np.multiply(dy, xhat, out=gx)
    dgamma = _sum(gx, axis=lead)
    dbeta = _sum(dy, axis=lead)
    # dx = rstd (g - mean(g) - xhat mean(g xhat)), into g and gx in place
    g -= sums[0] / count
    g -= np.multiply(xhat, sums[1] / count, out=gx)
    g *= rstd
    return g, np.asarray(dgamma), np.asarray(dbeta)


@functools.lru_cache(maxsize=1024)  # asked on every step, for the same few shapes
def _ln_geometry(x: tuple[int, ...], begin_norm_axis: int, begin_params_axis: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(normalised axes, leading axes of gamma's gradient, elements per normalised row)."""
    bna = checks.axis(begin_norm_axis, len(x), "LayerNorm: begin_norm_axis")
    bpa = checks.axis(begin_params_axis, len(x), "LayerNorm: begin_params_axis")
    return tuple(range(bna, len(x))), tuple(range(bpa)), math.prod(x[bna:])


@register(mindspore_cost=CostClass.LAYER_NORM, elementwise=False)
class LayerNorm(Primitive):
    """``(x - mean) / sqrt(var + epsilon) * gamma + beta``; mean and variance over the dims
    ``begin_norm_axis..``, ``gamma``/``beta`` of shape ``x.shape[begin_params_axis:]``.

    Unlike MindSpore, which returns ``(y, mean, variance)``, this returns ``y`` only (the
    statistics are internal; the backward recomputes nothing and needs no extra output).

    gamma's and beta's cuts must equal x's on the dims they share. The normalised axes may be
    split: ``LayerNorm().shard(((2, 4), (4,), (4,)))`` on 8 devices, x (8, 16), gamma (16,):
    device matrix [2, 4]; rank 5 holds rows 4..7, columns 4..7 of x and gamma[4:8]. It sums its
    4 columns per row and AllReduces the 4 row sums over ranks [4, 5, 6, 7] (the mean), then
    does the same with its squared deviations (the variance): two AllReduces of 4 numbers,
    never the activations. Backward: one AllReduce of the stacked per-row ``[sum g, sum g*x̂]``
    (8 numbers, ``g = dy * gamma``); gamma's and beta's gradients are this rank's
    contributions, completed by the framework's AllReduce over ranks [1, 5] (the row split).
    """

    tape = Tape.NEW_LIKE_INPUT

    def keeps_input(self, k: int) -> bool:
        return k == 1   # gamma the backward scales by, beside its own xhat and rstd

    n_inputs = 3

    def __init__(self, begin_norm_axis: int = 1, begin_params_axis: int = 1,
                 epsilon: float = 1e-7) -> None:
        super().__init__()
        self.begin_norm_axis = _check_int_attr(self.name, "begin_norm_axis", begin_norm_axis)
        self.begin_params_axis = _check_int_attr(self.name, "begin_params_axis",
                                                 begin_params_axis)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.floating)):
            raise TypeError(f"{self.name}: epsilon must be a float, got "
                            f"{type(epsilon).__name__} {epsilon!r}")
        if not (math.isfinite(epsilon) and epsilon >= 0):
            raise ValueError(f"{self.name}: epsilon must be a finite float >= 0, got {epsilon!r}")
        self.epsilon = float(epsilon)

    def attrs(self) -> dict[str, Any]:
        return {"begin_norm_axis": self.begin_norm_axis,
                "begin_params_axis": self.begin_params_axis, "epsilon": self.epsilon}

    def _axes(self, x: tuple[int, ...]) -> tuple[int, int]:
        if not x:
            raise ValueError(f"{self.name}: the input must have rank >= 1, got shape {x}")
        return (checks.axis(self.begin_norm_axis, len(x), f"{self.name}: begin_norm_axis"),
                checks.axis(self.begin_params_axis, len(x), f"{self.name}: begin_params_axis"))

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x, gamma, beta = shapes
        _, bpa = self._axes(x)
        want = x[bpa:]
        for what, s in (("gamma", gamma), ("beta", beta)):
            if tuple(s) != want:
                raise ValueError(f"{self.name}: {what} has shape {tuple(s)} but must have shape "
                                 f"{want} (x.shape[begin_params_axis:] with x {x}, "
                                 f"begin_params_axis={self.begin_params_axis})")
        return x

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        x = self.infer_shape(*shapes)
        _, bpa = self._axes(x)
        names = dim_names(len(x))
        return IterSpace((names, names[bpa:], names[bpa:]), names, names)

    def _geometry(self, x: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        return _ln_geometry(x, self.begin_norm_axis, self.begin_params_axis)

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        x, gamma, beta = xs
        self.infer_shape(x.shape, gamma.shape, beta.shape)
        _check_float(self.name, "x", x)
        axes, _, count = self._geometry(x.shape)
        return _layer_norm(x, gamma, beta, axes, count, self.epsilon, _identity)[0]

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        x, gamma, beta = xs
        axes, lead, count = self._geometry(x.shape)
        _, xhat, rstd = _layer_norm(x, gamma, beta, axes, count, self.epsilon, _identity)
        return _layer_norm_grad(dy, xhat, rstd, gamma, axes, lead, count, _identity)

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 8 * math.prod(local_out)

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        sh = super()._sharding(shapes, strat, out_strategy, device_num, enable_alltoall)
        axes, _, _ = self._geometry(shapes[0])
        rows = math.prod(sh.in_layouts[0].local_shape()[:axes[0]])
        return _row_statistics(
            sh, axes, rows,
            forward=(("LayerNorm: row sums (mean)", 1, "sum"),
                     ("LayerNorm: squared deviations (var)", 1, "sum")),
            backward=(("LayerNorm: row sums of g and g*xhat", 2, "sum"),))

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        x, gamma, beta = xs
        _check_float(self.name, "x", x)
        axes, _, count = self._geometry(sh.input_shapes[0])
        y, xhat, rstd = _layer_norm(x, gamma, beta, axes, count, self.epsilon,
                                    _group_reduce(sh, sh.internal_forward, collectives))
        return y, (xhat, rstd, gamma)

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        xhat, rstd, gamma = saved
        axes, lead, count = self._geometry(sh.input_shapes[0])
        return _layer_norm_grad(dy, xhat, rstd, gamma, axes, lead, count,
                                _group_reduce(sh, sh.internal_backward, collectives))


# ------------------------------------------------------------------ BatchNorm
def _channel_view(v: np.ndarray, ndim: int) -> np.ndarray:
    """A per-channel vector (C,) shaped to broadcast against (N, C, ...)."""
    return v.reshape((1, v.shape[0]) + (1,) * (ndim - 2))


def _batch_norm(xs: Sequence[np.ndarray], axes: tuple[int, ...], count: int, eps: float,
                training: bool, reduce: _Reduce
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """(y, xhat, rstd, statistics) of ``xs = (x, scale, bias, mean, variance)``. Training
    normalises with the batch statistics over ``axes`` (two passes, as LayerNorm: the mean,
    then the squared deviations) and gives them as ``(batch mean, unbiased batch variance)``,
    each (C,); inference normalises with the given ``mean`` and ``variance`` and gives ()."""
    x, scale, bias, mean, variance = xs
    stats: tuple[np.ndarray, ...] = ()
    if training:
        mu = reduce(np.sum(x, axis=axes, keepdims=True), "sum", "sum-x") / count
        xc = x - mu
        var = reduce(np.sum(xc * xc, axis=axes, keepdims=True), "sum", "sum-sq-dev") / count
        unbiased = count / (count - 1) if count > 1 else 1.0
        stats = (np.asarray(mu.reshape(-1), dtype=x.dtype),
                 np.asarray(var.reshape(-1) * unbiased, dtype=x.dtype))
    else:
        xc = x - _channel_view(mean, x.ndim)
        var = _channel_view(variance, x.ndim)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = xc * rstd
    y = xhat * _channel_view(scale, x.ndim) + _channel_view(bias, x.ndim)
    return np.asarray(y, dtype=x.dtype), np.asarray(xhat), np.asarray(rstd), stats


def _batch_norm_grad(dy: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, scale: np.ndarray,
                     axes: tuple[int, ...], count: int, training: bool, reduce: _Reduce
                     ) -> tuple[np.ndarray | None, ...]:
    # This rank's sums over its slice of (N, H, W): scale's and bias's gradient contributions,
    # which the AllReduce over their replica axes completes (their Mirror).
    dbias = np.sum(dy, axis=axes)
    dscale = np.sum(dy * xhat, axis=axes)
    g = dy * _channel_view(scale, dy.ndim) * rstd
    if training:
        # dx needs the whole sums: one AllReduce of the stacked (2, C) buffer.
        sums = reduce(np.stack([dbias, dscale]), "sum", "grad-sums")
        g = g - _channel_view(scale, dy.ndim) * rstd * (
            _channel_view(sums[0], dy.ndim) + xhat * _channel_view(sums[1], dy.ndim)) / count
    return np.asarray(g, dtype=dy.dtype), dscale, dbias, None, None


_BN_PARAMS = ("scale", "bias", "mean", "variance")


@register(mindspore_cost=CostClass.BATCH_NORM, elementwise=False)
class BatchNorm(Primitive):
    """Batch normalisation over the channel dimension (MindSpore's BatchNorm, data format
    NCHW): inputs ``x`` (N, C, H, W) or (N, C) and ``scale``, ``bias``, ``mean``,
    ``variance``, each (C,). ``y = (x - mu) / sqrt(var + epsilon) * scale + bias`` per
    channel, with ``mu`` and ``var`` the batch statistics over N, H and W (the biased
    variance) when ``is_training``, else the ``mean`` and ``variance`` inputs.

    Training returns ``(y, batch_mean, batch_variance)``: MindSpore's first three outputs (it
    adds two reserve spaces), the variance the unbiased one (over ``N*H*W - 1``) that the
    moving variance is updated with, as MindSpore and PyTorch update it; ``nn.BatchNorm2d``
    folds them into its ``moving_mean`` and ``moving_variance`` after every forward
    (:meth:`simpar.graph.update_parameter`). Inference returns ``y`` alone. As MindSpore's
    bprop does, only ``y``'s cotangent reaches the inputs: the statistics outputs carry no
    gradient. The ``mean`` and ``variance`` inputs get none either (MindSpore gives them
    zeros); ``x``, ``scale`` and ``bias`` do.

    Sharding (MindSpore's BatchNormInfo): the four (C,) inputs must be cut as x's channel
    dimension; N, C, H and W may all be cut. Training with N, H or W cut is MindSpore's
    SyncBatchNorm: the statistics are whole-batch ones, never gathered activations.
    ``BatchNorm(True).shard(((4, 2, 1, 1), (2,), (2,), (2,), (2,)))`` on 8 devices, x
    (8, 4, 2, 2): device matrix [4, 2, 1, 1]; rank 5 (coordinate (2, 1, 0, 0)) holds
    x[4:6, 2:4] and scale[2:4]. It sums its slice per channel and AllReduces the 2 sums over
    ranks [1, 3, 5, 7] (the ranks of its channels; the mean), then the same with its squared
    deviations (the variance): two AllReduces of 2 numbers; its batch-statistics outputs are
    then the whole batch's, for channels 2..3. Backward: one AllReduce of the
    stacked per-channel ``[sum dy, sum dy*xhat]`` (4 numbers) over the same ranks for dx;
    scale's and bias's gradients are this rank's sums over its slice, completed by the
    framework's AllReduce over the same ranks (their replicas). In inference mode, or with only
    C cut, nothing is communicated forward or in dx's backward.
    """

    tape = Tape.NEW_LIKE_INPUT

    def keeps_input(self, k: int) -> bool:
        return k == 1   # the scale the backward scales by, beside its own xhat and rstd

    n_inputs = 5
    nondiff_inputs = (3, 4)

    def __init__(self, is_training: bool = False, epsilon: float = 1e-5,
                 momentum: float = 0.1, data_format: str = "NCHW") -> None:
        super().__init__()
        if not isinstance(is_training, bool):
            raise TypeError(f"BatchNorm: is_training must be a bool, got "
                            f"{type(is_training).__name__} {is_training!r}")
        self.is_training = is_training
        self.n_outputs = 3 if is_training else 1
        for name, value, lo_open in (("epsilon", epsilon, True), ("momentum", momentum, False)):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
                raise TypeError(f"BatchNorm: {name} must be a float, got "
                                f"{type(value).__name__} {value!r}")
            if not (0.0 < value <= 1.0 if lo_open else 0.0 <= value <= 1.0):
                raise ValueError(f"BatchNorm: {name} must be in {'(0' if lo_open else '[0'}, "
                                 f"1], got {value!r}")
        self.epsilon, self.momentum = float(epsilon), float(momentum)
        if data_format != "NCHW":
            raise ValueError(f"BatchNorm: data_format must be 'NCHW' (the only layout "
                             f"MindSpore's BatchNormInfo shards), got {data_format!r}")
        self.data_format = data_format

    def attrs(self) -> dict[str, Any]:
        return {"is_training": self.is_training, "epsilon": self.epsilon,
                "momentum": self.momentum, "data_format": self.data_format}

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        x = tuple(shapes[0])
        if len(x) not in (2, 4):
            raise ValueError(f"BatchNorm: x must be (N, C, H, W) or (N, C), got shape {x}")
        for name, s in zip(_BN_PARAMS, shapes[1:]):
            if tuple(s) != (x[1],):
                raise ValueError(f"BatchNorm: {name} has shape {tuple(s)} but must have shape "
                                 f"({x[1]},), one value per channel of x {x}")
        return x

    def output_shapes(self, *shapes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        x = self.infer_shape(*shapes)
        return (x, (x[1],), (x[1],)) if self.is_training else (x,)

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        x = self.infer_shape(*shapes)
        names = dim_names(len(x))
        return IterSpace((names,) + ((names[1],),) * 4, names, names)

    @staticmethod
    def _geometry(x: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """The axes of the statistics (all but the channel) and their element count."""
        axes = tuple(d for d in range(len(x)) if d != 1)
        return axes, math.prod(x[d] for d in axes)

    def _check(self, xs: Sequence[np.ndarray]) -> None:
        self.infer_shape(*(a.shape for a in xs))
        for name, a in zip(("x",) + _BN_PARAMS, xs):
            _check_float(self.name, name, a)

    def kernel(self, *xs: np.ndarray) -> Any:
        self._check(xs)
        axes, count = self._geometry(xs[0].shape)
        y, _, _, stats = _batch_norm(xs, axes, count, self.epsilon, self.is_training,
                                     _identity)
        return (y, *stats) if stats else y

    def vjp(self, xs: Sequence[np.ndarray], y: Any, dy: Any) -> tuple[np.ndarray | None, ...]:
        axes, count = self._geometry(xs[0].shape)
        _, xhat, rstd, _ = _batch_norm(xs, axes, count, self.epsilon, self.is_training,
                                       _identity)
        return _batch_norm_grad(self._dy(dy), xhat, rstd, xs[1], axes, count,
                                self.is_training, _identity)

    def _dy(self, dy: Any) -> np.ndarray:
        """``y``'s cotangent (a training op's statistics outputs carry no gradient)."""
        return dy[0] if self.is_training else dy

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return (8 if self.is_training else 4) * math.prod(local_out)

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        sh = super()._sharding(shapes, strat, out_strategy, device_num, enable_alltoall)
        if not self.is_training:
            return sh
        # The statistics are laid out as scale is: cut as x's channels, whole elsewhere.
        stat = sh.in_layouts[1]
        sh = dataclasses.replace(sh, more_outs=((stat, stat, plan(stat, stat)),) * 2)
        axes, _ = self._geometry(shapes[0])
        group = sh.device_axes_cutting([f"d{a}" for a in axes])
        if not group:
            return sh
        channels = sh.in_layouts[1].local_size()
        dm = sh.device_matrix
        fwd = (CommSpec(ALL_REDUCE, dm, group, channels, "BatchNorm: channel sums (mean)"),
               CommSpec(ALL_REDUCE, dm, group, channels,
                        "BatchNorm: squared deviations (variance)"))
        bwd = (CommSpec(ALL_REDUCE, dm, group, 2 * channels,
                        "BatchNorm: channel sums of dy and dy*xhat"),)
        return dataclasses.replace(sh, internal_forward=fwd, internal_backward=bwd)

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[Any, Any]:
        self._check(xs)
        axes, count = self._geometry(sh.input_shapes[0])
        y, xhat, rstd, stats = _batch_norm(xs, axes, count, self.epsilon, self.is_training,
                                           _group_reduce(sh, sh.internal_forward, collectives))
        return ((y, *stats) if stats else y), (xhat, rstd, xs[1])

    def local_backward(self, sh: OpSharding, saved: Any, dy: Any,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        xhat, rstd, scale = saved
        axes, count = self._geometry(sh.input_shapes[0])
        return _batch_norm_grad(self._dy(dy), xhat, rstd, scale, axes, count,
                                self.is_training,
                                _group_reduce(sh, sh.internal_backward, collectives))


# ------------------------------------------------------------------ cross entropy
_LABEL_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _cross_entropy(logits: np.ndarray, labels: np.ndarray, class_offset: int,
                   reduce: _Reduce, classes: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Per-row loss of the rows held, for the classes ``class_offset..`` held (of
    ``classes``; labels already checked to lie in ``0..classes-1``); also the softmax and where
    the target sits locally (for the backward): the rows holding theirs (None: all) and its
    column."""
    rows = np.arange(logits.shape[0])
    m = reduce(_max(logits, axis=1), "max", "max")
    e = logits - m[:, None]
    np.exp(e, out=e)
    # Sum of exponentials and the target logit travel together: one AllReduce of (2, rows).
    both = np.empty((2, logits.shape[0]), logits.dtype)
    _sum(e, axis=1, out=both[0])
    own: np.ndarray | None
    if class_offset == 0 and logits.shape[1] == classes:   # every class here
        own, idx = None, labels
        both[1] = logits[rows, idx]
    else:
        local = labels.astype(np.int64) - class_offset
        own = (local >= 0) & (local < logits.shape[1])
        idx = np.where(own, local, 0)
        both[1] = np.where(own, logits[rows, idx], 0.0)
    s, xt = reduce(both, "sum", "sum-exp-and-target")
    loss = np.log(s) + m - xt
    e /= s[:, None]     # the softmax, in the exponentials' array
    return loss, e, own, idx


def _cross_entropy_grad(p: np.ndarray, own: np.ndarray | None, idx: np.ndarray,
                        scale: np.ndarray) -> np.ndarray:
    g = p.copy()
    rows = np.arange(g.shape[0]) if own is None else np.flatnonzero(own)
    g[rows, idx[rows]] -= 1.0
    if np.result_type(g, scale) != g.dtype:
        return np.asarray(g * scale)
    g *= scale
    return g


@register(mindspore_cost=CostClass.SOFTMAX_CROSS_ENTROPY, elementwise=False)
class SparseSoftmaxCrossEntropyWithLogits(Primitive):
    """Mean over the batch of ``-log softmax(logits)[i, labels[i]]`` (MindSpore with
    ``is_grad=False``): logits (N, C) float, labels (N,) int32/int64, a 0-d output.

    Strategy ``((n, c), (n,))``: labels' cut must equal logits' batch cut. The class dim may
    be split (vocabulary parallel). ``.shard(((2, 4), (2,)))`` on 8 devices, logits (8, 16):
    device matrix [2, 4]; rank 5 holds rows 4..7 and classes 4..7. It AllReduces (max) its 4
    row maxima over ranks [4, 5, 6, 7], then AllReduces (sum) the stacked (2, 4) buffer of
    its row sums of exp and its target logits (the logit of a row's label if rank 5 owns that
    class, else 0). After that sum every rank of the class group holds its rows' whole
    losses, and each computes the same sum of them / N, as Megatron's vocabulary-parallel
    cross entropy does: the raw output is replicated over the class split and partial over
    the batch split only, and the output plan completes it with one AllReduce of 1 number
    over ranks [1, 5] (none when the batch is not split). The backward is local:
    ``(softmax - onehot) / N * dloss`` with ``dloss`` whole (in a program the loss's
    cotangent is whole on every rank; ``run_op``, whose replicas share an output's
    cotangent, first sums the shares over the class split, see
    :attr:`OpSharding.share_axes`). Labels outside ``[0, C)`` raise ValueError naming the
    label.
    """

    tape = Tape.NEW_LIKE_INPUT

    def keeps_input(self, k: int) -> bool:
        return k == 1   # the labels, as they are when the class dimension is whole

    n_inputs = 2
    nondiff_inputs = (1,)
    whole_over_split_inputs = True

    def __init__(self, is_grad: bool = False) -> None:
        super().__init__()
        if not isinstance(is_grad, bool):
            raise TypeError(f"{self.name}: is_grad must be a bool, got {is_grad!r}")
        if is_grad:
            raise ValueError(f"{self.name}: is_grad=True (MindSpore's internal form that "
                             "returns the logits' gradient) is not supported; use "
                             "is_grad=False, simpar derives the gradient from the op's vjp")
        self.is_grad = is_grad

    def attrs(self) -> dict[str, Any]:
        return {"is_grad": self.is_grad}

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        logits, labels = shapes
        if len(logits) != 2 or len(labels) != 1 or labels[0] != logits[0]:
            raise ValueError(f"{self.name}: logits must be (N, C) and labels (N,), got shapes "
                             f"{tuple(logits)} and {tuple(labels)}")
        if logits[1] < 1:
            raise ValueError(f"{self.name}: logits {tuple(logits)} must have at least one class")
        return ()

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        self.infer_shape(*shapes)
        return IterSpace((("n", "c"), ("n",)), (), ("n", "c"))

    def index_limit(self, i: int, shapes: tuple[tuple[int, ...], ...]) -> int | None:
        return shapes[0][1] if i == 1 else None

    def index_error(self, i: int, value: int, limit: int) -> str:
        return (f"{self.name}: label {value} is outside [0, {limit}); labels must be class "
                f"indices 0..{limit - 1}")

    def check_values(self, *global_inputs: np.ndarray) -> None:
        logits, labels = global_inputs
        self._check(logits, labels, logits.shape[1])

    def _check(self, logits: np.ndarray, labels: np.ndarray, classes: int,
               row_offset: int = 0) -> None:
        _check_float(self.name, "logits", logits)
        if labels.dtype not in _LABEL_DTYPES:
            raise TypeError(f"{self.name}: labels must be int32 or int64, got dtype "
                            f"{labels.dtype}")
        bad = np.flatnonzero((labels < 0) | (labels >= classes))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{self.name}: label {int(labels[i])} at row {row_offset + i} is "
                             f"outside [0, {classes}); labels must be class indices "
                             f"0..{classes - 1} ({bad.size} bad label(s) in this shard)")

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        logits, labels = xs
        self.infer_shape(logits.shape, labels.shape)
        self._check(logits, labels, logits.shape[1])
        loss = _cross_entropy(logits, labels, 0, _identity, logits.shape[1])[0]
        return np.array(np.sum(loss) / logits.shape[0], dtype=logits.dtype)

    def vjp(self, xs: Sequence[np.ndarray], y: np.ndarray, dy: np.ndarray
            ) -> tuple[np.ndarray | None, ...]:
        logits, labels = xs
        self._check(logits, labels, logits.shape[1])
        _, p, own, idx = _cross_entropy(logits, labels, 0, _identity, logits.shape[1])
        return _cross_entropy_grad(p, own, idx, np.asarray(dy) / logits.shape[0]), None

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 4 * math.prod(local_in[0])

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        # The generic rule makes the raw loss partial over every axis that splits n or c
        # (neither is an output dim). The class split's statistics AllReduces leave every
        # rank of a class group with its rows' whole losses, so the loss is replicated over
        # the class split: only the batch split's partial sums are left for the output plan.
        sh = super()._sharding(shapes, strat, out_strategy, device_num, enable_alltoall)
        group = sh.device_axes_cutting(["c"])
        if not group:
            return sh
        rows = sh.in_layouts[0].local_shape()[0]
        dm = sh.device_matrix
        fwd = (CommSpec(ALL_REDUCE, dm, group, rows, f"{self.name}: row max over classes",
                        how="max"),
               CommSpec(ALL_REDUCE, dm, group, 2 * rows,
                        f"{self.name}: row sum of exp and target logit over classes"))
        raw = sh.raw_out.with_partial_axes(
            tuple(a for a in sh.raw_out.partial_axes if a not in group))
        return dataclasses.replace(sh, internal_forward=fwd, raw_out=raw,
                                   out_plan=plan(raw, sh.out))

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        logits, labels = xs
        (row0, _), (class0, _) = sh.in_slices_on(collectives.rank)[0]
        n, classes = sh.input_shapes[0]
        # Every rank holding a bad label raises before its first collective; labels are
        # replicated over the class split, so a row block's whole class group raises together.
        self._check(logits, labels, classes, row0)
        reduce = _group_reduce(sh, sh.internal_forward, collectives)
        loss, p, own, idx = _cross_entropy(logits, labels, class0, reduce, classes)
        return np.array(np.sum(loss) / n, dtype=logits.dtype), (p, own, idx, n)

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        p, own, idx, n = saved
        # A 0-d cotangent may arrive as a numpy scalar or, from an adjoint AllReduce, as (1,).
        scale = np.asarray(dy).reshape(()) / n
        return _cross_entropy_grad(p, own, idx, scale), None
