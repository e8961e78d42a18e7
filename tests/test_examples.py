"""examples/: MindSpore-style scripts (``import simpar.mindspore as ms`` their only simpar
line) on 8 ranks. Each trains with ``Model`` on per-device batches, prints the strategies
MindSpore's documentation gives for its network, and trains like one device: the losses and
every rank's parameter shards against a stand-alone run on the assembled global batches."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import simpar
import simpar.mindspore as ms
from simpar import comm, nn
from simpar.check import check_against_single_device
from tests.mpi_guard import shared_dir
from tests.recording import Record

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(shared_dir(tmp_path))   # the strategy file goes there, on every rank
    yield
    simpar.reset_auto_parallel_context()
    ms.set_seed(0)


def _strategies(out: str) -> dict[str, list[list[int]]]:
    """{op: strategy} of the lines the example printed (rank 0)."""
    found = re.findall(r"^(\w+-op\d+): (\[.*\])$", out, flags=re.M)
    return {op: eval(text) for op, text in found}   # noqa: S307 (lists of ints it printed)


def _check(example: ModuleType, model: Any, record: Record, epochs: int) -> None:
    """Model's run against one device: each rank's own batches, assembled by the check."""
    n, rank = comm.get_group_size(), comm.get_rank()
    dataset = example.create_dataset(example.BATCH_PER_DEVICE, n, rank)
    batches = [batch for e in range(epochs) for batch in dataset.epoch(e)]
    assert len(batches) == len(record.losses) == model.train_network.step_count

    def reference() -> nn.TrainOneStepCell:
        net = example.Network() if hasattr(example, "Network") else example.FFN()
        params = net.trainable_params()
        loss = ms.nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        return nn.TrainOneStepCell(nn.WithLossCell(net, loss),
                                   ms.nn.Momentum(params, learning_rate=0.05, momentum=0.9))

    report = check_against_single_device(model.train_network, reference, batches,
                                         losses=record.losses)
    assert report.passed, report.summary()


@pytest.mark.mpi(min_size=8)
def test_operator_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    example, record = _load("operator_parallel"), Record()
    model = example.main(epochs=2, callbacks=[record])
    out = capsys.readouterr().out
    if comm.get_rank() == 0:
        got = _strategies(out)
        assert got["MatMul-op0"] == [[2, 4], [4, 1]] and got["ReLU-op1"] == [[4, 1]]
        assert got["MatMul-op2"] == [[1, 8], [8, 1]] and got["ReLU-op3"] == [[8, 1]]
        assert got["MatMul-op4"] == [[8, 1], [1, 1]]   # not set: data parallel, as MindSpore
        assert re.search(r"^epoch: 2 step: 16, loss is ", out, flags=re.M)
    # Each rank fed its own 4 rows of a 32-row batch: the program's input is cut 8 ways.
    assert model.train_network.per_device
    assert [lay.local_shape() for lay in model.train_network.batch_layouts()] == [(4, 64), (4,)]
    _check(example, model, record, 2)


@pytest.mark.mpi(min_size=8)
def test_sharding_propagation(capsys: pytest.CaptureFixture[str]) -> None:
    example, record = _load("sharding_propagation"), Record()
    model = example.main(epochs=1, callbacks=[record])
    out = capsys.readouterr().out
    if comm.get_rank() == 0:
        got = _strategies(out)
        # The one strategy given, and what propagates from it without moving a byte.
        assert got["MatMul-op0"] == [[2, 1], [1, 4]]
        assert got["Add-op1"] == [[2, 4], [4]] and got["ReLU-op2"] == [[2, 4]]
        assert got["MatMul-op3"] == [[2, 4], [4, 1]]
    _check(example, model, record, 1)


@pytest.mark.mpi(min_size=8)
def test_recursive_programming(capsys: pytest.CaptureFixture[str]) -> None:
    example, record = _load("recursive_programming"), Record()
    model = example.main(epochs=1, callbacks=[record])
    out = capsys.readouterr().out
    if comm.get_rank() == 0:
        got = _strategies(out)
        # The batch of 32 rows is cut over all 8 devices where the weight is small, and the
        # 512 x 512 layer's weight is cut 4 ways by its output rows.
        assert got["MatMul-op0"] == [[8, 1], [1, 1]]
        assert got["MatMul-op3"] == [[2, 1], [4, 1]]
        assert len(got) == 9
    _check(example, model, record, 1)


def test_the_examples_change_one_line_to_run_under_mindspore() -> None:
    """The only line that names simpar is the import of simpar.mindspore as ms."""
    paths = sorted(EXAMPLES.glob("*.py"))
    assert len(paths) >= 3
    for path in paths:
        lines = [line for line in path.read_text().splitlines() if "simpar" in line]
        assert lines == ["import simpar.mindspore as ms  # under MindSpore: import mindspore "
                         "as ms"], (path.name, lines)
