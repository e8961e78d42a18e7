"""The code's own checks, run by the suite so that CI enforces them: ruff (style, imports,
pyflakes) over the repository and mypy over simpar/ (settings in ruff.toml and setup.cfg)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, check=False, timeout=600)


def test_ruff_finds_nothing() -> None:
    done = _run("ruff", "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing() -> None:
    done = _run("mypy", "--no-incremental")  # files and options: setup.cfg [mypy]
    assert done.returncode == 0, done.stdout + done.stderr
