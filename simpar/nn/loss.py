"""Losses."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from simpar import ops
from simpar.nn.cell import Cell

__all__ = ["L1Loss", "MSELoss", "SoftmaxCrossEntropyWithLogits"]

_REDUCTIONS = ("none", "mean", "sum")


class SoftmaxCrossEntropyWithLogits(Cell):
    """Cross entropy of logits (..., C) (MindSpore's ``nn.SoftmaxCrossEntropyWithLogits``),
    against integer labels (...) with ``sparse=True`` (simpar's default), or against
    probability rows (..., C) of the logits' dtype with ``sparse=False`` (one-hot or smoothed
    labels, as MindSpore's ResNet trains with). ``reduction`` is "mean" or "sum" over the rows.

    Logits of rank > 2 are flattened to (N, C) first. The class axis may be split (vocabulary
    parallel): neither form gathers the logits. Sparse, one primitive
    (``ce``, SparseSoftmaxCrossEntropyWithLogits) does it all; dense, the loss is built from
    primitives that each shard, ``-reduce(sum_c(labels * log_softmax(logits)))``:
    ``log_softmax`` (its split class axis AllReduces per-row statistics), ``mul``,
    ``sum_classes`` (a split class axis leaves partial row sums, completed by an AllReduce)
    and ``reduce`` (ReduceMean or ReduceSum over the rows).
    """

    def __init__(self, sparse: bool = True, reduction: str = "mean") -> None:
        super().__init__()
        if not isinstance(sparse, bool):
            raise TypeError(f"SoftmaxCrossEntropyWithLogits: sparse must be a bool, got "
                            f"{sparse!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"SoftmaxCrossEntropyWithLogits: reduction must be 'mean' or "
                             f"'sum', got {reduction!r}")
        self.sparse, self.reduction = sparse, reduction
        self.flat_logits, self.flat_labels = ops.Reshape(), ops.Reshape()
        if sparse:
            self.ce = ops.SparseSoftmaxCrossEntropyWithLogits()
            self.to_sum = ops.Mul()
        else:
            self.log_softmax = ops.LogSoftmax(axis=-1)
            self.mul = ops.Mul()
            self.sum_classes = ops.ReduceSum(axis=-1)
            self.reduce = ops.ReduceMean(axis=()) if reduction == "mean" else \
                ops.ReduceSum(axis=())
            self.negate = ops.Mul()

    def construct(self, logits: Any, labels: Any) -> Any:
        c = logits.shape[-1]
        n = math.prod(logits.shape[:-1])
        if len(logits.shape) > 2:
            logits = self.flat_logits(logits, (n, c))
        if not self.sparse:
            if tuple(labels.shape) != (n, c) and tuple(labels.shape) != tuple(logits.shape):
                labels = self.flat_labels(labels, (n, c))
            rows = self.sum_classes(self.mul(labels, self.log_softmax(logits)))
            return self.negate(self.reduce(rows), np.asarray(-1.0, dtype=logits.dtype))
        if len(labels.shape) != 1:
            labels = self.flat_labels(labels, (n,))
        loss = self.ce(logits, labels)
        if self.reduction == "sum":
            loss = self.to_sum(loss, np.asarray(float(n), dtype=logits.dtype))
        return loss


class _PointwiseLoss(Cell):
    """``reduce(f(logits - labels))`` from primitives, so their sharding rules apply: ``sub``
    and ``f`` are pointwise, and ``reduce`` (ReduceMean or ReduceSum over every axis, None for
    ``reduction="none"``) leaves each rank a partial sum of its own slice that one
    AllReduce(sum) completes. Nothing is ever gathered.

    Logits (8, 4), "mean", data parallel over 4 ranks: rank 2 holds rows 4..5 and computes
    ``f(x - y)[4:6].sum() / 32``; the AllReduce over ranks 0..3 makes it the mean. With the
    feature axis split as well (dev_matrix (2, 2), cuts (2, 2)), rank 3 sums the block
    ``[4:8, 2:4]`` and the AllReduce runs over all four ranks.

    Strategies can be set on the primitives, ``loss.sub.shard(((dp, mp), (dp, mp)))``; left
    unset, they follow the layouts of the logits.
    """

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
            raise ValueError(f"{type(self).__name__}: reduction must be 'none', 'mean' or "
                             f"'sum', got {reduction!r}")
        self.reduction = reduction
        self.sub = ops.Sub()
        self.reduce: ops.Primitive | None = {
            "none": None, "mean": ops.ReduceMean(axis=()), "sum": ops.ReduceSum(axis=())
        }[reduction]

    # The name of the subclass's pointwise primitive (``loss.square``, ``loss.abs``), which
    # users shard like any other.
    pointwise: str

    def _check(self, logits: Any, labels: Any) -> None:
        x, y = (v if hasattr(v, "shape") and hasattr(v, "dtype") else np.asarray(v)
                for v in (logits, labels))
        name = type(self).__name__
        if np.dtype(x.dtype).kind != "f" or np.dtype(y.dtype) != np.dtype(x.dtype):
            raise TypeError(f"{name}: logits and labels must be floating point of one dtype, "
                            f"got {np.dtype(x.dtype)} and {np.dtype(y.dtype)}")
        try:
            np.broadcast_shapes(tuple(x.shape), tuple(y.shape))
        except ValueError:
            raise ValueError(f"{name}: logits of shape {tuple(x.shape)} and labels of shape "
                             f"{tuple(y.shape)} must have the same shape or broadcast to each "
                             "other") from None

    def construct(self, logits: Any, labels: Any) -> Any:
        self._check(logits, labels)
        loss = getattr(self, self.pointwise)(self.sub(logits, labels))
        return loss if self.reduce is None else self.reduce(loss)


class MSELoss(_PointwiseLoss):
    """Mean squared error (MindSpore's ``nn.MSELoss(reduction="mean")``): the elementwise
    loss is ``(logits - labels) ** 2`` over the broadcast shape of the two; ``reduction``
    "mean" (default) averages it over every element, "sum" sums it, "none" returns it.

    ``MSELoss()(np.array([1., 2., 3.]), np.array([1., 1., 1.]))`` is ``5 / 3``.
    """

    pointwise = "square"

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.square = ops.Square()


class L1Loss(_PointwiseLoss):
    """Mean absolute error (MindSpore's ``nn.L1Loss(reduction="mean")``): the elementwise
    loss is ``|logits - labels|`` over the broadcast shape of the two; ``reduction`` "mean"
    (default), "sum" or "none" as for :class:`MSELoss`. Its gradient at ``logits == labels``
    is 0.

    ``L1Loss()(np.array([1., 2., 3.]), np.array([1., 2., 2.]))`` is ``1 / 3``.
    """

    pointwise = "abs"

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.abs = ops.Abs()
