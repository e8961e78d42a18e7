"""The single-device check's arithmetic, in one process: every comparison fails on a
non-finite value, and the report says which parameter and rank.

    python -m pytest tests/test_check.py -q
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from simpar import nn
from simpar.check import CheckReport, Tolerance, default_tolerance, relative_error


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("side", ["got", "want"])
def test_relative_error_is_infinite_for_any_non_finite_value(bad: float, side: str) -> None:
    clean = np.array([1.0, 2.0, 3.0])
    dirty = clean.copy()
    dirty[1] = bad
    got, want = (dirty, clean) if side == "got" else (clean, dirty)
    assert relative_error(got, want) == math.inf
    assert not relative_error(got, want) <= 1e-10


def test_relative_error_is_relative_to_the_largest_reference_value() -> None:
    assert relative_error(np.array([1.0, 2.0]), np.array([1.0, 2.5])) == pytest.approx(0.2)
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_error(np.zeros((0, 4)), np.zeros((0, 4))) == 0.0
    assert relative_error(np.float32(1.0), np.float32(1.0)) == 0.0


def test_integer_arrays_compare_exactly() -> None:
    assert relative_error(np.arange(4), np.arange(4)) == 0.0
    assert relative_error(np.arange(4), np.arange(4) + 1) == math.inf


def test_relative_error_refuses_different_shapes() -> None:
    with pytest.raises(ValueError, match=r"got has shape \(2,\), want has shape \(3,\)"):
        relative_error(np.zeros(2), np.zeros(3))


FLOAT64 = Tolerance(1e-10)


def _report(loss: tuple[float, ...], params: dict[str, tuple[float, ...]],
            grads: dict[str, tuple[float, ...]] | None = None, same_loss: float = 0.0,
            tolerance: Tolerance = FLOAT64) -> CheckReport:
    tols = {n: tolerance.rtol for n in params}
    grads = grads if grads is not None else {n: (0.0,) * len(v) for n, v in params.items()}
    return CheckReport(len(loss), tolerance, loss, params, tols, grads, same_loss)


def test_a_nan_on_one_rank_fails_and_is_named() -> None:
    report = _report((0.0, 1e-16), {"fc1.weight": (1e-13, math.nan, 1e-13),
                                    "fc2.weight": (1e-12, 1e-12, 1e-12)})
    assert not report.passed
    assert report.worst_param[:2] == ("fc1.weight", 1)
    assert "fc1.weight on rank 1: non-finite" in report.summary()
    assert report.summary().splitlines()[0].endswith("FAIL")
    # Python's max() would have dropped the NaN: the report does not.
    assert max(1e-13, math.nan, 1e-13) == 1e-13
    assert math.isnan(report.max_param_error)


def test_a_nan_gradient_or_loss_at_the_same_parameters_fails() -> None:
    report = _report((0.0,), {"w": (0.0, 0.0)}, {"w": (0.0, math.inf)})
    assert report.failures == ["gradient of w on rank 1: non-finite"]
    assert _report((0.0,), {"w": (0.0,)}, same_loss=math.inf).failures == [
        "loss at the same parameters: non-finite"]


def test_a_non_finite_loss_fails() -> None:
    report = _report((0.0, math.inf), {"w": (0.0,)})
    assert not report.passed
    assert report.failures == ["loss of step 2: non-finite"]


def test_adam_losses_after_the_first_step_are_judged_through_the_parameters() -> None:
    adam = Tolerance(1e-5, 1e-3, judge_later_losses=False)
    # Step 2's loss differs by more than rtol: Adam's trajectory, not a failure...
    assert _report((0.0, 3e-5), {"w": (1e-6,)}, tolerance=adam).passed
    # ...but the first step's loss, a non-finite later loss and the gradients still count.
    assert not _report((3e-5, 0.0), {"w": (0.0,)}, tolerance=adam).passed
    assert not _report((0.0, math.nan), {"w": (0.0,)}, tolerance=adam).passed
    assert not _report((0.0,), {"w": (0.0,)}, {"w": (2e-5,)}, tolerance=adam).passed


def test_passing_report_and_its_table() -> None:
    report = _report((1e-16,), {"a.weight": (1e-13, 3e-13), "b": (0.0, 0.0)})
    assert report.passed and report.failures == []
    text = str(report)
    assert "a.weight" in text and text.rstrip().endswith("PASS")
    # The table's rows are aligned: every row puts its verdict in the same column.
    rows = text.splitlines()[1:3]
    assert len({r.rindex("ok") for r in rows}) == 1


def test_report_json_has_no_bare_nan() -> None:
    d = _report((math.nan,), {"w": (math.inf, 0.0)}).to_dict()
    text = json.dumps(d, allow_nan=False)  # raises on a bare NaN or Infinity
    assert d["passed"] is False and json.loads(text)["param_errors"]["w"] == ["inf", 0.0]


def test_default_tolerance_follows_dtype_and_optimizer() -> None:
    params = nn.Dense(2, 2).trainable_params()
    assert default_tolerance(np.float64, nn.Momentum(params, 0.1, 0.9)) == Tolerance(1e-10)
    assert default_tolerance(np.float32, nn.SGD(params, 0.1)) == Tolerance(1e-5)
    assert default_tolerance(np.float32) == Tolerance(1e-5)
    # Adam: lr * sqrt(steps) * u * sqrt(1 - beta2) / eps, u = 2**-24 in float32.
    adam = default_tolerance(np.float32, nn.Adam(params, 3e-3), steps=20)
    assert adam.rtol == 1e-5 and not adam.judge_later_losses
    assert adam.param_atol == pytest.approx(3e-3 * math.sqrt(20) * 2**-24 * math.sqrt(1e-3)
                                            / 1e-8)
    assert adam.param_atol == pytest.approx(0.84 * 3e-3, rel=0.01)
    assert default_tolerance(np.float64, nn.AdamW(params, 3e-3), 20).param_atol < 1e-11
    with pytest.raises(TypeError, match="dtype must be a floating dtype, got int32"):
        default_tolerance(np.int32)
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        default_tolerance(np.float32, steps=0)


def test_differences_in_a_diverged_reference_are_inconclusive_not_fail() -> None:
    bad = {"w": (1e-6,)}
    diverged = CheckReport(2, FLOAT64, (0.0, 0.0), bad, {"w": 1e-10}, {"w": (0.0,)}, 0.0,
                           (4.8, 172.0))
    assert diverged.reference_diverged and diverged.verdict == "INCONCLUSIVE"
    assert not diverged.passed and "the single-device run diverged" in diverged.summary()
    blew_up = CheckReport(2, FLOAT64, (0.0, 0.0), bad, {"w": 1e-10}, {"w": (0.0,)}, 0.0,
                          (4.8, math.nan))
    assert blew_up.verdict == "INCONCLUSIVE"
    trained = CheckReport(2, FLOAT64, (0.0, 0.0), bad, {"w": 1e-10}, {"w": (0.0,)}, 0.0,
                          (4.8, 3.1))
    assert trained.verdict == "FAIL"
    clean = CheckReport(2, FLOAT64, (0.0, 0.0), {"w": (0.0,)}, {"w": 1e-10}, {"w": (0.0,)},
                        0.0, (4.8, 172.0))
    assert clean.verdict == "PASS" and clean.passed


def test_what_a_diverged_reference_can_and_cannot_excuse() -> None:
    def report(grads: tuple[float, ...], loss: tuple[float, ...] = (0.0, 0.0),
               finite: bool = True) -> CheckReport:
        return CheckReport(2, FLOAT64, loss, {"w": (1e-6,)}, {"w": 1e-10}, {"w": grads}, 0.0,
                           (4.8, 172.0), finite)
    assert report((0.0,)).verdict == "INCONCLUSIVE"           # the trajectory
    assert report((0.05,)).verdict == "INCONCLUSIVE"          # gradients at ill-conditioned params
    assert report((0.0,), (1e-6, 0.0)).verdict == "FAIL"       # the first step's loss
    assert report((math.inf,), finite=False).verdict == "FAIL"  # a NaN/Inf in parallel shards
