"""dev.py, the setup-and-run script behind the README's two commands.

Most tests are pure: dev.py's counting runs on results files written here, or by real pytest
processes that play ranks 0 and 1 (PMI_RANK set by a stand-in launcher, no MPI). One test runs
``dev.py test`` for real, through mpirun -n 2, on a test that fails on rank 1 only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simpar_dev_script", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _fake_mpirun(directory: Path) -> Path:
    directory.mkdir(parents=True)
    exe = directory / "mpirun"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX executables")
def test_mpirun_is_the_first_on_the_path_it_is_given(tmp_path: Path) -> None:
    """The venv's bin comes first on dev.py's PATH, so the bundled mpirun wins when it is
    installed; without it (SIMPAR_SYSTEM_MPI) the system's mpirun is used."""
    dev = _dev()
    venv_bin, system_bin = tmp_path / "venv" / "bin", tmp_path / "system" / "bin"
    system = _fake_mpirun(system_bin)
    assert dev._mpirun({"PATH": os.pathsep.join([str(venv_bin), str(system_bin)])}) == str(system)
    bundled = _fake_mpirun(venv_bin)
    assert dev._mpirun({"PATH": os.pathsep.join([str(venv_bin), str(system_bin)])}) == str(bundled)


def test_no_mpirun_anywhere_stops_with_what_to_do(tmp_path: Path) -> None:
    dev = _dev()
    with pytest.raises(SystemExit, match="no mpirun in the venv nor on PATH"):
        dev._mpirun({"PATH": str(tmp_path)})


def test_the_commands_cache_bytecode_in_the_venv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even where the environment says not to write bytecode: every rank of every run would
    compile simpar and rewrite the test modules' asserts again. The cache is the venv's,
    not beside the sources, unless the user chose one."""
    dev = _dev()
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    env = dev._env()
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["PYTHONPYCACHEPREFIX"] == str(dev.VENV / "pycache")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "/elsewhere")
    assert dev._env()["PYTHONPYCACHEPREFIX"] == "/elsewhere"


# --- counting every rank's outcomes (issue 10: a failure on rank 1 only was reported as
# "N passed, 0 failed", because only rank 0's closing line was read) ---

PASS = {"setup": "passed", "call": "passed", "teardown": "passed"}
FAIL = {"setup": "passed", "call": "failed", "teardown": "passed"}
SKIP = {"setup": "skipped", "teardown": "passed"}


def _results(directory: Path, rank: int, size: int, tests: dict[str, dict[str, str]],
             finished: bool = True, xfail: tuple[str, ...] = ()) -> None:
    """A results-rank{r}.jsonl as tests/conftest.py writes it: test -> phase -> outcome."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [{"event": "start"}]
    for node, phases in tests.items():
        lines += [{"event": "report", "nodeid": node, "when": when, "outcome": outcome,
                   "xfail": node in xfail} for when, outcome in phases.items()]
    if finished:
        lines.append({"event": "finish", "exitstatus": 0})
    with open(directory / f"results-rank{rank}.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({**rec, "rank": rank, "size": size}) + "\n" for rec in lines)


def test_a_failure_on_rank_1_only_is_counted_and_named(tmp_path: Path) -> None:
    dev = _dev()
    _results(tmp_path, 0, 2, {"tests/t.py::test_a": PASS, "tests/t.py::test_b": PASS})
    _results(tmp_path, 1, 2, {"tests/t.py::test_a": PASS, "tests/t.py::test_b": FAIL})
    run = dev.read_run(tmp_path, "mpirun -n 2", 1, 2)
    assert run.count() == {"passed": 3, "failed": 1}
    assert dev.run_text(run) == ("mpirun -n 2: rank 0: 2 passed; rank 1: 1 passed, 1 failed "
                                 "(tests/t.py::test_b)")
    lines, ok = dev.report([run])
    assert not ok
    assert lines == [
        "dev.py: runs that failed: mpirun -n 2",
        "test runs (every rank of every run): 3 passed, 1 failed, 0 skipped",
        "distinct tests: 1 passed, 1 failed, 0 skipped (a test counts as failed if it failed "
        "on any rank of any run)",
        "distinct failed tests:",
        "  tests/t.py::test_b: failed on mpirun -n 2 rank 1"]


def test_a_failed_rank_fails_the_run_even_when_mpirun_exits_0(tmp_path: Path) -> None:
    dev = _dev()
    _results(tmp_path, 0, 2, {"t.py::test_a": PASS})
    _results(tmp_path, 1, 2, {"t.py::test_a": FAIL})
    assert dev.read_run(tmp_path, "mpirun -n 2", 0, 2).failed
    assert dev.report([dev.read_run(tmp_path, "mpirun -n 2", 0, 2)])[1] is False


def test_ranks_with_the_same_report_are_grouped(tmp_path: Path) -> None:
    dev = _dev()
    for rank in range(8):
        _results(tmp_path, rank, 8, {"t.py::test_a": FAIL if rank == 1 else PASS,
                                     "t.py::test_b": FAIL})
    run = dev.read_run(tmp_path, "mpirun -n 8", 1, 8)
    assert dev.run_text(run) == ("mpirun -n 8: ranks 0,2-7: 1 passed, 1 failed (t.py::test_b); "
                                 "rank 1: 2 failed (t.py::test_a, t.py::test_b)")
    lines, _ = dev.report([run])
    assert lines[-2:] == ["  t.py::test_a: failed on mpirun -n 8 rank 1",
                          "  t.py::test_b: failed on mpirun -n 8 ranks 0-7"]


def test_a_rank_that_wrote_no_results_counts_as_a_failure(tmp_path: Path) -> None:
    dev = _dev()
    for rank in range(3):
        _results(tmp_path, rank, 4, {"t.py::test_a": PASS})
    run = dev.read_run(tmp_path, "mpirun -n 4", 0, 4)
    assert run.failed and run.count() == {"passed": 3, "failed": 1}
    assert dev.run_text(run) == ("mpirun -n 4: ranks 0-2: 1 passed; rank 3: wrote no results "
                                 "(it died before pytest started)")
    lines, ok = dev.report([run])
    assert not ok
    assert lines[1] == "test runs (every rank of every run): 3 passed, 1 failed, 0 skipped"
    assert lines[-2:] == ["ranks that failed outside their tests' outcomes:",
                          "  mpirun -n 4 rank 3: wrote no results (it died before pytest "
                          "started)"]


def test_a_rank_that_died_inside_a_test_blames_that_test_once(tmp_path: Path) -> None:
    """An MPI Abort kills the rank between setup and teardown: the test is an error there, the
    rank's unfinished session is reported, and the failure is counted once."""
    dev = _dev()
    _results(tmp_path, 0, 2, {"t.py::test_a": PASS, "t.py::test_b": PASS})
    _results(tmp_path, 1, 2, {"t.py::test_a": PASS, "t.py::test_b": {"setup": "passed"}},
             finished=False)
    run = dev.read_run(tmp_path, "mpirun -n 2", 1, 2)
    assert run.count() == {"passed": 3, "error": 1}
    assert dev.run_text(run).endswith(
        "rank 1: 1 passed, 1 error (t.py::test_b); ended inside t.py::test_b before its pytest "
        "session finished (killed, or MPI abort)")
    lines, _ = dev.report([run])
    assert "test runs (every rank of every run): 3 passed, 1 failed, 0 skipped" in lines
    assert "  t.py::test_b: error on mpirun -n 2 rank 1" in lines


def test_a_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    dev = _dev()
    _results(tmp_path, 0, 1, {"t.py::test_a": PASS}, finished=False)
    with open(tmp_path / "results-rank0.jsonl", "a", encoding="utf-8") as f:
        f.write('{"event": "report", "nodeid": "t.py::te')
    run = dev.read_run(tmp_path, "1 process", 1, 1)
    assert run.count() == {"passed": 1, "failed": 1}  # the unfinished session is the failure


def test_phases_fold_into_one_outcome_per_test(tmp_path: Path) -> None:
    dev = _dev()
    _results(tmp_path, 0, 1, {
        "t.py::test_pass": PASS,
        "t.py::test_fail": FAIL,
        "t.py::test_fail_and_bad_teardown": {**FAIL, "teardown": "failed"},
        "t.py::test_bad_setup": {"setup": "failed", "teardown": "passed"},
        "t.py::test_bad_teardown": {**PASS, "teardown": "failed"},
        "t.py::test_skip": SKIP,
        "t.py::test_skip_in_body": {**PASS, "call": "skipped"},
        "t.py::test_xfail": {**PASS, "call": "skipped"},
        "t.py::test_xpass": PASS,
        "t.py": {"collect": "failed"},
    }, xfail=("t.py::test_xfail", "t.py::test_xpass"))
    outcomes = dev.read_run(tmp_path, "1 process", 1, 1).ranks[0].outcomes
    assert outcomes == {
        "t.py::test_pass": "passed", "t.py::test_fail": "failed",
        "t.py::test_fail_and_bad_teardown": "failed", "t.py::test_bad_setup": "error",
        "t.py::test_bad_teardown": "error", "t.py::test_skip": "skipped",
        "t.py::test_skip_in_body": "skipped", "t.py::test_xfail": "xfailed",
        "t.py::test_xpass": "xpassed", "t.py": "error"}


def test_distinct_tests_count_each_test_once_across_runs_and_ranks(tmp_path: Path) -> None:
    """test_a: passes everywhere; test_b: skipped in one process (min_size=2), fails on rank 1
    of mpirun -n 4 only; test_c: skipped everywhere."""
    dev = _dev()
    node_a, node_b, node_c = "t.py::test_a", "t.py::test_b", "t.py::test_c"
    one = tmp_path / "one"
    _results(one, 0, 1, {node_a: PASS, node_b: SKIP, node_c: SKIP})
    runs = [dev.read_run(one, "1 process", 0, 1)]
    for n in (2, 4):
        for rank in range(n):
            bad = n == 4 and rank == 1
            _results(tmp_path / str(n), rank, n, {node_a: PASS, node_b: FAIL if bad else PASS,
                                                  node_c: SKIP})
        runs.append(dev.read_run(tmp_path / str(n), f"mpirun -n {n}", int(n == 4), n))
    lines, ok = dev.report(runs)
    assert not ok
    assert lines[:3] == [
        "dev.py: runs that failed: mpirun -n 4",
        "test runs (every rank of every run): 12 passed, 1 failed, 8 skipped",
        "distinct tests: 1 passed, 1 failed, 1 skipped (a test counts as failed if it failed "
        "on any rank of any run)"]
    assert lines[3:] == ["distinct failed tests:", "  t.py::test_b: failed on mpirun -n 4 rank 1"]


def test_all_passing_runs_report_no_failures(tmp_path: Path) -> None:
    dev = _dev()
    _results(tmp_path, 0, 1, {"t.py::test_a": PASS, "t.py::test_b": SKIP})
    lines, ok = dev.report([dev.read_run(tmp_path, "1 process", 0, 1)])
    assert ok
    assert lines == [
        "dev.py: runs that failed: none",
        "test runs (every rank of every run): 1 passed, 0 failed, 1 skipped",
        "distinct tests: 1 passed, 0 failed, 1 skipped (a test counts as failed if it failed "
        "on any rank of any run)"]


def test_nothing_passed_is_a_failure(tmp_path: Path) -> None:
    dev = _dev()
    _results(tmp_path, 0, 1, {"t.py::test_a": SKIP})
    assert dev.report([dev.read_run(tmp_path, "1 process", 0, 1)])[1] is False


def test_without_results_files_rank_0s_closing_line_is_counted(tmp_path: Path) -> None:
    from collections import Counter

    dev = _dev()
    run = dev.read_run(tmp_path, "mpirun -n 2", 0, 2, Counter(passed=5, skipped=1))
    assert not run.failed and run.count() == {"passed": 5, "skipped": 1}
    assert dev.run_text(run) == ("mpirun -n 2: no results files (was tests/conftest.py loaded?); "
                                 "rank 0's closing line: 5 passed, 1 skipped")
    lines, ok = dev.report([run])
    assert ok
    assert lines[1:] == [
        "test runs (every rank of every run): 5 passed, 0 failed, 1 skipped",
        "distinct tests: 0 passed, 0 failed, 0 skipped (a test counts as failed if it failed "
        "on any rank of any run)",
        "distinct tests leave out runs without results files: mpirun -n 2"]


# --- real pytest processes ---

_TINY = """
    import os

    import pytest


    def test_everywhere() -> None:
        pass


    def test_not_on_rank_1() -> None:
        assert os.environ.get("PMI_RANK") != "1", "rank 1 only"


    @pytest.mark.skip(reason="never")
    def test_skipped() -> None:
        pass
"""

# Stands in for mpirun: runs the command once per rank with PMI_RANK/PMI_SIZE set, one rank
# after the other, and exits with the worst exit code. Enough for tests/conftest.py, which
# takes the rank from the launcher's environment; the tiny tests use no MPI.
_FAKE_MPIRUN = """
import os, subprocess, sys
n, cmd = int(sys.argv[1]), sys.argv[2:]
sys.exit(max(subprocess.call(cmd, env={**os.environ, "PMI_RANK": str(r), "PMI_SIZE": str(n)})
             for r in range(n)))
"""


def _clean_env() -> dict[str, str]:
    """This process's environment without an enclosing MPI job's or dev.py run's variables."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_", "SIMPAR_TEST_"))}


def test_every_rank_of_a_real_pytest_run_is_counted(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Two pytest processes as ranks 0 and 1 (tests/conftest.py writes their results, and sends
    rank 1's report to its log): rank 0's console says "2 passed", and dev.py still finds the
    failure on rank 1."""
    dev = _dev()
    tiny = tmp_path / "test_tiny.py"
    tiny.write_text(textwrap.dedent(_TINY))
    launcher = tmp_path / "fake_mpirun.py"
    launcher.write_text(_FAKE_MPIRUN)
    (tmp_path / "logs").mkdir()
    env = dict(_clean_env(), SIMPAR_TEST_LOGDIR=str(tmp_path / "logs"))
    cmd = [sys.executable, str(launcher), "2", sys.executable, "-m", "pytest", "-q",
           "-p", "tests.conftest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
           str(tiny)]
    run = dev._pytest("fake -n 2", cmd, env, 2)
    console = capsys.readouterr().out
    assert "2 passed, 1 skipped" in console  # rank 0's closing line, all that dev.py read before
    assert run.rc == 1 and run.failed
    node = "test_tiny.py::test_not_on_rank_1"
    assert ("dev.py: fake -n 2: rank 0: 2 passed, 1 skipped; rank 1: 1 passed, 1 failed, "
            f"1 skipped ({node})") in console
    assert "rank 1 only" in (tmp_path / "logs" / "rank1.log").read_text()
    lines, ok = dev.report([run])
    assert not ok
    assert lines[1:] == [
        "test runs (every rank of every run): 3 passed, 1 failed, 2 skipped",
        "distinct tests: 1 passed, 1 failed, 1 skipped (a test counts as failed if it failed "
        "on any rank of any run)",
        "distinct failed tests:",
        f"  {node}: failed on fake -n 2 rank 1"]


_TINY_MPI = """
    import pytest

    import simpar.comm as comm


    @pytest.mark.mpi(min_size=2)
    def test_not_on_rank_1() -> None:
        assert comm.get_rank() != 1, "rank 1 only"


    @pytest.mark.mpi
    def test_everywhere() -> None:
        assert comm.get_group_size() >= 1
"""


@pytest.mark.skipif(shutil.which("mpirun", path=os.pathsep.join(
    [str(ROOT / ".venv" / "bin"), os.environ.get("PATH", "")])) is None, reason="no mpirun")
def test_dev_py_test_reports_a_failure_on_rank_1_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug itself, end to end: ``dev.py test`` on one file, the 1-process run and
    mpirun -n 2; rank 0's console says "2 passed" for the mpirun run."""
    dev = _dev()
    tiny = tmp_path / "test_tiny_mpi.py"
    tiny.write_text(textwrap.dedent(_TINY_MPI))
    for key in set(os.environ) - set(_clean_env()):
        monkeypatch.delenv(key)
    monkeypatch.setattr(dev, "MPI_RUNS", (2,))
    # --rootdir: node ids relative to tmp_path, whatever configuration files lie above it.
    assert dev.test([str(tiny), "-p", "tests.conftest", "-p", "no:cacheprovider",
                     "--rootdir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    node = "test_tiny_mpi.py::test_not_on_rank_1"
    assert "dev.py: 1 process: 1 passed, 1 skipped" in out
    assert f"dev.py: mpirun -n 2: rank 0: 2 passed; rank 1: 1 passed, 1 failed ({node})" in out
    assert out.rstrip().splitlines()[-5:] == [
        "dev.py: runs that failed: mpirun -n 2",
        "test runs (every rank of every run): 4 passed, 1 failed, 1 skipped",
        "distinct tests: 1 passed, 1 failed, 0 skipped (a test counts as failed if it failed "
        "on any rank of any run)",
        "distinct failed tests:",
        f"  {node}: failed on mpirun -n 2 rank 1"]
