"""python -m simpar.checkpoint export: a checkpoint as MindSpore's safetensors files, read
back with the format's own reader (the safetensors package): per rank, each rank_{r} file
holding that rank's whole slice of every tensor (copies included), with the layouts in
strategy.json; merged, every tensor whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import simpar
from simpar import comm, nn
from simpar.checkpoint import export_merged, export_per_rank, safetensors_bytes, save_training
from simpar.checkpoint.cli import main
from tests.mpi_guard import shared_dir

safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    yield
    simpar.reset_auto_parallel_context()


def test_the_files_are_the_formats(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {f"t_{dtype}": (rng.standard_normal((3, 5)) * 9).astype(dtype)
               for dtype in ("float16", "float32", "float64", "int8", "int32", "int64", "uint8")}
    tensors["flag"], tensors["scalar"] = np.array([True, False]), np.array(2.5)
    path = tmp_path / "t.safetensors"
    path.write_bytes(safetensors_bytes(tensors, {"producer": "simpar"}))
    back = safetensors_numpy.load_file(str(path))
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)
    with pytest.raises(ValueError, match="tensor 'c' has dtype complex128, which the format"):
        safetensors_bytes({"c": np.zeros(2, complex)})


@pytest.mark.mpi(min_size=2)
def test_per_rank_and_merged_files_of_a_trained_cell(tmp_path: Path) -> None:
    n, rank = comm.get_group_size(), comm.get_rank()
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                     dataset_strategy=((2, 1), (2,)))
    net = nn.MLP(16, 32, 8)
    net.fc1.matmul.shard(((2, 1), (n // 2, 1)))             # a tensor cut, and replicas
    train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                                nn.Momentum(net.trainable_params(), 0.1, 0.9))
    rng = np.random.default_rng(0)
    train(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 8, 8).astype(np.int32))
    root = shared_dir(tmp_path)
    save_training(train, root / "ckpt")
    whole = train.global_parameters()
    if rank == 0:
        assert main(["export", str(root / "ckpt"), str(root / "ms")]) == 0
        assert main(["export", str(root / "ckpt"), str(root / "merged.safetensors")]) == 0
    comm.barrier()
    # Every rank reads its own file: its slice of every parameter, as it holds it.
    mine = safetensors_numpy.load_file(str(root / "ms" / f"rank_{rank}" /
                                           f"checkpoint_{rank}.safetensors"))
    for name, shard in train.params.items():
        np.testing.assert_array_equal(mine[name], shard)
        np.testing.assert_array_equal(mine[f"moments.{name}"],     # Momentum's, by its name
                                      train.optimizer.state[name]["v"])
    assert mine["fc1.weight"].shape == (32 // (n // 2), 16)
    layouts = json.loads((root / "ms" / "strategy.json").read_text())["parallel_layout_item"]
    item = layouts["fc1.weight"]
    assert np.prod(item["dev_matrix"]) == n and item["tensor_shape"] == [32, 16]
    merged = safetensors_numpy.load_file(str(root / "merged.safetensors"))
    for name, value in whole.items():
        np.testing.assert_array_equal(merged[name], value)


def test_export_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="out must end in '.safetensors'"):
        export_merged(tmp_path, tmp_path / "x.npz")
    (tmp_path / "exists").mkdir()
    with pytest.raises(ValueError, match="exists; export into a new directory"):
        export_per_rank(tmp_path, tmp_path / "exists")
