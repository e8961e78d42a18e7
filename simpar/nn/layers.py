"""Layers, shaped like MindSpore's ``nn`` layers. Each holds its primitives as attributes
(``dense.matmul``, ``dense.bias_add``), so a strategy is set the MindSpore way:
``net.fc1.matmul.shard(((2, 1), (4, 1)))``. :mod:`simpar.nn.presets` sets whole plans.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from simpar import graph, ops
from simpar.nn.cell import Cell, Parameter, initializer
from simpar.parameter import stable_seed
from simpar.seed import get_seed

__all__ = ["GPT", "MLP", "BatchNorm1d", "BatchNorm2d", "Dense", "Dropout", "Embedding",
           "FeedForward", "LayerNorm", "MultiHeadAttention", "PReLU", "TransformerBlock"]


def _check_sizes(layer: str, **sizes: Any) -> None:
    """Each size must be an int >= 1: TypeError for another type, ValueError below 1."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{layer}: {name} must be an int >= 1, got "
                            f"{type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{layer}: {name} must be an int >= 1, got {value}")


class Dense(Cell):
    """``y = x W^T + b`` with MindSpore's weight shape ``(out_channels, in_channels)``.

    Inputs of rank > 2 are flattened to 2-D around the MatMul and restored after, as
    MindSpore's Dense does. ``activation`` is None, ``"relu"``, ``"gelu"`` or ``"tanh"``.
    """

    def __init__(self, in_channels: int, out_channels: int, has_bias: bool = True,
                 activation: str | None = None, dtype: Any = np.float32,
                 weight_init: str = "normal") -> None:
        super().__init__()
        _check_sizes("Dense", in_channels=in_channels, out_channels=out_channels)
        if not isinstance(has_bias, bool):
            raise TypeError(f"Dense: has_bias must be a bool, got {has_bias!r}")
        if activation not in (None, "relu", "gelu", "tanh"):
            raise ValueError(f"Dense: activation must be None, 'relu', 'gelu' or 'tanh', got "
                             f"{activation!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.weight = Parameter(initializer(weight_init, (out_channels, in_channels), dtype))
        self.has_bias = has_bias
        if has_bias:
            self.bias = Parameter(initializer("zeros", (out_channels,), dtype))
            self.bias_add = ops.BiasAdd()
        self.matmul = ops.MatMul(transpose_b=True)
        self.act = {None: None, "relu": ops.ReLU(), "gelu": ops.GeLU(),
                    "tanh": ops.Tanh()}[activation]
        self.reshape_in = ops.Reshape()
        self.reshape_out = ops.Reshape()

    def construct(self, x: Any) -> Any:
        lead = tuple(x.shape[:-1])
        if len(x.shape) > 2:
            x = self.reshape_in(x, (math.prod(lead), self.in_channels))
        y = self.matmul(x, self.weight)
        if self.has_bias:
            y = self.bias_add(y, self.bias)
        if self.act is not None:
            y = self.act(y)
        if len(lead) > 1:
            y = self.reshape_out(y, lead + (self.out_channels,))
        return y


class Embedding(Cell):
    """Token lookup ``table[ids]`` through Gather; a row-split table is vocabulary parallel."""

    def __init__(self, vocab_size: int, embedding_size: int, dtype: Any = np.float32) -> None:
        super().__init__()
        _check_sizes("Embedding", vocab_size=vocab_size, embedding_size=embedding_size)
        self.embedding_table = Parameter(initializer("normal", (vocab_size, embedding_size),
                                                     dtype))
        self.gather = ops.Gather()

    def construct(self, ids: Any) -> Any:
        return self.gather(self.embedding_table, ids)


class LayerNorm(Cell):
    """Normalise over the last dims given by ``normalized_shape`` (MindSpore's nn.LayerNorm)."""

    def __init__(self, normalized_shape: tuple[int, ...], epsilon: float = 1e-7,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        if not isinstance(normalized_shape, (tuple, list)) or not normalized_shape:
            raise TypeError(f"LayerNorm: normalized_shape must be a non-empty tuple of ints, "
                            f"e.g. (d_model,), got {normalized_shape!r}")
        _check_sizes("LayerNorm", **{f"normalized_shape[{k}]": n
                                     for k, n in enumerate(normalized_shape)})
        self.normalized_shape = tuple(normalized_shape)
        self.gamma = Parameter(initializer("ones", self.normalized_shape, dtype))
        self.beta = Parameter(initializer("zeros", self.normalized_shape, dtype))
        self.epsilon = epsilon
        axis = -len(self.normalized_shape)
        self.layer_norm = ops.LayerNorm(begin_norm_axis=axis, begin_params_axis=axis,
                                        epsilon=epsilon)

    def construct(self, x: Any) -> Any:
        return self.layer_norm(x, self.gamma, self.beta)


class PReLU(Cell):
    """MindSpore's ``nn.PReLU(channel=1, w=0.25)``: a learnable slope for ``x <= 0`` per channel
    (dim 1) of x, or one shared slope when ``channel`` is 1. ``w`` is the initial slope: a
    float for every channel, or a list or array of ``channel`` values. Strategies go on
    ``prelu.prelu`` (``.shard(((dp, mp, 1, 1), (mp,)))``)."""

    def __init__(self, channel: int = 1, w: Any = 0.25, dtype: Any = np.float32) -> None:
        super().__init__()
        _check_sizes("PReLU", channel=channel)
        if isinstance(w, bool) or not isinstance(w, (int, float, list, tuple, np.ndarray)):
            raise TypeError(f"PReLU: w must be a float, or a list or array of {channel} floats, "
                            f"got {type(w).__name__} {w!r}")
        init = np.asarray(w, dtype=dtype)
        if init.ndim == 0:
            init = np.full((channel,), init, dtype=dtype)
        if init.shape != (channel,):
            raise ValueError(f"PReLU: w must be one float or {channel} values (one per "
                             f"channel), got shape {init.shape}")
        self.channel = channel
        self.w = Parameter(init)
        self.prelu = ops.PReLU()

    def construct(self, x: Any) -> Any:
        return self.prelu(x, self.w)


class _BatchNorm(Cell):
    """MindSpore's ``nn.BatchNorm1d``/``nn.BatchNorm2d``: ``gamma`` and ``beta`` (trainable
    when ``affine``), ``moving_mean`` and ``moving_variance`` (not trainable), and two
    primitives, ``bn_train`` (batch statistics) and ``bn_infer`` (the moving ones), as in
    MindSpore; shard both. ``use_batch_statistics`` None uses the batch statistics while the
    cell trains and the moving ones otherwise. Every forward with the batch statistics folds
    them into the moving ones as MindSpore does, ``moving = momentum * moving + (1 -
    momentum) * batch`` (the variance's unbiased), on each rank's own shard
    (:func:`simpar.graph.update_parameter`)."""

    rank: int

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 affine: bool = True, use_batch_statistics: bool | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        name = type(self).__name__
        _check_sizes(name, num_features=num_features)
        if not isinstance(affine, bool):
            raise TypeError(f"{name}: affine must be a bool, got {affine!r}")
        if use_batch_statistics is not None and not isinstance(use_batch_statistics, bool):
            raise TypeError(f"{name}: use_batch_statistics must be None or a bool, got "
                            f"{use_batch_statistics!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or \
                not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{name}: momentum must be a float in [0, 1], got {momentum!r}")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.use_batch_statistics = use_batch_statistics
        shape = (num_features,)
        self.gamma = Parameter(initializer("ones", shape, dtype), requires_grad=affine)
        self.beta = Parameter(initializer("zeros", shape, dtype), requires_grad=affine)
        self.moving_mean = Parameter(initializer("zeros", shape, dtype), requires_grad=False)
        self.moving_variance = Parameter(initializer("ones", shape, dtype), requires_grad=False)
        # MindSpore's momentum weighs the moving statistics (0.9); the primitive's the batch's.
        self.bn_train = ops.BatchNorm(True, eps, 1.0 - momentum)
        self.bn_infer = ops.BatchNorm(False, eps, 1.0 - momentum)

    def construct(self, x: Any) -> Any:
        if len(x.shape) != self.rank:
            raise ValueError(f"{type(self).__name__}: x must have rank {self.rank} "
                             f"((N, C{', H, W' if self.rank == 4 else ''})), got shape "
                             f"{tuple(x.shape)}")
        batch = self.training if self.use_batch_statistics is None else \
            self.use_batch_statistics
        if not batch:
            return self.bn_infer(x, self.gamma, self.beta, self.moving_mean,
                                 self.moving_variance)
        y, mean, variance = self.bn_train(x, self.gamma, self.beta, self.moving_mean,
                                          self.moving_variance)
        weight = self.bn_train.momentum
        graph.update_parameter(self.moving_mean, mean, weight)
        graph.update_parameter(self.moving_variance, variance, weight)
        return y


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of (N, C) inputs over the batch, per feature."""

    rank = 2


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of (N, C, H, W) inputs over N, H and W, per channel."""

    rank = 4


class Dropout(Cell):
    """Counter-based dropout: the mask depends on (seed, step, global index) only, so every
    shard computes its part of the single-device mask. Identity when not training."""

    def __init__(self, keep_prob: float = 0.9, seed: int = 0) -> None:
        super().__init__()
        if isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float)):
            raise TypeError(f"Dropout: keep_prob must be a float in (0, 1], got {keep_prob!r}")
        if not 0.0 < keep_prob <= 1.0:
            raise ValueError(f"Dropout: keep_prob must be in (0, 1], got {keep_prob}")
        self.keep_prob = keep_prob
        self.dropout = ops.Dropout(keep_prob=keep_prob, seed0=seed, seed1=0)

    def construct(self, x: Any) -> Any:
        if not self.training or self.keep_prob == 1.0:
            return x
        if graph.tracing():
            # Each Dropout layer draws its own mask: seed1 comes from the global seed and the
            # layer's place in the model, the same on every rank and in the reference run.
            self.dropout.seed1 = stable_seed(get_seed(), graph.current_scope()) & 0x7FFFFFFF
        return self.dropout(x)


class MLP(Cell):
    """``Dense(in, hidden, relu) -> Dense(hidden, out)``; with ``n_hidden`` > 1, more hidden
    layers. ``mlp.layers[i]`` are the Dense cells."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, n_hidden: int = 1,
                 activation: str = "relu", dtype: Any = np.float32) -> None:
        super().__init__()
        _check_sizes("MLP", in_channels=in_channels, hidden=hidden, out_channels=out_channels,
                     n_hidden=n_hidden)
        sizes = [in_channels] + [hidden] * n_hidden + [out_channels]
        self.layers = []
        for k in range(len(sizes) - 1):
            act = activation if k < len(sizes) - 2 else None
            layer = Dense(sizes[k], sizes[k + 1], activation=act, dtype=dtype)
            setattr(self, f"fc{k + 1}", layer)
            self.layers.append(layer)

    def construct(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


class FeedForward(Cell):
    """Transformer FFN: ``Dense(d, d_ff, gelu) -> Dense(d_ff, d)`` (Megatron: column- then
    row-parallel)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        _check_sizes("FeedForward", d_model=d_model, d_ff=d_ff)
        self.fc1 = Dense(d_model, d_ff, activation="gelu", dtype=dtype)
        self.fc2 = Dense(d_ff, d_model, dtype=dtype)
        self.drop = Dropout(1.0 - dropout) if dropout else None

    def construct(self, x: Any) -> Any:
        y = self.fc2(self.fc1(x))
        return self.drop(y) if self.drop is not None else y


class MultiHeadAttention(Cell):
    """Multi-head self-attention on (batch, seq, d_model), optionally causal.

    Q, K, V are Dense layers; heads come from Reshape (B, S, H) -> (B, S, nh, hd) and
    Transpose to (B, nh, S, hd); scores are a BatchMatMul with K transposed, scaled, masked
    (causal: a constant of -1e9 above the diagonal) and soft-maxed over the key axis.
    """

    def __init__(self, d_model: int, n_heads: int, seq_length: int, causal: bool = True,
                 dropout: float = 0.0, dtype: Any = np.float32) -> None:
        super().__init__()
        _check_sizes("MultiHeadAttention", d_model=d_model, n_heads=n_heads,
                     seq_length=seq_length)
        if d_model % n_heads:
            raise ValueError(f"MultiHeadAttention: d_model {d_model} must be divisible by "
                             f"n_heads {n_heads}")
        self.d_model, self.n_heads, self.seq_length = d_model, n_heads, seq_length
        self.head_dim = d_model // n_heads
        self.dtype = np.dtype(dtype)
        self.q = Dense(d_model, d_model, dtype=dtype)
        # No key bias: adding b to every key shifts each query's scores by a constant, which
        # the softmax ignores, so its gradient is identically zero (and Adam would turn
        # round-off into noise steps).
        self.k = Dense(d_model, d_model, has_bias=False, dtype=dtype)
        self.v = Dense(d_model, d_model, dtype=dtype)
        self.proj = Dense(d_model, d_model, dtype=dtype)
        self.split_q, self.split_k, self.split_v = ops.Reshape(), ops.Reshape(), ops.Reshape()
        self.heads_q = ops.Transpose((0, 2, 1, 3))
        self.heads_k = ops.Transpose((0, 2, 1, 3))
        self.heads_v = ops.Transpose((0, 2, 1, 3))
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.scale = ops.Mul()
        self.mask_add = ops.Add()
        self.softmax = ops.Softmax(axis=-1)
        self.context = ops.BatchMatMul()
        self.merge_t = ops.Transpose((0, 2, 1, 3))
        self.merge = ops.Reshape()
        self.causal = causal
        self.drop = Dropout(1.0 - dropout) if dropout else None
        self._mask = _causal_mask(seq_length, self.dtype)

    def construct(self, x: Any) -> Any:
        b, s, h = x.shape
        nh, hd = self.n_heads, self.head_dim
        q = self.heads_q(self.split_q(self.q(x), (b, s, nh, hd)))
        k = self.heads_k(self.split_k(self.k(x), (b, s, nh, hd)))
        v = self.heads_v(self.split_v(self.v(x), (b, s, nh, hd)))
        scores = self.scale(self.scores(q, k), np.asarray(1.0 / math.sqrt(hd), self.dtype))
        if self.causal:
            scores = self.mask_add(scores, self._mask[:s, :s])
        p = self.softmax(scores)
        if self.drop is not None:
            p = self.drop(p)
        ctx = self.merge(self.merge_t(self.context(p, v)), (b, s, h))
        return self.proj(ctx)


def _causal_mask(seq_length: int, dtype: np.dtype) -> np.ndarray:
    """The (seq, seq) causal mask, 0 on and below the diagonal and -1e9 above, as a read-only
    view of 2 seq - 1 elements: ``mask[i, j] = line[seq - 1 + j - i]``. A materialised mask
    would cost seq² elements per layer at construction (96 MiB for 24 layers at seq 1024),
    which planning from shapes alone must not allocate; a rank's kernel reads only its slice.
    """
    line = np.zeros(2 * seq_length - 1, dtype)
    line[seq_length:] = -1e9
    return np.lib.stride_tricks.as_strided(line[seq_length - 1:], (seq_length, seq_length),
                                           (-line.itemsize, line.itemsize), writeable=False)


class TransformerBlock(Cell):
    """Pre-LN block: ``x + attn(ln1(x))`` then ``x + ffn(ln2(x))``."""

    def __init__(self, d_model: int, n_heads: int, seq_length: int, d_ff: int | None = None,
                 causal: bool = True, dropout: float = 0.0, dtype: Any = np.float32) -> None:
        super().__init__()
        self.ln1 = LayerNorm((d_model,), dtype=dtype)
        self.attn = MultiHeadAttention(d_model, n_heads, seq_length, causal, dropout, dtype)
        self.ln2 = LayerNorm((d_model,), dtype=dtype)
        self.ffn = FeedForward(d_model, d_ff or 4 * d_model, dropout, dtype)
        self.add1, self.add2 = ops.Add(), ops.Add()

    def construct(self, x: Any) -> Any:
        x = self.add1(x, self.attn(self.ln1(x)))
        return self.add2(x, self.ffn(self.ln2(x)))


class GPT(Cell):
    """A small GPT: token + position embeddings, ``n_layers`` pre-LN blocks, final LayerNorm
    and an LM head Dense(d_model, vocab) without bias. Input ids (batch, seq) -> logits
    (batch, seq, vocab)."""

    def __init__(self, vocab_size: int = 128, seq_length: int = 32, d_model: int = 64,
                 n_layers: int = 2, n_heads: int = 8, d_ff: int | None = None,
                 dropout: float = 0.0, dtype: Any = np.float32) -> None:
        super().__init__()
        _check_sizes("GPT", vocab_size=vocab_size, seq_length=seq_length, d_model=d_model,
                     n_layers=n_layers, n_heads=n_heads)
        self.vocab_size, self.seq_length, self.d_model = vocab_size, seq_length, d_model
        self.embedding = Embedding(vocab_size, d_model, dtype)
        self.position = Parameter(initializer("normal", (seq_length, d_model), dtype,
                                              sigma=0.01))
        self.add_pos = ops.Add()
        self.blocks = []
        for k in range(n_layers):
            block = TransformerBlock(d_model, n_heads, seq_length, d_ff, True, dropout, dtype)
            setattr(self, f"block{k}", block)
            self.blocks.append(block)
        self.ln_f = LayerNorm((d_model,), dtype=dtype)
        self.head = Dense(d_model, vocab_size, has_bias=False, dtype=dtype)

    def construct(self, ids: Any) -> Any:
        x = self.add_pos(self.embedding(ids), self.position)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
