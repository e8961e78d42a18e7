"""MSELoss and L1Loss training on real MPI ranks against one device (world size 1, 2, 4, 8).

A small float64 regression MLP (fc1 column-parallel, fc2 row-parallel, fc3 column-parallel,
so its output's feature axis is split) trains ``STEPS`` steps under semi_auto_parallel; every
step's loss and every rank's final parameter shards must equal the stand-alone run's slices.
Verdicts are collective (one max-AllReduce of the problem count) and NaN-safe.

    python -m pytest tests/test_losses_mpi.py -q --with-mpi                  # world size 1
    mpirun -n 8 python -m pytest tests/test_losses_mpi.py -q --with-mpi -m mpi
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn, ops
from simpar.comm import CommEvent, CommTrace
from simpar.layout import distribute
from simpar.nn import presets
from tests.mpi_guard import abort_job_on_error
from tests.ophelpers import check_strategies

pytestmark = pytest.mark.mpi

SEED = 3
STEPS = 3
TRACED_STEP = 1
BATCH = 8
SIZES = (4, 8, 4)        # in, hidden, out; n_hidden=2 gives fc1, fc2, fc3
LR = 0.1
TOL = 1e-10
LOSS_SCOPE = "Default/network-WithLossCell/_loss_fn-"
BACKBONE = "Default/network-WithLossCell/_backbone-MLP/"


@dataclass(frozen=True)
class Case:
    loss: str        # "MSELoss" or "L1Loss"
    reduction: str   # "mean" or "sum"
    kind: str        # "dp", "megatron" (loss ops propagated) or "megatron_annotated"


@dataclass
class Run:
    train: nn.TrainOneStepCell
    losses: list[float] = field(default_factory=list)
    events: list[CommEvent] = field(default_factory=list)  # the collectives of TRACED_STEP


def _n() -> int:
    return comm.get_group_size()


def _dp_mp() -> tuple[int, int]:
    """Megatron degrees: mp over every rank at n <= 2, else dp = 2 and mp = n / 2."""
    n = _n()
    return (1, n) if n < 4 else (2, n // 2)


def _batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Global batch ``step``: regression targets, the same on every rank and every size."""
    rng = np.random.default_rng(1000 + step)
    return rng.standard_normal((BATCH, SIZES[0])), rng.standard_normal((BATCH, SIZES[2]))


def _net_and_loss(case: Case) -> tuple[nn.MLP, nn.MSELoss | nn.L1Loss]:
    net = nn.MLP(*SIZES, n_hidden=2, dtype=np.float64)
    loss = (nn.MSELoss if case.loss == "MSELoss" else nn.L1Loss)(case.reduction)
    return net, loss


def _apply(case: Case, net: nn.MLP, loss: nn.MSELoss | nn.L1Loss) -> tuple[tuple[int, ...], ...]:
    """Set the strategy; returns the dataset strategy of (data, label)."""
    n = _n()
    if case.kind == "dp":
        for dense in net.layers:
            dense.matmul.shard(((n, 1), (1, 1)))
            dense.bias_add.shard(((n, 1), (1,)))
        return (n, 1), (n, 1)
    dp, mp = _dp_mp()
    presets.megatron_mlp(net, dp, mp)
    if case.kind == "megatron_annotated":
        pointwise = loss.square if isinstance(loss, nn.MSELoss) else loss.abs
        loss.sub.shard(((dp, mp), (dp, mp)))
        pointwise.shard(((dp, mp),))
        assert loss.reduce is not None
        loss.reduce.shard(((dp, mp),))
    return (dp, 1), (dp, 1)


def _train(case: Case, mode: str) -> Run:
    net, loss = _net_and_loss(case)
    dataset = _apply(case, net, loss) if mode != "stand_alone" else "full_batch"
    simpar.reset_auto_parallel_context()
    if mode != "stand_alone":
        simpar.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True,
                                         dataset_strategy=dataset)
    try:
        cell = nn.WithLossCell(net, loss)
        opt = nn.Momentum(cell.trainable_params(), LR, 0.9)
        train = nn.TrainOneStepCell(cell, opt, parallel_mode=mode, seed=SEED)
        run = Run(train)
        with abort_job_on_error(f"{case} ({mode}) while training"):
            for k in range(STEPS):
                with CommTrace() as trace:
                    run.losses.append(train(*_batch(k)))
                if k == TRACED_STEP:
                    run.events = list(trace.events)
    finally:
        simpar.reset_auto_parallel_context()
    return run


@cache
def _reference(loss: str, reduction: str) -> tuple[tuple[float, ...], dict[str, np.ndarray]]:
    """The stand-alone run (each rank computes it: the model is tiny)."""
    run = _train(Case(loss, reduction, "dp"), "stand_alone")
    return tuple(run.losses), {k: v.copy() for k, v in run.train.params.items()}


_RUNS: dict[Case, Run] = {}


def _run(case: Case) -> Run:
    """The cached parallel run of ``case`` (every rank calls it in the same order)."""
    if case not in _RUNS:
        _RUNS[case] = _train(case, "semi_auto_parallel")
    return _RUNS[case]


def _all_agree(problems: list[str]) -> None:
    """Fail on every rank if any rank found a problem (collective)."""
    bad = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
    if bad:
        raise AssertionError(f"rank {comm.get_rank()}: " + (
            "; ".join(problems) if problems else "fine here, but another rank failed"))


def _mismatch(what: str, got: np.ndarray, want: np.ndarray) -> str | None:
    """A problem if ``got`` is not finite, has another shape, or differs from ``want`` by more
    than TOL relative (NaN and inf never pass: every comparison is on finite values)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, want {want.shape}"
    if not (np.all(np.isfinite(got)) and np.all(np.isfinite(want))):
        return f"{what}: not finite ({got.ravel()[:4]} vs {want.ravel()[:4]})"
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
    err = float(np.max(np.abs(got - want), initial=0.0)) / scale
    return None if err <= TOL else f"{what}: relative error {err:.2e} > {TOL:.0e}"


# ------------------------------------------------------------------ training
GRID = [Case(loss, "mean", kind) for loss in ("MSELoss", "L1Loss") for kind in ("dp", "megatron")]
GRID += [Case("MSELoss", "sum", "megatron_annotated"), Case("L1Loss", "sum", "dp"),
         Case("L1Loss", "mean", "megatron_annotated")]


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c.loss}-{c.reduction}-{c.kind}")
def test_training_matches_single_device(case: Case) -> None:
    """Every step's loss and every rank's parameter shards equal the stand-alone run."""
    run, rank = _run(case), comm.get_rank()
    want_losses, want_params = _reference(case.loss, case.reduction)
    prog = run.train.program
    assert prog is not None
    problems = [p for k, (a, b) in enumerate(zip(run.losses, want_losses, strict=True))
                if (p := _mismatch(f"loss[{k}]", np.asarray(a), np.asarray(b)))]
    if set(run.train.params) != set(want_params):
        problems.append(f"parameters {sorted(run.train.params)} != {sorted(want_params)}")
    for name in sorted(set(run.train.params) & set(want_params)):
        lay = prog.param_layouts[name]
        local = run.train.params[name]
        if local.shape != lay.local_shape():
            problems.append(f"{name}: local shape {local.shape}, layout gives "
                            f"{lay.local_shape()}")
        p = _mismatch(name, local, distribute(want_params[name], lay, rank))
        if p:
            problems.append(p)
    _all_agree(problems)


@pytest.mark.parametrize("case", [c for c in GRID if c.kind != "dp"],
                         ids=lambda c: f"{c.loss}-{c.reduction}-{c.kind}")
def test_loss_runs_on_the_feature_split_logits(case: Case) -> None:
    """fc3 is column-parallel: the loss's ops take the logits cut (dp, mp) as they come, and
    each rank's fc3.weight is its (out / mp, hidden) slice."""
    run = _run(case)
    dp, mp = _dp_mp()
    prog = run.train.program
    assert prog is not None
    loss_steps = [s for s in prog.steps if s.node.name.startswith(LOSS_SCOPE)]
    assert [s.node.op.name for s in loss_steps] == [
        "Sub", "Square" if case.loss == "MSELoss" else "Abs",
        "ReduceMean" if case.reduction == "mean" else "ReduceSum"]
    assert all(s.sharding.in_layouts[0].cuts == (dp, mp) for s in loss_steps)
    want = "annotated" if case.kind == "megatron_annotated" else "propagated"
    assert all(s.chosen == want for s in loss_steps), [s.chosen for s in loss_steps]
    assert run.train.params["_backbone.fc3.weight"].shape == (SIZES[2] // mp, SIZES[1])


# ------------------------------------------------------------------ communication
Sig = tuple[str, str | None, tuple[int, ...], tuple[int, ...], str]


def _sig(e: CommEvent) -> Sig:
    """(kind, op, group, local shape, phase): phase "forward", "backward" or "mirror" (the
    gradient AllReduces after the backward pass)."""
    phase = ("mirror" if e.label.startswith("Mirror:") else
             "backward" if ":backward" in e.label else "forward")
    return e.kind, e.op, e.group, e.shape, phase


def test_data_parallel_mse_collectives_exactly() -> None:
    """Data-parallel MSE over n ranks, one step, in order: the loss's AllReduce(sum) of the
    partial means (a scalar), and one fused Mirror AllReduce of every parameter's gradient
    (all replicated over the n ranks, pending over them). The scalar's cotangent is whole on
    every rank, so its AllReduce needs no adjoint. The backbone communicates nothing, and
    nothing is gathered. One rank: no collective."""
    run, n = _run(Case("MSELoss", "mean", "dp")), _n()
    world = tuple(range(n))
    n_params = sum(math.prod(v.shape) for v in run.train.params.values())
    want: list[Sig] = [] if n == 1 else [("AllReduce", "sum", world, (), "forward"),
                                         ("AllReduce", "sum", world, (n_params,), "mirror")]
    where = [LOSS_SCOPE + "MSELoss/ReduceMean-", "Mirror:6 params"]
    got = [_sig(e) for e in run.events]
    problems = [] if got == want else [f"collectives {[str(e) for e in run.events]}, want {want}"]
    problems += [f"event {k} is {e.label!r}, want it at {w}" for k, (e, w)
                 in enumerate(zip(run.events, where)) if not e.label.startswith(w)]
    _all_agree(problems)


@pytest.mark.parametrize("loss", ["MSELoss", "L1Loss"])
def test_megatron_collectives_exactly(loss: str) -> None:
    """Megatron (dp, mp) with the loss ops propagated, one step, in order:

    * forward: fc2's AllReduce of its partial output over the mp group, shape
      (batch / dp, hidden); the loss's scalar AllReduce of partial sums over all dp * mp
      ranks (the logits are feature-split and never gathered);
    * backward: the loss's cotangent is whole, so neither forward AllReduce needs an
      adjoint; fc3 (column-parallel) leaves its input's gradient pending over mp, summed once
      over the mp group before fc2's BiasAdd (Megatron's backward AllReduce), so that
      fc2.bias's gradient comes out whole;
    * Mirrors: every gradient is pending over dp only (fc2.bias's too, although it is
      replicated on every rank): one fused AllReduce over the dp group.
    """
    run, rank, n = _run(Case(loss, "mean", "megatron")), comm.get_rank(), _n()
    dp, mp = _dp_mp()
    i, h, o = SIZES
    world = tuple(range(n))
    mp_group = tuple(range(rank - rank % mp, rank - rank % mp + mp))
    dp_group = tuple(range(rank % mp, n, mp))
    block: tuple[str, str, tuple[int, ...], tuple[int, ...]] = (
        "AllReduce", "sum", mp_group, (BATCH // dp, h))
    scalar: tuple[str, str, tuple[int, ...], tuple[int, ...]] = ("AllReduce", "sum", world, ())
    split = h // mp * i + h // mp + h * h // mp + o // mp * h + o // mp
    want: list[Sig] = [block + ("forward",)] * (mp > 1)
    want += [scalar + ("forward",)] * (n > 1)
    want += [block + ("backward",)] * (mp > 1)
    want += [("AllReduce", "sum", dp_group, (split + h,), "mirror")] * (dp > 1)
    fc2 = BACKBONE + "fc2-Dense/"
    where = [fc2 + "MatMul"] * (mp > 1) + [LOSS_SCOPE + loss + "/ReduceMean"] * (n > 1) + [
        fc2 + "BiasAdd"] * (mp > 1) + ["Mirror:6 params"] * (dp > 1)
    got = [_sig(e) for e in run.events]
    problems = [] if got == want else [f"collectives {[str(e) for e in run.events]}, want {want}"]
    problems += [f"event {k} is {e.label!r}, want it at {w}" for k, (e, w)
                 in enumerate(zip(run.events, where)) if not e.label.startswith(w)]
    _all_agree(problems)


def test_no_loss_ever_gathers() -> None:
    """Across every run of the grid, the traced step has no AllGather, AllToAll or
    ReduceScatter: the losses reduce partial sums with AllReduce only."""
    problems = [f"{c}: {e}" for c in GRID for e in _run(c).events
                if e.kind != "AllReduce"]
    _all_agree(problems)


# ------------------------------------------------------------------ the primitives alone
@pytest.mark.parametrize("make", [ops.Abs, ops.Square], ids=["Abs", "Square"])
def test_abs_square_every_strategy_matches_single_device(make) -> None:
    """Every candidate strategy: shards, values, gradients and collectives (none)."""
    x = np.random.default_rng(9).standard_normal((8, 4))
    assert check_strategies(make, [x], limit=None if _n() == 8 else 12) >= 1
