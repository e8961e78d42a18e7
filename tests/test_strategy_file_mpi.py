"""Strategy files in training (mpirun -n 2, 4, 8): ``strategy_ckpt_config={"save_file": ...}``
writes the searched plan as MindSpore's JSON strategy file, and ``{"load_file": ...}`` trains
from it without searching: the same program, bit-identical losses, and the single-device check
passes. A file for another device count or another network fails on every rank, naming what
differs.

    mpirun -n 4 python -m pytest tests/test_strategy_file_mpi.py -q
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn
from simpar.check import check_against_single_device
from simpar.dataset import random_classification
from tests.mpi_guard import abort_job_on_error, raised_everywhere, searched_context, shared_dir

pytestmark = pytest.mark.mpi(min_size=2)

SIZES, BATCH, STEPS = (16, 32, 8), 8, 3


@pytest.fixture(autouse=True)
def _context() -> Iterator[None]:
    with searched_context():
        yield


def _make(mode: str = "auto_parallel", hidden: int = SIZES[1]) -> nn.TrainOneStepCell:
    net = nn.MLP(SIZES[0], hidden, SIZES[2], n_hidden=1, dtype=np.float64)
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                               nn.SGD(net.trainable_params(), 0.1), parallel_mode=mode, seed=5)


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    return [random_classification(k, BATCH, SIZES[0], SIZES[2], 1, np.dtype(np.float64))
            for k in range(STEPS)]


def test_a_saved_plan_loads_and_trains_identically(tmp_path: Path) -> None:
    path = str(shared_dir(tmp_path) / "strategy.json")
    simpar.set_auto_parallel_context(strategy_ckpt_config={"save_file": path})
    searched = _make()
    with abort_job_on_error("training that saves its strategy file"):
        first = [searched(*b) for b in _batches()]
    comm.barrier()  # every rank has written (the same bytes)
    doc = json.loads(Path(path).read_text())
    assert doc["current_stage"] == 1 and doc["simpar"]["search_mode"] == "recursive_programming"
    assert set(doc["parallel_strategy_item"]) == set(searched.program.strategy_map.ops)

    simpar.set_auto_parallel_context(strategy_ckpt_config={"save_file": "", "load_file": path})
    loaded = _make()
    with abort_job_on_error("training from a strategy file"):
        again = [loaded(*b) for b in _batches()]
    assert again == first  # bit-identical: the same program from the same seed
    assert loaded.program is not None and searched.program is not None
    assert {str(s.chosen) for s in loaded.program.steps} == {"file"}
    rank = comm.get_rank()
    assert [str(s) for s in loaded.program.schedule(rank)] == \
        [str(s) for s in searched.program.schedule(rank)]
    with abort_job_on_error("single-device check of the loaded plan"):
        report = check_against_single_device(_make(), lambda: _make("stand_alone"),
                                             _batches())
    assert report.passed, str(report)


def test_a_file_for_another_job_fails_on_every_rank(tmp_path: Path) -> None:
    directory = shared_dir(tmp_path)
    path = str(directory / "strategy.json")
    simpar.set_auto_parallel_context(strategy_ckpt_config={"save_file": path})
    with abort_job_on_error("saving a strategy file"):
        _make().build(*_batches()[0])
    comm.barrier()
    # Another network: the hidden layer is wider, so fc1's weight and every shape differ.
    simpar.set_auto_parallel_context(strategy_ckpt_config={"save_file": "", "load_file": path})
    raised_everywhere(lambda: _make(hidden=64).build(*_batches()[0]), ValueError,
                       "in the file but")
    # Another device count: the same plan written for twice the ranks.
    doc = json.loads(Path(path).read_text())
    other = str(directory / "other.json")
    if comm.get_rank() == 0:
        doc["simpar"]["device_num"] = 2 * comm.get_group_size()
        Path(other).write_text(json.dumps(doc))
    comm.barrier()
    simpar.set_auto_parallel_context(strategy_ckpt_config={"load_file": other})
    raised_everywhere(lambda: _make().build(*_batches()[0]), ValueError, "device")
    # A file that is not JSON.
    broken = str(directory / "broken.json")
    if comm.get_rank() == 0:
        Path(broken).write_text("{\"current_stage\": 1, ")
    comm.barrier()
    simpar.set_auto_parallel_context(strategy_ckpt_config={"load_file": broken})
    raised_everywhere(lambda: _make().build(*_batches()[0]), ValueError, "broken.json")


def test_a_save_into_a_missing_directory_fails_on_every_rank(tmp_path: Path) -> None:
    missing = str(shared_dir(tmp_path) / "no" / "such" / "strategy.json")
    simpar.set_auto_parallel_context(strategy_ckpt_config={"save_file": missing})
    raised_everywhere(lambda: _make().build(*_batches()[0]), ValueError, "does not exist")
    assert not Path(missing).parent.exists()
