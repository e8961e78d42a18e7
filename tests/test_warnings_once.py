"""simpar's warnings in a multi-rank job: shown once, by rank 0, as one line without a line
of simpar's code (``simpar._env``); warnings that are not simpar's are left alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import warnings
import numpy as np
import simpar
from simpar import nn
simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
net = nn.Dense(4, 2, dtype=np.float64)
net.matmul.shard(((1, 1), (1, 1)))
net.bias_add.shard(((1, 1), (1,)))
train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.1))
train(np.ones((4, 4)), np.ones((4, 2)))
train.build(np.ones((4, 4)), np.ones((4, 2)))          # planned again: warned again, not shown
simpar.set_cost_model_context(costmodel_allreduce_fusion_times=3)
warnings.warn("not simpar's")                            # a user's own warning, on every rank
"""


def test_a_three_rank_job_says_each_warning_once(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    bindir = str(Path(sys.executable).parent)
    mpirun = shutil.which("mpirun", path=bindir + os.pathsep + os.environ.get("PATH", ""))
    assert mpirun is not None, "no mpirun next to this Python nor on PATH"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_", "HYDRA_", "OMPI_", "PMIX_"))}
    proc = subprocess.run([mpirun, "-n", "3", sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    nothing = [ln for ln in lines if "nothing is parallel" in ln]
    assert len(nothing) == 1 and nothing[0].startswith("simpar: NothingParallelWarning: ")
    assert len([ln for ln in lines if "NotHonouredWarning" in ln]) == 1
    assert not any("/simpar/" in ln for ln in lines), out   # no line of simpar's code
    assert sum("UserWarning: not simpar's" in ln for ln in lines) == 3   # left alone
