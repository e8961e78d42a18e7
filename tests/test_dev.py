"""dev.py, the setup-and-run script behind the README's two commands (pure: no MPI)."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simpar_dev_script", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
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
