"""FloorDiv, PReLU, BatchNorm and Assign on real ranks (mpirun -n 2, 4 or 8) against one device.

* every candidate strategy of each op (repeated calculation included): on every rank the
  output and every input gradient equal the single-device kernel and VJP, each shard has the
  strategy's slice shape, and the collectives traced equal ``get_parallel_info``'s (the hand-
  written expectations of one strategy per op are in tests/test_ops_expected_comm_mpi.py);
* float32 with BatchNorm's statistics split over every rank;
* training a BatchNorm2d -> PReLU network with FloorDiv and Assign branches, in
  semi_auto_parallel (batch x channel, and batch x height cuts) and data_parallel, against the
  single-device run for every parameter and rank (``check_against_single_device``), with the
  statistics' AllReduces read back from the trace.

    mpirun -n 8 python -m pytest -q --with-mpi -m mpi tests/test_ops_floordiv_prelu_bn_assign_mpi.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn, ops
from simpar.check import check_against_single_device
from tests.mpi_guard import abort_job_on_error
from tests.ophelpers import check_strategies

pytestmark = pytest.mark.mpi

RNG = np.random.default_rng(31)


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def _limit() -> int | None:
    return None if comm.get_group_size() == 8 else 10


def _bn(x_shape: tuple[int, ...]) -> list[np.ndarray]:
    c = x_shape[1]
    return [3.0 + _r(*x_shape), _r(c), _r(c), _r(c), 0.5 + np.abs(_r(c))]


CASES: list[tuple[str, Callable[[], ops.Primitive], list[np.ndarray]]] = [
    ("FloorDiv", ops.FloorDiv, [5.0 * _r(4, 8), 1.5 + np.abs(_r(1, 8))]),
    ("FloorDiv_int", ops.FloorDiv, [RNG.integers(-50, 50, (8, 4)).astype(np.int64),
                                    RNG.integers(1, 9, (8, 4)).astype(np.int64)]),
    ("PReLU", ops.PReLU, [_r(4, 8, 2), _r(8)]),
    ("PReLU_4d", ops.PReLU, [_r(2, 4, 2, 2), _r(4)]),
    ("PReLU_shared", ops.PReLU, [_r(4, 4, 2), _r(1)]),
    ("BatchNorm_train_4d", lambda: ops.BatchNorm(True), _bn((4, 4, 2, 2))),
    ("BatchNorm_train_2d", lambda: ops.BatchNorm(True, 1e-3), _bn((8, 4))),
    ("BatchNorm_infer", lambda: ops.BatchNorm(False), _bn((4, 4, 2, 2))),
    ("Assign", ops.Assign, [_r(8, 4), _r(8, 4)]),
]


@pytest.mark.parametrize("name,make,inputs", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_matches_single_device(name: str, make: Callable[[], ops.Primitive],
                                              inputs: list[np.ndarray]) -> None:
    grad = any(x.dtype.kind == "f" for x in inputs)
    assert check_strategies(make, inputs, grad=grad, limit=_limit()) >= 1


def test_float32_with_the_statistics_split_over_every_rank() -> None:
    p = comm.get_group_size()
    f32 = [x.astype(np.float32) for x in _bn((8, 2, 2, 2))]
    check_strategies(lambda: ops.BatchNorm(True), f32, strategies=[((p, 1, 1, 1),) + ((1,),) * 4])
    check_strategies(lambda: ops.BatchNorm(True), f32,
                     strategies=[((max(p // 2, 1), 1, min(p, 2), 1),) + ((1,),) * 4])
    check_strategies(ops.PReLU, [_r(8, 2, 2).astype(np.float32), _r(2).astype(np.float32)],
                     strategies=[((p, 1, 1), (1,))])


# ------------------------------------------------------------------ training a network
class _Net(nn.Cell):
    """``h = PReLU(BatchNorm2d(x))``, then ``h + Assign(v, h) + FloorDiv(h, 0.5)``: the floor
    branch passes no gradient back, and Assign's passes its cotangent to ``v`` only."""

    def __init__(self, channels: int, spatial: tuple[int, int], batch: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(channels, dtype=np.float64)
        self.prelu = nn.PReLU(channels, w=list(np.linspace(0.1, 0.4, channels)),
                              dtype=np.float64)
        self.v = nn.Parameter(np.zeros((batch, channels) + spatial))
        self.assign, self.floordiv = ops.Assign(), ops.FloorDiv()
        self.add1, self.add2 = ops.Add(), ops.Add()

    def construct(self, x: Any) -> Any:
        h = self.prelu(self.bn(x))
        h = self.add1(h, self.assign(self.v, h))
        return self.add2(h, self.floordiv(h, np.asarray(0.5)))


SHAPE = (8, 4, 4, 2)


def _cuts(kind: str, n: int) -> tuple[int, int, int]:
    """(batch, channel, height) cuts of ``kind`` on n ranks."""
    d = 2 if n >= 4 else 1
    if kind == "batch_channel":
        return d, n // d, 1
    return d, 1, n // d          # batch_height: H = 4 takes up to 4


def _make(kind: str | None) -> nn.TrainOneStepCell:
    net = _Net(SHAPE[1], SHAPE[2:], SHAPE[0])
    if kind is not None:
        b, c, h = _cuts(kind, comm.get_group_size())
        x = (b, c, h, 1)
        net.bn.bn_train.shard((x,) + ((c,),) * 4)
        net.prelu.prelu.shard((x, (c,)))
        net.assign.shard((x, x))
        net.floordiv.shard((x, ()))
    opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)


def _batches(k: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [(2.0 + rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)) for _ in range(k)]


@pytest.fixture
def _context() -> Iterator[None]:
    yield
    simpar.reset_auto_parallel_context()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["batch_channel", "batch_height", "data_parallel"])
def test_training_matches_single_device(kind: str, _context: None) -> None:
    mode = "data_parallel" if kind == "data_parallel" else "semi_auto_parallel"
    dataset: Any = "data_parallel" if kind == "data_parallel" else "full_batch"
    simpar.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True,
                                     enable_alltoall=True, dataset_strategy=dataset)
    train = _make(None if kind == "data_parallel" else kind)
    batches = _batches()
    with abort_job_on_error(f"{kind}: training"):
        train.build(*batches[0])
    report = check_against_single_device(train, lambda: _make(None), batches)
    assert report.passed, str(report)
    assert set(report.param_errors) == {"bn.gamma", "bn.beta", "bn.moving_mean",
                                        "bn.moving_variance", "prelu.w", "v"}
    # Assign gave v the output's cotangent; FloorDiv gave nothing back.
    assert train.last_grads["v"].any()


@pytest.mark.mpi(min_size=2)
def test_the_statistics_are_allreduced_over_the_batch_blocks(_context: None) -> None:
    n, rank = comm.get_group_size(), comm.get_rank()
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", enable_alltoall=True)
    train = _make("batch_channel")
    b, c, _ = _cuts("batch_channel", n)
    x, y = _batches(1)[0]
    train(x, y)                                  # set-up and the first step
    with comm.CommTrace() as trace:
        train(x, y)
    # The ranks holding this rank's channels in the other batch blocks (stride c).
    group = tuple(range(rank % c, n, c))
    # The program labels an op's own collective with its reason.
    stats = [(e.label.rsplit("/", 1)[-1], e.group, e.shape) for e in trace.events
             if e.label.rsplit("/", 1)[-1].startswith("BatchNorm:")]
    chans = SHAPE[1] // c
    want = [("BatchNorm: channel sums (mean)", group, (1, chans, 1, 1)),
            ("BatchNorm: squared deviations (variance)", group, (1, chans, 1, 1)),
            ("BatchNorm: channel sums of dy and dy*xhat", group, (2, chans))] if b > 1 else []
    assert stats == want, (stats, want)
    assert not [e for e in trace.events if e.kind == "AllGather"]
