"""The single-device check: a parallel run must match one device, number for number.

``check_against_single_device(train, build_reference, batches)`` runs a few training steps in
parallel and the same steps on one device, and reports, for every parameter and every rank,
the largest relative difference between the rank's shard and the matching slice of the
single-device parameter, with PASS or FAIL::

    report = check_against_single_device(train, lambda: make_train_cell(), batches)
    print(report)            # a table: loss and every parameter, worst rank, PASS/FAIL
    assert report.passed     # the same verdict on every rank

Every comparison here fails on a non-finite value: a NaN or an infinity in either run counts
as an infinite difference (Python's ``max`` silently drops NaN, so nothing here relies on it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from simpar import comm
from simpar.layout import distribute
from simpar.nn.optim import Adam, Optimizer
from simpar.nn.wrap import TrainOneStepCell

__all__ = [
    "CheckReport",
    "check_against_single_device",
    "default_tolerance",
    "relative_error",
]


def relative_error(got: Any, want: Any) -> float:
    """``max |got - want| / max |want|`` (the denominator floored at 1e-30), or ``inf`` when
    either side holds a NaN or an infinity. Integer and boolean arrays compare exactly (0 or
    ``inf``). Arrays of different shapes raise ``ValueError``.

    >>> relative_error(np.array([1.0, 2.0]), np.array([1.0, 2.5]))
    0.2
    >>> relative_error(np.array([np.nan]), np.array([1.0]))
    inf
    """
    a, b = np.asarray(got), np.asarray(want)
    if a.shape != b.shape:
        raise ValueError(f"relative_error: got has shape {a.shape}, want has shape {b.shape}; "
                         "compare arrays of one shape")
    if a.size == 0:
        return 0.0
    if a.dtype.kind not in "fc" and b.dtype.kind not in "fc":
        return 0.0 if np.array_equal(a, b) else math.inf
    a64, b64 = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64), \
        b.astype(np.complex128 if b.dtype.kind == "c" else np.float64)
    if not (np.isfinite(a64).all() and np.isfinite(b64).all()):
        return math.inf
    scale = max(float(np.max(np.abs(b64))), 1e-30)
    return float(np.max(np.abs(a64 - b64))) / scale


def default_tolerance(dtype: Any, optimizer: Optimizer | None = None) -> float:
    """The relative tolerance of the single-device check, derived from the dtype and the
    optimizer (README, "The single-device check").

    float64: 1e-10 for every optimizer. float32: 1e-5, except for Adam-style optimizers
    (Adam, AdamW), see :func:`_adam_float32_tolerance`.
    """
    dt = np.dtype(dtype)
    if dt.kind != "f":
        raise TypeError(f"default_tolerance: dtype must be a floating dtype, got {dt}")
    if dt.itemsize >= 8:
        return 1e-10
    if isinstance(optimizer, Adam):
        return _adam_float32_tolerance(optimizer)
    return 1e-5


def _adam_float32_tolerance(optimizer: Adam) -> float:
    return 1e-5


@dataclass(frozen=True, slots=True)
class CheckReport:
    """The outcome of one single-device check, identical on every rank.

    ``loss_errors[k]`` is the relative difference of step ``k``'s loss;
    ``param_errors[name][r]`` the relative difference of rank ``r``'s shard of ``name``
    against the matching slice of the single-device parameter (``inf`` for a non-finite
    value on either side).
    """

    steps: int
    tolerance: float
    loss_errors: tuple[float, ...]
    param_errors: Mapping[str, tuple[float, ...]]

    @property
    def max_loss_error(self) -> float:
        return max(self.loss_errors, default=0.0, key=_nan_last)

    @property
    def worst_param(self) -> tuple[str, int, float]:
        """(parameter, rank, relative error) of the largest parameter difference."""
        worst = ("", -1, 0.0)
        for name, per_rank in self.param_errors.items():
            for rank, err in enumerate(per_rank):
                if _nan_last(err) > _nan_last(worst[2]):
                    worst = (name, rank, err)
        return worst

    @property
    def max_param_error(self) -> float:
        return self.worst_param[2]

    @property
    def failures(self) -> list[str]:
        """One line per loss step and per (parameter, rank) outside the tolerance."""
        out = [f"loss of step {k + 1}: {_fmt(e)}" for k, e in enumerate(self.loss_errors)
               if not e <= self.tolerance]
        for name, per_rank in self.param_errors.items():
            out += [f"{name} on rank {r}: {_fmt(e)}" for r, e in enumerate(per_rank)
                    if not e <= self.tolerance]
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """One line: the worst loss and parameter differences and the verdict."""
        name, rank, err = self.worst_param
        where = f" ({name} on rank {rank})" if name else ""
        verdict = "PASS" if self.passed else "FAIL"
        line = (f"check against one device ({self.steps} steps, every rank's shards): max "
                f"|Δloss| {_fmt(self.max_loss_error)}, max |Δparam| {_fmt(err)}{where} "
                f"(relative; tolerance {self.tolerance:.0e}): {verdict}")
        bad = self.failures
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            line += "\n  outside the tolerance: " + "; ".join(bad[:5]) + more
        return line

    def __str__(self) -> str:
        width = max([len("parameter"), *map(len, self.param_errors)]) + 2
        lines = [f"  {'parameter':<{width}}{'max |Δ| (relative)':>20}  {'worst rank':>10}  "
                 "verdict"]
        for name, per_rank in self.param_errors.items():
            rank = max(range(len(per_rank)), key=lambda r: _nan_last(per_rank[r]))
            err = per_rank[rank]
            lines.append(f"  {name:<{width}}{_fmt(err):>20}  {rank:>10}  "
                         f"{'ok' if err <= self.tolerance else 'FAIL'}")
        return "\n".join([*lines, self.summary()])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite differences are written as the strings "inf"/"nan"."""
        return {"steps": self.steps, "tolerance": self.tolerance, "passed": self.passed,
                "max_dloss": _json(self.max_loss_error),
                "max_dparam": _json(self.max_param_error),
                "loss_errors": [_json(e) for e in self.loss_errors],
                "param_errors": {n: [_json(e) for e in v]
                                 for n, v in self.param_errors.items()}}


def _nan_last(x: float) -> float:
    """Order key that ranks NaN above everything, so a NaN is never the one dropped."""
    return math.inf if math.isnan(x) else x


def _fmt(x: float) -> str:
    return "non-finite" if not math.isfinite(x) else f"{x:.2e}"


def _json(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def check_against_single_device(train: TrainOneStepCell,
                                build_reference: Callable[[], TrainOneStepCell],
                                batches: Iterable[tuple[np.ndarray, np.ndarray]],
                                losses: Sequence[float] | None = None,
                                tolerance: float | None = None) -> CheckReport:
    """Run ``batches`` through ``train`` in parallel and through a single-device twin, and
    compare every rank's parameter shards and every step's loss (collective: every rank
    calls it with the same global batches).

    ``build_reference()`` must build the same model and optimizer afresh (strategies set on
    it are ignored: the twin runs stand-alone). Rank 0 alone trains the twin, from the same
    seed, and broadcasts its results; every rank compares its own shards with the matching
    slices. ``losses`` says that ``train`` has already run these batches and returned these
    losses (the main job prints progress while it trains); otherwise this runs them.
    ``tolerance`` defaults to :func:`default_tolerance` for the parameters' dtype and the
    optimizer.

    On 8 ranks with a dp x mp = 2 x 4 GPT, rank 5's shard of ``fc1.weight`` is compared with
    rows 256..511 of the single-device ``fc1.weight``.
    """
    if not isinstance(train, TrainOneStepCell):
        raise TypeError(f"check_against_single_device: train must be a TrainOneStepCell, got "
                        f"{type(train).__name__}")
    if not callable(build_reference):
        raise TypeError("check_against_single_device: build_reference must be a callable "
                        f"that returns a new TrainOneStepCell, got {build_reference!r}")
    data = [(np.asarray(x), np.asarray(y)) for x, y in batches]
    if not data:
        raise ValueError("check_against_single_device: batches is empty; give at least one "
                         "(data, label) pair")
    if losses is None:
        if train.step_count:
            raise ValueError(f"check_against_single_device: train has already run "
                             f"{train.step_count} steps, and the single-device twin starts "
                             "from the initial parameters; pass a new cell, or losses= with "
                             "the losses of the steps it ran on these batches")
        losses = [train(x, y) for x, y in data]
    elif len(losses) != len(data) or train.step_count != len(data):
        raise ValueError(f"check_against_single_device: {len(losses)} losses and "
                         f"{len(data)} batches for a cell that ran {train.step_count} steps; "
                         "give every batch it ran, in order, with its loss")
    prog = train.program
    if prog is None:
        raise ValueError("check_against_single_device: train has not run a step; pass "
                         "losses=None to let the check run the batches")
    rank, world = comm.get_rank(), comm.get_group_size()
    names = sorted(prog.param_layouts)
    ref_losses = np.zeros(len(data))
    ref: TrainOneStepCell | None = None
    if rank == 0:
        ref = _twin(train, build_reference())
        ref_losses[:] = [ref(x, y) for x, y in data]
    if world > 1:
        ref_losses = comm.broadcast(ref_losses, root=0)
    loss_errors = tuple(relative_error(np.float64(a), np.float64(b))
                        for a, b in zip(losses, ref_losses))
    mine = np.empty(len(names))
    for i, name in enumerate(names):
        lay = prog.param_layouts[name]
        whole = ref.params[name] if ref is not None else np.empty(lay.shape,
                                                                 train.params[name].dtype)
        if world > 1:
            whole = comm.broadcast(np.ascontiguousarray(whole), root=0)
        rank_of_prog = rank if prog.device_num > 1 else 0
        mine[i] = relative_error(train.params[name], distribute(whole, lay, rank_of_prog))
    every = comm.all_gather(mine[None, :], axis=0) if world > 1 else mine[None, :]
    # The losses too: a rank whose loss went non-finite makes every rank fail.
    loss_every = (comm.all_reduce(np.array(loss_errors), op="max") if world > 1 and loss_errors
                  else np.array(loss_errors))
    if tolerance is None:
        dtype = train.params[names[0]].dtype if names else np.dtype(np.float64)
        tolerance = default_tolerance(dtype, train.optimizer)
    return CheckReport(len(data), float(tolerance), tuple(float(e) for e in loss_every),
                       {n: tuple(float(e) for e in every[:, i]) for i, n in enumerate(names)})


def _twin(train: TrainOneStepCell, built: TrainOneStepCell) -> TrainOneStepCell:
    """``built``'s network and optimizer as a stand-alone training cell that starts from
    ``train``'s seed and reproduces its gradient scale."""
    if not isinstance(built, TrainOneStepCell):
        raise TypeError("check_against_single_device: build_reference must return a "
                        f"TrainOneStepCell, got {type(built).__name__}")
    if built is train or built.network is train.network:
        raise ValueError("check_against_single_device: build_reference returned the cell "
                         "under test (or one sharing its network); it must build a new model")
    assert train.program is not None
    sens = train.sens
    if not train.gradients_mean and train.mode != "stand_alone":
        # The parallel gradients are the sum over the D batch shards at the loss op (see
        # simpar.nn.wrap): D times the single-device gradient, which sens=D reproduces.
        sens *= float(train.program.loss_batch_cut())
    return TrainOneStepCell(built.network, built.optimizer, sens=sens,
                            parallel_mode="stand_alone", seed=train.seed)
