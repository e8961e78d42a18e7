#!/usr/bin/env python3
"""Set up simpar's virtual environment and run the main job or the test suite.

    python3 dev.py train [ARGS...]   # mpirun -n 8 python -m simpar.train ARGS
    python3 dev.py test              # the whole suite: 1 process, then mpirun -n 2, 4, 8
                                     # (the 1-process run's files spread over the cores;
                                     # SIMPAR_TEST_WORKERS=1 keeps them in one process)
    python3 dev.py setup             # only create/refresh .venv

Only the Python standard library is used here, so this runs on a machine that has nothing
but Python 3.10+. The virtual environment lives in ./.venv (override with SIMPAR_VENV) and is
refreshed when pyproject.toml changes. Set SIMPAR_SYSTEM_MPI=1 to skip the bundled MPICH
wheel and build mpi4py against the MPI already on your PATH (a cluster's own MPI).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
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
    """The venv's environment for the commands dev.py runs. Bytecode is cached (in the venv,
    not beside the sources) even where the environment says not to write it: the suite
    starts some 30 Python processes per run (8 ranks at once, and every job a test launches),
    and each would otherwise compile simpar and rewrite every test module's asserts again;
    on this 2-core host the 8-rank collection took 42.7 s that way."""
    env = dict(os.environ)
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(VENV)
    env.pop("PYTHONHOME", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", str(VENV / "pycache"))
    return env


def train(args: list[str]) -> int:
    env = _env()
    return _run([_mpirun(env), "-n", "8", PY, "-m", "simpar.train", *args], env=env)


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
# pytest's closing line, with or without the "=====" frame of non-quiet mode.
_CLOSING = re.compile(r"^=*\s*(\d+ \w+(, )?)+.* in [\d.]+s.*$|^=*\s*no tests ran")
# One outcome per test and rank, in the order pytest prints them.
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_BAD = ("failed", "error")
# Which outcome of one test wins across ranks and runs, for the distinct-test count.
_PRECEDENCE = {"skipped": 0, "xfailed": 1, "passed": 2, "xpassed": 3, "error": 4, "failed": 5}
_EXIT = {2: "was interrupted", 3: "hit an internal error", 4: "was given bad arguments"}


@dataclass
class RankResults:
    """One rank's outcomes, folded from its results-rank{r}.jsonl (see tests/conftest.py)."""

    rank: int
    outcomes: dict[str, str] = field(default_factory=dict)  # node id -> one of OUTCOMES
    present: bool = False  # it wrote a results file
    finished: bool = False  # its pytest session reached the end
    exitstatus: int | None = None
    died_in: list[str] = field(default_factory=list)  # tests it was inside when it ended

    @property
    def problem(self) -> str | None:
        """Why this rank failed beyond its tests' outcomes, if it did."""
        if not self.present:
            return "wrote no results (it died before pytest started)"
        if not self.finished:
            inside = f" inside {', '.join(self.died_in)}" if self.died_in else ""
            return f"ended{inside} before its pytest session finished (killed, or MPI abort)"
        status = self.exitstatus
        if status is not None and status in _EXIT:
            return f"pytest {_EXIT[status]} (exit status {status})"
        return None

    @property
    def uncounted_problem(self) -> bool:
        """A problem that no test's outcome counts already (dying inside a test is its error)."""
        return self.problem is not None and not self.died_in

    def count(self) -> Counter[str]:
        return Counter(self.outcomes.values())

    def bad(self) -> list[str]:
        return sorted(t for t, o in self.outcomes.items() if o in _BAD)


def _fold(records: list[dict[str, object]], rank: int) -> RankResults:
    """One outcome per test from its phase reports: failed if the test body failed, error if
    setup, teardown or collection failed (or the rank died inside the test), skipped if it was
    skipped, else passed; xfailed/xpassed for tests marked xfail."""
    result = RankResults(rank, present=True)
    out = result.outcomes
    running: set[str] = set()
    for rec in records:
        if rec.get("event") == "finish":
            result.finished = True
            status = rec.get("exitstatus")
            result.exitstatus = status if isinstance(status, int) else None
        if rec.get("event") != "report":
            continue
        node, when, outcome = str(rec.get("nodeid")), rec.get("when"), rec.get("outcome")
        xfail = bool(rec.get("xfail"))
        if outcome == "failed":
            out[node] = "failed" if when == "call" or out.get(node) == "failed" else "error"
        elif outcome == "skipped":
            out[node] = "xfailed" if xfail else "skipped"
        elif when == "call":
            out[node] = "xpassed" if xfail else "passed"
        if when == "setup":
            running.add(node)
        elif when == "teardown":
            running.discard(node)
    result.died_in = sorted(running)
    for node in running:
        out[node] = "error"
    return result


def _read_rank(path: Path, rank: int) -> RankResults:
    if not path.exists():
        return RankResults(rank)
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(rec, dict):
            records.append(rec)
    return _fold(records, rank)


@dataclass
class RunResults:
    """One pytest invocation: the 1-process run, or one mpirun with every rank's results."""

    label: str
    rc: int
    ranks: list[RankResults]
    closing: Counter[str] = field(default_factory=Counter)  # rank 0's closing line

    @property
    def has_results(self) -> bool:
        return any(r.present for r in self.ranks)

    @property
    def failed(self) -> bool:
        return self.rc != 0 or (self.has_results and any(r.problem or r.bad() for r in self.ranks))

    def count(self) -> Counter[str]:
        """Outcomes summed over ranks (a rank that died outside any test adds one failure);
        rank 0's closing line when no rank wrote results (tests/conftest.py not loaded)."""
        if not self.has_results:
            return Counter(self.closing)
        total: Counter[str] = Counter()
        for r in self.ranks:
            total.update(r.count())
            if r.uncounted_problem:
                total["failed"] += 1
        return total


def read_run(directory: Path, label: str, rc: int, size: int,
             closing: Counter[str] | None = None) -> RunResults:
    """Every rank's results in ``directory``: ranks 0..size-1, and any other rank found there."""
    found = {int(m[1]) for p in directory.glob("results-rank*.jsonl")
             if (m := re.fullmatch(r"results-rank(\d+)\.jsonl", p.name))}
    ranks = sorted(found | set(range(size)))
    return RunResults(label, rc, [_read_rank(directory / f"results-rank{r}.jsonl", r)
                                  for r in ranks], Counter(closing or {}))


def _counts_text(count: Counter[str]) -> str:
    parts = [f"{count[k]} {k}" for k in OUTCOMES if count[k]]
    return ", ".join(parts) or "no tests ran"


def _ranks_text(ranks: list[int]) -> str:
    """[0, 2, 3, 4] -> "ranks 0,2-4"."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _rank_text(r: RankResults, most: int = 5) -> str:
    if not r.present:
        return str(r.problem)
    text = _counts_text(r.count())
    bad = r.bad()
    if bad:
        more = f", and {len(bad) - most} more" if len(bad) > most else ""
        text += " (" + ", ".join(bad[:most]) + more + ")"
    if r.problem:
        text += "; " + r.problem
    return text


def run_text(run: RunResults) -> str:
    """One line per run; ranks with the same report are grouped, e.g.
    "mpirun -n 4: ranks 0,2-3: 5 passed; rank 1: 4 passed, 1 failed (tests/t.py::test_a)"."""
    if not run.has_results:
        return (f"{run.label}: no results files (was tests/conftest.py loaded?); rank 0's "
                f"closing line: {_counts_text(run.closing)}")
    groups: dict[str, list[int]] = {}
    for r in run.ranks:
        groups.setdefault(_rank_text(r), []).append(r.rank)
    if len(run.ranks) == 1:
        return f"{run.label}: {next(iter(groups))}"
    return f"{run.label}: " + "; ".join(f"{_ranks_text(ranks)}: {text}"
                                        for text, ranks in groups.items())


def _place(run: RunResults, ranks: list[int]) -> str:
    """"mpirun -n 8 ranks 0-7", or "the 1 process run" for a run of one rank."""
    return f"{run.label} {_ranks_text(ranks)}" if len(run.ranks) > 1 else f"the {run.label} run"


def report(runs: list[RunResults]) -> tuple[list[str], bool]:
    """The closing lines of ``dev.py test`` and whether the suite passed: per-run totals over
    every rank of every run, then distinct tests (a test counts as failed if it failed on any
    rank of any run), then where each failure happened."""
    total: Counter[str] = Counter()
    for run in runs:
        total.update(run.count())
    # failed node id -> "failed"/"error" -> run -> ranks
    where: dict[str, dict[str, dict[str, list[int]]]] = {}
    dead: list[str] = []  # ranks with a problem
    status: dict[str, str] = {}
    for run in runs:
        for r in run.ranks if run.has_results else []:
            if r.problem:
                dead.append(f"  {_place(run, [r.rank])}: {r.problem}")
            for node, outcome in r.outcomes.items():
                if outcome in _BAD:
                    runs_of = where.setdefault(node, {}).setdefault(outcome, {})
                    runs_of.setdefault(run.label, []).append(r.rank)
                old = status.get(node)
                if old is None or _PRECEDENCE[outcome] > _PRECEDENCE[old]:
                    status[node] = outcome
    distinct = Counter("failed" if o in _BAD else o for o in status.values())
    failed_runs = [run.label for run in runs if run.failed]

    def totals(count: Counter[str]) -> str:
        extra = "".join(f", {count[k]} {k}" for k in ("xfailed", "xpassed") if count[k])
        return (f"{count['passed']} passed, {count['failed'] + count['error']} failed, "
                f"{count['skipped']} skipped{extra}")

    lines = ["dev.py: runs that failed: " + (", ".join(failed_runs) or "none"),
             f"test runs (every rank of every run): {totals(total)}",
             f"distinct tests: {totals(distinct)} (a test counts as failed if it failed on "
             f"any rank of any run)"]
    blind = [run.label for run in runs if not run.has_results]
    if blind:
        lines.append("distinct tests leave out runs without results files: " + ", ".join(blind))
    if where:
        lines.append("distinct failed tests:")
        by_label = {run.label: run for run in runs}
        for node, kinds in sorted(where.items()):
            lines.append(f"  {node}: " + "; ".join(
                f"{kind} on " + ", ".join(_place(by_label[label], ranks)
                                          for label, ranks in places.items())
                for kind, places in kinds.items()))
    if dead:
        lines += ["ranks that failed outside their tests' outcomes:", *dead]
    return lines, not failed_runs and total["passed"] > 0


def _pytest(label: str, cmd: list[str], env: dict[str, str], size: int) -> RunResults:
    """Run one pytest invocation (``size`` ranks) with a fresh results directory, echo rank
    0's console, print the ranks' outcomes, and return them."""
    with tempfile.TemporaryDirectory(prefix="simpar-results-") as results:
        env = dict(env, SIMPAR_TEST_RESULTS=results)
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
        closing: Counter[str] = Counter()
        for n, kind in _SUMMARY.findall(last):
            closing["error" if kind.startswith("error") else kind] += int(n)
        run = read_run(Path(results), label, rc, size, closing)
    if rc == 5:
        print("dev.py: pytest collected no tests, which counts as a failure", flush=True)
    print("dev.py: " + run_text(run), flush=True)
    return run


def _print_rank_logs(run: RunResults, logdir: Path) -> None:
    """The console shows rank 0 only: print the log of every other rank that failed."""
    for r in run.ranks:
        log = logdir / f"rank{r.rank}.log"
        if r.rank == 0 or not log.exists():
            continue
        text = log.read_text(errors="replace")
        if (r.problem or r.bad()) if run.has_results else ("FAILED" in text or "Error" in text):
            print(f"----- {log.name} ({run.label}) -----\n{text[-6000:]}")


def _browser() -> None:
    """The report's test opens it in headless Chromium: install Debian's package where it is
    missing and this may (root, apt-get). Best effort: without it that test is skipped and
    says why."""
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        return
    if not shutil.which("apt-get") or os.geteuid() != 0:
        print("dev.py: no chromium, and no apt-get as root to install it: the report's "
              "browser test will be skipped", flush=True)
        return
    print("dev.py: installing Debian's chromium for the report's browser test", flush=True)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
    if subprocess.call(["apt-get", "install", "-y", "-q", "chromium"], **quiet) != 0:
        subprocess.call(["apt-get", "update", "-q"], **quiet)
        if subprocess.call(["apt-get", "install", "-y", "-q", "chromium"], **quiet) != 0:
            print("dev.py: apt-get could not install chromium: the report's browser test "
                  "will be skipped", flush=True)


def _workers() -> int:
    """pytest-xdist workers for the 1-process run: one per usable core (at most 8), each
    running whole test files (so a file's cached plans are made once); SIMPAR_TEST_WORKERS
    overrides, 0 or 1 running the files in this one process (for --pdb, say)."""
    override = os.environ.get("SIMPAR_TEST_WORKERS", "")
    if override:
        if not override.isdigit():
            sys.exit(f"dev.py: SIMPAR_TEST_WORKERS must be a whole number, got {override!r}")
        return int(override)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def test(args: list[str]) -> int:
    _browser()
    env = _env()
    workers = _workers()
    spread = ["--numprocesses", str(workers), "--dist", "loadfile"] if workers > 1 else []
    runs = [_pytest("1 process", [PY, "-m", "pytest", "-q", "--with-mpi", *spread, *args],
                    env, 1)]
    for n in MPI_RUNS:
        with tempfile.TemporaryDirectory(prefix=f"simpar-np{n}-") as logdir:
            cmd = [_mpirun(env), "-n", str(n), PY, "-m", "pytest", "-q", "--with-mpi",
                   "-m", "mpi", *args]
            run = _pytest(f"mpirun -n {n}", cmd, dict(env, SIMPAR_TEST_LOGDIR=logdir), n)
            runs.append(run)
            if run.failed:
                _print_rank_logs(run, Path(logdir))
    lines, ok = report(runs)
    print("\n".join(lines), flush=True)
    return 0 if ok else 1


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
