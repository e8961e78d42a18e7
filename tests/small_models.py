"""The small float64 MLP and GPT the multi-rank training tests compare with one device, and
their batches: one definition for every such test."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from simpar import nn
from simpar.dataset import CharCorpus, random_classification


def small_model(model: str, mlp_sizes: Sequence[int], gpt_sizes: Mapping[str, Any]) -> nn.Cell:
    """``nn.MLP(*mlp_sizes, n_hidden=2)`` or ``nn.GPT(**gpt_sizes)``, in float64."""
    if model == "mlp":
        return nn.MLP(*mlp_sizes, n_hidden=2, dtype=np.float64)
    return nn.GPT(**gpt_sizes, dtype=np.float64)


def small_batch(model: str, step: int, batch: int, mlp_sizes: Sequence[int],
                gpt_sizes: Mapping[str, Any], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s global batch for :func:`small_model`: random classification data for
    the MLP, character windows for the GPT."""
    if model == "mlp":
        return random_classification(step, batch, mlp_sizes[0], mlp_sizes[2], seed,
                                     np.dtype(np.float64))
    return CharCorpus(seed=seed).batch(step, batch, gpt_sizes["seq_length"])
