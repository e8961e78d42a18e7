#!/usr/bin/env python3
"""Set up simpar's virtual environment and run the main job or the test suite.

    python3 dev.py train [ARGS...]   # mpirun -n 8 python -m simpar.train ARGS
    python3 dev.py test              # the whole suite: 1 process, then mpirun -n 2, 4, 8
    python3 dev.py setup             # only create/refresh .venv

Only the Python standard library is used here, so this runs on a machine that has nothing
but Python 3.10+. The virtual environment lives in ./.venv (override with SIMPAR_VENV) and is
refreshed when pyproject.toml changes. Set SIMPAR_SYSTEM_MPI=1 to skip the bundled MPICH
wheel and build mpi4py against the MPI already on your PATH (a cluster's own MPI).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("SIMPAR_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"

# Each multi-rank run of the suite: number of ranks, and the pytest selection it runs.
MPI_RUNS = (2, 4, 8)


def _run(cmd: list[str], **kw: object) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], **kw)  # type: ignore[arg-type]


def setup() -> None:
    system_mpi = bool(os.environ.get("SIMPAR_SYSTEM_MPI"))
    extras = "test" if system_mpi else "test,mpich"
    pyproject = (ROOT / "pyproject.toml").read_text()
    want = hashlib.sha256((pyproject + extras).encode()).hexdigest()
    stamp = VENV / ".simpar-installed"
    if PY.exists() and stamp.exists() and stamp.read_text() == want:
        return
    if not PY.exists() and _run([sys.executable, "-m", "venv", VENV]) != 0:
        sys.exit("dev.py: could not create the virtual environment at " + str(VENV))
    pip = [PY, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if _run([*pip, "--upgrade", "pip"]) != 0:
        sys.exit("dev.py: pip install failed (see above)")
    if system_mpi:
        # The bundled MPI out (its mpirun would come first on the venv's PATH), and mpi4py
        # compiled from source against the MPI whose mpicc is on PATH (or $MPICC).
        if _run([PY, "-m", "pip", "show", "-q", "mpich"], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL) == 0:
            _run([PY, "-m", "pip", "uninstall", "-y", "-q", "mpich"])
        spec = re.search(r'"(mpi4py[^"]*)"', pyproject)
        if spec is None:
            sys.exit("dev.py: pyproject.toml does not list mpi4py")
        if _run([*pip, "--no-binary=mpi4py", "--force-reinstall", "--no-deps", spec[1]]) != 0:
            sys.exit("dev.py: building mpi4py against your MPI failed (see above); is mpicc "
                     "on PATH, or MPICC set?")
    if _run([*pip, "-e", f".[{extras}]"], cwd=ROOT) != 0:
        sys.exit("dev.py: pip install failed (see above)")
    stamp.write_text(want)


def _mpirun(env: dict[str, str]) -> str:
    """The venv's mpirun (the bundled MPICH), else the first one on PATH (SIMPAR_SYSTEM_MPI)."""
    found = shutil.which("mpirun", path=env["PATH"])
    if found is None:
        sys.exit("dev.py: no mpirun in the venv nor on PATH; run without SIMPAR_SYSTEM_MPI to "
                 "install the bundled MPICH, or put your MPI's bin directory on PATH")
    return found


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(VENV)
    env.pop("PYTHONHOME", None)
    return env


def train(args: list[str]) -> int:
    env = _env()
    return _run([_mpirun(env), "-n", "8", PY, "-m", "simpar.train", *args], env=env)


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
# pytest's closing line, with or without the "=====" frame of non-quiet mode.
_CLOSING = re.compile(r"^=*\s*(\d+ \w+(, )?)+.* in [\d.]+s.*$|^=*\s*no tests ran")


def _pytest(cmd: list[str], env: dict[str, str], totals: dict[str, int]) -> int:
    """Run one pytest invocation, echo it, and add its counts to ``totals``."""
    proc = subprocess.Popen([str(c) for c in cmd], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    print("+", " ".join(str(c) for c in cmd), flush=True)
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        if _CLOSING.match(line.strip()):
            last = line
    rc = proc.wait()
    for n, kind in _SUMMARY.findall(last):
        key = "errors" if kind.startswith("error") else kind
        totals[key] = totals.get(key, 0) + int(n)
    if rc == 5:
        print("dev.py: pytest collected no tests, which counts as a failure", flush=True)
    return rc


def test(args: list[str]) -> int:
    env = _env()
    totals: dict[str, int] = {}
    failed: list[str] = []
    if _pytest([PY, "-m", "pytest", "-q", "--with-mpi", *args], env, totals) != 0:
        failed.append("1 process")
    for n in MPI_RUNS:
        with tempfile.TemporaryDirectory(prefix=f"simpar-np{n}-") as logdir:
            env_n = dict(env, SIMPAR_TEST_LOGDIR=logdir)
            cmd = [_mpirun(env), "-n", str(n), PY, "-m", "pytest", "-q", "--with-mpi",
                   "-m", "mpi", *args]
            if _pytest(cmd, env_n, totals) != 0:
                failed.append(f"mpirun -n {n}")
                for log in sorted(Path(logdir).glob("rank*.log")):
                    text = log.read_text()
                    if "FAILED" in text or "Error" in text:
                        print(f"----- {log.name} (mpirun -n {n}) -----\n{text[-6000:]}")
    print("dev.py: runs that failed: " + (", ".join(failed) if failed else "none"))
    passed, nfail = totals.get("passed", 0), totals.get("failed", 0) + totals.get("errors", 0)
    line = f"{passed} passed, {nfail} failed"
    if totals.get("skipped"):
        line += f", {totals['skipped']} skipped"
    print(line, flush=True)
    return 1 if failed or passed == 0 else 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("setup", "train", "test"):
        print(__doc__)
        return 2
    setup()
    if argv[0] == "train":
        return train(argv[1:])
    if argv[0] == "test":
        return test(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
