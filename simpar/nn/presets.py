"""Ready-made strategies for the models in :mod:`simpar.nn.layers`, set the MindSpore way
(``op.shard(...)`` on the primitives inside the cells), for ``semi_auto_parallel``.

* :func:`megatron_mlp` / :func:`megatron_gpt`: Megatron-LM tensor parallelism over ``mp``
  devices (column-parallel first Dense, row-parallel second; attention heads split; the
  embedding and LM head vocabulary-parallel, with the cross entropy split on the class axis)
  combined with data parallelism over ``dp``. ``dp * mp`` may be less than ``device_num``:
  the rest is repeated calculation.
* :func:`redistributing_mlp`: alternates a data-parallel and a model-parallel layer, so the
  activations must be redistributed between them (an AllGather into the model-parallel layer,
  whose backward is a ReduceScatter; an AllToAll out of it).

Ops left without a strategy are filled in by sharding propagation
(:mod:`simpar.search.propagation`).
"""

from __future__ import annotations

from typing import Any

from simpar.nn.layers import GPT, MLP, Dense, MultiHeadAttention
from simpar.nn.loss import SoftmaxCrossEntropyWithLogits

__all__ = ["PRESETS", "apply", "column_parallel", "megatron_gpt", "megatron_mlp", "mixed_gpt",
           "redistributing_mlp", "row_parallel"]


def column_parallel(dense: Dense, dp: int, mp: int) -> None:
    """Weight rows (output features) split over mp: no forward communication."""
    dense.matmul.shard(((dp, 1), (mp, 1)))
    if dense.has_bias:
        dense.bias_add.shard(((dp, mp), (mp,)))


def row_parallel(dense: Dense, dp: int, mp: int) -> None:
    """Weight columns (input features) split over mp: one AllReduce of the output."""
    dense.matmul.shard(((dp, mp), (1, mp)))
    if dense.has_bias:
        dense.bias_add.shard(((dp, 1), (1,)))


def megatron_mlp(mlp: MLP, dp: int, mp: int) -> MLP:
    """Alternate column- and row-parallel layers (one AllReduce per pair, forward and back)."""
    for k, layer in enumerate(mlp.layers):
        (column_parallel if k % 2 == 0 else row_parallel)(layer, dp, mp)
    return mlp


def _attention(attn: MultiHeadAttention, dp: int, mp: int) -> None:
    for dense in (attn.q, attn.k, attn.v):
        column_parallel(dense, dp, mp)
    attn.scores.shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
    attn.softmax.shard(((dp, mp, 1, 1),))
    attn.context.shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
    row_parallel(attn.proj, dp, mp)


def megatron_gpt(gpt: GPT, dp: int, mp: int, loss: SoftmaxCrossEntropyWithLogits | None = None
                 ) -> GPT:
    """Megatron tensor parallelism for the GPT, with dp-way data parallelism around it."""
    gpt.embedding.gather.shard(((mp, 1), (dp, 1)))
    for block in gpt.blocks:
        _attention(block.attn, dp, mp)
        column_parallel(block.ffn.fc1, dp, mp)
        row_parallel(block.ffn.fc2, dp, mp)
    column_parallel(gpt.head, dp, mp)
    if loss is not None:
        loss.ce.shard(((dp, mp), (dp,)))
    return gpt


def mixed_gpt(gpt: GPT, loss: SoftmaxCrossEntropyWithLogits, n: int) -> GPT:
    """A two-block GPT whose blocks disagree, on ``n`` devices (even): vocabulary-parallel
    embedding over all n, block 0 attention Megatron (1, n) and FFN (2, n/2), block 1 attention
    data parallel over n and FFN Megatron (1, n), LM head and loss (2, n/2). Every boundary
    changes the layout: most changes are free slices, some need collectives."""
    gpt.embedding.gather.shard(((n, 1), (1, 1)))
    b0, b1 = gpt.blocks
    _attention(b0.attn, 1, n)
    column_parallel(b0.ffn.fc1, 2, n // 2)
    row_parallel(b0.ffn.fc2, 2, n // 2)
    _attention(b1.attn, n, 1)
    column_parallel(b1.ffn.fc1, 1, n)
    row_parallel(b1.ffn.fc2, 1, n)
    column_parallel(gpt.head, 2, n // 2)
    loss.ce.shard(((2, n // 2), (2,)))
    return gpt


def redistributing_mlp(mlp: MLP, device_num: int) -> MLP:
    """Layer 1 data parallel, layer 2 model parallel over every device, and so on: every
    boundary redistributes the activations (AllGather into a model-parallel layer, AllToAll
    out of it)."""
    for k, layer in enumerate(mlp.layers):
        if k % 2 == 0:
            layer.matmul.shard(((device_num, 1), (1, 1)))
            layer.bias_add.shard(((device_num, 1), (1,)))
        else:
            layer.matmul.shard(((1, 1), (device_num, 1)))
            layer.bias_add.shard(((1, device_num), (device_num,)))
    return mlp


def apply(preset: str, model: Any, device_num: int, loss: Any = None) -> tuple[int, int]:
    """Apply a named preset; returns (dp, mp). ``dp``: nothing to set (use data_parallel
    mode); ``mp``: Megatron over every device; ``hybrid``: dp=2 x mp=device_num/2, for an
    even device_num."""
    if preset not in PRESETS:
        raise ValueError(f"strategy preset must be one of {list(PRESETS)}, got {preset!r}")
    if preset == "dp":
        return device_num, 1
    if preset == "hybrid" and device_num % 2:
        raise ValueError(f"strategy preset 'hybrid' is dp=2 x mp=device_num/2, which needs an "
                         f"even device_num, got {device_num}; use 'mp' or 'dp' instead")
    dp, mp = (1, device_num) if preset == "mp" else (2, device_num // 2)
    if isinstance(model, GPT):
        megatron_gpt(model, dp, mp, loss)
    elif isinstance(model, MLP):
        megatron_mlp(model, dp, mp)
    else:
        raise TypeError(f"presets know GPT and MLP models, got {type(model).__name__}")
    return dp, mp


PRESETS = ("dp", "mp", "hybrid")
