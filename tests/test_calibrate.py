"""simpar.calibrate in one process: its argument checks and its alpha-beta fit (no timing).

    python -m pytest tests/test_calibrate.py -q

The measuring itself runs under mpirun in tests/test_calibrate_mpi.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from simpar import calibrate
from simpar.calibrate import (
    FULL,
    KINDS,
    QUICK,
    STEP_TERMS,
    Calibration,
    MeasurementPlan,
    Sample,
    StepSample,
    fit_at_least,
    fit_link,
    fit_step_terms,
    model_terms,
)
from simpar.cost import DeviceProfile, Link, load_profile, traffic

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m simpar.calibrate ARGS`` with the venv's python, outside any MPI launcher
    (pytest itself may run under one: its rank variables would silence the child's rank 0)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "simpar.calibrate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


# ------------------------------------------------------------------ arguments
def test_an_out_in_a_missing_directory_exits_2_naming_out(tmp_path: Path) -> None:
    run = _cli("--out", "/nonexistent/dir/x.json", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert "--out" in lines[0] and "/nonexistent/dir" in lines[0] and "does not exist" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_flag_exits_2_naming_it(tmp_path: Path) -> None:
    run = _cli("--bogus", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "python -m simpar.calibrate: error: unrecognized arguments: --bogus (--help lists the "
        "options)"]
    assert list(tmp_path.iterdir()) == []


BAD = [
    (["--out", "profile.txt"], ["--out", "'profile.txt'", ".json"]),
    (["--out", "."], ["--out", "'.'"]),
    (["--out"], ["--out", "expected one argument"]),
    (["--name", ""], ["--name", "''"]),
    (["--name", "x/y", "--out", "ok.json"], ["--name", "'x/y'"]),
    (["--quick", "extra"], ["unrecognized arguments: extra"]),
    (["--qu"], ["unrecognized arguments: --qu"]),                   # no abbreviations
]


@pytest.mark.parametrize(("args", "names"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_exit_2_with_one_line(args: list[str], names: list[str],
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    """Checked before MPI starts (in this process: calibrate.main returns before comm.init)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        calibrate.main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("python -m simpar.calibrate: error: ")
    for name in names:
        assert name in err
    assert list(tmp_path.iterdir()) == []


def test_the_default_out_is_the_name_in_the_current_directory(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert calibrate.parse_args([]).out == Path("cpu-local.json")
    assert calibrate.parse_args(["--name", "my-box"]).out == Path("my-box.json")
    assert calibrate.parse_args(["--out", "sub.json", "--quick"]).quick is True


def test_help_gives_the_mpirun_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        calibrate.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "mpirun -n 8 python -m simpar.calibrate --out" in out
    assert "--quick" in out and "--name" in out


# ------------------------------------------------------------------ the fit
def _samples(latency: float, bandwidth: float) -> list[Sample]:
    link = Link(latency, bandwidth)
    out = []
    for p in (2, 4, 8):
        for kind in KINDS:
            for nbytes in FULL.sizes:
                rounds, moved = model_terms(kind, p, nbytes)
                out.append(Sample(kind, p, nbytes, link.seconds(int(rounds), moved)))
    return out


def _fit(samples: list[Sample]) -> Link:
    terms = [model_terms(s.kind, s.group_size, s.nbytes) for s in samples]
    return fit_link([r for r, _ in terms], [t for _, t in terms], [s.seconds for s in samples])


@pytest.mark.parametrize(("latency", "bandwidth"), [(50e-6, 0.6e9), (5e-6, 25e9), (1e-3, 1e7)])
def test_the_fit_recovers_a_known_link_exactly(latency: float, bandwidth: float) -> None:
    link = _fit(_samples(latency, bandwidth))
    assert link.latency == pytest.approx(latency, rel=1e-9)
    assert link.bandwidth == pytest.approx(bandwidth, rel=1e-9)


def test_the_fit_keeps_latency_non_negative() -> None:
    """Times below the bandwidth line (a negative intercept) fit with latency 0, not < 0."""
    rounds, moved = [1, 1, 1, 1], [1e3, 1e4, 1e5, 1e6]
    seconds = [m / 1e9 - 5e-7 + 1e-9 for m in moved]       # the best unconstrained alpha is < 0
    link = fit_link(rounds, moved, seconds)
    assert link.latency == 0.0
    assert 0.9e9 < link.bandwidth < 1.5e9
    x, *_ = np.linalg.lstsq(np.column_stack([rounds, moved]), seconds, rcond=None)
    assert x[0] < 0                                          # clipping was needed


def test_the_fit_refuses_times_that_do_not_grow_with_the_bytes() -> None:
    with pytest.raises(ValueError, match="no bandwidth to fit"):
        fit_link([1, 1, 1], [1e3, 1e4, 1e5], [3e-3, 2e-3, 1e-3])
    with pytest.raises(ValueError, match="at least 2 points"):
        fit_link([1], [1e3], [1e-3])
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_link([1, 1], [1e3, 1e4], [1e-3, 0.0])


def test_the_model_terms_are_the_cost_models() -> None:
    """Rounds and traffic come from DeviceProfile.collective_seconds: ring rounds 2(p-1) for
    AllReduce, p-1 otherwise, and the traffic simpar.cost.traffic gives."""
    for p in (2, 3, 8):
        for kind in KINDS:
            rounds, moved = model_terms(kind, p, 3 * 2**20)
            assert rounds == (2 * (p - 1) if kind == "AllReduce" else p - 1)
            assert moved == traffic(kind, p, 3 * 2**20)
    prof = load_profile("ascend910a")
    for s in _samples(prof.intra_server.latency, prof.intra_server.bandwidth):
        assert s.fitted(prof.intra_server) == pytest.approx(
            prof.collective_seconds(s.kind, range(s.group_size), s.nbytes), rel=1e-12)


def test_the_table_shows_measured_and_fitted_with_the_worst_error() -> None:
    link = Link(50e-6, 0.6e9)
    slow = ("AllGather", 8, 4096)          # measured at twice the model's time
    samples = [replace(s, seconds=2 * s.seconds) if (s.kind, s.group_size, s.nbytes) == slow
               else s for s in _samples(link.latency, link.bandwidth)]
    prof = DeviceProfile("t", {"float32": 1e9}, 1, 1e9, link, link, 8)
    result = Calibration(prof, tuple(samples))
    lines = result.table().splitlines()
    assert lines[0].split() == ["collective", "p", "4", "KiB", "16", "KiB", "64", "KiB", "256",
                                "KiB", "1", "MiB", "4", "MiB", "worst"]
    assert len(lines) == 1 + 3 * len(KINDS)             # a row per (kind, group size)
    assert [ln.split()[:2] for ln in lines[1:5]] == [[k, "8"] for k in KINDS]
    row = next(ln for ln in lines if ln.split()[:2] == ["AllGather", "8"])
    assert row.split()[-1] == "-50%"                    # fitted is half the measured
    assert all(ln.split()[-1] in ("+0%", "-0%") for ln in lines[1:] if ln != row)
    assert np.count_nonzero(np.abs(result.errors()) > 1e-9) == 1


def test_plans_are_checked_and_print_in_one_line() -> None:
    assert "4 KiB..4 MiB" in str(FULL) and "\n" not in str(QUICK)
    with pytest.raises(ValueError, match="reps must be an int >= 1"):
        MeasurementPlan(0.01, 1, 1024, 1, (4096, 8192), 0, False)
    with pytest.raises(ValueError, match="at least 2 buffer sizes"):
        MeasurementPlan(0.01, 1, 1024, 1, (4096,), 3, False)


def _step(k: float, roof: float, calls: float, truth: dict[str, float], rest: float = 1e-3
          ) -> StepSample:
    terms = (1.0, k, roof, calls)
    return StepSample("s", rest + float(np.dot(terms, [truth[t] for t in STEP_TERMS])),
                      terms, rest)


def test_the_step_terms_are_recovered_from_exact_steps() -> None:
    truth = {"step_overhead": 2e-4, "kernel_overhead": 3e-5, "compute_scale": 1.4,
             "sync_overhead": -2e-4}
    shapes = [(12, 5e-5, 3), (54, 5e-4, 3), (99, 1.4e-3, 3), (345, 5e-3, 3), (99, 4e-3, 71),
              (30, 2e-2, 2)]
    fitted = fit_step_terms([_step(*s, truth) for s in shapes], link_overhead=4e-4)
    assert fitted == pytest.approx(truth, rel=1e-9, abs=1e-12)


def test_the_step_terms_keep_their_bounds() -> None:
    """A collective never costs less than nothing: a sync below minus the link's overhead
    is held at that bound; a negative per-kernel cost at 0; no collectives, no sync."""
    truth = {"step_overhead": 1e-3, "kernel_overhead": 2e-5, "compute_scale": 1.0,
             "sync_overhead": -9e-4}
    shapes = [(12, 5e-5, 3), (54, 5e-4, 9), (99, 1.4e-3, 30), (345, 5e-3, 3)]
    fitted = fit_step_terms([_step(*s, truth) for s in shapes], link_overhead=4e-4)
    assert fitted["sync_overhead"] == pytest.approx(-4e-4)
    assert fitted["kernel_overhead"] >= 0 and fitted["compute_scale"] >= 0.05
    alone = fit_step_terms([_step(k, r, 0, truth) for k, r, _ in shapes], link_overhead=4e-4)
    assert alone["sync_overhead"] == 0.0
    assert alone["kernel_overhead"] == pytest.approx(2e-5)


def test_fit_at_least_is_exact_when_the_bound_binds() -> None:
    """min |a x - y| with x >= lower: here the unconstrained optimum has x1 < 0."""
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = np.array([1.0, -1.0, 0.0])
    assert fit_at_least(a, y, np.zeros(2)) == pytest.approx([0.5, 0.0])
    assert fit_at_least(a, y, np.array([0.0, -5.0])) == pytest.approx([1.0, -1.0])
