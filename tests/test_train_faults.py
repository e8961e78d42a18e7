"""The main job run as a user runs it (``mpirun -n 2 python -m simpar.train`` in a
subprocess): an exception on one rank ends the whole job within seconds with that rank's
message; a NaN or Inf loss stops training and names the step; a job saved on 2 ranks resumes
on 4.

    python -m pytest tests/test_train_faults.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simpar import launch
from simpar.train import INJECT_FAILURE
from tests.mpi_guard import have_mpirun

ROOT = Path(__file__).resolve().parent.parent
GUARD_S = 120  # a hung job fails the test instead of the suite


pytestmark = pytest.mark.skipif(not have_mpirun(), reason="no usable mpirun")


def _job(args: list[str], extra_env: dict[str, str] | None = None, ranks: int = 2
         ) -> tuple[subprocess.CompletedProcess[str], float]:
    """``mpirun -n RANKS python -m simpar.train ARGS``; its result and wall seconds."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra_env or {})
    start = time.perf_counter()
    done = subprocess.run([launch.find_mpirun(), "-n", str(ranks), sys.executable, "-m",
                           "simpar.train",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=GUARD_S, check=False)
    return done, time.perf_counter() - start


SMALL = ["--model", "mlp", "--d-model", "8", "--hidden", "16", "--batch-size", "8", "--no-check",
         "--profile", "none"]


def test_an_exception_on_one_rank_ends_the_job_with_its_message() -> None:
    """Rank 1 raises before step 3 of 100 000 (hours of work): the abort hook ends every rank
    at once, so the job returns while rank 0 would still be training, with rank 1's message."""
    failed, seconds = _job([*SMALL, "--steps", "100000"], {INJECT_FAILURE: "1:3"})
    reference, base = _job([*SMALL, "--steps", "3"])  # start-up and three steps, no failure
    assert reference.returncode == 0, reference.stderr
    assert failed.returncode != 0
    assert "injected failure on rank 1 before step 3" in failed.stderr
    assert "[simpar rank 1] uncaught RuntimeError; aborting the job" in failed.stderr
    assert seconds < base + 10, (seconds, base)


def test_a_nonfinite_loss_stops_training_and_names_the_step() -> None:
    """SGD with a learning rate of 1e300 overflows the parameters after the first step."""
    diverging = [*SMALL, "--optimizer", "sgd", "--lr", "1e300", "--steps", "20"]
    stopped, _ = _job(diverging)
    assert stopped.returncode == 1
    assert "error: the loss is" in stopped.stderr and "at step 2; training stopped" in \
        stopped.stderr, stopped.stderr
    assert "step  20/20" not in stopped.stdout
    going_on, _ = _job([*diverging, "--no-stop-on-nonfinite"])
    assert going_on.returncode == 0, going_on.stderr
    assert "step  20/20" in going_on.stdout


def test_a_job_saved_on_two_ranks_resumes_on_four(tmp_path: Path) -> None:
    """Each of the 4 ranks reads only the saved blocks that overlap its own; the resumed job
    passes its single-device check from step 0 (the checkpoint keeps the first losses)."""
    ckpt = tmp_path / "ckpt"
    job = ["--model", "mlp", "--d-model", "8", "--hidden", "16", "--batch-size", "8",
           "--profile", "none", "--optimizer", "momentum"]
    saved, _ = _job([*job, "--steps", "2", "--save-every", "2", "--ckpt-dir", str(ckpt),
                     "--no-check"])
    assert saved.returncode == 0, saved.stderr
    resumed, _ = _job([*job, "--steps", "4", "--resume", str(ckpt)], ranks=4)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt / 'step_000002'} after step 2" in resumed.stdout
    assert "PASS" in resumed.stdout


def test_a_rank_failing_inside_a_pipeline_ends_the_job_with_its_message() -> None:
    """Two pipeline stages, rank 1 (stage 1) raising before step 3: rank 0 has sent its
    micro-batches forward and waits in a receive for their cotangents, which never come; the
    abort hook must end it too, within seconds, with rank 1's message."""
    pipelined = [*SMALL, "--pipeline-stages", "2", "--micro-batches", "2"]
    failed, seconds = _job([*pipelined, "--steps", "100000"], {INJECT_FAILURE: "1:3"})
    reference, base = _job([*pipelined, "--steps", "3"])
    assert reference.returncode == 0, reference.stderr
    assert failed.returncode != 0
    assert "injected failure on rank 1 before step 3" in failed.stderr
    assert "[simpar rank 1] uncaught RuntimeError; aborting the job" in failed.stderr
    assert seconds < base + 10, (seconds, base)
