"""simrun (simpar.launch): real 2-rank jobs through mpirun, rank tables, bad arguments.

These run in one process: each job is a ``python -m simpar.launch -n 2 ...`` subprocess, so
they are not marked ``mpi`` and never run under mpirun themselves. A 60 s timeout on every job
only guards against a hang; no test asserts on wall-clock time.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from simpar import launch
from simpar.launch import (
    RankTable,
    build_rank_table,
    detect_mpi_flavor,
    parse_hostfile,
    read_rank_table,
    write_rank_table,
)
from simpar.launch.mpi import with_abort_on_exception
from simpar.launch.rank_table import _rank_table_from_json
from tests.mpi_guard import have_mpirun

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 60


needs_mpirun = pytest.mark.skipif(not have_mpirun(), reason="no usable mpirun")


def _env() -> dict[str, str]:
    """This environment minus any MPI launcher's variables (pytest may itself run under one)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _simrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "simpar.launch", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)


HELLO = """
import os
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
print(f"hello from rank {rank}")
print(f"table={os.environ['SIMPAR_RANK_TABLE_FILE']} logs={os.environ['SIMPAR_LOG_DIR']}")
MPI.COMM_WORLD.Barrier()
"""


@pytest.fixture(scope="module")
def hello_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str],
                                                                   Path]:
    """One 2-rank job with the default log dir (./logs), shared by the tests that read it."""
    cwd = tmp_path_factory.mktemp("hello")
    return _simrun("-n", "2", "--", "python", "-c", HELLO, cwd=cwd), cwd / "logs"


# --------------------------------------------------------------------------- real jobs


@needs_mpirun
def test_each_rank_writes_its_own_log(hello_job: tuple[Any, Path]) -> None:
    result, logs = hello_job
    assert result.returncode == 0, result.stderr
    for rank, other in ((0, 1), (1, 0)):
        text = (logs / f"rank_{rank}.log").read_text()
        assert f"hello from rank {rank}" in text
        assert f"hello from rank {other}" not in text
        assert f"table={logs / 'rank_table.json'} logs={logs}" in text
    # Rank 0 is also on the console, rank 1 only in its log.
    assert "hello from rank 0" in result.stdout
    assert "hello from rank 1" not in result.stdout


@needs_mpirun
def test_rank_table_is_written_for_two_ranks(hello_job: tuple[Any, Path]) -> None:
    result, logs = hello_job
    assert result.returncode == 0, result.stderr
    table = read_rank_table(logs / "rank_table.json")
    assert table == build_rank_table(2, [(socket.gethostname(), 2)])
    assert [s.server_id for s in table.servers] == [socket.gethostname()]
    assert [(d.device_id, d.rank_id) for d in table.servers[0].devices] == [(0, 0), (1, 1)]
    assert table.server_of(0) == table.server_of(1) == 0
    raw = json.loads((logs / "rank_table.json").read_text())
    assert raw["server_count"] == "1" and raw["status"] == "completed" and raw["version"] == "1.0"
    assert raw["server_list"][0]["device"][1] == {"device_id": "1", "device_ip": "10.0.0.2",
                                                  "rank_id": "1"}


@needs_mpirun
def test_join_shows_every_rank_and_a_given_rank_table_is_used(tmp_path: Path) -> None:
    given = write_rank_table(build_rank_table(2, [("node-a", 1), ("node-b", 1)]),
                             tmp_path / "my_table.json")
    result = _simrun("-n", "2", "--join", "--log-dir", "out", "--rank-table-file", str(given),
                     "--", "python", "-c", HELLO, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[rank 0] hello from rank 0" in result.stdout
    assert "[rank 1] hello from rank 1" in result.stdout
    assert f"[rank 1] table={given} logs={tmp_path / 'out'}" in result.stdout
    assert not (tmp_path / "out" / "rank_table.json").exists()


FAIL_IN_BARRIER = """
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
print(f"rank {rank} started", flush=True)
if rank == 1:
    raise RuntimeError("boom on rank 1")
MPI.COMM_WORLD.Barrier()  # rank 0 waits here for a rank that will never come
"""


@needs_mpirun
def test_a_rank_that_raises_ends_the_job(tmp_path: Path) -> None:
    result = _simrun("-n", "2", "--", "python", "-c", FAIL_IN_BARRIER, cwd=tmp_path)
    assert result.returncode != 0
    assert "rank 1 failed" in result.stderr
    assert "RuntimeError: boom on rank 1" in result.stderr  # the traceback's last line
    assert "RuntimeError: boom on rank 1" in (tmp_path / "logs" / "rank_1.log").read_text()
    assert "rank 0 started" in (tmp_path / "logs" / "rank_0.log").read_text()


EXIT_WITHOUT_MPI = """
import os, sys, time
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
print(f"rank {rank} up", flush=True)
if rank == 1:
    print("rank 1 gives up", flush=True)
    sys.exit(3)
time.sleep(HANG_GUARD_S)
""".replace("HANG_GUARD_S", str(HANG_GUARD_S))


@needs_mpirun
def test_the_launcher_stops_ranks_that_mpirun_leaves_running(tmp_path: Path) -> None:
    # No MPI in these ranks, so mpirun does not end rank 0 when rank 1 exits: simrun must.
    result = _simrun("-n", "2", "--grace", "1", "--", "python", "-c", EXIT_WITHOUT_MPI,
                     cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "rank 1 failed (exit code 3)" in result.stderr
    assert "simrun stopped the remaining ranks" in result.stderr
    assert "rank 1 gives up" in result.stderr  # the end of rank 1's log


@needs_mpirun
def test_ctrl_c_stops_the_job(tmp_path: Path) -> None:
    job = subprocess.Popen([sys.executable, "-m", "simpar.launch", "-n", "2", "--", "python",
                            "-c", EXIT_WITHOUT_MPI.replace("rank == 1", "False")],
                           cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        logs = [tmp_path / "logs" / f"rank_{r}.log" for r in (0, 1)]
        give_up = time.monotonic() + HANG_GUARD_S
        while not all(p.is_file() and "up" in p.read_text() for p in logs):
            assert time.monotonic() < give_up and job.poll() is None, job.communicate()
            time.sleep(0.05)
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=HANG_GUARD_S)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGINT
    assert "interrupted by SIGINT" in stderr


# --------------------------------------------------------------------------- rank tables


def test_rank_table_from_a_two_host_hostfile(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two Ascend servers\nnode-a:8\n\nnode-b:8  # second\n")
    hosts = parse_hostfile(hostfile, "hydra")
    assert hosts == (("node-a", 8), ("node-b", 8))
    table = build_rank_table(16, hosts)
    assert [s.server_id for s in table.servers] == ["node-a", "node-b"]
    assert table.servers[0].ranks == tuple(range(8))
    assert table.servers[1].ranks == tuple(range(8, 16))
    assert table.server_of(7) == 0 and table.server_of(8) == 1
    assert table.device_of(9).device_id == 1
    assert read_rank_table(write_rank_table(table, tmp_path / "t.json")) == table
    # Fewer ranks than slots: node-a fills first.
    assert [s.ranks for s in build_rank_table(10, hosts).servers] == [tuple(range(8)), (8, 9)]


def test_open_mpi_hostfile_syntax(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=8 max_slots=8\nnode-b slots=4\nnode-c\n")
    assert parse_hostfile(hostfile, "openmpi") == (("node-a", 8), ("node-b", 4), ("node-c", 1))


def test_a_host_with_more_than_8_ranks_is_several_servers() -> None:
    table = build_rank_table(20, [("vm", 20)])
    assert [(s.server_id, len(s.devices)) for s in table.servers] == [
        ("vm#0", 8), ("vm#1", 8), ("vm#2", 4)]
    assert table.server_of(15) == 1 and table.device_of(15).device_id == 7
    assert str(table) == "RankTable(20 devices: vm#0[0..7], vm#1[8..15], vm#2[16..19])"


def test_example_rank_table_is_two_servers_of_eight() -> None:
    table = read_rank_table(ROOT / "launch" / "rank_table_16p.example.json")
    assert table == build_rank_table(16, parse_hostfile(ROOT / "launch" / "hostfile.example"))
    assert (table.server_count, table.device_num) == (2, 16)


def _valid() -> dict[str, Any]:
    return build_rank_table(4, [("a", 2), ("b", 2)]).to_json_dict()


def _set(path: str, value: Any) -> Any:
    """A change to a rank-table dict: set (or delete) the item at ``a.0.b``."""
    def change(data: dict[str, Any]) -> None:
        *parents, last = (int(k) if k.isdecimal() else k for k in path.split("."))
        node: Any = data
        for key in parents:
            node = node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return change


_DELETE = object()


@pytest.mark.parametrize(("change", "message"), [
    (_set("server_list", _DELETE), "server_list must be a non-empty list"),
    (_set("server_count", "3"), "server_count is '3', but server_list holds 2 servers"),
    (_set("server_count", _DELETE), "server_count is missing"),
    (_set("status", "initializing"), "status must be 'completed', got 'initializing'"),
    (_set("server_list.1.device.0.rank_id", "x"), "server_list[1].device[0].rank_id must be a "
                                                  "non-negative integer"),
    (_set("server_list.1.device.0.rank_id", "1"), "server_list[1].device[0].rank_id 1 appears "
                                                  "twice"),
    (_set("server_list.1.device.1.rank_id", "7"), "rank_id values must be 0..3"),
    (_set("server_list.0.device.1.device_id", "0"), "server_list[0].device[1].device_id 0 "
                                                    "appears twice"),
    (_set("server_list.1.server_id", "a"), "server_list[1].server_id 'a' appears twice"),
    (_set("server_list.0.device", []), "server_list[0].device must be a non-empty list"),
    (_set("server_list.0.device.0.device_id", _DELETE), "device[0].device_id is missing"),
])
def test_read_rank_table_names_the_bad_field(tmp_path: Path, change: Any, message: str) -> None:
    data = copy.deepcopy(_valid())
    change(data)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="table.json") as info:
        read_rank_table(path)
    assert message in str(info.value)


def test_read_rank_table_rejects_non_json(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    path.write_bytes(b"\x80\x04K\x01.")  # a pickle: never loaded as one
    with pytest.raises(ValueError, match="not valid JSON|cannot read"):
        read_rank_table(path)


def test_rank_table_accepts_json_numbers() -> None:
    data = _valid()
    for server in data["server_list"]:
        for device in server["device"]:
            device["rank_id"] = int(device["rank_id"])
    data["server_count"] = 2
    assert _rank_table_from_json(data) == build_rank_table(4, [("a", 2), ("b", 2)])


def test_server_of_rejects_a_rank_outside_the_table() -> None:
    with pytest.raises(ValueError, match="rank 4 is not in this rank table of 4 devices"):
        build_rank_table(4).server_of(4)
    assert isinstance(build_rank_table(4), RankTable)


# --------------------------------------------------------------------------- mpirun and arguments


def _fake_mpirun(tmp_path: Path, version: str) -> Path:
    """An "mpirun" that prints ``version`` for --version and records any other call."""
    script = tmp_path / "fake-mpirun"
    script.write_text("#!/bin/sh\n"
                      f'if [ "$1" = --version ]; then echo "{version}"; exit 0; fi\n'
                      f'printf "%s\\n" "$@" > "{tmp_path}/argv"\n')
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(("version", "flavor"), [
    ("HYDRA build details:\n    Version: 4.2.0", "hydra"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.9", "hydra"),
    ("mpirun (Open MPI) 4.1.2\n\nReport bugs to http://www.open-mpi.org/community/help/",
     "openmpi"),
    ("some other launcher 1.0", "unknown"),
])
def test_mpi_flavor_comes_from_mpirun_version(tmp_path: Path, version: str, flavor: str) -> None:
    assert detect_mpi_flavor(str(_fake_mpirun(tmp_path, version))) == flavor


@pytest.mark.parametrize(("version", "hostfile_text", "flag", "extra"), [
    ("HYDRA build details:", "node-a:2\n", "-f", []),
    ("mpirun (Open MPI) 4.1.2", "node-a slots=2\n", "--hostfile", ["-x", "PYTHONPATH"]),
])
def test_mpirun_gets_the_hostfile_in_its_own_syntax(
        tmp_path: Path, version: str, hostfile_text: str, flag: str, extra: list[str]) -> None:
    (tmp_path / "hosts").write_text(hostfile_text)
    mpirun = _fake_mpirun(tmp_path, version)
    result = _simrun("-n", "2", "--hostfile", "hosts", "--mpirun", str(mpirun),
                     "--", "python", "-u", "train.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:4] == ["-n", "2", flag, str(tmp_path / "hosts")]
    assert all(word in argv for word in extra)
    wrapper = argv.index("--_rank-wrapper")
    assert argv[wrapper - 3:wrapper] == [sys.executable, "-m", "simpar.launch"]
    # The command runs under mpi4py's runner, so an uncaught exception aborts the job.
    assert argv[argv.index("--") + 1:] == ["python", "-u", "-m", "mpi4py", "train.py"]
    table = read_rank_table(tmp_path / "logs" / "rank_table.json")
    assert [s.server_id for s in table.servers] == ["node-a"]


@pytest.mark.parametrize(("command", "expected"), [
    (["python", "-m", "simpar.train", "--steps", "3"],
     ["python", "-m", "mpi4py", "-m", "simpar.train", "--steps", "3"]),
    (["/opt/venv/bin/python3.11", "-X", "dev", "-c", "pass"],
     ["/opt/venv/bin/python3.11", "-X", "dev", "-m", "mpi4py", "-c", "pass"]),
    (["python", "-m", "mpi4py", "x.py"], ["python", "-m", "mpi4py", "x.py"]),
    (["bash", "job.sh"], ["bash", "job.sh"]),
])
def test_python_commands_run_under_mpi4py(command: list[str], expected: list[str]) -> None:
    assert with_abort_on_exception(command) == expected


@pytest.fixture
def hydra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    return str(_fake_mpirun(tmp_path, "HYDRA build details:"))


@pytest.mark.parametrize(("args", "message"), [
    (["-n", "0", "--", "true"], "-n must be at least 1, got 0"),
    (["-n", "two", "--", "true"], "argument -n/--nproc: invalid int value: 'two'"),
    (["--", "true"], "the following arguments are required: -n/--nproc"),
    (["-n", "2"], "no command given"),
    (["-n", "2", "--"], "no command given"),
    (["-n", "2", "--hostfile", "nowhere", "--", "true"], "--hostfile 'nowhere' does not exist"),
    (["-n", "2", "--bogus", "--", "true"], "unrecognized arguments: --bogus"),
    (["-n", "2", "--grace", "-1", "--", "true"], "--grace must be between 0 and 3600 seconds, "
                                                 "got -1"),
    (["-n", "2", "--mpirun", "/no/such/mpirun", "--", "true"],
     "--mpirun '/no/such/mpirun' is not an executable file"),
])
def test_bad_arguments_exit_2_naming_the_flag(hydra: str, capsys: pytest.CaptureFixture[str],
                                              args: list[str], message: str) -> None:
    if "--mpirun" not in args:
        args = ["--mpirun", hydra, *args]
    assert launch.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("simrun: error: ") and message in err


@pytest.mark.parametrize(("hostfile_text", "message"), [
    ("node-a:1\n", "--hostfile 'hosts' has 1 slots (node-a:1), fewer than -n 2"),
    ("node-a slots=2\n", "line 1: 'node-a slots=2' is Open MPI syntax; MPICH Hydra reads "
                         "'node-a:2'"),
    ("node-a:0\n", "the slot count of 'node-a' must be a positive integer, got '0'"),
    ("node-a:1\nnode-a:1\n", "line 2: host 'node-a' appears twice"),
    ("# nothing\n", "names no host"),
])
def test_bad_hostfiles_exit_2(hydra: str, capsys: pytest.CaptureFixture[str],
                              hostfile_text: str, message: str) -> None:
    Path("hosts").write_text(hostfile_text)
    assert launch.main(["--mpirun", hydra, "-n", "2", "--hostfile", "hosts", "--", "true"]) == 2
    assert message in capsys.readouterr().err


def test_a_rank_table_for_another_device_count_exits_2(
        hydra: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(["--mpirun", hydra, "-n", "2", "--rank-table-file",
                        str(ROOT / "launch" / "rank_table_16p.example.json"), "--", "true"]) == 2
    assert "describes 16 devices, but -n is 2" in capsys.readouterr().err
    Path("bad.json").write_text("{")
    assert launch.main(["--mpirun", hydra, "-n", "2", "--rank-table-file", "bad.json",
                        "--", "true"]) == 2
    assert "--rank-table-file: rank table" in capsys.readouterr().err


# --------------------------------------------------------------------------- launch/


def test_launch_scripts_parse_and_the_hostfile_is_valid() -> None:
    scripts = sorted((ROOT / "launch").glob("*.sh"))
    assert {p.name for p in scripts} >= {"run_8p.sh", "run_multihost.sh"}
    for script in scripts:
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                               check=False)
        assert check.returncode == 0, f"{script.name}: {check.stderr}"
        assert os.access(script, os.X_OK), f"{script.name} is not executable"
    assert parse_hostfile(ROOT / "launch" / "hostfile.example", "hydra") == (
        ("node-a", 8), ("node-b", 8))
    assert not (ROOT / "launch" / "__init__.py").exists()
