"""Shared test setup.

Under ``mpirun -n N`` every rank runs pytest. Rank 0 reports to the console; the other ranks
write their report to ``$SIMPAR_TEST_LOGDIR/rank{r}.log`` (dev.py prints it when a run fails),
so a failure on any rank is still seen and still fails the run (mpirun exits non-zero).
With ``$SIMPAR_TEST_RESULTS`` set (dev.py sets it), every rank also appends one JSON line per
report to ``results-rank{r}.jsonl`` there, so that dev.py counts the outcomes of every rank.
The 1-process run spreads its test files over pytest-xdist workers, one per core (dev.py).
Hypothesis draws the same examples on every rank (derandomize), or the ranks would deadlock.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "simpar", derandomize=True, deadline=None, print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=int(os.environ.get("SIMPAR_HYPOTHESIS_EXAMPLES", "40")))
settings.load_profile("simpar")


def _launcher_rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _launcher_size() -> int:
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


class _ResultsWriter:
    """Appends this rank's reports to ``<directory>/results-rank{r}.jsonl``, one JSON line per
    phase (setup, call, teardown; collect when a file fails to collect), between a ``start`` and
    a ``finish`` line. dev.py folds them into one outcome per test; a file without ``finish``
    means the rank died, and a test without teardown is the one it died in. Line-buffered, so
    what was written before a crash (or an MPI Abort) is on disk."""

    def __init__(self, directory: str) -> None:
        self.rank, self.size = _launcher_rank(), _launcher_size()
        path = os.path.join(directory, f"results-rank{self.rank}.jsonl")
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._write(event="start")

    def _write(self, **record: object) -> None:
        self._file.write(json.dumps({**record, "rank": self.rank, "size": self.size}) + "\n")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write(event="report", nodeid=report.nodeid, when=report.when,
                    outcome=report.outcome, xfail=hasattr(report, "wasxfail"))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if not report.passed:
            self._write(event="report", nodeid=report.nodeid, when="collect",
                        outcome=report.outcome, xfail=False)

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        self._write(event="finish", exitstatus=int(exitstatus))

    def pytest_unconfigure(self) -> None:
        self._file.close()


def _per_rank_basetemp(config: pytest.Config) -> None:
    """Under mpirun every rank is a pytest process: give each its own tmp_path root, or one
    rank's clean-up of old /tmp/pytest-of-<user> directories deletes another rank's files."""
    if config.option.basetemp or not any(v in os.environ for v in ("PMI_RANK",
                                                                   "OMPI_COMM_WORLD_RANK")):
        return
    parent = os.environ.get("SIMPAR_TEST_LOGDIR") or tempfile.gettempdir()
    config.option.basetemp = os.path.join(parent, f"pytest-rank{_launcher_rank()}-{os.getpid()}")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _per_rank_basetemp(config)  # before the tmp_path plugin reads --basetemp
    results = os.environ.get("SIMPAR_TEST_RESULTS")
    # Under pytest-xdist the controller hears every worker's reports: it alone writes them.
    if results and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_ResultsWriter(results), "simpar-results")


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    rank = _launcher_rank()
    logdir = os.environ.get("SIMPAR_TEST_LOGDIR")
    if rank > 0 and logdir:
        log = open(os.path.join(logdir, f"rank{rank}.log"), "w", buffering=1)  # noqa: SIM115
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
        # pytest writes its report to a copy of the original stdout it made at start-up.
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter._tw._file = log  # type: ignore[attr-defined]


@pytest.fixture
def world() -> tuple[int, int]:
    """(rank, size) of the MPI world."""
    import simpar.comm as comm

    return comm.get_rank(), comm.get_group_size()
