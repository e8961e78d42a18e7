"""The README's tour runs as written: every ```python block, in order, as one script under
``mpirun -n 8`` (what the README says), from the one-process run of the suite.

    python -m pytest tests/test_readme.py -q
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import simpar.comm as comm

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    """The README's ```python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_readme_has_a_tour() -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 4, "the tour lost snippets"
    assert any("check_against_single_device" in b for b in blocks)


@pytest.mark.slow
def test_every_readme_snippet_runs_under_mpirun_n_8(tmp_path: Path) -> None:
    if comm.get_group_size() != 1:
        pytest.skip("the one-process run starts its own mpirun -n 8")
    script = tmp_path / "tour.py"
    script.write_text("\n\n".join(python_blocks(README.read_text())))
    bindir = str(Path(sys.executable).parent)
    mpirun = shutil.which("mpirun", path=bindir + os.pathsep + os.environ.get("PATH", ""))
    assert mpirun is not None, "no mpirun next to this Python nor on PATH"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_", "HYDRA_", "OMPI_", "PMIX_"))}
    proc = subprocess.run([mpirun, "-n", "8", sys.executable, str(script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # Every rank printed the check's verdict, and it passed.
    assert out.count("check against one device (3 steps, every rank's shards)") == 8, out[-4000:]
    assert "FAIL" not in out and out.count(": PASS") == 8
    assert "AllToAll" in out  # the redistribution snippet's plan
