"""MindSpore's feeding through simpar.mindspore's Model, on every world size: with
``full_batch=False`` each rank passes its own slice of the batch, laid out by the dataset
strategy ("data_parallel", or cuts whose copies feed the same rows); with ``full_batch=True``
every rank passes the whole batch. Each way trains like one device (the check assembles the
global batches from the ranks' slices)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.mindspore as ms
from simpar import comm, nn
from simpar.check import CheckReport, check_against_single_device
from tests.mpi_guard import raised_everywhere
from tests.recording import Record

ROWS, FEATURES, CLASSES = 64, 8, 4


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    yield
    simpar.reset_auto_parallel_context()
    ms.set_seed(0)


def _network() -> Any:
    net = ms.nn.SequentialCell([ms.nn.Dense(FEATURES, 16), ms.nn.ReLU(),
                                ms.nn.Dense(16, CLASSES)])
    net[0].matmul.shard(((1, 1), (2, 1)))   # a tensor cut too, besides the batch's
    return net


def _dataset(num_shards: int | None, shard_id: int | None, batch: int) -> Any:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, ROWS).astype(np.int32)
    return ms.dataset.NumpySlicesDataset((x, y), column_names=["x", "y"], num_shards=num_shards,
                                         shard_id=shard_id).batch(batch, drop_remainder=True)


def _train(dataset: Any, full_batch: bool, dataset_strategy: Any) -> CheckReport:
    ms.set_seed(5)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                 dataset_strategy=dataset_strategy)
    if full_batch:
        ms.set_auto_parallel_context(full_batch=True)
    net = _network()
    params = net.trainable_params()
    loss = ms.nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    model = ms.Model(net, loss_fn=loss, optimizer=ms.nn.Momentum(params, 0.1, 0.9))
    record = Record()
    model.train(2, dataset, callbacks=[record])
    train = model.train_network
    assert train.per_device is not full_batch
    batches = [b for e in range(2) for b in dataset.epoch(e)]

    def reference() -> nn.TrainOneStepCell:
        ms.set_seed(5)
        net = _network()
        params = net.trainable_params()
        return nn.TrainOneStepCell(
            nn.WithLossCell(net, ms.nn.SoftmaxCrossEntropyWithLogits(sparse=True,
                                                                     reduction="mean")),
            ms.nn.Momentum(params, 0.1, 0.9))

    return check_against_single_device(train, reference, batches, losses=record.losses)


@pytest.mark.mpi(min_size=2)
def test_each_rank_feeds_its_own_rows_data_parallel() -> None:
    n, rank = comm.get_group_size(), comm.get_rank()
    report = _train(_dataset(n, rank, 16 // n), full_batch=False,
                    dataset_strategy="data_parallel")
    assert report.passed, report.summary()


@pytest.mark.mpi(min_size=2)
def test_copies_of_one_block_feed_the_same_rows() -> None:
    """((2, 1), (2,)) on n ranks: rank r holds block r // (n/2) of the batch, so the ranks
    of one block shard the dataset alike (num_shards=2)."""
    n, rank = comm.get_group_size(), comm.get_rank()
    report = _train(_dataset(2, rank // (n // 2), 8), full_batch=False,
                    dataset_strategy=((2, 1), (2,)))
    assert report.passed, report.summary()


@pytest.mark.mpi(min_size=4)
def test_copies_fed_different_rows_fail_the_check() -> None:
    """The ranks of one block feeding different rows (shard_id = rank % 2, crosswise) is not
    caught while training, but the check against one device says so, on every rank."""
    rank = comm.get_rank()
    raised_everywhere(lambda: _train(_dataset(2, rank % 2, 8), full_batch=False,
                                     dataset_strategy=((2, 1), (2,))),
                      ValueError, "the ranks that hold copies of one block of the batch fed "
                                  "different rows")


@pytest.mark.mpi(min_size=2)
def test_full_batch_feeds_every_rank_the_whole_batch() -> None:
    report = _train(_dataset(None, None, 16), full_batch=True, dataset_strategy="full_batch")
    assert report.passed, report.summary()


def test_one_device_feeds_the_whole_batch() -> None:
    ms.set_seed(5)
    net = _network()
    model = ms.Model(net, ms.nn.CrossEntropyLoss(),
                     ms.nn.Momentum(net.trainable_params(), 0.1, 0.9))
    record = Record()
    model.train(1, _dataset(None, None, 16), callbacks=[record])
    assert len(record.losses) == ROWS // 16 and not model.train_network.per_device
    assert all(np.isfinite(record.losses))


def _eval_reference(train: Any, dataset: Any) -> dict[str, float]:
    """Accuracy and mean loss of the trained parameters on one device, eagerly, in
    evaluation mode, over the whole (unsharded) dataset."""
    whole = train.global_parameters()
    net = _network()
    for name, param in net.parameters_and_names():
        param.set_data(whole[name])
    net.set_train(False)
    correct = total = 0
    loss_sum = 0.0
    for x, y in dataset.epoch(0):
        logits = np.asarray(net(x), dtype=np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        loss_sum += float(-log_p[np.arange(len(y)), y].sum())
        correct += int((logits.argmax(axis=1) == y).sum())
        total += len(y)
    return {"accuracy": correct / total, "loss": loss_sum / total}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("full_batch", [False, True])
def test_eval_gives_one_devices_metrics(full_batch: bool) -> None:
    """Model.eval in parallel (each rank its rows, or the whole batch) against one device's
    forward with the same parameters: the same accuracy, the same loss."""
    n, rank = comm.get_group_size(), comm.get_rank()
    ms.set_seed(5)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                 dataset_strategy="full_batch" if full_batch else "data_parallel")
    net = _network()
    model = ms.Model(net, ms.nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                     ms.nn.Momentum(net.trainable_params(), 0.1, 0.9),
                     metrics={"accuracy", "loss"})
    shards = (None, None) if full_batch or n == 1 else (n, rank)
    batch = 16 if full_batch else 16 // n
    model.train(1, _dataset(*shards, batch))
    got = model.eval(_dataset(*shards, batch))
    want = _eval_reference(model.train_network, _dataset(None, None, 16))
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-12)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert net.training                                   # eval left the training mode alone
    every = comm.all_gather(np.array([[got["accuracy"], got["loss"]]]), axis=0)
    assert (every == every[0]).all()                      # the same on every rank


@pytest.mark.mpi(min_size=2)
def test_per_device_steps_run_the_global_steps_collectives() -> None:
    """A step fed each rank's rows runs exactly the collectives of the same step fed the
    global batch (the feeding moves nothing); assembling the global batch for the check is one
    AllGather per input."""
    n, rank = comm.get_group_size(), comm.get_rank()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                 dataset_strategy="data_parallel")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, 16).astype(np.int32)
    mine = (x[rank * 16 // n:(rank + 1) * 16 // n], y[rank * 16 // n:(rank + 1) * 16 // n])

    def step(per_device: bool) -> tuple[list[str], float]:
        ms.set_seed(5)
        net = _network()
        train = nn.TrainOneStepCell(
            nn.WithLossCell(net, ms.nn.CrossEntropyLoss()),
            ms.nn.Momentum(net.trainable_params(), 0.1, 0.9), per_device=per_device)
        batch = mine if per_device else (x, y)
        train(*batch)                                     # the build, untraced
        with comm.CommTrace() as trace:
            loss = train(*batch)
        return trace.kinds(), loss

    local_kinds, local_loss = step(True)
    global_kinds, global_loss = step(False)
    assert local_kinds == global_kinds and "AllReduce" in local_kinds
    assert local_loss == global_loss
    ms.set_seed(5)
    net = _network()
    train = nn.TrainOneStepCell(nn.WithLossCell(net, ms.nn.CrossEntropyLoss()),
                                ms.nn.Momentum(net.trainable_params(), 0.1, 0.9),
                                per_device=True)
    train.build(*mine)
    with comm.CommTrace() as trace:
        whole = train.global_batch(*mine)
    assert trace.count("AllGather") == 2
    np.testing.assert_array_equal(whole[0], x)
    np.testing.assert_array_equal(whole[1], y)


@pytest.mark.mpi(min_size=2)
def test_a_sharded_function_redistributes_its_inputs_and_trains_like_one_device() -> None:
    """ms.shard(function, in_strategy) inside a construct: its input is moved from the
    batch cut to the column cut (collectives in the trace), and training matches one
    device."""
    n = comm.get_group_size()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                 dataset_strategy="full_batch")

    class Net(ms.nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = ms.nn.Dense(FEATURES, 16), ms.nn.Dense(16, CLASSES)
            self.fc1.matmul.shard(((n, 1), (1, 1)))          # rows cut: the batch
            relu = ms.ops.ReLU()
            self.act = ms.shard(lambda h: relu(h), ((1, n),))   # columns cut

        def construct(self, x: Any) -> Any:
            return self.fc2(self.act(self.fc1(x)))

    def build() -> nn.TrainOneStepCell:
        ms.set_seed(5)
        net = Net()
        return nn.TrainOneStepCell(nn.WithLossCell(net, ms.nn.CrossEntropyLoss()),
                                   ms.nn.Momentum(net.trainable_params(), 0.1, 0.9))

    train = build()
    batches = [b for b in _dataset(None, None, 16).epoch(0)][:2]
    train.build(*batches[0])
    assert train.program is not None
    assert [s.sharding.strategy for s in train.program.steps
            if s.node.op.name == "Identity"] == [((1, n),)]
    with comm.CommTrace() as trace:
        train(*batches[0])
    moved = [(e.label.rsplit("/", 1)[-1], kind) for e, kind in zip(trace.events, trace.kinds())
             if "act-_Sharded/Identity" in e.label]
    # rows -> columns: an AllGather (then a slice) forward, its adjoint a ReduceScatter
    assert moved == [("redistribute:AllGather", "AllGather"),
                     ("redistribute-adjoint:AllGather", "ReduceScatter")]
    report = check_against_single_device(build(), build, batches)
    assert report.passed, report.summary()
