"""The single-device check on real ranks: it passes a correct run, fails a NaN or a wrong
value on any one rank and names it, and refuses inputs that differ between ranks.

    mpirun -n 8 python -m pytest tests/test_check_mpi.py -q --with-mpi -m mpi
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn, ops
from simpar.check import check_against_single_device
from simpar.parallel import OpCheckError, run_op

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def _context() -> Iterator[None]:
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True,
                                     enable_alltoall=True, dataset_strategy="full_batch")
    yield
    simpar.reset_auto_parallel_context()


def _make(mp: int | None = None, dtype: type = np.float64, adam: bool = False
          ) -> nn.TrainOneStepCell:
    """A Megatron MLP over every rank (column- then row-parallel) with an MSE loss."""
    mp = comm.get_group_size() if mp is None else mp
    fc1 = nn.Dense(8, 16, activation="gelu", dtype=dtype)
    fc2 = nn.Dense(16, 4, dtype=dtype)
    fc1.matmul.shard(((1, 1), (mp, 1)))
    fc1.bias_add.shard(((1, mp), (mp,)))
    fc2.matmul.shard(((1, mp), (1, mp)))

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = fc1, fc2

        def construct(self, x: object) -> object:
            return self.fc2(self.fc1(x))

    net = Net()
    opt = nn.Adam(net.trainable_params(), 3e-3) if adam else nn.Momentum(
        net.trainable_params(), 0.05, 0.9)
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)


def _batches(k: int = 2, dtype: type = np.float64) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [(rng.standard_normal((4, 8)).astype(dtype),
             rng.standard_normal((4, 4)).astype(dtype)) for _ in range(k)]


def test_a_correct_run_passes_on_every_rank() -> None:
    report = check_against_single_device(_make(), _make, _batches())
    assert report.passed, str(report)
    assert report.steps == 2 and report.tolerance.rtol == 1e-10
    n = comm.get_group_size()
    assert set(report.param_errors) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert all(len(per_rank) == n for per_rank in report.param_errors.values())
    # Every rank holds the same report.
    worst = comm.all_gather(np.array([report.max_param_error]))
    assert np.all(worst == worst[0])


def test_a_nan_in_one_ranks_shard_fails_everywhere_and_names_the_rank() -> None:
    train, batches = _make(), _batches()
    losses = [train(x, y) for x, y in batches]
    bad = comm.get_group_size() - 1
    if comm.get_rank() == bad:
        train.params["fc2.weight"][0, 0] = np.nan
    report = check_against_single_device(train, _make, batches, losses=losses)
    assert not report.passed
    assert report.worst_param[:2] == ("fc2.weight", bad)
    assert f"fc2.weight on rank {bad}: non-finite" in report.summary()
    assert report.summary().splitlines()[0].endswith("FAIL")


def test_a_small_error_on_one_rank_fails() -> None:
    train, batches = _make(), _batches()
    losses = [train(x, y) for x, y in batches]
    if comm.get_rank() == 0:
        train.params["fc1.bias"] *= 1 + 1e-7
    report = check_against_single_device(train, _make, batches, losses=losses)
    assert not report.passed and report.worst_param[:2] == ("fc1.bias", 0)
    assert 1e-10 < report.max_param_error < 1e-6


def test_float32_adam_is_judged_on_adams_scale_and_gradients_stay_sharp() -> None:
    def make() -> nn.TrainOneStepCell:
        return _make(dtype=np.float32, adam=True)

    batches = _batches(4, np.float32)
    report = check_against_single_device(make(), make, batches)
    assert report.passed, str(report)
    tol = report.tolerance
    assert tol.rtol == 1e-5 and not tol.judge_later_losses
    assert tol.param_atol == pytest.approx(3e-3 * 2 * 2**-24 * 0.999**0 * (1e-3) ** 0.5 / 1e-8)
    assert report.worst_grad[2] <= 1e-5

    # A 1% wrong gradient scale (say, a wrong loss seed): Adam nearly ignores the scale, so
    # its parameters barely move, but the gradients at the same parameters catch it.
    train = make()
    train.build(*batches[0])
    train._seed *= 1.01
    report = check_against_single_device(train, make, batches)
    assert not report.passed
    assert any(f.startswith("gradient of ") for f in report.failures), report.failures
    assert report.worst_grad[2] == pytest.approx(0.01, rel=0.05)


def test_check_refuses_a_cell_that_already_trained() -> None:
    train, batches = _make(), _batches()
    train(*batches[0])
    with pytest.raises(ValueError, match="train has already run 1 steps"):
        check_against_single_device(train, _make, batches)
    with pytest.raises(ValueError, match="2 losses and 2 batches for a cell that ran 1 steps"):
        check_against_single_device(train, _make, batches, losses=[1.0, 2.0])


@pytest.mark.mpi(min_size=2)
def test_training_refuses_inputs_that_differ_between_ranks() -> None:
    train = _make()
    x, y = _batches(1)[0]
    if comm.get_rank() == 1:
        x = x + 1.0  # an unseeded generator, in effect
    with pytest.raises(comm.InputMismatchError,
                       match="the global inputs differ across ranks .*rank 1: data float64"):
        train(x, y)


@pytest.mark.mpi(min_size=2)
def test_run_op_refuses_inputs_that_differ_between_ranks() -> None:
    rng = np.random.default_rng(comm.get_rank())  # a different "global" array per rank
    a, b = rng.random((4, 4)), np.ones((4, 4))
    with pytest.raises(comm.InputMismatchError, match=r"run_op\(MatMul\): the global inputs "
                       r"differ across ranks .*seed the random generator"):
        run_op(ops.MatMul().shard(((2, 1), (1, 1))), a, b, check=True)


def test_run_op_check_fails_on_a_nan_and_names_the_rank() -> None:
    n = comm.get_group_size()
    a = np.random.default_rng(0).random((2 * n, 4))
    a[-1, 0] = np.nan  # in the last rank's rows
    with pytest.raises(OpCheckError, match=rf"output differs from single device: non-finite "
                       rf".*shards of ranks \[{n - 1}\]"):
        run_op(ops.MatMul().shard(((n, 1), (1, 1))), a, np.ones((4, 3)), check=True)


def test_a_bad_reference_builder_raises_on_every_rank() -> None:
    batches = _batches(1)
    with pytest.raises(TypeError, match="build_reference must return a TrainOneStepCell, got "
                       "Dense"):
        check_against_single_device(_make(), lambda: nn.Dense(2, 2), batches)
    train = _make()
    with pytest.raises(ValueError, match="build_reference returned the cell under test"):
        check_against_single_device(train, lambda: train, batches)


def test_a_reference_of_another_model_raises_on_every_rank() -> None:
    def other() -> nn.TrainOneStepCell:
        return _make(dtype=np.float32)

    with pytest.raises(ValueError, match=r"build_reference built a model whose parameter "
                       r"fc1.weight is \(\(16, 8\), dtype\('float32'\)\), but the cell under "
                       r"test has \(\(16, 8\), dtype\('float64'\)\)"):
        check_against_single_device(_make(), other, _batches(1))


def test_loss_repeated_mean_false_is_refused_clearly() -> None:
    simpar.set_auto_parallel_context(loss_repeated_mean=False)
    with pytest.raises(ValueError, match="loss_repeated_mean=False"):
        check_against_single_device(_make(), _make, _batches(1))


def test_a_gradient_that_is_zero_in_exact_arithmetic_passes() -> None:
    """A shift added to every logit cannot change a softmax cross entropy: its gradient is
    round-off on both sides, judged against the model's largest gradient, not its own."""
    n = comm.get_group_size()

    class Shifted(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Dense(8, 2 * n, dtype=np.float64)
            self.fc.matmul.shard(((1, 1), (n, 1)))
            self.shift = nn.Parameter(np.full((1, 1), 0.3))
            self.add = ops.Add()

        def construct(self, x: object) -> object:
            return self.add(self.fc(x), self.shift)

    def make() -> nn.TrainOneStepCell:
        net = Shifted()
        return nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                                   nn.SGD(net.trainable_params(), 0.5))

    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((4, 8)), rng.integers(0, 2 * n, 4).astype(np.int32))
               for _ in range(2)]
    report = check_against_single_device(make(), make, batches)
    assert report.passed, str(report)


@pytest.mark.mpi(min_size=2)
def test_run_op_refuses_a_grad_output_that_differs_between_ranks() -> None:
    a = np.random.default_rng(0).random((4, 4))
    dy = np.ones((4, 4)) * (1 + comm.get_rank())
    with pytest.raises(comm.InputMismatchError, match="grad_output 0"):
        run_op(ops.MatMul().shard(((2, 1), (1, 1))), a, a, grad_output=dy, check=True)
