"""The convolutional network's operators on real ranks (mpirun -n 2, 4 or 8) against one
device: Conv2D (batch, input-channel and output-channel cuts, and the spatial cuts whose
windows stay inside a slice), Conv2DTranspose, MaxPool, AvgPool, ReLU6, Exp, Log, Flatten,
Squeeze, ExpandDims and OneHot (its class dim cut too).

Every candidate strategy of each op (repeated calculation included): on every rank the
output and every input gradient equal the single-device kernel and VJP, each shard has the
strategy's slice shape, and the collectives traced equal ``get_parallel_info``'s
(``check_strategies``). A cut of C_in is asserted to run its AllReduce, a batch or C_out cut
to run nothing forward.

    mpirun -n 8 python -m pytest -q --with-mpi -m mpi tests/test_ops_conv_mpi.py
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import simpar.comm as comm
from simpar import ops
from simpar.parallel import run_op
from tests.mpi_guard import raised_everywhere
from tests.ophelpers import check_strategies

pytestmark = pytest.mark.mpi

RNG = np.random.default_rng(33)


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def _limit() -> int | None:
    return None if comm.get_group_size() == 8 else 12


CASES: list[tuple[str, Callable[[], ops.Primitive], list[np.ndarray]]] = [
    ("Conv2D_same_3x3", lambda: ops.Conv2D(8, 3, pad_mode="same"), [_r(4, 4, 6, 6),
                                                                    _r(8, 4, 3, 3)]),
    ("Conv2D_1x1_stride2", lambda: ops.Conv2D(4, 1, stride=2), [_r(2, 4, 8, 8), _r(4, 4, 1, 1)]),
    ("Conv2D_pad_dilated", lambda: ops.Conv2D(4, 3, pad_mode="pad", pad=(1, 0, 2, 1),
                                              stride=2, dilation=(1, 2)),
     [_r(2, 2, 7, 8), _r(4, 2, 3, 3)]),
    ("Conv2DTranspose_same", lambda: ops.Conv2DTranspose(4, 3, pad_mode="same", stride=2,
                                                         input_size=(4, 2, 6, 6)),
     [_r(4, 4, 3, 3), _r(4, 2, 3, 3)]),
    ("MaxPool_same", lambda: ops.MaxPool(3, 2, "same"), [_r(4, 4, 6, 6)]),
    ("MaxPool_2x2", lambda: ops.MaxPool(2, 2), [_r(2, 4, 8, 8)]),
    ("AvgPool_2x2", lambda: ops.AvgPool(2, 2), [_r(2, 4, 8, 8)]),
    ("AvgPool_same", lambda: ops.AvgPool(3, 1, "same"), [_r(4, 4, 5, 5)]),
    ("ReLU6", ops.ReLU6, [4.0 * _r(8, 4)]),
    ("Exp", ops.Exp, [_r(8, 4)]),
    ("Log", ops.Log, [0.5 + np.abs(_r(8, 4))]),
    ("Flatten", ops.Flatten, [_r(4, 8, 2, 2)]),
    ("Squeeze", lambda: ops.Squeeze(1), [_r(4, 1, 8)]),
    ("ExpandDims", lambda: ops.ExpandDims(1), [_r(8, 4)]),
    ("OneHot", lambda: ops.OneHot(depth=8), [RNG.integers(-1, 9, 8).astype(np.int32),
                                              np.asarray(0.9), np.asarray(0.0125)]),
    ("OneHot_2d", lambda: ops.OneHot(depth=4), [RNG.integers(0, 4, (4, 2)).astype(np.int64),
                                                 np.asarray(1.0), np.asarray(0.0)]),
]


@pytest.mark.parametrize("name,make,inputs", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_matches_single_device(name: str, make: Callable[[], ops.Primitive],
                                              inputs: list[np.ndarray]) -> None:
    assert check_strategies(make, inputs, limit=_limit()) >= 1


def test_float32_convolution_with_every_rank_cutting() -> None:
    p = comm.get_group_size()
    x, w = _r(p, 2, 6, 6).astype(np.float32), _r(2 * p, 2, 3, 3).astype(np.float32)
    make = lambda: ops.Conv2D(2 * p, 3, pad_mode="same")  # noqa: E731
    check_strategies(make, [x, w], strategies=[((p, 1, 1, 1), (1, 1, 1, 1)),
                                               ((1, 1, 1, 1), (p, 1, 1, 1))])


@pytest.mark.mpi(min_size=2)
def test_the_input_channel_cut_sums_the_partial_outputs() -> None:
    """C_in cut p ways: one AllReduce over all p ranks of this rank's whole output; a batch
    or an output-channel cut: nothing forward."""
    p = comm.get_group_size()
    x, w = _r(2, 2 * p, 4, 4), _r(3, 2 * p, 3, 3)
    with comm.CommTrace() as trace:
        run_op(ops.Conv2D(3, 3).shard(((1, p, 1, 1), (1, p, 1, 1))), x, w, check=True)
    forward = [(e.kind, e.group, e.shape) for e in trace.events if "run_op:forward" in e.label]
    assert forward == [("AllReduce", tuple(range(p)), (2, 3, 2, 2))]
    for strategy in (((p, 1, 1, 1), (1, 1, 1, 1)), ((1, 1, 1, 1), (p, 1, 1, 1))):
        with comm.CommTrace() as trace:
            run_op(ops.Conv2D(p, 3).shard(strategy), _r(p, 2, 4, 4), _r(p, 2, 3, 3),
                   check=True)
        assert not [e for e in trace.events if "run_op:forward" in e.label]


@pytest.mark.mpi(min_size=2)
def test_a_strategy_that_needs_the_halo_is_refused_on_every_rank() -> None:
    """A ResNet whose stem's H is cut (a 7x7 window crosses every slice edge): building it
    raises the same StrategyError on every rank, before any collective."""
    import simpar
    from simpar import nn
    from simpar.ops import StrategyError

    p = comm.get_group_size()
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    try:
        net = nn.resnet(18, num_classes=4, width=4, layer_nums=(1, 1, 1, 1), dtype=np.float64)
        net.conv1.conv2d.shard(((1, 1, p, 1), (1, 1, 1, 1)))
        train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                                    nn.SGD(net.trainable_params(), 0.1))
        x = np.zeros((p, 3, 8 * p, 8))
        raised_everywhere(lambda: train.build(x, np.zeros(p, np.int32)), StrategyError,
                          f"cuts H into {p}, which this op cannot compute on slices")
        raised_everywhere(lambda: ops.Conv2D(4, 3, stride=0), ValueError,
                          "Conv2D: stride must be >= 1, got 0")
    finally:
        simpar.reset_auto_parallel_context()
