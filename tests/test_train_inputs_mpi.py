"""A training step's input check on real ranks: it runs alongside the step (its Allreduce
completes inside the step's collectives), and still refuses, on every rank and with no hang,
a batch that differs between ranks, a rank's shard with a bad id or label, and a shape the
program cannot take; a refused step changes no parameter.

    mpirun -n 4 python -m pytest tests/test_train_inputs_mpi.py -q --with-mpi -m mpi
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn

VOCAB, SEQ = 16, 4


@pytest.fixture(autouse=True)
def _context() -> Iterator[None]:
    simpar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    yield
    simpar.reset_auto_parallel_context()


def _gpt() -> nn.TrainOneStepCell:
    """A one-block GPT under data parallel: each rank embeds its own rows of the batch."""
    cell = nn.WithLossCell(nn.GPT(VOCAB, SEQ, 8, 1, 2), nn.SoftmaxCrossEntropyWithLogits())
    return nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), 0.1), seed=0)


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    rows = 2 * comm.get_group_size()
    return (rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32),
            rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32))


def _refused(train: nn.TrainOneStepCell, ids: np.ndarray, labels: np.ndarray
             ) -> BaseException:
    """Run a step that must be refused: its error on this rank, after checking that no
    parameter moved and that every rank is still in step (the barrier would hang if not)."""
    before = {n: p.copy() for n, p in train.params.items()}
    steps = train.step_count
    with pytest.raises(ValueError) as caught:
        train(ids, labels)
    assert train.step_count == steps
    for name, p in train.params.items():
        np.testing.assert_array_equal(p, before[name], err_msg=name)
    comm.barrier()
    return caught.value


@pytest.mark.mpi(min_size=2)
def test_a_bad_id_in_one_ranks_shard_refuses_the_step_everywhere() -> None:
    train = _gpt()
    ids, labels = _batch()
    train(ids, labels)
    ids[0, 1] = 99                             # row 0: rank 0's shard only
    error = _refused(train, ids, labels)
    message = str(error)
    assert "Gather: index 99 is out of range for input_params with 16 entries" in message
    if comm.get_rank() != 0:
        assert isinstance(error, comm.InputMismatchError)
        assert message.startswith("TrainOneStepCell: rank 0 refused its input with ValueError")
    else:
        assert not isinstance(error, comm.InputMismatchError)
    good = train(*_batch())                    # the next good step trains as usual
    assert np.isfinite(good)


@pytest.mark.mpi(min_size=2)
def test_a_bad_label_read_through_a_reshape_is_refused_everywhere() -> None:
    """The loss reads the labels flattened: the check follows the Reshape to the op."""
    train = _gpt()
    ids, labels = _batch()
    train(ids, labels)
    last = labels.shape[0] - 1                 # the last rank's rows
    labels[last, 0] = -1
    message = str(_refused(train, ids, labels))
    assert "label -1 is outside [0, 16)" in message
    p = comm.get_group_size()
    assert (message.startswith("SparseSoftmaxCrossEntropyWithLogits") if comm.get_rank() == p - 1
            else f"rank {p - 1} refused its input" in message)


@pytest.mark.mpi(min_size=2)
def test_a_batch_that_differs_after_the_first_step_is_refused_everywhere() -> None:
    train = _gpt()
    ids, labels = _batch()
    train(ids, labels)
    if comm.get_rank() == 1:
        ids = (ids + 1) % VOCAB                # valid ids, but not the others' batch
    message = str(_refused(train, ids, labels))
    assert "TrainOneStepCell: the global inputs differ across ranks" in message
    assert "rank 1: data int32[" in message


@pytest.mark.mpi(min_size=2)
def test_a_shape_the_program_cannot_take_on_one_rank_is_refused_everywhere() -> None:
    train = _gpt()
    ids, labels = _batch()
    train(ids, labels)
    if comm.get_rank() == 1:
        ids = ids[:, :2]
    message = str(_refused(train, ids, labels))
    assert "input of shape (" in message and "is neither the global batch" in message
    assert comm.get_rank() == 1 or message.startswith("TrainOneStepCell: rank 1 refused")


def test_the_program_knows_which_inputs_are_indices_and_their_limits() -> None:
    """Gather reads the ids straight; the cross entropy reads the labels after a Reshape."""
    cell = nn.WithLossCell(nn.GPT(VOCAB, SEQ, 8, 1, 2), nn.SoftmaxCrossEntropyWithLogits())
    train = nn.TrainOneStepCell(cell, nn.SGD(cell.trainable_params(), 0.1),
                                parallel_mode="stand_alone", seed=0)
    prog = train.build(*_batch_one())
    data, label = prog.index_limits
    assert [(op.name, k, limit) for op, k, limit in data] == [("Gather", 1, VOCAB)]
    assert [(op.name, k, limit) for op, k, limit in label] == [
        ("SparseSoftmaxCrossEntropyWithLogits", 1, VOCAB)]
    ids, labels = _batch_one()
    assert prog.refused_input([ids, labels]) is None
    labels[1, 2] = VOCAB
    refused = prog.refused_input([ids, labels])
    assert isinstance(refused, ValueError)
    assert "label 16 is outside [0, 16)" in str(refused)
    with pytest.raises(ValueError, match="label 16 is outside"):   # one device: at once
        train(ids, labels)


def _batch_one() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    return (rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32),
            rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32))
