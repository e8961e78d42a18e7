"""python -m simpar.checkpoint export: a checkpoint as MindSpore's safetensors files, read
back with the format's own reader (the safetensors package): per rank, each rank_{r} file
holding that rank's whole slice of every tensor (copies included), with the layouts in
strategy.json; merged, every tensor whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import simpar
from simpar import comm, nn
from simpar.checkpoint import export_merged, export_per_rank, safetensors_bytes, save_training
from simpar.checkpoint.cli import main
from simpar.checkpoint.export import ckpt_bytes
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
    if rank == 0:
        assert main(["export", str(root / "ckpt"), str(root / "ms_ckpt"), "--format",
                     "ckpt"]) == 0
    comm.barrier()
    again = read_ckpt((root / "ms_ckpt" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
                       ).read_bytes())
    for name, shard in train.params.items():
        np.testing.assert_array_equal(again[name], shard)


def test_export_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="out must end in '.safetensors' or '.ckpt'"):
        export_merged(tmp_path, tmp_path / "x.npz")
    (tmp_path / "exists").mkdir()
    with pytest.raises(ValueError, match="exists; export into a new directory"):
        export_per_rank(tmp_path, tmp_path / "exists")


def _ckpt_class() -> Any:
    """MindSpore's checkpoint.proto messages (Checkpoint, its Value, TensorProto), built for
    the protobuf library, which then parses the files."""
    descriptor_pb2 = pytest.importorskip("google.protobuf.descriptor_pb2")
    from google.protobuf import descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="checkpoint.proto", syntax="proto2")
    tensor = proto.message_type.add(name="TensorProto")
    tensor.field.add(name="dims", number=1, type=field.TYPE_INT64, label=field.LABEL_REPEATED)
    tensor.field.add(name="tensor_type", number=2, type=field.TYPE_STRING,
                     label=field.LABEL_REQUIRED)
    tensor.field.add(name="tensor_content", number=3, type=field.TYPE_BYTES,
                     label=field.LABEL_REQUIRED)
    checkpoint = proto.message_type.add(name="Checkpoint")
    value = checkpoint.nested_type.add(name="Value")
    value.field.add(name="tag", number=1, type=field.TYPE_STRING, label=field.LABEL_REQUIRED)
    value.field.add(name="tensor", number=2, type=field.TYPE_MESSAGE,
                    label=field.LABEL_REQUIRED, type_name=".TensorProto")
    checkpoint.field.add(name="value", number=1, type=field.TYPE_MESSAGE,
                         label=field.LABEL_REPEATED, type_name=".Checkpoint.Value")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("Checkpoint"))


_NP = {"Float16": np.float16, "Float32": np.float32, "Float64": np.float64, "Int8": np.int8,
       "Int32": np.int32, "Int64": np.int64, "UInt8": np.uint8, "Bool": np.bool_}


def read_ckpt(data: bytes) -> dict[str, np.ndarray]:
    message = _ckpt_class()()
    message.ParseFromString(data)
    out = {}
    for value in message.value:
        dims = list(value.tensor.dims)
        array = np.frombuffer(value.tensor.tensor_content, _NP[value.tensor.tensor_type])
        out[value.tag] = array.reshape(()) if dims == [0] else array.reshape(dims)
    return out


def test_the_ckpt_is_mindsporess_protobuf() -> None:
    rng = np.random.default_rng(1)
    tensors = {"fc1.weight": rng.standard_normal((4, 3)).astype(np.float32),
               "moments.fc1.weight": rng.standard_normal((4, 3)),
               "global_step": np.array(7, np.int32), "mask": np.array([True, False])}
    back = read_ckpt(ckpt_bytes(tensors))
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)
