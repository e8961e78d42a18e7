"""Shared test setup.

Under ``mpirun -n N`` every rank runs pytest. Rank 0 reports to the console; the other ranks
write their report to ``$SIMPAR_TEST_LOGDIR/rank{r}.log`` (dev.py prints it when a run fails),
so a failure on any rank is still seen and still fails the run (mpirun exits non-zero).
Hypothesis draws the same examples on every rank (derandomize), or the ranks would deadlock.
"""

from __future__ import annotations

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
