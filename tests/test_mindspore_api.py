"""simpar.mindspore: MindSpore's import paths, its defaults where simpar's differ, the names it
does not implement (NotImplementedError, saying what to use), and the datasets."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.mindspore as ms
import simpar.parallel
from simpar.context import NotHonouredWarning


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    yield
    simpar.reset_auto_parallel_context()
    simpar.reset_cost_model_context()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="Ascend", device_id=0)
    ms.set_seed(0)


def test_mindspore_names_lead_to_simpars() -> None:
    assert ms.nn.Dense is simpar.nn.Dense and ms.ops.MatMul is simpar.ops.MatMul
    assert ms.Parameter is simpar.nn.Parameter
    assert ms.parallel.auto_parallel.AutoParallel is simpar.nn.AutoParallel
    assert ms.set_auto_parallel_context is simpar.set_auto_parallel_context
    assert ms.parallel.set_algo_parameters is simpar.set_algo_parameters
    assert ms.Model is ms.train.Model
    assert ms.ParallelMode.SEMI_AUTO_PARALLEL == "semi_auto_parallel"
    assert ms.communication.get_rank() == simpar.comm.get_rank()
    assert ms.communication.get_group_size("hccl_world_group") == simpar.comm.get_group_size()


@pytest.mark.parametrize("module, name, hint", [
    (ms, "jit", "traces the network"),
    (ms, "value_and_grad", "value_and_grad(data, label)"),
    (ms.nn, "LSTM", "recurrent"),
    (ms.nn, "DistributedGradReducer", "TrainOneStepCell reduces"),
    (ms.ops, "matmul", "ops.MatMul()"),
    (ms.ops, "relu", "ops.ReLU()"),
    (ms.ops, "GradOperation", "TrainOneStepCell"),
    (ms.dataset, "MnistDataset", "NumpySlicesDataset"),
    (ms.train, "Precision", "train.Accuracy"),
    (ms.communication, "create_group", "simpar.comm.create_group"),
    (ms.parallel, "transform_checkpoints", "simpar.checkpoint transform"),
])
def test_documented_names_simpar_lacks_say_what_to_use(module: object, name: str, hint: str
                                                       ) -> None:
    with pytest.raises(NotImplementedError, match=name) as e:
        getattr(module, name)
    assert hint in str(e.value)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="MatMull"):
        ms.ops.MatMull  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'jitt'"):
        ms.jitt  # noqa: B018


def test_tensor_is_an_array_with_mindsporess_dtypes() -> None:
    t = ms.Tensor([1.0, 2.0])
    assert isinstance(t, np.ndarray) and t.dtype == np.float32   # Python floats: float32
    assert ms.Tensor([1, 2]).dtype == np.int64
    assert ms.Tensor(np.arange(3.0)).dtype == np.float64          # an array keeps its dtype
    assert ms.Tensor(np.arange(3), ms.float16).dtype == np.float16
    assert type(t.asnumpy()) is np.ndarray and t.asnumpy().tolist() == [1.0, 2.0]
    assert ms.Tensor(shape=(2, 3), dtype=ms.int32).shape == (2, 3)
    with pytest.raises(ValueError, match="give input_data, or a shape"):
        ms.Tensor()


def test_the_device_target_sets_the_cost_models_beta() -> None:
    ms.set_context(device_target="GPU")
    assert simpar.get_cost_model_context("costmodel_beta") == 50.0
    assert not simpar.cost_model_context.cost_model_context().objective_changed
    ms.set_context(device_target="Ascend")
    assert simpar.get_cost_model_context("costmodel_beta") == 400.0
    simpar.set_cost_model_context(costmodel_beta=7)         # the user's beta stays
    ms.set_context(device_target="GPU")
    assert simpar.get_cost_model_context("costmodel_beta") == 7.0
    assert ms.get_context("device_target") == "GPU"


def test_set_context_checks_every_key_first() -> None:
    with pytest.raises(ValueError, match="device_target must be one of .*'TPU'"):
        ms.set_context(mode=ms.PYNATIVE_MODE, device_target="TPU")
    assert ms.get_context("mode") == ms.GRAPH_MODE            # nothing changed
    with pytest.raises(ValueError, match="unknown key 'devise_target'"):
        ms.set_context(devise_target="GPU")
    with pytest.warns(NotHonouredWarning, match="save_graphs"):
        ms.set_context(save_graphs=False)


def test_a_sub_cells_named_parameters_take_its_prefix() -> None:
    class Dense(ms.nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.weight = ms.Parameter(np.ones((2, 2), np.float32), name="weight")
            self.bias = ms.Parameter(np.zeros(2, np.float32))

    class Net(ms.nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.dense1, self.dense2 = Dense(), Dense()

    names = [p.name for p in Net().trainable_params()]
    assert names == ["dense1.weight", "dense1.bias", "dense2.weight", "dense2.bias"]


def test_mindsporess_loss_defaults() -> None:
    with pytest.raises(NotImplementedError, match="reduction='none'"):
        ms.nn.SoftmaxCrossEntropyWithLogits()
    assert ms.nn.SoftmaxCrossEntropyWithLogits(reduction="mean").sparse is False
    assert ms.nn.CrossEntropyLoss().sparse is True
    with pytest.raises(NotImplementedError, match="label_smoothing=0.1"):
        ms.nn.CrossEntropyLoss(label_smoothing=0.1)


def test_shard_sets_a_cells_strategy() -> None:
    cell = ms.nn.Dense(4, 4)
    assert ms.shard(cell, ((2, 1),)) is cell and cell.in_strategy == ((2, 1),)
    with pytest.raises(TypeError, match="parameter_plan needs fn to be a Cell"):
        ms.shard(lambda x: x, ((2, 1),), parameter_plan={"w": (2, 1)})
    with pytest.raises(TypeError, match="fn must be a Cell or a function, got int"):
        ms.shard(3, ((2, 1),))
    with pytest.raises(ValueError, match="level must be 0"):
        ms.shard(cell, ((2, 1),), level=1)


# ------------------------------------------------------------------ datasets

def _rows(dataset: ms.dataset.Dataset, epoch: int = 0) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in np.ravel(row[0])) for row in dataset.epoch(epoch)]


def test_shards_partition_each_epochs_samples() -> None:
    data = np.arange(10)
    for shuffle in (False, True):
        for epoch in (0, 1):
            parts = [_rows(ms.dataset.NumpySlicesDataset(data, shuffle=shuffle, num_shards=4,
                                                         shard_id=s), epoch) for s in range(4)]
            assert [len(p) for p in parts] == [3, 3, 3, 3]   # 10 padded to 12 by wrapping
            seen = sorted(v for p in parts for (v,) in p)
            assert set(seen) == set(range(10)) and len(seen) == 12
    first = _rows(ms.dataset.NumpySlicesDataset(data, num_shards=4, shard_id=0), 0)
    again = _rows(ms.dataset.NumpySlicesDataset(data, num_shards=4, shard_id=0), 1)
    assert first != again                                      # reshuffled each epoch
    plain = _rows(ms.dataset.NumpySlicesDataset(data, shuffle=False, num_shards=4, shard_id=1))
    assert plain == [(1,), (5,), (9,)]


def test_the_dataset_seed_decides_the_order() -> None:
    ms.set_seed(3)
    a = _rows(ms.dataset.NumpySlicesDataset(np.arange(20)))
    ms.set_seed(3)
    b = _rows(ms.dataset.NumpySlicesDataset(np.arange(20)))
    ms.dataset.config.set_seed(4)
    c = _rows(ms.dataset.NumpySlicesDataset(np.arange(20)))
    assert a == b != c and sorted(a) == [(k,) for k in range(20)]


def test_batch_map_repeat_and_iterators() -> None:
    x = np.arange(14, dtype=np.float32).reshape(7, 2)
    y = np.arange(7, dtype=np.int32)
    ds = ms.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False)
    batched = ds.map(lambda v: v * 2, input_columns="y").batch(3)
    assert batched.get_dataset_size() == 3 and batched.get_col_names() == ["x", "y"]
    rows = list(batched.create_tuple_iterator(output_numpy=True, num_epochs=1))
    assert [r[0].shape for r in rows] == [(3, 2), (3, 2), (1, 2)]
    np.testing.assert_array_equal(rows[0][1], [0, 2, 4])
    assert ds.batch(3, drop_remainder=True).get_dataset_size() == 2
    tensors = next(iter(ds.batch(2)))
    assert isinstance(tensors[0], ms.Tensor)
    d = next(ds.batch(2).create_dict_iterator(output_numpy=True))
    assert set(d) == {"x", "y"}
    assert ds.repeat(2).get_dataset_size() == 14
    shuffled = sorted(int(r[1]) for r in ds.shuffle(4).epoch(0))
    assert shuffled == list(range(7))


def test_generator_dataset_sources() -> None:
    pairs = [(np.full(2, k, np.float32), np.int32(k)) for k in range(6)]
    ds = ms.dataset.GeneratorDataset(pairs, column_names=["data", "label"], shuffle=False,
                                     num_shards=2, shard_id=1)
    assert [int(r[1]) for r in ds.epoch(0)] == [1, 3, 5]

    def gen() -> Iterator[tuple[np.ndarray, np.int32]]:
        yield from pairs

    stream = ms.dataset.GeneratorDataset(gen, column_names=["data", "label"])
    assert [len(r[1]) for r in stream.batch(4).epoch(0)] == [4, 2]
    assert stream.batch(4).get_dataset_size() == 2
    with pytest.raises(ValueError, match="need a random-access source"):
        ms.dataset.GeneratorDataset(gen, column_names=["data", "label"], num_shards=2,
                                    shard_id=0)
    with pytest.raises(ValueError, match="column_names is required"):
        ms.dataset.GeneratorDataset(pairs)
    with pytest.raises(ValueError, match="shard_id must be an int in \\[0, 2\\)"):
        ms.dataset.NumpySlicesDataset(np.arange(4), num_shards=2, shard_id=2)
    with pytest.raises(ValueError, match="num_shards and shard_id must be given together"):
        ms.dataset.NumpySlicesDataset(np.arange(4), num_shards=2)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        ms.dataset.NumpySlicesDataset(np.arange(4)).batch(0)


def test_the_api_table_lists_every_key() -> None:
    """docs/mindspore.md has a row for every key simpar's contexts know and for every
    MindSpore key simpar refuses, each with its status."""
    import re
    from pathlib import Path

    from simpar import context

    page = (Path(__file__).resolve().parent.parent / "docs" / "mindspore.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([a-z' ]+) \|", page, flags=re.M))
    for key in [*context._AUTO_KEYS, *context._ALGO_SPECS]:
        assert rows.get(key) in ("supported", "difference", "simpar's own"), key
    for key in context.MINDSPORE_KEYS_NOT_IMPLEMENTED:
        assert rows.get(key) == "not supported", key
        with pytest.raises(NotImplementedError, match=key):
            ms.set_auto_parallel_context(**{key: 1})


_NET_SPECS = [((8, 4), np.float32), ((8,), np.int32)]


def _net() -> simpar.nn.Cell:
    return simpar.nn.WithLossCell(simpar.nn.Dense(4, 4), simpar.nn.SoftmaxCrossEntropyWithLogits())


@pytest.mark.parametrize("call, error, match", [
    (lambda: simpar.parallel.search_strategies(_net(), None), TypeError,
     "input_specs must be a list of \\(shape, dtype\\) pairs, one per input, got None"),
    (lambda: simpar.parallel.search_strategies(None, _NET_SPECS), TypeError,
     "the network must be a Cell or a function, got None"),
    (lambda: simpar.parallel.search_strategies(_net(), [(8, 4)]), TypeError,
     "input_specs\\[0\\] must be a \\(shape, dtype\\) pair"),
    (lambda: simpar.parallel.search_strategies(_net(), _NET_SPECS, device_num="8"), TypeError,
     "search_strategies: device_num must be a positive int, got str '8'"),
    (lambda: simpar.parallel.search_strategies(_net(), _NET_SPECS, 8, search_mode=3), TypeError,
     "search_strategies: search_mode must be None"),
    (lambda: simpar.parallel.search_strategies(_net(), _NET_SPECS, 8, dataset_strategy="half"),
     ValueError, "search_strategies: dataset_strategy must be 'full_batch', 'data_parallel'"),
    (lambda: simpar.parallel.search_strategies(_net(), _NET_SPECS, 8, enable_alltoall=1),
     TypeError, "enable_alltoall must be None \\(the context's\\) or a bool, got int 1"),
    (lambda: simpar.parallel.get_parallel_info(None, [(8, 4), (4, 4)]), TypeError,
     "get_parallel_info: op must be a simpar.ops primitive, got None"),
    (lambda: simpar.parallel.get_parallel_info(ms.ops.MatMul(), None), TypeError,
     "get_parallel_info: input_shapes must be a list of shapes"),
    (lambda: simpar.parallel.export_strategy(None, _net(), _NET_SPECS, 8), TypeError,
     "export_strategy: path"),
    (lambda: simpar.parallel.import_strategy("s.json", _net(), _NET_SPECS, None), TypeError,
     "import_strategy: device_num must be a positive int, got None"),
])
def test_public_functions_refuse_none_and_wrong_types(call: Any, error: type, match: str
                                                      ) -> None:
    with pytest.raises(error, match=match):
        call()


def test_cells_start_in_evaluation_mode_and_set_train_switches() -> None:
    def cells() -> tuple[Any, Any]:
        net = ms.nn.SequentialCell([ms.nn.Dense(2, 2), ms.nn.Dropout(0.5)])
        return net, ms.nn.Momentum(net.trainable_params(), 0.1, 0.9)

    net, opt = cells()
    assert not net.training and not net[1].training           # as MindSpore's Cells
    loss = ms.nn.CrossEntropyLoss()
    train = ms.nn.TrainOneStepCell(ms.nn.WithLossCell(net, loss), opt)
    assert not net.training                                   # MindSpore's leaves the mode
    assert train.set_train() is train and net[1].training     # ... to set_train()
    net, opt = cells()
    simpar.nn.TrainOneStepCell(simpar.nn.WithLossCell(net, loss), opt)
    assert net[1].training                                    # simpar's puts it in training
    with pytest.raises(TypeError, match="set_train: mode must be a bool, got 1"):
        net.set_train(1)  # type: ignore[arg-type]


def test_model_train_runs_its_callbacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    """LossMonitor and TimeMonitor print MindSpore's lines; ModelCheckpoint saves every
    save_checkpoint_steps steps as {prefix}-{epoch}_{step} and keeps the newest
    keep_checkpoint_max; a callback may stop the training."""
    from simpar.checkpoint import read_manifest

    ms.set_seed(2)
    net = ms.nn.Dense(4, 3)
    model = ms.Model(net, ms.nn.CrossEntropyLoss(), ms.nn.SGD(net.trainable_params(), 0.1))
    rng = np.random.default_rng(0)
    data = ms.dataset.NumpySlicesDataset(
        (rng.standard_normal((12, 4)).astype(np.float32), rng.integers(0, 3, 12).astype(np.int32)),
        column_names=["x", "y"], shuffle=False).batch(4)
    saver = ms.train.ModelCheckpoint("net", str(tmp_path), ms.train.CheckpointConfig(
        save_checkpoint_steps=2, keep_checkpoint_max=2))

    class StopAt(ms.train.Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if run_context.original_args().cur_step_num == 5:
                run_context.request_stop()

    model.train(3, data, callbacks=[ms.train.LossMonitor(2), ms.train.TimeMonitor(), saver,
                                    StopAt()])
    out = capsys.readouterr().out
    assert re.findall(r"^epoch: (\d) step: (\d), loss is \d", out, flags=re.M) == [
        ("1", "2"), ("2", "1")]                                 # steps 2 and 4 of 5
    assert len(re.findall(r"^epoch time: [\d.]+ ms, per step time: [\d.]+ ms$", out,
                          flags=re.M)) == 2                     # stopped in epoch 2
    assert model.train_network.step_count == 5
    # steps 2 and 4, and the last (5) as training ends; the newest 2 kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net-2_1", "net-2_2"]
    assert read_manifest(tmp_path / "net-2_1").step == 4
    assert read_manifest(tmp_path / "net-2_2").step == 5
    with pytest.raises(ValueError, match="epoch must be a positive int, got 0"):
        model.train(0, data)
    with pytest.raises(ValueError, match="keep_checkpoint_max must be a positive int"):
        ms.train.CheckpointConfig(keep_checkpoint_max=0)



def test_iterators_run_one_epoch_per_loop_as_mindsporess() -> None:
    ds = ms.dataset.NumpySlicesDataset((np.arange(3), np.arange(3)), shuffle=False)
    it = ds.create_tuple_iterator(output_numpy=True, num_epochs=2)
    epochs = [[int(row[0]) for row in it] for _ in range(3)]
    assert epochs == [[0, 1, 2], [0, 1, 2], []]              # num_epochs=2, then done
    forever = ds.create_dict_iterator(output_numpy=True)
    assert [[int(r["column_0"]) for r in forever] for _ in range(3)] == [[0, 1, 2]] * 3
    with pytest.raises(ValueError, match="num_epochs must be -1 or an int >= 1, got 0"):
        ds.create_tuple_iterator(num_epochs=0)


def test_map_lists_and_batch_sizes_as_mindsporess() -> None:
    # a list is one column; a tuple is a column per entry
    rows = ms.dataset.NumpySlicesDataset([[1, 2], [3, 4], [5, 6]], shuffle=False)
    assert rows.get_col_names() == ["column_0"] and rows.get_dataset_size() == 3
    ds = ms.dataset.NumpySlicesDataset((np.arange(4.0), np.arange(4)), column_names=["x", "y"],
                                       shuffle=False)
    scaled = ds.map(lambda x: x / 2)                         # the first column only
    assert [(float(x), int(y)) for x, y in scaled.epoch(0)] == [(0, 0), (0.5, 1), (1, 2),
                                                                (1.5, 3)]
    swapped = ds.map(lambda x, y: (y, x), input_columns=["x", "y"])
    assert [(float(x), float(y)) for x, y in swapped.epoch(0)][1] == (1.0, 1.0)
    assert ds.batch(3).shuffle(2).get_batch_size() == 3
    assert ds.batch(3).last_batch_short() and not ds.batch(2).last_batch_short()
    with pytest.raises(ValueError, match="set_seed: seed must be an int in \\[0, 2\\*\\*32\\)"):
        ms.set_seed(2 ** 32)


def test_model_eval_before_and_after_training_and_a_short_last_batch() -> None:
    """Model.eval on one device against the network run eagerly: before training (the
    initial parameters, and training still works after), after it, with a last batch shorter
    than the others; and Model.train refuses a short last batch up front."""
    ms.set_seed(4)
    net = ms.nn.Dense(4, 3)
    model = ms.Model(net, ms.nn.CrossEntropyLoss(), ms.nn.SGD(net.trainable_params(), 0.5),
                     metrics={"accuracy", "loss"})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 4)).astype(np.float32)
    y = rng.integers(0, 3, 10).astype(np.int32)
    uneven = ms.dataset.NumpySlicesDataset((x, y), shuffle=False).batch(4)   # 4, 4, 2

    def eager() -> dict[str, float]:
        params = model.train_network.params or {
            p.name: p.initial_value(model.train_network.seed, tuple((0, d) for d in p.shape))
            for p in net.trainable_params()}
        logits = x @ params["weight"].T + params["bias"]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        return {"accuracy": float((logits.argmax(axis=1) == y).mean()),
                "loss": float(-log_p[np.arange(10), y].mean())}

    before = model.eval(uneven)
    assert before == pytest.approx(eager(), rel=1e-5)
    with pytest.raises(ValueError, match="last batch is shorter than the others"):
        model.train(1, uneven)
    model.train(2, ms.dataset.NumpySlicesDataset((x, y), shuffle=False).batch(5))
    after = model.eval(uneven)
    assert after == pytest.approx(eager(), rel=1e-5) and after["loss"] < before["loss"]
