"""Losses."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from simpar import ops
from simpar.nn.cell import Cell

__all__ = ["SoftmaxCrossEntropyWithLogits"]


class SoftmaxCrossEntropyWithLogits(Cell):
    """Cross entropy of logits (..., C) against integer labels (...) (MindSpore's
    ``nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")``).

    Logits of rank > 2 are flattened to (N, C) first. The class axis may be split (vocabulary
    parallel): the loss op never gathers the logits. ``reduction`` is "mean" or "sum".
    """

    def __init__(self, sparse: bool = True, reduction: str = "mean") -> None:
        super().__init__()
        if sparse is not True:
            raise ValueError("SoftmaxCrossEntropyWithLogits: only sparse=True (integer labels) "
                             "is supported")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"SoftmaxCrossEntropyWithLogits: reduction must be 'mean' or "
                             f"'sum', got {reduction!r}")
        self.reduction = reduction
        self.ce = ops.SparseSoftmaxCrossEntropyWithLogits()
        self.flat_logits, self.flat_labels = ops.Reshape(), ops.Reshape()
        self.to_sum = ops.Mul()

    def construct(self, logits: Any, labels: Any) -> Any:
        c = logits.shape[-1]
        n = math.prod(logits.shape[:-1])
        if len(logits.shape) > 2:
            logits = self.flat_logits(logits, (n, c))
        if len(labels.shape) != 1:
            labels = self.flat_labels(labels, (n,))
        loss = self.ce(logits, labels)
        if self.reduction == "sum":
            loss = self.to_sum(loss, np.asarray(float(n), dtype=logits.dtype))
        return loss
