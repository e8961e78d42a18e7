"""The single-device check: a parallel run must match one device, number for number.

``check_against_single_device(train, build_reference, batches)`` trains a few steps in
parallel and the same steps on one device, and compares, for every parameter and every rank:

* the trajectory: every step's loss, and the rank's parameter shards after the last step
  against the matching slices of the single-device parameters;
* the arithmetic: the loss and every gradient shard at *identical* parameters (the parallel
  run's final ones, handed to the single-device twin), for the first batch.

::

    report = check_against_single_device(train, make_train_cell, batches)
    print(report)            # one row per parameter: worst rank, Δparam, Δgrad, verdict
    assert report.passed     # the same verdict on every rank

The tolerances follow the dtype and the optimizer (:func:`default_tolerance`;
docs/check.md#tolerances says why). Every comparison fails on a non-finite value: a NaN or an
infinity on either side counts as an infinite difference (Python's ``max`` silently drops
NaN, so nothing here relies on it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from simpar import comm
from simpar.compare import largest_difference as _largest_difference
from simpar.compare import relative_error
from simpar.layout import distribute
from simpar.nn.optim import Adam, Optimizer
from simpar.nn.wrap import TrainOneStepCell

__all__ = ["CheckReport", "Tolerance", "check_against_single_device", "default_tolerance",
           "relative_error"]


# A gradient is compared relative to max(its largest value, this fraction of the model's
# largest gradient): see check_against_single_device.
GRAD_SCALE_FLOOR = 1e-3


@dataclass(frozen=True, slots=True)
class Tolerance:
    """What the single-device check allows, derived from the dtype and the optimizer.

    ``rtol`` (1e-10 in float64, 1e-5 in float32) bounds, relative to the largest reference
    value: the loss and every gradient at identical parameters, the first step's loss, and the
    parameters and losses of optimizers that are linear in the gradient (SGD, Momentum).

    Adam and AdamW divide each gradient element by its own running size, so round-off in a
    tiny, cancelling gradient (any two summation orders, parallel or not) becomes a parameter
    difference of up to ``lr * u * G / eps_hat`` per step (``u`` the dtype's unit round-off,
    ``G`` ~ 1 the largest gradient, ``eps_hat = eps / sqrt(1 - beta2**t)``). So their
    parameters may also differ by ``param_atol = lr * sqrt(steps) * u * sqrt(1 - beta2) /
    eps`` (float32, defaults, 20 steps: 0.84 lr; float64: 3.5e-10 sqrt(steps) lr), and their
    losses after the first step (which differ only because the parameters do) are judged by
    that parameter rule, not on their own: ``judge_later_losses`` is False. Non-finite values
    fail everything.
    """

    rtol: float
    param_atol: float = 0.0
    judge_later_losses: bool = True

    def __str__(self) -> str:
        adam = f"; Adam parameters + {self.param_atol:.2g} absolute" if self.param_atol else ""
        return f"relative {self.rtol:.0e}{adam}"


def default_tolerance(dtype: Any, optimizer: Optimizer | None = None,
                      steps: int = 1) -> Tolerance:
    """The :class:`Tolerance` of a run of ``steps`` steps in ``dtype`` with ``optimizer``.

    >>> default_tolerance(np.float32, nn.Momentum(params, 0.1, 0.9)).rtol
    1e-05
    """
    dt = np.dtype(dtype)
    if dt.kind != "f":
        raise TypeError(f"default_tolerance: dtype must be a floating dtype, got {dt}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"default_tolerance: steps must be an int >= 1, got {steps!r}")
    rtol = 1e-10 if dt.itemsize >= 8 else 1e-5
    if not isinstance(optimizer, Adam):  # AdamW is an Adam
        return Tolerance(rtol)
    u = float(np.finfo(dt).eps) / 2
    atol = (optimizer.learning_rate * math.sqrt(steps) * u * math.sqrt(1 - optimizer.beta2)
            / optimizer.eps)
    return Tolerance(rtol, atol, judge_later_losses=False)


@dataclass(frozen=True, slots=True)
class CheckReport:
    """The outcome of one single-device check, identical on every rank.

    ``loss_errors[k]``: the relative difference of step ``k``'s loss. ``param_errors[name][r]``:
    max |rank ``r``'s shard - the matching single-device slice| / max |single-device
    parameter|, judged against ``param_tolerances[name]``. ``grad_errors[name][r]`` and
    ``same_params_loss_error``: the same for the gradients and the loss at identical
    parameters. ``inf`` stands for a non-finite value on either side. ``reference_loss``:
    the single-device loss of the first batch before the first step and after the last one.
    """

    steps: int
    tolerance: Tolerance
    loss_errors: tuple[float, ...]
    param_errors: Mapping[str, tuple[float, ...]]
    param_tolerances: Mapping[str, float]
    grad_errors: Mapping[str, tuple[float, ...]]
    same_params_loss_error: float
    reference_loss: tuple[float, float] = (0.0, 0.0)
    parallel_finite: bool = True

    def __post_init__(self) -> None:
        for name in ("param_errors", "param_tolerances", "grad_errors"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @property
    def max_loss_error(self) -> float:
        return _worst(self.loss_errors)

    @property
    def worst_param(self) -> tuple[str, int, float]:
        """(parameter, rank, relative difference) of the largest parameter difference."""
        return _worst_of(self.param_errors)

    @property
    def max_param_error(self) -> float:
        return self.worst_param[2]

    @property
    def worst_grad(self) -> tuple[str, int, float]:
        """(parameter, rank, relative difference) of the largest gradient difference."""
        return _worst_of(self.grad_errors)

    @property
    def failures(self) -> list[str]:
        """One line per comparison outside its tolerance."""
        rtol = self.tolerance.rtol
        out = [f"loss of step {k + 1}: {_fmt(e)}" for k, e in enumerate(self.loss_errors)
               if not (e <= rtol or (k and not self.tolerance.judge_later_losses
                                     and math.isfinite(e)))]
        for name, per_rank in self.param_errors.items():
            out += [f"{name} on rank {r}: {_fmt(e)}" for r, e in enumerate(per_rank)
                    if not e <= self.param_tolerances[name]]
        if not self.same_params_loss_error <= rtol:
            out.append(f"loss at the same parameters: {_fmt(self.same_params_loss_error)}")
        for name, per_rank in self.grad_errors.items():
            out += [f"gradient of {name} on rank {r}: {_fmt(e)}" for r, e in enumerate(per_rank)
                    if not e <= rtol]
        return out

    @property
    def reference_diverged(self) -> bool:
        """The single-device run made the first batch's loss worse (or non-finite): a
        diverging run amplifies round-off without bound, so no tolerance can hold."""
        before, after = self.reference_loss
        return not (math.isfinite(before) and math.isfinite(after) and after <= before)

    @property
    def verdict(self) -> str:
        """PASS; FAIL; or INCONCLUSIVE: differences beyond the tolerance in a run whose
        single-device reference diverged, where round-off grows without bound (even the
        gradients at the final, identical parameters are ill-conditioned there). The first
        step's loss (at the initial parameters, well-conditioned) and a non-finite value in
        the parallel run's own shards still make it a FAIL."""
        bad = self.failures
        if not bad:
            return "PASS"
        first_step = any(f.startswith("loss of step 1:") for f in bad)
        return ("INCONCLUSIVE" if self.reference_diverged and self.parallel_finite
                and not first_step else "FAIL")

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    def summary(self) -> str:
        """The verdict in one line (plus the first few failures, if any)."""
        name, rank, err = self.worst_param
        gname, grank, gerr = self.worst_grad
        line = (f"check against one device ({self.steps} steps, every rank's shards): max "
                f"|Δloss| {_fmt(self.max_loss_error)}, max |Δparam| {_fmt(err)}"
                f"{f' ({name} on rank {rank})' if name else ''}, at the same parameters max "
                f"|Δgrad| {_fmt(gerr)}{f' ({gname} on rank {grank})' if gname else ''} "
                f"(tolerance {self.tolerance}): {self.verdict}")
        bad = self.failures
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            line += "\n  outside the tolerance: " + "; ".join(bad[:5]) + more
        if self.verdict == "INCONCLUSIVE":
            before, after = self.reference_loss
            line += (f"\n  the single-device run diverged (first batch's loss {before:.4g} -> "
                     f"{after:.4g}); a diverging run amplifies round-off without bound, so "
                     "these differences do not show a parallel error; train stably (a smaller "
                     "learning rate) to check")
        return line

    def __str__(self) -> str:
        rows = [["parameter", "max |Δparam|", "tolerance", "max |Δgrad|", "worst rank",
                 "verdict"]]
        for name, per_rank in self.param_errors.items():
            grads = self.grad_errors.get(name, ())
            rank = max(range(len(per_rank)), key=lambda r: (
                _nan_last(per_rank[r]) / max(self.param_tolerances[name], 1e-300),
                _nan_last(grads[r]) if grads else 0.0))
            ok = all(e <= self.param_tolerances[name] for e in per_rank) and all(
                e <= self.tolerance.rtol for e in grads)
            rows.append([name, _fmt(per_rank[rank]), f"{self.param_tolerances[name]:.1e}",
                         _fmt(_worst(grads)) if grads else "-", str(rank),
                         "ok" if ok else "over"])
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  " + "  ".join(c.ljust(w) if k == 0 else c.rjust(w)
                                  for k, (c, w) in enumerate(zip(r, widths))) for r in rows]
        return "\n".join([*lines, self.summary()])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite differences are written as the strings "inf"/"nan"."""
        return {"steps": self.steps, "passed": self.passed, "verdict": self.verdict,
                "parallel_finite": self.parallel_finite,
                "reference_loss": [_json(x) for x in self.reference_loss],
                "tolerance": {"rtol": self.tolerance.rtol,
                              "param_atol": self.tolerance.param_atol,
                              "judge_later_losses": self.tolerance.judge_later_losses},
                "max_dloss": _json(self.max_loss_error),
                "max_dparam": _json(self.max_param_error),
                "max_dgrad": _json(self.worst_grad[2]),
                "same_params_dloss": _json(self.same_params_loss_error),
                "loss_errors": [_json(e) for e in self.loss_errors],
                "param_errors": {n: [_json(e) for e in v]
                                 for n, v in self.param_errors.items()},
                "param_tolerances": dict(self.param_tolerances),
                "grad_errors": {n: [_json(e) for e in v] for n, v in self.grad_errors.items()}}


def _nan_last(x: float) -> float:
    """Order key that ranks NaN above everything, so a NaN is never the one dropped."""
    return math.inf if math.isnan(x) else x


def _worst(values: Iterable[float]) -> float:
    return max(values, default=0.0, key=_nan_last)


def _worst_of(errors: Mapping[str, tuple[float, ...]]) -> tuple[str, int, float]:
    worst = ("", -1, 0.0)
    for name, per_rank in errors.items():
        for rank, err in enumerate(per_rank):
            if _nan_last(err) > _nan_last(worst[2]):
                worst = (name, rank, err)
    return worst


def _fmt(x: float) -> str:
    return "non-finite" if not math.isfinite(x) else f"{x:.2e}"


def _json(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def check_against_single_device(train: TrainOneStepCell,
                                build_reference: Callable[[], TrainOneStepCell],
                                batches: Iterable[tuple[np.ndarray, np.ndarray]],
                                losses: Sequence[float] | None = None,
                                tolerance: Tolerance | None = None) -> CheckReport:
    """Run ``batches`` through ``train`` in parallel and through a single-device twin, and
    compare every step's loss, every rank's parameter shards, and the loss and gradients at
    identical parameters (collective: every rank calls it with the same global batches).

    ``build_reference()`` must build the same model and optimizer afresh (strategies set on
    it are ignored: the twin runs stand-alone). Rank 0 alone trains the twin, from the same
    seed, and broadcasts its results; every rank compares its own shards with the matching
    slices. ``losses`` says that ``train`` has already run these batches and returned these
    losses (the main job prints progress while it trains); otherwise this runs them. A
    ``per_device`` cell (MindSpore's ``full_batch=False``) is given each rank's own slices,
    and the check assembles the global batches from them (:meth:`TrainOneStepCell.global_batch`).
    ``tolerance`` defaults to :func:`default_tolerance` for the parameters' dtype, the
    optimizer and the number of steps.

    On 8 ranks with a dp x mp = 2 x 4 GPT, rank 5's shard of ``head.weight`` (vocabulary
    rows 32..63) is compared with those rows of the single-device ``head.weight``.
    """
    if not isinstance(train, TrainOneStepCell):
        raise TypeError(f"check_against_single_device: train must be a TrainOneStepCell, got "
                        f"{type(train).__name__}")
    if not callable(build_reference):
        raise TypeError("check_against_single_device: build_reference must be a callable "
                        f"that returns a new TrainOneStepCell, got {build_reference!r}")
    data = [(np.asarray(x), np.asarray(y)) for x, y in batches]
    if train.program is None and data:   # how the cell feeds is decided as it builds
        train.build(*data[0])
    if train.per_device and data:   # each rank passed its slices: the twin takes the whole
        data = [train.global_batch(x, y) for x, y in data]
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
    assert prog is not None
    # With pipeline stages a rank holds its stage's parameters only: every rank walks every
    # parameter (rank 0 broadcasts each), comparing those it holds.
    runner = train.pipeline
    world = prog.device_num * (runner.count if runner is not None else 1)
    rank = (runner.local if runner is not None else comm.get_rank()) if world > 1 else 0
    programs = runner.programs if runner is not None else [prog]
    shapes = {n: (v.shape, v.dtype) for p in programs for n, v in p.param_values.items()}
    stored = ({n: owner.storage_layout(n) for n, (owner, _) in runner.params().items()}
              if runner is not None else {n: prog.storage_layout(n) for n in prog.param_layouts})
    names = sorted(shapes)
    trainable = sorted(n for p in programs for n, v in p.param_values.items()
                       if v.param is not None and v.param.requires_grad)
    if tolerance is None:
        dtype = np.dtype(shapes[names[0]][1]) if names else np.dtype(np.float64)
        tolerance = default_tolerance(dtype, train.optimizer, len(data))
    if train.mode != "stand_alone" and not train.loss_repeated_mean:
        raise ValueError("check_against_single_device: the cell was built with "
                         "loss_repeated_mean=False, whose gradients are r times the "
                         "single-device ones (r = the loss's replicas); the check compares "
                         "with loss_repeated_mean=True only")
    twin: TrainOneStepCell | None = None
    error: Exception | None = None
    if rank == 0:
        try:  # everything that can go wrong with the reference, before any broadcast
            twin = _twin(train, build_reference())
            twin.build(*data[0])
            _same_parameters(train, twin)
        except (TypeError, ValueError) as e:
            error = e
        except Exception as e:  # noqa: BLE001 - shared with every rank and raised there
            error = ValueError(f"check_against_single_device: the single-device reference "
                               f"failed on rank 0 ({type(e).__name__}: {e}); build_reference "
                               "must build the same model as the cell under test")
    _raise_everywhere(error, world)

    # The trajectory: free-running losses, then the parameters after the last step.
    ref_losses = _from_rank_0(np.array([twin(x, y) for x, y in data]) if twin else
                              np.zeros(len(data)), world)
    loss_errors = [relative_error(np.float64(a), b) for a, b in zip(losses, ref_losses)]
    param_diff, param_tol = {}, {}
    for name in names:
        diff, scale = _against_rank_0(train.params.get(name), twin.params if twin else None,
                                      name, stored.get(name), shapes[name], rank, world)
        param_diff[name] = diff / scale
        param_tol[name] = tolerance.rtol + tolerance.param_atol / scale

    # The arithmetic: loss and gradients at identical parameters (the parallel run's).
    same = train.global_parameters()
    loss, grads = train.value_and_grad(*data[0], step=train.step_count)
    ref_grads: dict[str, np.ndarray] | None = None
    ref_loss = np.zeros(2)  # at the parallel run's parameters; the twin's own, at its own
    if twin is not None:
        ref_loss[1], _ = twin.value_and_grad(*data[0], step=0)  # the masks of the first
        twin.params = same
        ref_loss[0], ref_grads = twin.value_and_grad(*data[0], step=train.step_count)
    ref_loss = _from_rank_0(ref_loss, world)
    grad_names = trainable
    measured = {name: _against_rank_0(grads.get(name), ref_grads, name, stored.get(name),
                                      shapes[name], rank, world) for name in grad_names}
    # A gradient that is zero in exact arithmetic (a bias the loss cannot see) is pure
    # round-off on both sides; measured against its own size it would differ by O(1). So
    # each gradient's scale is at least GRAD_SCALE_FLOOR of the model's largest gradient.
    floor = GRAD_SCALE_FLOOR * max((scale for _, scale in measured.values()
                                    if math.isfinite(scale)), default=0.0)
    grad_diff = {name: diff / max(scale, floor) for name, (diff, scale) in measured.items()}

    # Every rank's figures, to every rank; inf (never NaN) crosses MPI's MAX and gather.
    finite = all(np.isfinite(a).all() for a in (*train.params.values(), *grads.values())) \
        and all(math.isfinite(x) for x in (*losses, loss))
    mine = np.array([*(param_diff[n] for n in names), *(grad_diff[n] for n in grad_names),
                     relative_error(np.float64(loss), ref_loss[0]), *loss_errors,
                     0.0 if finite else 1.0])
    every = comm.all_gather(mine[None, :], axis=0) if world > 1 else mine[None, :]
    k, g = len(names), len(grad_names)
    return CheckReport(
        len(data), tolerance, tuple(float(e) for e in every[:, k + g + 1:-1].max(axis=0)),
        {n: tuple(float(e) for e in every[:, i]) for i, n in enumerate(names)}, param_tol,
        {n: tuple(float(e) for e in every[:, k + i]) for i, n in enumerate(grad_names)},
        float(every[:, k + g].max()), (float(ref_losses[0]), float(ref_loss[1])),
        not every[:, -1].any())


def _raise_everywhere(error: Exception | None, device_num: int) -> None:
    """Rank 0's ``TypeError``/``ValueError`` (or nothing), raised on every rank alike
    (collective): the other ranks would otherwise wait for rank 0's broadcasts forever."""
    if device_num == 1:
        if error is not None:
            raise error
        return
    text = f"{type(error).__name__}\0{error}".encode()[:4096] if error is not None else b""
    buf = np.zeros(4096, dtype=np.int32)  # simpar.comm moves numbers, not bytes
    buf[:len(text)] = np.frombuffer(text, dtype=np.uint8)
    buf = comm.broadcast(buf, root=0)
    if error is not None:
        raise error
    if buf.any():
        kind, _, message = bytes(buf.astype(np.uint8)).rstrip(b"\0").decode(
            errors="replace").partition("\0")
        raise (TypeError if kind == "TypeError" else ValueError)(message)


def _same_parameters(train: TrainOneStepCell, twin: TrainOneStepCell) -> None:
    assert train.program is not None and twin.program is not None
    mine, theirs = train.program.param_layouts, twin.program.param_layouts
    for name, lay in mine.items():
        other = theirs.get(name)
        want = (lay.shape, train.params[name].dtype)
        got = None if other is None else (other.shape, twin.params[name].dtype)
        if got != want:
            raise ValueError(f"check_against_single_device: build_reference built a model "
                             f"whose parameter {name} is {got or 'missing'}, but the cell "
                             f"under test has {want}; it must build the same model")


def _from_rank_0(x: np.ndarray, device_num: int) -> np.ndarray:
    return comm.broadcast(np.ascontiguousarray(x), root=0) if device_num > 1 else x


def _against_rank_0(local: np.ndarray | None, whole: Mapping[str, np.ndarray] | None,
                    name: str, layout: Any, shape: tuple[Any, Any], rank: int,
                    device_num: int) -> tuple[float, float]:
    """(max |local - this rank's slice of rank 0's ``whole[name]``|, max |whole[name]|): the
    global array crosses from rank 0 (collective), so every rank shares one scale. A rank
    that does not hold it (``local`` None: another pipeline stage's) differs by 0."""
    want = _from_rank_0(whole[name] if whole is not None else np.empty(*shape), device_num)
    diff = 0.0
    if local is not None:
        diff, _ = _largest_difference(local, distribute(want, layout, rank))
    return diff, max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-30)


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
        loss_program = (train.pipeline.programs[-1] if train.pipeline is not None
                        else train.program)
        sens *= float(loss_program.loss_batch_cut())
    return TrainOneStepCell(built.network, built.optimizer, sens=sens,
                            parallel_mode="stand_alone", seed=train.seed)
