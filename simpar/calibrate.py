"""Measure this machine at this rank count and write a device profile for the cost model.

    mpirun -n 8 python -m simpar.calibrate --out simpar/cost/profiles/cpu-local.json
    mpirun -n 2 python -m simpar.calibrate --quick --out /tmp/quick.json   # seconds, rough
    python -m simpar.calibrate --help

Every rank measures at once, as in a training step, under the BLAS threads and MPI wait policy
that simpar itself chooses (``simpar/_env.py`` applies them on ``import simpar``, before numpy's
BLAS and MPI start). Each time is the slowest rank's, after a barrier; each figure is the median
over reps. The profile (:class:`~simpar.cost.profile.DeviceProfile`) gets:

* ``peak_flops``: float32 and float64 GEMM throughput per rank, 2 n^3 / time of a square GEMM
  whose size n is chosen, from a few probes, to take about 40 ms with every rank busy;
* ``memory_bandwidth``: bytes per second per rank of ``np.add(a, b, out=c)`` on 32 MiB arrays,
  counted as the cost model counts an elementwise op (inputs plus output: 3 x 32 MiB);
* ``intra_server``: latency per ring round and bandwidth, fitted (:func:`fit_link`) to
  AllReduce, AllGather, ReduceScatter and AllToAll through ``simpar.comm`` (validation off)
  on 4 KiB .. 4 MiB local buffers, over the world and over groups of 2 and 4 (every group at
  once), priced as :meth:`DeviceProfile.collective_seconds` prices them. The ranks must share
  one host, so ``inter_server`` is the same link and ``devices_per_server`` the world size.
  At 1 rank there is nothing to time: the link is copied from the shipped ``cpu-local``
  profile, and ``sources`` says so;
* ``memory_capacity``: the host's physical memory (``os.sysconf``) / its ranks; not measured;
* ``array_op_overhead``: seconds per tiny in-place numpy operation (an optimizer's update);
* the step terms (:data:`STEP_TERMS`): seconds per step, per kernel call and per collective
  call inside a step, and the kernels' time over their roofline, fitted jointly
  (:func:`fit_step_terms`) to eight reference training steps over every rank (MLPs and small
  transformers, float32 and float64, data parallel, optimizer level2, Megatron), each timed
  as ``benchmarks/cost_fidelity.py`` times a step and priced by the cost model itself
  (:func:`step_terms`).

``sources`` says, for every figure, how it was measured, with the command, the date and the
rank count. Rank 0 prints a line per phase, then every collective's measured time against the
fitted model's, and alone writes the profile (default ``<name>.json`` in the current directory;
a temporary file first, then renamed). ``--quick`` measures few sizes and reps, in seconds:
for tests, not for a profile to keep.

Exit codes: 0 written; 1 the ranks span several hosts; 2 bad arguments (one line on rank 0
names the flag and the value; no rank starts MPI).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import pathlib
import re
import shlex
import socket
import sys
import types
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any

import numpy as np

import simpar.comm as comm
from simpar import _env, collective_kinds, nn
from simpar.context import scoped_auto_parallel_context
from simpar.cost.model import evaluate
from simpar.cost.profile import DeviceProfile, Link, load_profile
from simpar.nn import presets

__all__ = ["FULL", "KINDS", "QUICK", "STEP_TERMS", "Calibration", "MeasurementPlan", "Sample",
           "StepSample", "calibrate", "fit_at_least", "fit_link", "fit_step_terms", "main",
           "measure_collectives", "measure_gemm", "measure_memory_bandwidth",
           "measure_step_terms", "model_terms", "step_terms"]

KIB, MIB = 2**10, 2**20
#: The collectives measured: every kind with one traffic formula for every rank.
KINDS = tuple(k.name for k in collective_kinds.KINDS.values() if k.ring is not None)
PROG = "python -m simpar.calibrate"


@dataclass(frozen=True, slots=True)
class MeasurementPlan:
    """What to measure, and how often.

    ``gemm_seconds``: the GEMM is sized to take about this long; ``stream_bytes``: each array
    of the ``a + b`` sweep; ``sizes``: local buffers of the collectives, in bytes;
    ``subgroups``: also time groups of 2 and 4 (those smaller than the world that divide it).
    """

    gemm_seconds: float
    gemm_reps: int
    stream_bytes: int
    stream_reps: int
    sizes: tuple[int, ...]
    reps: int
    subgroups: bool
    warmup: int = 2

    def __post_init__(self) -> None:
        counts = {"gemm_reps": self.gemm_reps, "stream_reps": self.stream_reps,
                  "reps": self.reps, "stream_bytes": self.stream_bytes}
        for what, n in counts.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"MeasurementPlan: {what} must be an int >= 1, got {n!r}")
        if self.warmup < 0 or not self.gemm_seconds > 0:
            raise ValueError(f"MeasurementPlan: warmup must be >= 0 and gemm_seconds > 0, got "
                             f"{self.warmup!r} and {self.gemm_seconds!r}")
        if len(self.sizes) < 2 or any(s < 4 for s in self.sizes):
            raise ValueError(f"MeasurementPlan: sizes must list at least 2 buffer sizes of >= 4 "
                             f"bytes (a line needs two points), got {self.sizes!r}")

    def __str__(self) -> str:
        return (f"MeasurementPlan(GEMM ~{self.gemm_seconds * 1e3:g} ms x{self.gemm_reps}, a+b "
                f"{_size(self.stream_bytes)} x{self.stream_reps}, collectives "
                f"{_sizes(self.sizes)} x{self.reps}{', subgroups' if self.subgroups else ''})")


FULL = MeasurementPlan(gemm_seconds=0.04, gemm_reps=9, stream_bytes=32 * MIB, stream_reps=9,
            sizes=tuple(4 * KIB * 4**k for k in range(6)), reps=21, subgroups=True)
QUICK = MeasurementPlan(gemm_seconds=0.004, gemm_reps=3, stream_bytes=4 * MIB, stream_reps=3,
             sizes=(4 * KIB, 64 * KIB, 1 * MIB), reps=5, subgroups=False, warmup=1)


def model_terms(kind: str, group_size: int, nbytes: int) -> tuple[float, float]:
    """(latency rounds, bytes at the bandwidth) that the cost model charges one ``kind`` of a
    local ``nbytes`` buffer over ``group_size`` ranks: the kind's row of
    :data:`simpar.collective_kinds.KINDS`, which :meth:`DeviceProfile.collective_seconds`
    reads too, so the fit can never disagree with the formula its figures feed. 1 MiB
    AllReduce over 8 ranks: 14 rounds and 2 * 7/8 MiB.

    >>> model_terms("AllReduce", 8, 2**20) == (14.0, 2 * 7 * 2**20 / 8)
    True
    """
    facts = collective_kinds.kind_of(kind)
    return float(facts.rounds(group_size)), float(facts.traffic(group_size, nbytes))


@dataclass(frozen=True, slots=True)
class Sample:
    """One collective timed: ``kind`` over groups of ``group_size`` ranks on a local buffer of
    ``nbytes``; ``seconds`` is the median over reps of the slowest rank's time."""

    kind: str
    group_size: int
    nbytes: int
    seconds: float

    def fitted(self, link: Link) -> float:
        """The cost model's time of this collective on ``link``."""
        rounds, traffic = model_terms(self.kind, self.group_size, self.nbytes)
        return link.seconds(int(rounds), traffic)

    def __str__(self) -> str:
        return f"{self.kind} p={self.group_size} {_size(self.nbytes)}: {self.seconds * 1e3:.3f} ms"


def fit_link(rounds: Sequence[float], traffic: Sequence[float],
             seconds: Sequence[float]) -> Link:
    """The link that best explains ``seconds[i] ~ overhead + rounds[i] * latency + traffic[i]
    / bandwidth``: least squares in relative error (so a 4 KiB call weighs as much as a 4 MiB
    one), with overhead, latency and 1/bandwidth kept >= 0 (when the unconstrained optimum has
    a negative term, the best fit over the subsets of terms with none negative is taken: exact
    for three unknowns).

    >>> link = fit_link([2, 14, 14], [1e3, 1e3, 1e6], [2.1e-5, 1.41e-4, 1.14e-3])
    >>> round(link.latency * 1e6, 9), round(link.bandwidth / 1e9, 9), link.overhead  # 10 us
    (10.0, 1.0, 0.0)
    """
    ones = np.ones(len(seconds))
    a = np.column_stack([ones, np.asarray(rounds, float), np.asarray(traffic, float)])
    y = np.asarray(seconds, float)
    if a.shape[0] != y.shape[0] or y.shape[0] < 2:
        raise ValueError(f"fit_link: needs at least 2 points and as many rounds, traffic and "
                         f"seconds, got {len(rounds)}, {len(traffic)} and {len(seconds)}")
    if not (np.isfinite(a).all() and np.isfinite(y).all() and (y > 0).all() and (a >= 0).all()):
        raise ValueError("fit_link: rounds and traffic must be finite and >= 0, and seconds "
                         f"finite and > 0, got seconds {list(y)}")
    x = fit_at_least(a / y[:, None], np.ones_like(y), np.zeros(3))  # relative errors
    overhead, latency, per_byte = (float(v) for v in x)
    if per_byte <= 0:
        raise ValueError("fit_link: the times do not grow with the bytes moved, so there is no "
                         f"bandwidth to fit (seconds {list(y)} for traffic {list(a[:, 2])})")
    return Link(latency, 1.0 / per_byte, overhead)


def measure_array_op_overhead(plan: MeasurementPlan, calls: int = 256) -> float:
    """Seconds per tiny in-place numpy operation (as an optimizer's update runs them), every
    rank at once."""
    a = np.ones(16)

    def run() -> None:
        for _ in range(calls):
            np.multiply(a, 0.999, out=a)

    return float(np.median(_timed([run], plan.stream_reps, 1))) / calls


#: The fixed software costs that :func:`fit_step_terms` fits, in the order of its columns.
STEP_TERMS = ("step_overhead", "kernel_overhead", "compute_scale", "sync_overhead")


@dataclass(frozen=True, slots=True)
class StepSample:
    """One reference training step timed: ``seconds`` is the median over reps of the slowest
    rank's step after a barrier (as ``benchmarks/cost_fidelity.py`` times its steps);
    ``terms`` what the cost model charges each figure of :data:`STEP_TERMS` (1 per step,
    kernel calls, roofline seconds, collective calls); ``rest`` its time for the rest (the
    links' own time and the optimizer's)."""

    what: str
    seconds: float
    terms: tuple[float, float, float, float]
    rest: float

    def fitted(self, profile: DeviceProfile) -> float:
        """The cost model's step time on ``profile``."""
        return self.rest + float(np.dot(self.terms, [getattr(profile, t) for t in STEP_TERMS]))


Build = Callable[[], tuple[nn.TrainOneStepCell, tuple[np.ndarray, np.ndarray], str]]


def _reference_steps(p: int) -> list[tuple[str, dict[str, object], Build]]:
    """The reference steps of :func:`measure_step_terms`, over all ``p`` ranks: (what, the
    auto-parallel context, a builder of (the train cell, its global batch, its optimizer)).
    They vary the kernel calls, the roofline time and the collectives apart: MLPs and 1- to
    3-layer transformers, float32 and float64, data parallel, with optimizer level2 (many
    small collectives) and Megatron (an operator's AllReduces). None is a row of
    ``benchmarks/cost_fidelity.py``."""
    mode = "data_parallel" if p > 1 else "stand_alone"
    rng = np.random.default_rng(0)

    def gpt(layers: int, width: int) -> Build:
        def build() -> tuple[nn.TrainOneStepCell, tuple[np.ndarray, np.ndarray], str]:
            net = nn.GPT(96, 16, width, layers, 4, dtype=np.float64)
            ids = rng.integers(0, 96, (4 * p, 16)).astype(np.int32)
            labels = rng.integers(0, 96, (4 * p, 16)).astype(np.int32)
            return _train(net, "momentum", mode), (ids, labels), "momentum"
        return build

    def mlp(sizes: tuple[int, int, int], hidden: int, dtype: type, batch: int, opt: str,
            megatron: bool = False) -> Build:
        def build() -> tuple[nn.TrainOneStepCell, tuple[np.ndarray, np.ndarray], str]:
            net = nn.MLP(*sizes, n_hidden=hidden, dtype=np.dtype(dtype))
            if megatron:
                presets.megatron_mlp(net, 1, p)
            x: np.ndarray = rng.standard_normal((batch, sizes[0])).astype(dtype)
            y = rng.integers(0, sizes[2], batch).astype(np.int32)
            return _train(net, opt, "semi_auto_parallel" if megatron else mode), (x, y), opt
        return build

    dp: dict[str, object] = {"parallel_mode": mode, "gradients_mean": True}
    gpt_what = "GPT(vocabulary 96, sequence 16, d_model {}, {} layer(s), 4 heads) float64, " \
               "batch 4 per rank, Momentum"
    refs = [
        ("MLP(64 -> 128 -> 8) float64, batch 8 per rank, SGD", dp,
         mlp((64, 128, 8), 1, np.float64, 8 * p, "sgd")),
        ("MLP(64 -> 128 x8 -> 8) float64, batch 8 per rank, SGD", dp,
         mlp((64, 128, 8), 8, np.float64, 8 * p, "sgd")),
        ("MLP(128 -> 512 -> 128) float32, batch 256 per rank, Momentum", dp,
         mlp((128, 512, 128), 1, np.float32, 256 * p, "momentum")),
        (gpt_what.format(48, 1), dp, gpt(1, 48)),
        (gpt_what.format(48, 3), dp, gpt(3, 48)),
        (gpt_what.format(96, 1), dp, gpt(1, 96)),
    ]
    if p > 1:
        refs += [
            (gpt_what.format(48, 1) + ", optimizer level2, threshold 0",
             {**dp, "enable_parallel_optimizer": True, "parallel_optimizer_config": {
                 "optimizer_level": "level2", "parallel_optimizer_threshold": 0}}, gpt(1, 48)),
            (f"MLP(64 -> 256 x2 -> 64) float64, Megatron 1 x {p}, batch 32, Momentum",
             {"parallel_mode": "semi_auto_parallel", "gradients_mean": True,
              "dataset_strategy": ((1, 1), (1,))},
             mlp((64, 256, 64), 2, np.float64, 32, "momentum", megatron=True)),
        ]
    return refs


def _train(net: nn.Cell, optimizer: str, mode: str) -> nn.TrainOneStepCell:
    params = net.trainable_params()
    opt = nn.SGD(params, 0.01) if optimizer == "sgd" else nn.Momentum(params, 0.01, 0.9)
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()), opt,
                               parallel_mode=mode, seed=0)


def step_terms(program: Any, profile: DeviceProfile, optimizer: str
               ) -> tuple[tuple[float, float, float, float], float]:
    """(what the cost model charges each figure of :data:`STEP_TERMS` in one step of
    ``program``, its time for the rest) on ``profile``: read off :func:`evaluate` itself,
    which is linear in those figures, by pricing the step with each set to 1 in turn."""
    zero = replace(profile, step_overhead=0.0, kernel_overhead=0.0, compute_scale=1.0,
                   sync_overhead=0.0)
    base = evaluate(program, zero, optimizer)
    kernels = evaluate(program, replace(zero, kernel_overhead=1.0), optimizer).compute
    calls = evaluate(program, replace(zero, sync_overhead=1.0), optimizer).step_seconds
    return ((1.0, float(round(kernels - base.compute)), base.compute,
             float(round(calls - base.step_seconds))), base.step_seconds - base.compute)


def measure_step_terms(plan: MeasurementPlan, profile: DeviceProfile) -> list[StepSample]:
    """Every reference step of :func:`_reference_steps`, timed with every rank in it (the
    slowest rank's step after a barrier, median of ``plan.stream_reps`` reps after one
    untimed step) and priced by ``profile``'s model."""
    samples = []
    for what, keys, build in _reference_steps(comm.get_group_size()):
        with scoped_auto_parallel_context(**keys):
            train, batch, optimizer = build()
            step = functools.partial(train, *batch)
            step()
            seconds = float(np.median(_timed([step], plan.stream_reps, 1)))
        assert train.program is not None
        terms, rest = step_terms(train.program, profile, optimizer)
        samples.append(StepSample(what, seconds, terms, rest))
    return samples


def fit_step_terms(samples: Sequence[StepSample], link_overhead: float
                   ) -> dict[str, float]:
    """The figures of :data:`STEP_TERMS` that best explain the samples' times: least squares
    in relative error, with each >= 0 but ``compute_scale`` >= 0.05 and ``sync_overhead`` >=
    ``-link_overhead`` (a collective inside a step may cost less than one timed alone after a
    barrier, never less than nothing). Without collectives in any sample, ``sync_overhead``
    is 0.

    >>> s = [StepSample("a", 1.0 + 2e-3 * k + 0.5 * r + 1e-3 * c, (1.0, k, r, c), 1.0)
    ...      for k, r, c in ((10, 0.001, 0), (100, 0.002, 2), (20, 0.02, 1), (50, 0.005, 9))]
    >>> {k: round(v, 9) for k, v in fit_step_terms(s, 1e-3).items()}
    ... # doctest: +NORMALIZE_WHITESPACE
    {'step_overhead': 0.0, 'kernel_overhead': 0.002, 'compute_scale': 0.5,
     'sync_overhead': 0.001}
    """
    a = np.array([s.terms for s in samples], float)
    y = np.array([s.seconds - s.rest for s in samples], float)
    seconds = np.array([s.seconds for s in samples], float)
    lower = np.array([0.0, 0.0, 0.05, -link_overhead])
    free = [i for i in range(len(STEP_TERMS)) if a[:, i].any()]
    x: np.ndarray = np.zeros(len(STEP_TERMS))
    x[2] = 1.0
    x[free] = fit_at_least(a[:, free] / seconds[:, None], y / seconds, lower[free])
    return {t: float(v) for t, v in zip(STEP_TERMS, x)}


def fit_at_least(a: np.ndarray, y: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """``x`` minimising ``|a x - y|`` with ``x >= lower``: the best over the subsets of
    unknowns left free, the others at their bound (exact for the few unknowns of a fit here).
    Columns are scaled to unit norm first (they differ by many orders of magnitude)."""
    shifted = y - a @ lower
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    n = a.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for mask in range(2**n - 1, -1, -1):        # every unknown free first
        cols = [i for i in range(n) if mask >> i & 1]
        z = np.zeros(n)
        if cols:
            sol, *_ = np.linalg.lstsq(a[:, cols] / scale[cols], shifted, rcond=None)
            z[cols] = sol / scale[cols]
        if (z < -1e-15 * np.maximum(1.0, np.abs(z).max())).any():
            continue
        z = np.maximum(z, 0.0)
        err = float(np.sum((a @ z - shifted) ** 2))
        if best is None or err < best[0] - 1e-12 * max(1.0, best[0]):
            best = (err, z)
    assert best is not None  # every unknown at its bound is always feasible
    return lower + best[1]


@dataclass(frozen=True, slots=True)
class Calibration:
    """A measured profile and the collective samples its link was fitted to."""

    profile: DeviceProfile
    samples: tuple[Sample, ...]
    steps: tuple[StepSample, ...] = ()

    def errors(self) -> np.ndarray:
        """(fitted - measured) / measured for every sample."""
        link = self.profile.intra_server
        return np.array([s.fitted(link) / s.seconds - 1.0 for s in self.samples])

    def table(self) -> str:
        """Measured / fitted ms of every collective, a row per (kind, group size), a column per
        buffer size, and each row's worst relative error."""
        if not self.samples:
            return "(1 rank: no collectives measured)"
        link, errors = self.profile.intra_server, self.errors()
        sizes = sorted({s.nbytes for s in self.samples})
        rows: dict[tuple[int, str], dict[int, tuple[Sample, float]]] = {}
        for s, e in zip(self.samples, errors):
            rows.setdefault((-s.group_size, s.kind), {})[s.nbytes] = (s, e)
        header = ["collective", "p", *(_size(n) for n in sizes), "worst"]
        body = []
        for (neg_p, kind), cells in sorted(rows.items(), key=lambda kv: (kv[0][0],
                                                                        KINDS.index(kv[0][1]))):
            row = [kind, str(-neg_p)]
            for n in sizes:
                cell = cells[n][0] if n in cells else None
                row.append("" if cell is None else
                           f"{cell.seconds * 1e3:.3g}/{cell.fitted(link) * 1e3:.3g}")
            worst = max((e for _, e in cells.values()), key=abs)
            row.append(f"{worst:+.0%}")
            body.append(row)
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))) for r in [header, *body]]
        return "\n".join(lines)


# ------------------------------------------------------------------ timing (every rank)
def _slowest(times: np.ndarray) -> np.ndarray:
    """Every rank's ``times`` reduced to the slowest rank's, the same on every rank."""
    return comm.all_reduce(np.ascontiguousarray(times, dtype=np.float64), op="max")


def _timed(calls: Sequence[Callable[[], object]], reps: int, warmup: int) -> np.ndarray:
    """(calls, reps) seconds: each rep runs every call once after a world barrier, starting
    from a call that rotates rep by rep (drift hits every call alike); the slowest rank's."""
    for _ in range(warmup):
        for call in calls:
            comm.barrier()
            call()
    times = np.zeros((len(calls), reps))
    for rep in range(reps):
        shift = rep % len(calls)
        for i in [*range(shift, len(calls)), *range(shift)]:
            comm.barrier()
            start = perf_counter()
            calls[i]()
            times[i, rep] = perf_counter() - start
    return _slowest(times)


def measure_gemm(dtype: np.dtype | type, plan: MeasurementPlan) -> tuple[int, float]:
    """(n, FLOP/s per rank) of an n x n ``dtype`` GEMM run by every rank at once, n chosen
    so that one takes about ``plan.gemm_seconds``. Every rank calls it and gets the same."""
    rng = np.random.default_rng(comm.get_rank())
    # A GEMM shorter than the scheduler's time slice runs at one core's speed even when 8 ranks
    # share 2 cores, so a small probe overrates the rate: resize until the size settles.
    n, tried = 256, set[int]()
    while n not in tried and len(tried) < 4:
        tried.add(n)
        t = _gemm_seconds(rng, dtype, n, reps=3 if n <= 256 else 1)
        wanted = (plan.gemm_seconds * (2 * n**3 / t) / 2) ** (1 / 3)
        n = int(min(4096, max(128, round(wanted / 64) * 64)))
    return n, 2 * n**3 / _gemm_seconds(rng, dtype, n, plan.gemm_reps)


def _gemm_seconds(rng: np.random.Generator, dtype: np.dtype | type, n: int, reps: int) -> float:
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    out = np.empty((n, n), dtype)
    return float(np.median(_timed([lambda: np.matmul(a, b, out=out)], reps, 1)))


def measure_memory_bandwidth(plan: MeasurementPlan) -> float:
    """Bytes/s per rank of ``np.add(a, b, out=c)`` on float32 arrays of ``plan.stream_bytes``,
    every rank at once: 3 arrays moved (2 read, 1 written), as the cost model counts an
    elementwise op."""
    n = plan.stream_bytes // 4
    rng = np.random.default_rng(comm.get_rank())
    a, b = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
    c = np.empty_like(a)
    t = float(np.median(_timed([lambda: np.add(a, b, out=c)], plan.stream_reps, 1)))
    return 3 * n * 4 / t


def _collective(kind: str, x: np.ndarray, group: comm.Group | None, p: int
                ) -> Callable[[], object]:
    """The simpar.comm call for ``kind`` on the 1-D ``x`` (along its only axis), into a
    buffer made once."""
    if kind not in KINDS:
        raise ValueError(f"calibrate: kind must be one of {list(KINDS)}, got {kind!r}")
    facts = collective_kinds.kind_of(kind)
    call = getattr(comm, facts.function)
    out = np.empty(facts.result(p, x.size), x.dtype)
    args = facts.arguments(_ALONG_AXIS_0)
    return lambda: call(x, group=group, out=out, **args)


#: What a redistribution step of a 1-D buffer along its only axis passes its collective.
_ALONG_AXIS_0 = types.SimpleNamespace(tensor_dim=0, concat_dim=0, gather_dims=((0, (0,)),))


def measure_collectives(plan: MeasurementPlan, group_size: int) -> list[Sample]:
    """Every kind of :data:`KINDS` at every size of ``plan.sizes`` over groups of
    ``group_size`` consecutive ranks, all groups at once (on 8 ranks and groups of 4: ranks
    0..3 and 4..7). Buffers are float32, rounded down to a multiple of the world size (so
    every group size times the same buffers). Every rank calls it and gets the same samples."""
    p, rank = comm.get_group_size(), comm.get_rank()
    if group_size < 2 or p % group_size:
        raise ValueError(f"calibrate: group_size must be >= 2 and divide the world of {p}, got "
                         f"{group_size}")
    first = rank // group_size * group_size
    group = None if group_size == p else comm.create_group(range(first, first + group_size))
    rng = np.random.default_rng(rank)
    calls, keys = [], []
    for nbytes in plan.sizes:
        n = max(p, nbytes // 4 // p * p)
        x = rng.standard_normal(n, np.float32)
        for kind in KINDS:
            calls.append(_collective(kind, x, group, group_size))
            keys.append((kind, 4 * n))
    with comm.validation_disabled():
        times = _timed(calls, plan.reps, plan.warmup)
    return [Sample(kind, group_size, nbytes, float(np.median(t)))
            for (kind, nbytes), t in zip(keys, times)]


def _group_sizes(p: int, plan: MeasurementPlan) -> list[int]:
    smaller = [g for g in (2, 4) if plan.subgroups and g < p and p % g == 0]
    return [*smaller, p] if p > 1 else []


def _hosts() -> int:
    """How many hosts the ranks run on (hostnames compared by checksum)."""
    mine = np.array([zlib.crc32(socket.gethostname().encode())], np.int64)
    return len(set(comm.all_gather(mine).tolist()))


# ------------------------------------------------------------------ the whole calibration
def calibrate(plan: MeasurementPlan = FULL, name: str = "cpu-local", command: str = "",
              say: Callable[[str], None] | None = None) -> Calibration:
    """Measure this machine at this rank count: every rank calls it, and every rank gets the
    same :class:`Calibration` (figures come from max-reduced times). ``command`` is recorded
    in ``sources``; ``say`` gets one progress line per phase (give it on rank 0 only).

    On 2 ranks, ``calibrate(QUICK).profile.devices_per_server`` is 2 and its
    ``intra_server`` the link fitted to 4 kinds x 3 sizes over the pair.
    """
    say = say or (lambda line: None)
    started = perf_counter()
    p = comm.get_group_size()
    hosts = _hosts()
    if hosts > 1:
        raise ValueError(f"calibrate: the {p} ranks run on {hosts} hosts; calibrate measures "
                         "the ranks of one host (run it on each kind of host)")
    s = _env.SETTINGS
    when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    busy = f"{_ranks(p)} busy"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())  # other work skews every figure
    run = (f"{command or 'simpar.calibrate.calibrate()'} on {when}, {_ranks(p)} on host "
           f"{socket.gethostname()} ({s['cores']} usable cores, load average at start {load}), "
           f"BLAS threads per rank {s['blas_threads']} ({s['threads_from']}), MPI wait policy "
           f"{s['wait_policy']} ({s['wait_policy_from']}); {plan}")
    say(f"calibrate: {_ranks(p)}, {s['cores']} cores (load average {load}), BLAS threads per "
        f"rank {s['blas_threads']}, wait policy {s['wait_policy']}, malloc {s['malloc']}")

    flops, flops_how = {}, []
    for dtype in ("float32", "float64"):
        t0 = perf_counter()
        n, rate = measure_gemm(np.dtype(dtype), plan)
        flops[dtype] = rate
        flops_how.append(f"{dtype} n={n}: {rate / 1e9:.3g} GFLOP/s")
        say(f"calibrate: GEMM {dtype} n={n} x{plan.gemm_reps} ... {rate / 1e9:.1f} GFLOP/s "
            f"per rank ({busy}; {perf_counter() - t0:.1f} s)")
    t0 = perf_counter()
    bandwidth = measure_memory_bandwidth(plan)
    say(f"calibrate: memory bandwidth, np.add on {_size(plan.stream_bytes)} float32 arrays "
        f"x{plan.stream_reps} ... {bandwidth / 1e9:.2f} GB/s per rank ({busy}; "
        f"{perf_counter() - t0:.1f} s)")

    samples: list[Sample] = []
    for g in _group_sizes(p, plan):
        t0 = perf_counter()
        samples += measure_collectives(plan, g)
        say(f"calibrate: collectives over {p // g} group(s) of {g}: {len(KINDS)} kinds x "
            f"{len(plan.sizes)} sizes ({_sizes(plan.sizes)}) x{plan.reps} ... "
            f"{perf_counter() - t0:.1f} s")
    link, link_how = _fitted_link(samples, plan, p, say)
    inter_how = (f"the intra-server link: all {_ranks(p)} run on one host (not measured apart)"
                 if samples else link_how)

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sources = {
        "profile": f"measured by {run}",
        "peak_flops": (f"measured: square GEMM, 2 n^3 FLOP / the slowest rank's time with "
                       f"all {_ranks(p)} running GEMMs at once, median of {plan.gemm_reps} "
                       f"reps (n sized for ~{plan.gemm_seconds * 1e3:g} ms): "
                       + "; ".join(flops_how)),
        "memory_bandwidth": (f"measured: np.add(a, b, out=c) on float32 arrays of "
                             f"{_size(plan.stream_bytes)}, 3 arrays moved per call (inputs "
                             f"plus output, as the cost model counts an elementwise op) / "
                             f"the slowest rank's time with all {_ranks(p)} at once, median of "
                             f"{plan.stream_reps} reps"),
        "memory_capacity": (f"not measured: physical memory of the host (os.sysconf, "
                            f"{memory / 2**30:.1f} GiB) / the {_ranks(p)} on it"),
        "intra_server": link_how,
        "inter_server": inter_how,
        "devices_per_server": f"the world size: all {_ranks(p)} run on one host",
    }
    profile = DeviceProfile(name, flops, memory // p, bandwidth, link, link, p, sources)
    t0 = perf_counter()
    array_op = measure_array_op_overhead(plan)
    profile = replace(profile, array_op_overhead=array_op)
    steps = measure_step_terms(plan, profile)
    fitted = fit_step_terms(steps, min(link.overhead, profile.inter_server.overhead))
    profile = replace(profile, step_overhead=fitted["step_overhead"],
                      kernel_overhead=fitted["kernel_overhead"],
                      compute_scale=fitted["compute_scale"], sync_overhead=fitted["sync_overhead"])
    errors = [st.fitted(profile) / st.seconds - 1 for st in steps]
    say(f"calibrate: {array_op * 1e6:.2f} us per plain numpy operation; fitted to "
        f"{len(steps)} reference steps: {fitted['kernel_overhead'] * 1e6:.1f} us per kernel "
        f"call, {fitted['compute_scale']:.2f}x the roofline, "
        f"{fitted['sync_overhead'] * 1e3:+.2f} ms per collective call, "
        f"{fitted['step_overhead'] * 1e3:.2f} ms per step; |error| worst "
        f"{max(abs(e) for e in errors):.0%} ({busy}; {perf_counter() - t0:.1f} s)")
    for st, e in zip(steps, errors):
        say(f"calibrate:   {st.what}: {st.seconds * 1e3:.2f} ms measured, "
            f"{st.fitted(profile) * 1e3:.2f} fitted ({e:+.0%})")
    sources["array_op_overhead"] = (
        f"measured: 256 in-place multiplications of a 16-element float64 array, the slowest "
        f"rank's time with all {_ranks(p)} at once / 256, median of {plan.stream_reps} reps")
    how = (f"fitted jointly with {', '.join(t for t in STEP_TERMS)} (least squares in "
           f"relative error) to {len(steps)} reference training steps over all {_ranks(p)} "
           f"({'; '.join(st.what for st in steps)}), each the slowest rank's step after a "
           f"barrier, median of {plan.stream_reps} reps, against what the cost model charges "
           f"each figure in it; |error| worst {max(abs(e) for e in errors):.0%}")
    for term in STEP_TERMS:
        sources[term] = "measured: " + how
    say(f"calibrate: measured in {perf_counter() - started:.1f} s")
    return Calibration(replace(profile, sources=sources), tuple(samples), tuple(steps))


def _fitted_link(samples: Sequence[Sample], plan: MeasurementPlan, p: int,
                 say: Callable[[str], None]) -> tuple[Link, str]:
    """(the link fitted to ``samples``, how it was measured), or at 1 rank the shipped
    cpu-local link, so labelled."""
    if not samples:
        return load_profile("cpu-local").intra_server, (
            "not measured: 1 rank has no collectives to time; copied from the shipped cpu-local "
            "profile (run with mpirun -n 2 or more to measure it)")
    terms = [model_terms(x.kind, x.group_size, x.nbytes) for x in samples]
    link = fit_link([r for r, _ in terms], [t for _, t in terms], [x.seconds for x in samples])
    errors = np.array([x.fitted(link) / x.seconds - 1.0 for x in samples])
    worst = samples[int(np.argmax(np.abs(errors)))]
    quality = (f"|error| median {np.median(np.abs(errors)):.0%}, worst "
               f"{worst.fitted(link) / worst.seconds - 1:+.0%} ({worst.kind} "
               f"p={worst.group_size} {_size(worst.nbytes)})")
    say(f"calibrate: fit: {link.overhead * 1e6:.1f} us per call + {link.latency * 1e6:.1f} us "
        f"per ring round, bandwidth {link.bandwidth / 1e9:.3g} GB/s; {quality}")
    groups = ", ".join(str(g) for g in _group_sizes(p, plan))
    return link, (f"measured: least-squares fit (relative error, every term >= 0) of "
                  f"DeviceProfile.collective_seconds' ring model, overhead + rounds x latency + "
                  f"traffic / bandwidth, to {', '.join(KINDS)} through simpar.comm (validation "
                  f"off) over "
                  f"groups of {groups} (all groups of a size at once), float32 buffers "
                  f"{_sizes(plan.sizes)} ({len(plan.sizes)} sizes), median of {plan.reps} reps of "
                  f"the slowest rank's time after a barrier; {quality} over {len(samples)} "
                  "points")


# ------------------------------------------------------------------ command line


def _unwritable(path: pathlib.Path) -> str | None:
    """Why a profile cannot be written to ``path``, or None."""
    if path.suffix != ".json":
        return "must end in .json (load_profile reads a path by its .json suffix)"
    return _env.unwritable_file(path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options, checked; a bad one prints one line on rank 0 and exits 2 on every rank,
    before MPI starts."""
    p = _env.RankZeroParser(prog=PROG, description=__doc__, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None,
                   help="where to write the profile (default: <name>.json in the current "
                   "directory)")
    p.add_argument("--name", default="cpu-local", help="the profile's name (default cpu-local)")
    p.add_argument("--quick", action="store_true",
                   help="few sizes and reps: seconds, for tests; not a profile to keep")
    args = p.parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.name):
        p.error(f"argument --name: {args.name!r} is not a name (letters, digits, '.', '_', '-')")
    given = args.out is not None
    args.out = pathlib.Path(args.out if given else f"{args.name}.json")
    problem = _unwritable(args.out)
    if problem:
        p.error(f"argument --out{'' if given else ' (default)'}: {str(args.out)!r}: {problem}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    comm.init()
    rank, p = comm.get_rank(), comm.get_group_size()
    launch = f"mpirun -n {p} {PROG}" if p > 1 else PROG
    command = " ".join([launch, shlex.join(argv)]).strip()

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    try:
        result = calibrate(QUICK if args.quick else FULL, args.name, f"`{command}`", say)
    except ValueError as error:  # raised alike on every rank
        if rank == 0:
            print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    if rank == 0:
        link = result.profile.intra_server
        if result.samples:
            print(f"calibrate: measured / fitted ms per call (slowest rank, median of reps); "
                  f"fitted = {link.overhead * 1e6:.1f} us + rounds x {link.latency * 1e6:.1f} us "
                  f"+ traffic / "
                  f"{link.bandwidth / 1e9:.3g} GB/s")
        print(result.table())
        result.profile.save(args.out)
        print(f"calibrate: wrote {args.out} (profile {args.name!r}, {_ranks(p)})", flush=True)
    comm.barrier()  # every rank ends once the file is there
    return 0


# ------------------------------------------------------------------ formatting
def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= 0.99 * scale:  # a buffer rounded to a multiple of 3 ranks is still "1 MiB"
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def _ranks(p: int) -> str:
    return f"{p} rank{'s' * (p != 1)}"


def _sizes(sizes: Sequence[int]) -> str:
    return f"{_size(min(sizes))}..{_size(max(sizes))}"


if __name__ == "__main__":
    sys.exit(main())
