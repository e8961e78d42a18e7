"""One training step, simpar against hand-written numpy + mpi4py and PyTorch DTensor (issue 12).

    python benchmarks/step.py                    # writes "## step" to benchmarks/RESULTS.md
    python benchmarks/step.py --quick --no-write # a smoke check: 2 rounds of 3 steps
    python benchmarks/step.py --rounds 8 --steps 20 --models mlp --single-threads 1
    python benchmarks/step.py --pipelines        # benchmarks/pipeline_step.py, 8 and 2 ranks

Run it without mpirun: it is the orchestrator, and starts three jobs that stay up for the whole
run (their commands are printed and recorded):

* ``mpirun -n 8 python benchmarks/step.py --worker mpi``: variants (a) and (b);
* ``python benchmarks/step.py --worker single`` (one process): variants (c) and (d);
* ``torchrun --standalone --nproc-per-node 8 benchmarks/_dtensor_step.py`` with
  ``OMP_NUM_THREADS=1``: variant (e), when torch is installed (``pip install -e '.[bench]'``).

Only one job runs at a time. The others wait in a blocking read of their control socket
(benchmarks/_step_shared.py), so they take no CPU, where ranks waiting in MPI would poll even
with MPICH's yielding wait. Each round runs every variant for ``--steps`` steps, the variants in
an order that rotates from round to round, so that drift on this shared host hits them alike.
Within a job each step starts after a barrier (MPI's, or gloo's for DTensor) and a step's time
is the slowest rank's. The table gives the median and the min-max of every timed step, and the
range of the per-round medians; a ratio is computed per round (median over median) and shown as
its median and min-max over rounds.

The Megatron MLP (issue 12): batch 64, hidden 1024, FFN 4096, fc1 column-parallel -> GeLU (tanh
form) -> fc2 row-parallel, MSE loss, SGD (lr 0.1), float32, on every rank of the mesh:

* (a) hand-written numpy + mpi4py, the floor for this machine: one AllReduce per step (fc2's
  output; fc1's input needs no gradient, so the backward needs none), the tanh of the GeLU kept
  from the forward for its gradient, in-place SGD; in the MPI job's processes, so with simpar's
  thread and wait policy (one BLAS thread per rank, set again with threadpoolctl; MPICH's
  yielding wait when ranks outnumber cores);
* (b) simpar: ``nn.MLP(1024, 4096, 1024, activation="gelu")`` with
  ``presets.megatron_mlp(mlp, 1, 8)``, ``WithLossCell(MSELoss)``, ``TrainOneStepCell(SGD)``
  in ``semi_auto_parallel`` (dataset ``full_batch``, ``gradients_mean=True``), fed the global
  batch as a user would;
* (c) the same numpy step in one process (the whole model, no communication) and (d) simpar's
  ``stand_alone`` step, both in the single-process job. That job is a process of its own rather
  than rank 0 of the MPI job, because seven ranks waiting in MPI slow a busy rank down (README,
  "Threads and the MPI wait policy"). It takes the threads simpar chooses for one process on
  this host (both cores; the table says how many; ``--single-threads`` sets them), the same
  for (c) and (d);
* (e) PyTorch DTensor: ``parallelize_module`` with ColwiseParallel / RowwiseParallel over gloo
  on CPU, ``torch.optim.SGD``, one thread per rank (benchmarks/_dtensor_step.py).

The main job's GPT (``python -m simpar.train``'s default sizes: vocabulary 128, sequence 32,
d_model 64, 2 layers, 8 heads, batch 8), in float32 with SGD (the main job trains float64 with
Adam; the optimizer is elementwise and small here), cross entropy: (a) and (b) under the
``hybrid`` preset (Megatron dp 2 x mp 4) and under ``mp`` (Megatron over all 8), (c) and (d) in
one process. The hand-written GPT is Megatron's: vocabulary-parallel embedding (one AllReduce),
per block the two forward AllReduces (attention and FFN outputs) and the two backward ones (the
column-parallel inputs' gradients), the LM head's input gradient, a vocabulary-parallel cross
entropy (one MAX and one SUM AllReduce over mp), the loss over dp, and one bucketed gradient
AllReduce over dp. There is no DTensor GPT.

All variants of a model start from the same weights (benchmarks/_step_shared.py for the MLP,
:func:`gpt_weights` here; simpar's parameter shards are overwritten with their slices after
``build``) and train on the same batches. Before timing, each trains 3 steps from them: every
variant's 3 losses must agree with (c)'s within a relative 1e-4, or the run stops. The
collectives of one step are recorded once, before the check: by CommTrace for simpar, by
counting for the numpy steps, by CommDebugMode for DTensor (simpar.comm's one-word input check
is not traced).
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# The environment as launched, before simpar/_env.py adds its thread and wait-policy variables:
# each job must choose for itself (8 ranks and 1 process choose differently).
_LAUNCH_ENV = dict(os.environ)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import simpar
from simpar import _env, comm, nn

import numpy as np
from _common import host_line, markdown_table, today, write_section
from _step_shared import (
    BATCH,
    CHECK_STEPS,
    CONTROL_ENV,
    FFN,
    HIDDEN,
    LR,
    N_BATCHES,
    SEED,
    Variant,
    mlp_batch,
    mlp_weights,
    serve,
)
from threadpoolctl import threadpool_info, threadpool_limits

from simpar.dataset import VOCAB_SIZE
from simpar.nn import presets

SCRIPT = "python benchmarks/step.py"
LOSS_RTOL = 1e-4
MODELS = ("mlp", "gpt")
GPT_PRESETS = ("hybrid", "mp")


@dataclass(frozen=True, slots=True)
class GPTSizes:
    """``python -m simpar.train``'s default GPT."""

    vocab: int = VOCAB_SIZE
    seq: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 8
    batch: int = 8

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


GPT = GPTSizes()


@dataclass(frozen=True, slots=True)
class Ratio:
    label: str
    model: str
    numerator: str
    denominator: str
    target: float


RATIOS = (Ratio("(b)/(a)", "mlp", "mlp/b", "mlp/a", 1.15),
          Ratio("(d)/(c)", "mlp", "mlp/d", "mlp/c", 1.15),
          Ratio("(b)/(e)", "mlp", "mlp/b", "mlp/e", 0.6),
          Ratio("(b)/(a) hybrid", "gpt", "gpt-hybrid/b", "gpt-hybrid/a", 1.15),
          Ratio("(b)/(a) mp", "gpt", "gpt-mp/b", "gpt-mp/a", 1.15),
          Ratio("(d)/(c)", "gpt", "gpt/d", "gpt/c", 1.15))

WHAT = {"a": "numpy + mpi4py, by hand", "b": "simpar semi_auto_parallel",
        "c": "numpy, one process", "d": "simpar stand_alone, one process",
        "e": "PyTorch DTensor, gloo"}


def gpt_weights(s: GPTSizes = GPT, seed: int = SEED) -> dict[str, np.ndarray]:
    """The GPT's global float32 parameters, named as in ``simpar.nn.GPT``."""
    rng = np.random.default_rng([seed, 2])
    d, f = s.d_model, s.d_ff

    def normal(*shape: int, sigma: float = 0.02) -> np.ndarray:
        return rng.normal(0, sigma, shape).astype(np.float32)

    w = {"position": normal(s.seq, d, sigma=0.01), "embedding.embedding_table": normal(s.vocab, d)}
    for layer in range(s.n_layers):
        b = f"block{layer}."
        for ln in ("ln1", "ln2"):
            w[f"{b}{ln}.gamma"], w[f"{b}{ln}.beta"] = 1 + normal(d), normal(d)
        for name in ("q", "k", "v", "proj"):
            w[f"{b}attn.{name}.weight"] = normal(d, d)
        for name in ("q", "v", "proj"):  # the key has no bias
            w[f"{b}attn.{name}.bias"] = normal(d)
        w[f"{b}ffn.fc1.weight"], w[f"{b}ffn.fc1.bias"] = normal(f, d), normal(f)
        w[f"{b}ffn.fc2.weight"], w[f"{b}ffn.fc2.bias"] = normal(d, f), normal(d)
    w["ln_f.gamma"], w["ln_f.beta"] = 1 + normal(d), normal(d)
    w["head.weight"] = normal(s.vocab, d)
    return w


def gpt_batch(k: int, s: GPTSizes = GPT, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Global batch ``k % N_BATCHES``: token ids and labels, int32 (batch, seq)."""
    rng = np.random.default_rng([seed, 3, k % N_BATCHES])
    return (rng.integers(0, s.vocab, (s.batch, s.seq), dtype=np.int32),
            rng.integers(0, s.vocab, (s.batch, s.seq), dtype=np.int32))


# ------------------------------------------------------------------ the hand-written steps
@dataclass
class _Group:
    """In-place AllReduces over one mpi4py communicator (None: one rank, nothing to do).
    While ``calls`` is a list, each call appends its kind and shape to it."""

    comm: Any = None
    mpi: Any = None
    calls: list[tuple[str, tuple[int, ...]]] | None = None

    def sum(self, a: np.ndarray) -> np.ndarray:
        return self._reduce(a, "SUM")

    def max(self, a: np.ndarray) -> np.ndarray:
        return self._reduce(a, "MAX")

    def _reduce(self, a: np.ndarray, op: str) -> np.ndarray:
        if self.comm is None:
            return a
        if self.calls is not None:
            self.calls.append(("AllReduce" if op == "SUM" else "AllReduce(max)", a.shape))
        self.comm.Allreduce(self.mpi.IN_PLACE, a, op=getattr(self.mpi, op))
        return a


_GELU_C, _GELU_A = math.sqrt(2.0 / math.pi), 0.044715
_LN_EPS = 1e-7  # simpar.nn.LayerNorm's default


def _gelu(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``0.5 z (1 + t)`` with ``t = tanh(c (z + a z^3))``; returns both (t for the gradient)."""
    t = z * z
    t *= _GELU_A
    t += 1.0
    t *= z
    t *= _GELU_C
    np.tanh(t, out=t)
    h = t + 1.0
    h *= z
    h *= 0.5
    return h, t


def _gelu_grad(z: np.ndarray, t: np.ndarray, dh: np.ndarray) -> np.ndarray:
    s = z * z
    s *= 3 * _GELU_A
    s += 1.0
    s *= _GELU_C
    s *= z
    s *= 1.0 - t * t
    s += t
    s += 1.0
    s *= 0.5
    s *= dh
    return s


def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray
                ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    xc = x - x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + _LN_EPS)
    xc *= rstd
    return xc * gamma + beta, (xc, rstd)


def _layer_norm_grad(dy: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, gamma: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = dy * gamma
    dx = g - g.mean(-1, keepdims=True)
    dx -= xhat * (g * xhat).mean(-1, keepdims=True)
    dx *= rstd
    d = dy.shape[-1]
    return dx, (dy * xhat).reshape(-1, d).sum(0), dy.reshape(-1, d).sum(0)


def _part(n: int, k: int, parts: int) -> slice:
    return slice(k * n // parts, (k + 1) * n // parts)


class _HandModel(Protocol):
    def load(self, weights: dict[str, np.ndarray]) -> None: ...

    def step(self, x: np.ndarray, y: np.ndarray) -> float: ...


class HandMLP:
    """The Megatron MLP on ``parts`` ranks, this one holding part ``part``: fc1's rows (output
    features) and fc2's columns ``[part * 4096 / parts, ...)``; fc2's bias whole. One
    AllReduce of fc2's output per step and none backward (the input needs no gradient)."""

    def __init__(self, part: int, parts: int, lr: float, group: _Group) -> None:
        self.part, self.parts, self.lr, self.group = part, parts, lr, group
        self.w1 = self.b1 = self.w2 = self.b2 = np.empty(0, np.float32)

    def load(self, weights: dict[str, np.ndarray]) -> None:
        cols = _part(FFN, self.part, self.parts)
        self.w1 = weights["fc1.weight"][cols].copy()
        self.b1 = weights["fc1.bias"][cols].copy()
        self.w2 = weights["fc2.weight"][:, cols].copy()  # C order, never a view
        self.b2 = weights["fc2.bias"].copy()

    def step(self, x: np.ndarray, target: np.ndarray) -> float:
        z = x @ self.w1.T
        z += self.b1
        h, t = _gelu(z)
        y = h @ self.w2.T
        self.group.sum(y)
        y += self.b2
        d = y
        d -= target
        loss = float(np.vdot(d, d)) / d.size
        d *= 2.0 / d.size                        # dloss/dy
        gw2 = d.T @ h
        gb2 = d.sum(0)
        dz = _gelu_grad(z, t, d @ self.w2)
        gw1 = dz.T @ x
        gb1 = dz.sum(0)
        for p, g in ((self.w1, gw1), (self.b1, gb1), (self.w2, gw2), (self.b2, gb2)):
            g *= self.lr
            p -= g
        return loss


_ROW_SPLIT = ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.q.bias", "attn.v.bias",
              "ffn.fc1.weight", "ffn.fc1.bias")
_COLUMN_SPLIT = ("attn.proj.weight", "ffn.fc2.weight")


class HandGPT:
    """The GPT, Megatron-style over dp x mp ranks; rank ``r`` is (r // mp, r % mp), holding
    batch rows ``[d * batch / dp, ...)`` and model part ``m`` of ``mp``: vocabulary rows of
    the embedding and LM head, heads ``[m * n_heads / mp, ...)`` of q, k and v (their weight
    rows), the matching columns of proj, FFN columns of fc1's rows and fc2's columns.
    LayerNorms, the position table and the row-parallel biases are whole."""

    def __init__(self, s: GPTSizes, dp: int, mp: int, rank: int, lr: float, mp_group: _Group,
                 dp_group: _Group) -> None:
        self.s, self.dp, self.mp, self.lr = s, dp, mp, lr
        self.d, self.m = divmod(rank, mp)
        self.mpg, self.dpg = mp_group, dp_group
        self.rows = _part(s.batch, self.d, dp)
        self.vocab = _part(s.vocab, self.m, mp)
        self.heads, self.head_dim = s.n_heads // mp, s.d_model // s.n_heads
        self.scale = np.float32(1.0 / math.sqrt(self.head_dim))
        self.mask = np.triu(np.full((s.seq, s.seq), -1e9, np.float32), 1)
        self.p: dict[str, np.ndarray] = {}

    def load(self, weights: dict[str, np.ndarray]) -> None:
        self.p = {}
        for name, w in weights.items():
            if name in ("embedding.embedding_table", "head.weight"):
                self.p[name] = w[self.vocab].copy()
            elif name.endswith(_ROW_SPLIT):
                self.p[name] = w[_part(w.shape[0], self.m, self.mp)].copy()
            elif name.endswith(_COLUMN_SPLIT):
                self.p[name] = w[:, _part(w.shape[1], self.m, self.mp)].copy()
            else:
                self.p[name] = w.copy()

    def step(self, ids_global: np.ndarray, labels_global: np.ndarray) -> float:
        p, s = self.p, self.s
        ids, labels = ids_global[self.rows], labels_global[self.rows].reshape(-1)
        b, seq = ids.shape
        n, total, d = b * seq, s.batch * s.seq, s.d_model
        # Vocabulary-parallel embedding: each rank looks up its rows, one AllReduce over mp.
        local = ids - self.vocab.start
        mine = (local >= 0) & (local < self.vocab.stop - self.vocab.start)
        local = np.where(mine, local, 0)
        x = p["embedding.embedding_table"][local]
        if self.mp > 1:
            x *= mine[..., None]
            self.mpg.sum(x)
        x += p["position"]
        caches = []
        for layer in range(s.n_layers):
            x, cache = self._block(x, f"block{layer}.")
            caches.append(cache)
        xf, lnf = _layer_norm(x, p["ln_f.gamma"], p["ln_f.beta"])
        xf = xf.reshape(n, d)
        logits = xf @ p["head.weight"].T
        # Vocabulary-parallel cross entropy: the row maxima, then [sum exp, target logit].
        top = self.mpg.max(logits.max(1))
        e = logits - top[:, None]
        np.exp(e, out=e)
        target = labels - self.vocab.start
        hit = (target >= 0) & (target < self.vocab.stop - self.vocab.start)
        target = np.where(hit, target, 0)
        stats = np.empty((2, n), np.float32)
        stats[0] = e.sum(1)
        stats[1] = np.where(hit, logits[np.arange(n), target], 0)
        self.mpg.sum(stats)
        loss = np.array([(np.log(stats[0]) + top - stats[1]).sum() / total], np.float32)
        self.dpg.sum(loss)
        # Backward.
        e /= stats[0][:, None]
        e[np.flatnonzero(hit), target[hit]] -= 1.0
        e *= 1.0 / total                        # dloss/dlogits
        g: dict[str, np.ndarray] = {"head.weight": e.T @ xf}
        dxf = self.mpg.sum(e @ p["head.weight"])
        dx, g["ln_f.gamma"], g["ln_f.beta"] = _layer_norm_grad(dxf.reshape(b, seq, d), *lnf,
                                                               p["ln_f.gamma"])
        for layer in reversed(range(s.n_layers)):
            dx = self._block_grad(dx, caches[layer], f"block{layer}.", g)
        g["position"] = dx.sum(0)
        table = np.zeros_like(p["embedding.embedding_table"])
        np.add.at(table, local[mine], dx[mine])
        g["embedding.embedding_table"] = table
        self._sgd(g)
        return float(loss[0])

    def _block(self, x: np.ndarray, pre: str) -> tuple[np.ndarray, tuple[Any, ...]]:
        p = self.p
        b, seq, d = x.shape
        n, nh, hd = b * seq, self.heads, self.head_dim
        h1, ln1 = _layer_norm(x, p[pre + "ln1.gamma"], p[pre + "ln1.beta"])
        h1 = h1.reshape(n, d)
        q = h1 @ p[pre + "attn.q.weight"].T
        q += p[pre + "attn.q.bias"]
        k = h1 @ p[pre + "attn.k.weight"].T
        v = h1 @ p[pre + "attn.v.weight"].T
        v += p[pre + "attn.v.bias"]
        q4, k4, v4 = (a.reshape(b, seq, nh, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
        pr = q4 @ k4.transpose(0, 1, 3, 2)
        pr *= self.scale
        pr += self.mask
        pr -= pr.max(-1, keepdims=True)
        np.exp(pr, out=pr)
        pr /= pr.sum(-1, keepdims=True)
        ctx = (pr @ v4).transpose(0, 2, 1, 3).reshape(n, nh * hd)
        o = self.mpg.sum(ctx @ p[pre + "attn.proj.weight"].T)
        o += p[pre + "attn.proj.bias"]
        xm = x + o.reshape(b, seq, d)
        h2, ln2 = _layer_norm(xm, p[pre + "ln2.gamma"], p[pre + "ln2.beta"])
        h2 = h2.reshape(n, d)
        z = h2 @ p[pre + "ffn.fc1.weight"].T
        z += p[pre + "ffn.fc1.bias"]
        a, t = _gelu(z)
        f = self.mpg.sum(a @ p[pre + "ffn.fc2.weight"].T)
        f += p[pre + "ffn.fc2.bias"]
        return xm + f.reshape(b, seq, d), (ln1, h1, q4, k4, v4, pr, ctx, ln2, h2, z, a, t)

    def _block_grad(self, dx: np.ndarray, cache: tuple[Any, ...], pre: str,
                    g: dict[str, np.ndarray]) -> np.ndarray:
        p = self.p
        ln1, h1, q4, k4, v4, pr, ctx, ln2, h2, z, a, t = cache
        b, seq, d = dx.shape
        n, nh, hd = b * seq, self.heads, self.head_dim
        df = dx.reshape(n, d)
        g[pre + "ffn.fc2.weight"], g[pre + "ffn.fc2.bias"] = df.T @ a, df.sum(0)
        dz = _gelu_grad(z, t, df @ p[pre + "ffn.fc2.weight"])
        g[pre + "ffn.fc1.weight"], g[pre + "ffn.fc1.bias"] = dz.T @ h2, dz.sum(0)
        dh2 = self.mpg.sum(dz @ p[pre + "ffn.fc1.weight"])
        dxm, g[pre + "ln2.gamma"], g[pre + "ln2.beta"] = _layer_norm_grad(
            dh2.reshape(b, seq, d), ln2[0], ln2[1], p[pre + "ln2.gamma"])
        dxm += dx
        do = dxm.reshape(n, d)
        g[pre + "attn.proj.weight"], g[pre + "attn.proj.bias"] = do.T @ ctx, do.sum(0)
        dctx = (do @ p[pre + "attn.proj.weight"]).reshape(b, seq, nh, hd).transpose(0, 2, 1, 3)
        ds = dctx @ v4.transpose(0, 1, 3, 2)
        dv4 = pr.transpose(0, 1, 3, 2) @ dctx
        ds -= (ds * pr).sum(-1, keepdims=True)
        ds *= pr
        ds *= self.scale
        dq4, dk4 = ds @ k4, ds.transpose(0, 1, 3, 2) @ q4
        dq, dk, dv = (a.transpose(0, 2, 1, 3).reshape(n, nh * hd) for a in (dq4, dk4, dv4))
        g[pre + "attn.q.weight"], g[pre + "attn.q.bias"] = dq.T @ h1, dq.sum(0)
        g[pre + "attn.k.weight"] = dk.T @ h1
        g[pre + "attn.v.weight"], g[pre + "attn.v.bias"] = dv.T @ h1, dv.sum(0)
        dh1 = dq @ p[pre + "attn.q.weight"]
        dh1 += dk @ p[pre + "attn.k.weight"]
        dh1 += dv @ p[pre + "attn.v.weight"]
        self.mpg.sum(dh1)
        dxa, g[pre + "ln1.gamma"], g[pre + "ln1.beta"] = _layer_norm_grad(
            dh1.reshape(b, seq, d), ln1[0], ln1[1], p[pre + "ln1.gamma"])
        dxm += dxa
        return dxm

    def _sgd(self, g: dict[str, np.ndarray]) -> None:
        """Every gradient is this dp shard's part of the global one: one bucketed AllReduce
        over dp completes them all (none on one dp rank)."""
        assert g.keys() == self.p.keys(), sorted(set(g) ^ set(self.p))
        names = list(self.p)
        if self.dpg.comm is None:
            for name in names:
                g[name] *= self.lr
                self.p[name] -= g[name]
            return
        flat = self.dpg.sum(np.concatenate([g[name].reshape(-1) for name in names]))
        flat *= self.lr
        start = 0
        for name in names:
            w = self.p[name]
            w -= flat[start:start + w.size].reshape(w.shape)
            start += w.size


# ------------------------------------------------------------------ the variants
Batch = Callable[[int], tuple[np.ndarray, np.ndarray]]


def _describe(calls: Sequence[tuple[str, tuple[int, ...]]]) -> str:
    """``AllReduce 64x1024 x1, AllReduce scalar x1``: one step's collectives by kind and
    local shape."""
    counts = Counter((kind, "x".join(map(str, shape)) or "scalar") for kind, shape in calls)
    return ", ".join(f"{kind} {shape} x{n}" for (kind, shape), n in counts.items()) or "none"


def _hand_variant(model: _HandModel, weights: dict[str, np.ndarray], batch: Batch,
                  groups: Sequence[_Group]) -> Variant:
    """``model`` from ``weights``; one step is run to count its collectives, then the weights
    are loaded again."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    for group in groups:
        group.calls = calls
    model.load(weights)
    model.step(*batch(0))
    for group in groups:
        group.calls = None
    model.load(weights)
    batches = [batch(k) for k in range(N_BATCHES)]
    return Variant(lambda k: model.step(*batches[k % N_BATCHES]), _describe(calls))


def _load(train: nn.TrainOneStepCell, weights: dict[str, np.ndarray]) -> None:
    """Overwrite this rank's parameter shards with their slices of ``weights``."""
    prog = train.program
    assert prog is not None
    rank = comm.get_rank() if prog.device_num > 1 else 0
    names = {name.removeprefix("_backbone."): name for name in train.params}
    if set(names) != set(weights):
        raise ValueError(f"step.py: simpar's parameters {sorted(names)} are not the "
                         f"benchmark's {sorted(weights)}")
    for short, name in names.items():
        block = tuple(slice(lo, hi) for lo, hi in prog.param_layouts[name].slice_of(rank))
        train.params[name][...] = weights[short][block]


def _simpar_variant(model: nn.Cell, loss: nn.Cell, mode: str, dataset: Any,
                    weights: dict[str, np.ndarray], batch: Batch) -> Variant:
    """``TrainOneStepCell(WithLossCell(model, loss), SGD)`` built under ``mode``, from
    ``weights``; one traced step counts its collectives, then the weights are loaded again."""
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True,
                                     enable_alltoall=True, dataset_strategy=dataset)
    try:
        cell = nn.WithLossCell(model, loss)
        train = nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), LR),
                                    parallel_mode=mode, seed=SEED)
        train.build(*batch(0))
    finally:
        simpar.reset_auto_parallel_context()
    _load(train, weights)
    with comm.CommTrace() as trace:
        train(*batch(0))
    _load(train, weights)
    batches = [batch(k) for k in range(N_BATCHES)]
    return Variant(lambda k: train(*batches[k % N_BATCHES]),
                   _describe([(e.kind, tuple(e.shape)) for e in trace.events]))


def _read_only(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The shared initial weights, locked: a variant that trained them in place would hand
    the next one trained weights (and fail the loss check for a reason that is no bug)."""
    for a in weights.values():
        a.setflags(write=False)
    return weights


def _blas_threads() -> dict[str, Any]:
    """Limit BLAS to simpar's choice of threads for this process (threadpoolctl, as
    simpar/_env.py does when numpy came first) and say what it reports."""
    threads = int(str(_env.SETTINGS["blas_threads"]))
    threadpool_limits(limits=threads, user_api="blas")
    seen = sorted({int(i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"})
    return {"blas_threads": seen, "threads_from": _env.SETTINGS["threads_from"],
            "wait_policy": _env.SETTINGS["wait_policy"],
            "wait_policy_from": _env.SETTINGS["wait_policy_from"],
            "numpy": np.__version__}


def _gpt_cell() -> tuple[nn.GPT, nn.SoftmaxCrossEntropyWithLogits]:
    s = GPT
    return (nn.GPT(s.vocab, s.seq, s.d_model, s.n_layers, s.n_heads, dtype=np.float32),
            nn.SoftmaxCrossEntropyWithLogits())


def mpi_worker(models: Sequence[str]) -> None:
    """Variants (a) and (b), on every rank of the MPI job."""
    comm.init()                       # simpar starts MPI, after choosing threads and wait policy
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    info = _blas_threads()
    variants: dict[str, Variant] = {}
    if "mlp" in models:
        w = _read_only(mlp_weights())
        group = _Group(world, MPI)
        variants["mlp/a"] = _hand_variant(HandMLP(rank, size, LR, group), w, mlp_batch, [group])
        mlp = nn.MLP(HIDDEN, FFN, HIDDEN, activation="gelu", dtype=np.float32)
        presets.megatron_mlp(mlp, 1, size)
        variants["mlp/b"] = _simpar_variant(mlp, nn.MSELoss(), "semi_auto_parallel",
                                            "full_batch", w, mlp_batch)
    if "gpt" in models:
        w = _read_only(gpt_weights())
        for preset in GPT_PRESETS:
            gpt, loss = _gpt_cell()
            dp, mp = presets.apply(preset, gpt, size, loss)
            d, m = divmod(rank, mp)
            mp_comm, dp_comm = world.Split(d, m), world.Split(m, d)
            groups = [_Group(c if c.Get_size() > 1 else None, MPI) for c in (mp_comm, dp_comm)]
            hand = HandGPT(GPT, dp, mp, rank, LR, *groups)
            variants[f"gpt-{preset}/a"] = _hand_variant(hand, w, gpt_batch, groups)
            variants[f"gpt-{preset}/b"] = _simpar_variant(
                gpt, loss, "semi_auto_parallel", ((dp, 1), (dp, 1)) if dp > 1 else "full_batch",
                w, gpt_batch)
    serve("mpi", rank, size, variants, world.Barrier, info)


def single_worker(models: Sequence[str]) -> None:
    """Variants (c) and (d), in one process."""
    info = _blas_threads()
    variants: dict[str, Variant] = {}
    if "mlp" in models:
        w = _read_only(mlp_weights())
        variants["mlp/c"] = _hand_variant(HandMLP(0, 1, LR, _Group()), w, mlp_batch, [])
        mlp = nn.MLP(HIDDEN, FFN, HIDDEN, activation="gelu", dtype=np.float32)
        variants["mlp/d"] = _simpar_variant(mlp, nn.MSELoss(), "stand_alone", "full_batch", w,
                                            mlp_batch)
    if "gpt" in models:
        w = _read_only(gpt_weights())
        hand = HandGPT(GPT, 1, 1, 0, LR, _Group(), _Group())
        variants["gpt/c"] = _hand_variant(hand, w, gpt_batch, [])
        gpt, loss = _gpt_cell()
        variants["gpt/d"] = _simpar_variant(gpt, loss, "stand_alone", "full_batch", w, gpt_batch)
    serve("single", 0, 1, variants, lambda: None, info)


# ------------------------------------------------------------------ the orchestrator
@dataclass
class _Job:
    """One launched job: its process, log, and a control connection per rank."""

    name: str
    argv: list[str]
    size: int
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    links: dict[int, Any] = field(default_factory=dict)      # rank -> socket file
    hello: dict[str, Any] = field(default_factory=dict)      # rank 0's report

    def start(self) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def ready(self) -> bool:
        return len(self.links) == self.size

    def dead(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def tail(self, lines: int = 25) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def command(self) -> str:
        """The launch command as one would type it in the repository, venv active."""
        short = {sys.executable: "python", _mpirun(): "mpirun", _torchrun(): "torchrun"}
        argv = [short.get(a, str(Path(a).relative_to(HERE.parent))
                          if a.startswith(f"{HERE}/") else a) for a in self.argv]
        told = [f"{k}={v}" for k, v in self.env.items()
                 if k != CONTROL_ENV and _LAUNCH_ENV.get(k) != v]
        return " ".join([*told, shlex.join(argv)])

    def request(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """Send ``message`` to every rank; the answers, by rank."""
        line = json.dumps(message) + "\n"
        for link in self.links.values():
            link.write(line)
            link.flush()
        return [self._answer(rank) for rank in sorted(self.links)]

    def _answer(self, rank: int) -> dict[str, Any]:
        line = self.links[rank].readline()
        if not line:
            raise RuntimeError(f"job {self.name} (rank {rank}) stopped answering; its log "
                               f"{self.log} ends:\n{self.tail()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def quit(self) -> None:
        for link in self.links.values():
            try:
                link.write(json.dumps({"cmd": "quit"}) + "\n")
                link.flush()
            except OSError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(timeout=30)


def _mpirun() -> str:
    beside = Path(sys.executable).with_name("mpirun")
    return str(beside) if beside.exists() else (shutil.which("mpirun") or "mpirun")


def _torchrun() -> str:
    beside = Path(sys.executable).with_name("torchrun")
    return str(beside) if beside.exists() else (shutil.which("torchrun") or "torchrun")


def _connect(jobs: list[_Job], listener: socket.socket, timeout: float) -> dict[str, str]:
    """Accept every rank's report until each job has all its ranks, or has died. Returns the
    jobs that died, with the end of their logs."""
    deadline = time.monotonic() + timeout
    by_name = {job.name: job for job in jobs}
    dead: dict[str, str] = {}
    while any(not job.ready() and job.name not in dead for job in jobs):
        for job in jobs:
            if not job.ready() and job.dead() and job.name not in dead:
                dead[job.name] = job.tail()
        if time.monotonic() > deadline:
            late = [job.name for job in jobs if not job.ready() and job.name not in dead]
            raise RuntimeError(f"jobs {late} did not report within {timeout:.0f} s")
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(600)
        link = conn.makefile("rw", encoding="utf-8")
        hello = json.loads(link.readline())
        job = by_name[hello["job"]]
        job.links[int(hello["rank"])] = link
        if int(hello["rank"]) == 0:
            job.hello = hello
    return dead


def _check_losses(hellos: dict[str, dict[str, Any]]) -> tuple[list[str], float]:
    """Every variant's first losses against the one-process numpy step's (c): the problems,
    and the largest relative difference."""
    problems, worst = [], 0.0
    for model in MODELS:
        names = [v for v in hellos if v.split("/")[0].split("-")[0] == model]
        ref_name = f"{model}/c"
        if ref_name not in hellos:
            continue
        ref = np.array(hellos[ref_name]["losses"])
        for name in names:
            got = np.array(hellos[name]["losses"])
            rel = float(np.max(np.abs(got - ref) / np.abs(ref)))
            worst = max(worst, rel)
            if not rel <= LOSS_RTOL:
                problems.append(f"{name}: losses {got.tolist()} against {ref_name}'s "
                                f"{ref.tolist()} (relative {rel:.2e} > {LOSS_RTOL})")
    return problems, worst


def _order(names: Sequence[str]) -> list[str]:
    rank = {"mlp": 0, "gpt-hybrid": 1, "gpt-mp": 2, "gpt": 3}
    return sorted(names, key=lambda v: (rank.get(v.split("/")[0], 9), v.split("/")[1]))


def orchestrate(args: argparse.Namespace) -> int:
    load = host_line()
    models = [m for m in MODELS if m in args.models]
    tmp = Path(tempfile.mkdtemp(prefix="simpar-step-"))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(1.0)
    env = dict(_LAUNCH_ENV, **{CONTROL_ENV: f"127.0.0.1:{listener.getsockname()[1]}"})
    here = str(Path(__file__).resolve())
    passed = ["--models", *models]
    jobs = [_Job("mpi", [_mpirun(), "-n", str(args.ranks), sys.executable, here, "--worker",
                         "mpi", *passed], args.ranks, env, tmp / "mpi.log"),
            _Job("single", [sys.executable, here, "--worker", "single", *passed], 1,
                 env if args.single_threads is None else
                 dict(env, SIMPAR_NUM_THREADS=str(args.single_threads)), tmp / "single.log")]
    skipped: str | None = None
    if "mlp" not in models:
        skipped = "--models leaves out the MLP, the only model with a DTensor step"
    elif args.no_dtensor:
        skipped = "--no-dtensor"
    elif importlib.util.find_spec("torch") is None:
        skipped = "torch is not importable here (pip install -e '.[bench]' installs it)"
    else:
        jobs.append(_Job("dtensor", [_torchrun(), "--standalone", "--nproc-per-node",
                                     str(args.ranks), str(HERE / "_dtensor_step.py")],
                         args.ranks, dict(env, OMP_NUM_THREADS="1"), tmp / "dtensor.log"))
    print("starting (logs in " + str(tmp) + "):\n" + "\n".join(f"  {j.command()}" for j in jobs),
          flush=True)
    try:
        for job in jobs:
            job.start()
        dead = _connect(jobs, listener, args.setup_timeout)
        for name, tail in dead.items():
            if name != "dtensor":
                raise RuntimeError(f"job {name} failed before reporting; its log ends:\n{tail}")
            last = tail.strip().splitlines()[-1] if tail.strip() else "no output"
            skipped = f"the torchrun job failed before reporting: {last}"
            print(f"(e) skipped: {skipped}\n{tail}", flush=True)
        jobs = [job for job in jobs if job.name not in dead]
        owner = {v: job for job in jobs for v in job.hello["variants"]}
        hellos = {v: job.hello["variants"][v] for job in jobs for v in job.hello["variants"]}
        names = _order(list(owner))
        problems, worst = _check_losses(hellos)
        if problems:
            print("losses disagree, so the timings would not compare the same step:\n  "
                  + "\n  ".join(problems), file=sys.stderr)
            return 1
        print(f"losses of the first {CHECK_STEPS} steps agree (largest relative difference "
              f"{worst:.1e}); warming up, then {args.rounds} rounds of {args.steps} steps",
              flush=True)
        for name in names:
            owner[name].request({"cmd": "run", "variant": name, "steps": args.warmup})
        rounds: dict[str, list[np.ndarray]] = {name: [] for name in names}
        for r in range(args.rounds):
            shift = r % len(names)
            for name in [*names[shift:], *names[:shift]]:
                answers = owner[name].request({"cmd": "run", "variant": name,
                                               "steps": args.steps})
                rounds[name].append(np.max([a["times"] for a in answers], axis=0))
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {np.median(rounds[n][-1]) * 1e3:.1f}" for n in names) + " ms", flush=True)
        infos = {job.name: job.hello["info"] for job in jobs}
        commands = [job.command() for job in jobs]
    finally:
        for job in jobs:
            job.quit()
        listener.close()
    shutil.rmtree(tmp, ignore_errors=True)  # kept, for their logs, when a job failed
    body = _report(args, names, rounds, hellos, owner, infos, commands, skipped, worst, load)
    print("\n" + body, flush=True)
    if not args.no_write:
        write_section("step", body)
        print("\nwritten to benchmarks/RESULTS.md (## step)")
    return 0


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _report(args: argparse.Namespace, names: list[str], rounds: dict[str, list[np.ndarray]],
            hellos: dict[str, dict[str, Any]], owner: dict[str, _Job],
            infos: dict[str, dict[str, Any]], commands: list[str], skipped: str | None,
            worst: float, load: str) -> str:
    rows = []
    for name in names:
        model, letter = name.split("/")
        every = np.concatenate(rounds[name])
        medians = [float(np.median(t)) for t in rounds[name]]
        ranks = owner[name].size
        rows.append([model, f"({letter}) {WHAT[letter]}", ranks, _ms(float(np.median(every))),
                     f"{_ms(float(every.min()))}–{_ms(float(every.max()))}",
                     f"{_ms(min(medians))}–{_ms(max(medians))}", hellos[name]["comm"]])
    if skipped is not None and "mlp" in args.models:
        after_mlp = sum(1 for name in names if name.startswith("mlp/"))
        rows.insert(after_mlp, ["mlp", f"(e) {WHAT['e']}", args.ranks, "skipped", "—", "—",
                                skipped])
    table = markdown_table(["model", "variant", "ranks", "median ms", "min–max ms",
                            "round medians ms", "collectives per step"], rows)
    ratio_rows, missed = [], []
    for ratio in RATIOS:
        if ratio.numerator not in rounds or ratio.denominator not in rounds:
            if ratio.model in args.models:
                ratio_rows.append([ratio.model, ratio.label, f"<= {ratio.target}", "—", "—",
                                   "not measured"])
            continue
        per_round = [float(np.median(a) / np.median(b)) for a, b in
                     zip(rounds[ratio.numerator], rounds[ratio.denominator])]
        mid = float(np.median(per_round))
        met = mid <= ratio.target
        if not met:
            missed.append(f"{ratio.model} {ratio.label} {mid:.2f}")
        ratio_rows.append([ratio.model, ratio.label, f"<= {ratio.target}", f"{mid:.2f}",
                           f"{min(per_round):.2f}–{max(per_round):.2f}",
                           "met" if met else "missed"])
    ratios = markdown_table(["model", "ratio", "target", "median over rounds",
                             "min–max over rounds", "verdict"], ratio_rows)
    settings = []
    for job, info in infos.items():
        if job == "dtensor":
            settings.append(f"dtensor: torch {info['torch']}, {info['threads']} intra-op / "
                            f"{info['interop_threads']} inter-op thread per rank, backend "
                            f"{info['backend']}")
        else:
            settings.append(f"{job}: BLAS threads {info['blas_threads']} "
                            f"({info['threads_from']}), wait policy {info['wait_policy']} "
                            f"({info['wait_policy_from']})")
    s = GPT
    command = shlex.join(["python", "benchmarks/step.py", *sys.argv[1:]])
    return "\n".join([
        f"Command: `{command}` · date: {today()}, which runs",
        "",
        *[f"    {c}" for c in commands],
        "",
        f"MLP: batch {BATCH}, hidden {HIDDEN}, FFN {FFN} (fc1 column-parallel -> GeLU -> fc2 "
        f"row-parallel), MSE, SGD lr {LR}, float32. GPT: the main job's sizes (vocabulary "
        f"{s.vocab}, sequence {s.seq}, d_model {s.d_model}, {s.n_layers} layers, {s.n_heads} "
        f"heads, batch {s.batch}), float32, SGD lr {LR}; hybrid = Megatron dp 2 x mp "
        f"{args.ranks // 2}, mp = Megatron over {args.ranks}. {args.rounds} rounds, each "
        f"running every variant for {args.steps} steps (after {args.warmup} untimed warm-up "
        "step(s) each), the order rotating between rounds; one job runs at a time while the others "
        "block in a socket read. A step is timed after a barrier, as the slowest rank's time. "
        "Ratios: per round, median over median; the median and range over rounds, and a "
        "ratio meets its target when its median over rounds does.",
        "",
        table,
        "",
        ratios,
        "",
        ("Targets missed: " + "; ".join(missed) + ".") if missed else
        "Every measured ratio meets its target.",
        "",
        f"Correctness: every variant's losses of its first {CHECK_STEPS} steps, from the same "
        f"weights on the same batches, agree with (c)'s within a relative {LOSS_RTOL} "
        f"(largest difference {worst:.1e}). Collectives per step: one step traced by CommTrace "
        "for simpar (simpar.comm's one-word input agreement check is not traced), counted for "
        "the numpy steps, by CommDebugMode for DTensor; shapes are per rank. There is no "
        "DTensor GPT. (c) and (d) run in a process of their own, not on rank 0 of the MPI job "
        "(seven ranks waiting in MPI would slow it), with the threads simpar chooses there.",
        "",
        "; ".join(settings) + ".",
        "",
        f"{load}.",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds (default 6)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke check: 2 rounds of 3 steps, 1 warm-up step")
    ap.add_argument("--ranks", type=int, default=8, help="ranks of the MPI and torchrun jobs")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--no-dtensor", action="store_true", help="skip (e) even with torch")
    ap.add_argument("--single-threads", type=int, default=None, metavar="N",
                    help="BLAS threads of the one-process job, (c) and (d) alike (default: "
                    "simpar's choice for one process, every usable core)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--setup-timeout", type=float, default=900,
                    help="seconds the jobs may take to build and check (default 900)")
    ap.add_argument("--worker", choices=("mpi", "single"), help=argparse.SUPPRESS)
    ap.add_argument("--pipelines", action="store_true",
                    help="the pipeline rows instead: benchmarks/pipeline_step.py on 8 ranks "
                    "and on 2, against a hand-written numpy + mpi4py 1F1B")
    args = ap.parse_args()
    if args.pipelines:   # each its own MPI job: the rows go under "## pipeline_step"
        script = str(Path(__file__).with_name("pipeline_step.py"))
        extra = ["--no-write"] if args.no_write else []
        for ranks in (8, 2):
            code = subprocess.call([_mpirun(), "-n", str(ranks), sys.executable, script,
                                    *extra], env=_LAUNCH_ENV)   # (not this process's threads)
            if code:
                return code
        return 0
    if args.worker == "mpi":
        mpi_worker(args.models)
        return 0
    if args.worker == "single":
        single_worker(args.models)
        return 0
    if any(v in _LAUNCH_ENV for v in _env.RANK_VARS):
        ap.error("run it without mpirun: it starts its own jobs")
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 1
    for name in ("rounds", "steps", "ranks", "single_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.ranks % 2 and "gpt" in args.models:
        ap.error(f"--ranks {args.ranks}: the GPT's hybrid preset needs an even number")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
