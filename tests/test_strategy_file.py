"""Strategy files, in one process: a searched StrategyMap saved as MindSpore's JSON strategy
file and loaded back against its graph; a plain MindSpore file loads too; a failed save leaves
the old file; bad files, and files for another graph or device count, are refused with errors
that say what differs.

    python -m pytest tests/test_strategy_file.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpar import graph, nn, ops, parallel
from simpar.layout import TensorLayout, block_key
from simpar.runtime import lower
from simpar.search import OpStrategy, Source, StrategyMap
from simpar.strategy_file import FORMAT_VERSION, graph_fingerprint, load_strategy, save_strategy

DEVICES = 4
MLP_SPECS = [((8, 16), np.float32)]
FC1 = "Default/network-MLP/fc1-Dense/MatMul-op0"
# What MindSpore writes per parameter (StrategyCheckpointInfo::to_json) and its readers need.
MINDSPORE_LAYOUT_KEYS = {"dev_matrix", "tensor_map", "tensor_shape", "param_split_shape",
                         "indices_offset", "field", "opt_weight_shard_step",
                         "opt_weight_shard_size"}


@dataclasses.dataclass(frozen=True)
class Case:
    """A traced graph and the map searched for it on DEVICES devices."""

    graph: graph.Graph
    smap: StrategyMap


def _searched(cell: nn.Cell, specs: list[tuple[tuple[int, ...], Any]]) -> Case:
    smap = parallel.search_strategies(cell, specs, DEVICES, "dynamic_programming",
                                      dataset_strategy="data_parallel")
    return Case(graph.trace(cell, specs), smap)


@pytest.fixture(scope="module")
def mlp() -> Case:
    return _searched(nn.MLP(16, 32, 8, n_hidden=1), MLP_SPECS)


@pytest.fixture(scope="module")
def gpt() -> Case:
    return _searched(nn.GPT(vocab_size=32, seq_length=8, d_model=16, n_layers=1, n_heads=4),
                     [((8, 8), np.int32)])


def _from_file(smap: StrategyMap) -> StrategyMap:
    """``smap`` as loading its file gives it back: every op's source is the file."""
    ops_ = {name: dataclasses.replace(s, source=Source.FILE) for name, s in smap.ops.items()}
    return StrategyMap(smap.device_num, smap.mode, ops_, smap.params, smap.inputs)


def _saved(tmp_path: Path, case: Case) -> Path:
    path = tmp_path / "strategy.json"
    save_strategy(path, case.smap, case.graph, search_mode="dynamic_programming",
                  cost_model="cpu-local")
    return path


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_searched_map_round_trips(name: str, request: pytest.FixtureRequest,
                                    tmp_path: Path) -> None:
    case: Case = request.getfixturevalue(name)
    path = _saved(tmp_path, case)
    back = load_strategy(path, case.graph, DEVICES)
    assert back == _from_file(case.smap)
    assert back.count(Source.FILE) == len(case.graph.nodes) and back.inputs
    assert load_strategy(str(path)) == back  # no graph: types and shapes come from the file
    assert lower(case.graph, back).strategies() == lower(case.graph, case.smap).strategies()
    own = json.loads(path.read_text())["simpar"]
    assert own["version"] == FORMAT_VERSION and own["device_num"] == DEVICES
    assert (own["mode"], own["search_mode"], own["cost_model"]) == (
        "auto_parallel", "dynamic_programming", "cpu-local")
    assert own["graph_fingerprint"] == graph_fingerprint(case.graph)


def test_the_file_has_mindspore_keys_and_tensor_map(tmp_path: Path, mlp: Case) -> None:
    # DESIGN.md: MatMul().shard(((2, 1), (1, 4))) lays B out on [2, 1, 4] with map [1, 0].
    w = TensorLayout((2, 1, 4), (1, 0), (16, 32))
    assert ops.MatMul().sharding([(8, 16), (16, 32)], 8, ((2, 1), (1, 4))).in_layouts[1] == w
    key = "Default/network-Net/MatMul-op0"
    smap = StrategyMap(8, "semi_auto_parallel",
                       {key: OpStrategy("MatMul", ((2, 1), (1, 4)))}, {"w": w})
    path = tmp_path / "s.json"
    save_strategy(path, smap)
    doc = json.loads(path.read_text())
    assert set(doc) == {"current_stage", "parallel_strategy_item", "parallel_layout_item",
                        "simpar"}
    assert doc["current_stage"] == 1
    assert doc["parallel_strategy_item"] == {key: {"stage": 0,
                                                   "parallel_strategy": [[2, 1], [1, 4]]}}
    assert doc["parallel_layout_item"] == {"w": {
        "dev_matrix": [2, 1, 4], "tensor_map": [1, 0], "tensor_shape": [16, 32],
        "param_split_shape": [], "indices_offset": [], "field": 0, "opt_weight_shard_step": 0,
        "opt_weight_shard_size": 0}}
    back = load_strategy(path, mode="semi_auto_parallel")
    assert back == _from_file(smap)
    assert back.params["w"].slice_of(5) == ((0, 16), (8, 16))  # rank 5: columns 8..15
    # A searched map's file: the same keys on every item, with int values throughout (the
    # protobuf fields MindSpore's Python reader fills).
    save_strategy(path, mlp.smap, mlp.graph)
    doc = json.loads(path.read_text())
    for item in doc["parallel_strategy_item"].values():
        assert set(item) == {"stage", "parallel_strategy"}
        assert all(type(c) is int for cuts in item["parallel_strategy"] for c in cuts)
    assert set(doc["parallel_layout_item"]) == {v.name for v in mlp.graph.params}
    for item in doc["parallel_layout_item"].values():
        assert set(item) == MINDSPORE_LAYOUT_KEYS
        assert all(type(v) is int for v in item["dev_matrix"] + item["tensor_map"])
        assert all(type(item[k]) is int for k in ("field", "opt_weight_shard_step",
                                                  "opt_weight_shard_size"))


def test_out_strategies_go_under_mindspore_out_item(tmp_path: Path) -> None:
    dense = nn.Dense(16, 8, has_bias=False)
    g = graph.trace(dense, [((8, 16), np.float32)], ["x"])
    key = g.nodes[0].name
    smap = StrategyMap(8, "semi_auto_parallel",
                       {key: OpStrategy("MatMul", ((2, 4), (1, 4)), ((8, 1),))})
    path = tmp_path / "s.json"
    save_strategy(path, smap, g)
    doc = json.loads(path.read_text())
    assert doc["parallel_out_strategy_item"] == {key: {"stage": 0, "parallel_strategy": [[8, 1]]}}
    assert load_strategy(path, g, 8, mode="semi_auto_parallel") == _from_file(smap)


def test_a_split_over_consecutive_axes_is_written_as_one_axis(tmp_path: Path) -> None:
    """MindSpore's tensor_map holds one int per dimension: axes (2, 2) splitting dimension 0
    become one axis of 4, which gives every rank the same block."""
    lay = TensorLayout.from_dim_axes((2, 2, 2), [(0, 1), ()], (8, 4))
    path = tmp_path / "s.json"
    save_strategy(path, StrategyMap(8, "auto_parallel", {}, {"w": lay}))
    item = json.loads(path.read_text())["parallel_layout_item"]["w"]
    assert (item["dev_matrix"], item["tensor_map"]) == ([4, 2], [1, -1])
    back = load_strategy(path).params["w"]
    assert block_key(back) == block_key(lay)
    assert all(back.slice_of(r) == lay.slice_of(r) for r in range(8))
    apart = TensorLayout.from_dim_axes((2, 2, 2), [(0, 2), ()], (8, 4))
    with pytest.raises(ValueError, match=r"parameter 'w' .* device axes \[0, 2\] that are not "
                                         "consecutive"):
        save_strategy(path, StrategyMap(8, "auto_parallel", {}, {"w": apart}))


def test_a_plain_mindspore_file_loads(tmp_path: Path, mlp: Case) -> None:
    """No simpar key: op types from the graph, device_num from the layouts, no input layouts;
    the optimizer's weight sharding does not change the layout the forward reads."""
    cuts = {"MatMul": [[4, 1], [1, 1]], "BiasAdd": [[4, 1], [1]], "ReLU": [[4, 1]]}

    def item(dev_matrix: list[int], tensor_map: list[int], shard: int = 0) -> dict[str, Any]:
        return {"dev_matrix": dev_matrix, "tensor_map": tensor_map, "param_split_shape": [],
                "indices_offset": [], "field": 0, "opt_weight_shard_step": shard and 1,
                "opt_weight_shard_size": shard}

    doc = {"current_stage": 1,
           "parallel_strategy_item": {n.name: {"stage": 0, "parallel_strategy": cuts[n.op.name]}
                                      for n in mlp.graph.nodes},
           "parallel_layout_item": {"fc1.weight": item([4, 1, 1], [1, 0], shard=4),
                                    "fc1.bias": item([4, 1], [0]),
                                    "fc2.weight": item([4, 1, 1], [1, 0]),
                                    "fc2.bias": item([4, 1], [0])}}
    path = tmp_path / "mindspore.json"
    path.write_text(json.dumps(doc))
    smap = load_strategy(path, mlp.graph)
    assert (smap.device_num, smap.mode, dict(smap.inputs)) == (DEVICES, "auto_parallel", {})
    assert smap.ops[FC1] == OpStrategy("MatMul", ((4, 1), (1, 1)), source=Source.FILE)
    assert smap.params["fc1.weight"] == TensorLayout((4, 1, 1), (1, 0), (32, 16))
    assert lower(mlp.graph, smap).strategies()[FC1] == [[4, 1], [1, 1]]
    assert load_strategy(path, mlp.graph, mode="semi_auto_parallel").mode == "semi_auto_parallel"
    with pytest.raises(ValueError, match="parameter 'fc1.weight' has no tensor_shape; pass "
                                         "graph="):
        load_strategy(path)
    doc["parallel_layout_item"] = {}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="records no device count .* pass device_num="):
        load_strategy(path, mlp.graph)
    assert load_strategy(path, mlp.graph, DEVICES).ops[FC1].in_strategy == ((4, 1), (1, 1))


def test_only_trainable_parameters_get_a_layout(tmp_path: Path, mlp: Case) -> None:
    cell = nn.MLP(16, 32, 8, n_hidden=1)
    cell.name_parameters()
    frozen = next(p for name, p in cell.parameters_and_names() if name == "fc2.bias")
    frozen.requires_grad = False
    g = graph.trace(cell, MLP_SPECS)
    path = tmp_path / "s.json"
    save_strategy(path, mlp.smap, g)
    assert "fc2.bias" not in json.loads(path.read_text())["parallel_layout_item"]
    assert "fc2.bias" not in load_strategy(path, g).params
    save_strategy(path, mlp.smap, g, only_trainable_params=False)
    assert load_strategy(path, g).params == mlp.smap.params


def test_the_fingerprint_is_stable_and_follows_shapes(mlp: Case) -> None:
    again = graph.trace(nn.MLP(16, 32, 8, n_hidden=1), MLP_SPECS)
    assert graph_fingerprint(again) == graph_fingerprint(mlp.graph)
    assert re.fullmatch("[0-9a-f]{64}", graph_fingerprint(again))
    wider = graph.trace(nn.MLP(16, 64, 8, n_hidden=1), MLP_SPECS)
    assert graph_fingerprint(wider) != graph_fingerprint(mlp.graph)
    with pytest.raises(TypeError, match="graph must be a simpar.graph.Graph, got dict"):
        graph_fingerprint({})  # type: ignore[arg-type]


# ------------------------------------------------------------------ atomic saves
@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_save_leaves_the_old_file(failing: str, tmp_path: Path, mlp: Case,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = _saved(tmp_path, mlp)
    old = path.read_bytes()

    def fail(*args: object) -> None:
        raise OSError(f"{failing} failed: no space left on device")

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match="no space left"):  # new content: another search_mode
        save_strategy(path, mlp.smap, mlp.graph, search_mode="exact")
    with pytest.raises(OSError, match="no space left"):
        save_strategy(tmp_path / "new.json", mlp.smap, mlp.graph)
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["strategy.json"]  # no temporary file, no new.json


def test_a_map_that_cannot_be_written_creates_nothing(tmp_path: Path) -> None:
    lay = TensorLayout((2, 4), (-1, 0), (8, 8), partial=(1,))
    with pytest.raises(ValueError, match=r"parameter 'w' .* pending sums \(partial \[1\]\)"):
        save_strategy(tmp_path / "s.json", StrategyMap(8, "auto_parallel", {}, {"w": lay}))
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ bad files
_DELETE = object()


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of a saved file's JSON: set (or with ``_DELETE`` remove) the key at ``path``."""
    def edit(doc: dict[str, Any]) -> None:
        for key in path[:-1]:
            doc = doc[key]
        if value is _DELETE:
            del doc[path[-1]]
        else:
            doc[path[-1]] = value
    return edit


_STRATEGY = ("parallel_strategy_item", FC1, "parallel_strategy")
_W1 = ("parallel_layout_item", "fc1.weight")


@pytest.mark.parametrize(("edit", "error", "words"), [
    (_set(("parallel_strategy_item",), []), TypeError,
     "['parallel_strategy_item'] must be an object {op name: "),
    (_set(_STRATEGY, [["4", "1"], [1, 1]]), TypeError,
     f"['parallel_strategy_item']['{FC1}']['parallel_strategy'] must be a list of lists of ints "
     ">= 1 (one list of cuts per op input), got a list"),
    (_set(_STRATEGY, [[4, 0], [1, 1]]), ValueError, "got [4, 0] (holds 0)"),
    (_set(("parallel_strategy_item", FC1, "stage"), _DELETE), ValueError,
     f"['parallel_strategy_item']['{FC1}'] has no 'stage'"),
    (_set(("parallel_strategy_item", FC1, "stage"), 1), ValueError,
     "is for pipeline stage 1: the file is a pipelined plan's; load it with pipeline_stages"),
    (_set(("parallel_strategy_item", FC1), _DELETE), ValueError,
     f"parallel_strategy_item has no strategy for op '{FC1}' (1 of the graph's 5 ops are "
     "missing)"),
    (_set(("parallel_strategy_item", "Default/network-MLP/fc3-Dense/MatMul-op9"),
          {"stage": 0, "parallel_strategy": [[1, 1], [1, 1]]}), ValueError,
     "names op 'Default/network-MLP/fc3-Dense/MatMul-op9', which the graph does not have "
     "(closest: "),
    (_set(_STRATEGY, [[3, 1], [1, 1]]), ValueError,
     f"op '{FC1}': strategy [[3, 1], [1, 1]] does not fit input shapes [[8, 16], [32, 16]] on "
     "4 devices"),
    (_set(("simpar", "op_types", FC1), "BatchMatMul"), ValueError,
     f"op '{FC1}' is a MatMul in the graph, but the file holds a BatchMatMul strategy"),
    (_set((*_W1, "tensor_shape"), [16, 32]), ValueError,
     "parameter 'fc1.weight' has tensor_shape [16, 32] in the file but shape [32, 16] in the "
     "graph"),
    (_set((*_W1, "tensor_map"), [0]), ValueError,
     "parameter 'fc1.weight': dev_matrix"),
    (_set((*_W1, "dev_matrix"), [2, 1]), ValueError,
     "['parallel_layout_item']['fc1.weight'] has dev_matrix [2, 1] of 2 devices, but the "
     "strategy is for 4 devices (from argument device_num)"),
    (_set(("parallel_layout_item", "fc9.weight"), {"dev_matrix": [4], "tensor_map": [-1]}),
     ValueError, "parameter 'fc9.weight' is not a parameter of the graph (closest: "),
    (_set((*_W1, "field"), 2), ValueError, "has field 2 (a field-split embedding)"),
    (_set((*_W1, "param_split_shape"), [8, 24]), ValueError,
     "has param_split_shape [8, 24] (an uneven manual split)"),
    (_set(("simpar",), []), TypeError, "['simpar'] must be an object of simpar's keys"),
    (_set(("simpar", "version"), FORMAT_VERSION + 1), ValueError,
     f"was written by a newer simpar (format version {FORMAT_VERSION + 1})"),
    (_set(("simpar", "mode"), "hybrid"), ValueError,
     "['simpar']['mode'] must be one of ['stand_alone', "),
    (_set(("simpar", "inputs", "input0", "shape"), [16, 16]), ValueError,
     "['simpar']['inputs']['input0'] is for shape [16, 16], but the graph's input has shape "
     "[8, 16]"),
])
def test_a_bad_file_is_refused_saying_where(edit: Callable[[dict[str, Any]], None],
                                            error: type[Exception], words: str,
                                            tmp_path: Path, mlp: Case) -> None:
    path = _saved(tmp_path, mlp)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(error, match=re.escape(words)) as raised:
        load_strategy(path, mlp.graph, DEVICES)
    assert str(path) in str(raised.value)


@pytest.mark.parametrize(("content", "error", "words"), [
    (b'{"current_stage": 1, "parallel_strategy_item": {', ValueError,  # cut short
     "is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 49"),
    (b"\x0a\x12\xff\xfe\x08\x01", ValueError,
     "is not a JSON strategy file: byte 2 is not UTF-8 text (a protobuf strategy file? simpar "
     "reads JSON only)"),
    (b'{"current_stage": 1, "current_stage": 1}', ValueError, "the key 'current_stage' appears "
     "twice"),
    (b"[]", TypeError, "must hold a JSON object with 'parallel_strategy_item', got a list"),
    (b"", ValueError, "is empty"),
])
def test_a_file_that_is_not_a_json_object_is_refused(content: bytes,
                                                     error: type[Exception], words: str,
                                                     tmp_path: Path, mlp: Case) -> None:
    path = tmp_path / "strategy.json"
    path.write_bytes(content)
    with pytest.raises(error, match=re.escape(words)):
        load_strategy(path, mlp.graph)


def test_a_file_for_another_graph_says_which_op_differs(tmp_path: Path, mlp: Case) -> None:
    path = _saved(tmp_path, mlp)
    cell = nn.MLP(16, 32, 8, n_hidden=1)
    bigger = graph.trace(cell, [((16, 16), np.float32)])
    with pytest.raises(ValueError, match=re.escape(
            f"was written for another graph (graph_fingerprint "
            f"{graph_fingerprint(mlp.graph)[:12]}…, this graph's "
            f"{graph_fingerprint(bigger)[:12]}…): op '{FC1}' is MatMul(float32[8, 16], "
            f"float32[32, 16]) -> float32[8, 32] in the file but MatMul(float32[16, 16], "
            "float32[32, 16]) -> float32[16, 32] in the graph;")):
        load_strategy(path, bigger, DEVICES)
    wider = graph.trace(nn.MLP(16, 64, 8, n_hidden=1), MLP_SPECS)
    with pytest.raises(ValueError, match=r"more differences"):
        load_strategy(path, wider, DEVICES)


def test_the_device_count_and_arguments_are_checked(tmp_path: Path, mlp: Case) -> None:
    path = _saved(tmp_path, mlp)
    with pytest.raises(ValueError, match="was written for device_num 4, but device_num is 8"):
        load_strategy(path, mlp.graph, 8)
    with pytest.raises(TypeError, match="device_num must be an int or None, got str '4'"):
        load_strategy(path, mlp.graph, "4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device_num must be >= 1, got 0"):
        load_strategy(path, mlp.graph, 0)
    with pytest.raises(ValueError, match="mode must be one of"):
        load_strategy(path, mode="hybrid")
    with pytest.raises(TypeError, match="graph must be a simpar.graph.Graph .* got list"):
        load_strategy(path, [])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no strategy file"):
        load_strategy(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="must end in '.json': MindSpore reads any other name "
                                         "as a protobuf strategy file"):
        load_strategy(tmp_path / "strategy.ckpt")
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        load_strategy(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"path": "s.pb"}, ValueError, "save_strategy: path 's.pb' must end in '.json'"),
    ({"strategy_map": {}}, TypeError, "strategy_map must be a simpar.search.StrategyMap, got "
     "dict"),
    ({"graph": "g"}, TypeError, "graph must be a simpar.graph.Graph"),
    ({"search_mode": 1}, TypeError, "search_mode must be a str or None, got int 1"),
    ({"cost_model": object()}, TypeError, "cost_model must be a str or None, got object"),
    ({"only_trainable_params": "yes"}, TypeError, "only_trainable_params must be a bool"),
    ({"path": "missing/s.json"}, ValueError, "the directory of 'missing/s.json' does not "
     "exist"),
])
def test_save_refuses_bad_arguments(kwargs: dict[str, Any], error: type[Exception],
                                    words: str, mlp: Case, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = {"path": "s.json", "strategy_map": mlp.smap, "graph": mlp.graph, **kwargs}
    with pytest.raises(error, match=re.escape(words)):
        save_strategy(**args)
    assert os.listdir(tmp_path) == []


def test_save_refuses_a_map_planned_for_another_graph(tmp_path: Path, mlp: Case,
                                                      gpt: Case) -> None:
    with pytest.raises(ValueError, match="the strategy map has no strategy for op "
                                         "'Default/network-GPT/embedding-Embedding/Gather-op0'"):
        save_strategy(tmp_path / "s.json", mlp.smap, gpt.graph)
    other = StrategyMap(DEVICES, "auto_parallel", mlp.smap.ops,
                        {**mlp.smap.params, "fc1.weight": TensorLayout((4,), (0, -1), (16, 16))})
    with pytest.raises(ValueError, match=r"parameter 'fc1.weight' has shape \[32, 16\] in the "
                                         "graph, but its layout"):
        save_strategy(tmp_path / "s.json", other, mlp.graph)
