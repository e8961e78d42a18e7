"""simpar.calibrate on real ranks, with the quick plan (a second or two).

    mpirun -n 2 python -m pytest tests/test_calibrate_mpi.py -q --with-mpi -m mpi

One calibration runs per job, on every rank, under a CommTrace; rank 0 writes its profile into
rank 0's tmp_path, whose name is broadcast, and every rank then reads that one file. No test
asserts on a time: only that each figure is there, finite, positive and of a plausible order.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np
import pytest

import simpar.comm as comm
from simpar import calibrate
from simpar.calibrate import KINDS, QUICK, STEP_TERMS, Calibration
from simpar.comm import CommTrace
from simpar.cost import DeviceProfile, load_profile, traffic
from tests.mpi_guard import abort_job_on_error, shared_dir

pytestmark = pytest.mark.mpi(min_size=2)




@cache
def _run(where: Path) -> tuple[Calibration, Path, CommTrace]:
    """The quick calibration, once per job: (its result on this rank, the file rank 0 wrote,
    this rank's trace of it)."""
    path = where / "quick.json"
    with abort_job_on_error("calibrate(QUICK)"), CommTrace() as trace:
        result = calibrate.calibrate(QUICK, name="quick-test", command="tests/test_calibrate_mpi")
        if comm.get_rank() == 0:
            result.profile.save(path)
    comm.barrier()
    return result, path, trace


@pytest.fixture
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Calibration, Path, CommTrace]:
    return _run(shared_dir(tmp_path_factory.getbasetemp()))


def test_the_file_loads_on_every_rank_with_every_figure_finite_and_positive(
        run: tuple[Calibration, Path, CommTrace]) -> None:
    result, path, _ = run
    prof = load_profile(path)
    p = comm.get_group_size()
    assert prof == result.profile and prof.name == "quick-test"
    figures = [*prof.peak_flops.values(), prof.memory_capacity, prof.memory_bandwidth,
               prof.intra_server.bandwidth, prof.inter_server.bandwidth, prof.devices_per_server]
    assert all(math.isfinite(x) and x > 0 for x in figures), prof
    # The fit keeps each term >= 0; on a loaded host the per-call overhead may explain the
    # small calls alone (latency 0), but a call always costs something.
    for link in (prof.intra_server, prof.inter_server):
        assert link.latency >= 0 and link.overhead >= 0 and link.latency + link.overhead > 0
    assert set(prof.peak_flops) == {"float32", "float64"}
    assert prof.devices_per_server == p and prof.server_of(p - 1) == 0
    assert prof.inter_server == prof.intra_server


def test_the_figures_are_plausible(run: tuple[Calibration, Path, CommTrace]) -> None:
    prof = load_profile(run[1])
    link = prof.intra_server
    assert 1e6 < link.bandwidth < 1e12
    assert 0 <= link.latency < 0.1 and 0 < link.latency + link.overhead < 0.1
    assert 1e7 < prof.peak_flops["float32"] < 1e14 and 1e7 < prof.peak_flops["float64"] < 1e14
    assert 1e6 < prof.memory_bandwidth < 1e13
    assert 2**20 < prof.memory_capacity < 2**50


def test_sources_say_measured_when_and_at_how_many_ranks(
        run: tuple[Calibration, Path, CommTrace]) -> None:
    prof = load_profile(run[1])
    p = comm.get_group_size()
    sources = prof.sources
    assert set(sources) >= {"profile", "peak_flops", "memory_bandwidth", "memory_capacity",
                            "intra_server", "inter_server", "devices_per_server"}
    for key in ("profile", "peak_flops", "memory_bandwidth", "intra_server"):
        assert "measured" in sources[key], key
    assert "tests/test_calibrate_mpi" in sources["profile"]
    assert f"{p} ranks" in sources["profile"] and f"{p} ranks" in sources["peak_flops"]
    assert json.loads(run[1].read_text())["sources"] == sources   # one JSON object, as written
    assert "not measured" in sources["memory_capacity"]


def test_every_rank_got_the_same_profile(run: tuple[Calibration, Path, CommTrace]) -> None:
    prof = run[0].profile
    mine = np.array([prof.peak_flops["float32"], prof.peak_flops["float64"],
                     prof.memory_bandwidth, float(prof.memory_capacity),
                     prof.intra_server.latency, prof.intra_server.bandwidth,
                     *(getattr(prof, t) for t in STEP_TERMS)])
    every = comm.all_gather(mine[None, :])
    assert (every == mine).all(), every


def test_the_collectives_timed_are_the_ones_the_samples_name(
        run: tuple[Calibration, Path, CommTrace]) -> None:
    """Each sample is one (kind, size) over the world; the trace holds warmup + reps calls of
    each, float32 (the bookkeeping reductions are float64/int64), at the traffic priced."""
    result, _, trace = run
    p = comm.get_group_size()
    world = tuple(range(p))
    assert sorted((s.kind, s.nbytes) for s in result.samples) == sorted(
        (k, n) for k in KINDS for n in QUICK.sizes)
    assert all(s.group_size == p and s.seconds > 0 for s in result.samples)
    sizes = {(s.nbytes // 4,) for s in result.samples}   # (not the reference steps' own)
    timed = [e for e in trace.events if e.dtype == "float32" and e.shape in sizes]
    calls = QUICK.warmup + QUICK.reps
    assert len(timed) == len(result.samples) * calls
    for s in result.samples:
        events = [e for e in timed if e.kind == s.kind and e.shape == (s.nbytes // 4,)]
        assert len(events) == calls, s
        assert all(e.group == world and e.bytes_sent == traffic(s.kind, p, s.nbytes)
                   for e in events), s


def test_main_writes_on_rank_0_only_and_returns_0_everywhere(
        run: tuple[Calibration, Path, CommTrace],
        capsys: pytest.CaptureFixture[str]) -> None:
    out = run[1].parent / "main.json"
    with abort_job_on_error("calibrate.main"):
        code = calibrate.main(["--quick", "--name", "from-main", "--out", str(out)])
    printed = capsys.readouterr().out
    codes = comm.all_gather(np.array([code]))
    assert codes.tolist() == [0] * comm.get_group_size()
    assert load_profile(out).name == "from-main"
    assert isinstance(load_profile(out), DeviceProfile)
    if comm.get_rank() == 0:
        assert "calibrate: GEMM float32" in printed and f"wrote {out}" in printed
        assert all(any(ln.startswith(k) for ln in printed.splitlines()) for k in KINDS)
    else:
        assert printed == ""


def test_the_step_terms_are_fitted_to_reference_steps_over_every_rank(
        run: tuple[Calibration, Path, CommTrace]) -> None:
    """Eight reference training steps, each priced by the cost model: one
    step, its kernel calls, its roofline, its collective calls; the fitted figures keep their
    bounds and explain the steps better than any of them nudged."""
    result, path, _ = run
    prof = load_profile(path)
    steps = result.steps
    assert len(steps) == 8
    assert all(s.seconds > 0 and s.terms[0] == 1.0 and s.terms[1] > 10 and s.terms[2] > 0
               for s in steps)
    assert max(s.terms[3] for s in steps) > 20          # optimizer level2: many collectives
    assert prof.kernel_overhead >= 0 and prof.step_overhead >= 0
    assert prof.compute_scale >= 0.05 and prof.sync_overhead >= -prof.intra_server.overhead
    for term in STEP_TERMS:
        assert prof.sources[term].startswith("measured: fitted jointly"), term

    def error(p: DeviceProfile) -> float:
        return sum((s.fitted(p) / s.seconds - 1) ** 2 for s in steps)
    for term in STEP_TERMS:
        value = getattr(prof, term)      # (up: every bound is a lower one)
        nudged = replace(prof, **{term: value + abs(value) * 0.05 + 1e-6})
        assert error(prof) <= error(nudged) + 1e-12, term
