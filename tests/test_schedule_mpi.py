"""The per-rank program runs exactly its schedule on graphs off the common path (mpirun -n 2+).

Each graph is lowered for the world, run forward and backward on every rank under a
CommTrace, and checked three ways: every collective is a scheduled step with the step's kind,
group and bytes; every parameter's gradient has the parameter's dtype; every rank's gradient
shard is the slice of the one-device gradient. The graphs: an integer Cast between two float
ops (no gradient flows through integers), float64 data into a float32 model (the cotangent of
a value has the value's dtype, so the bytes are the schedule's), and a Split whose second
output is unused (its cotangent is a zero of the output's dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from simpar import comm, graph, nn, ops
from simpar.comm import CommTrace
from simpar.layout import distribute
from simpar.runtime import ParallelProgram, lower
from simpar.search import plan_strategies
from tests.mpi_guard import abort_job_on_error

pytestmark = pytest.mark.mpi(min_size=2)

F32 = np.float32


def _int_cast_path() -> tuple[Callable[..., Any], dict[str, nn.Parameter], np.ndarray]:
    w = nn.Parameter(np.linspace(-1, 1, 16).reshape(4, 4), name="w")
    v = nn.Parameter(np.linspace(1, 2, 16).reshape(4, 4), name="v")

    def f(x: Any) -> Any:
        y = ops.MatMul().shard(((2, 1), (1, 1)))(x, w)
        ids = ops.Cast("int32").shard(((2, 1),))(y)             # no gradient flows back
        back = ops.Cast("float64").shard(((1, 2),))(ids)
        return ops.MatMul().shard(((1, 2), (2, 1)))(back, v)

    return f, {"w": w, "v": v}, np.arange(16.0).reshape(4, 4) / 4


def _mixed_precision() -> tuple[Callable[..., Any], dict[str, nn.Parameter], np.ndarray]:
    w = nn.Parameter(np.linspace(-1, 1, 16, dtype=F32).reshape(4, 4), name="w")
    v = nn.Parameter(np.linspace(1, 2, 16, dtype=F32).reshape(4, 4), name="v")

    def f(x: Any) -> Any:  # float64 data into a float32 model
        y = ops.MatMul().shard(((2, 1), (1, 1)))(x, w)
        return ops.MatMul().shard(((2, 1), (1, 1)))(ops.Cast("float32")(y), v)

    return f, {"w": w, "v": v}, np.arange(16.0).reshape(4, 4) / 16


def _unused_split_output() -> tuple[Callable[..., Any], dict[str, nn.Parameter], np.ndarray]:
    w = nn.Parameter(np.linspace(-1, 1, 16, dtype=F32).reshape(4, 4), name="w")
    v = nn.Parameter(np.linspace(1, 2, 16, dtype=F32).reshape(4, 4), name="v")

    def f(x: Any) -> Any:
        y = ops.MatMul().shard(((2, 1), (1, 1)))(x, w)
        a, _unused = ops.Split(axis=1, output_num=2).shard(((1, 1),))(y)
        return a, ops.MatMul().shard(((2, 1), (1, 1)))(x, v)

    return f, {"w": w, "v": v}, (np.arange(16) / 16).astype(F32).reshape(4, 4)


CASES = {"int-cast": _int_cast_path, "mixed-precision": _mixed_precision,
         "unused-split-output": _unused_split_output}


def _run(program: ParallelProgram, g: graph.Graph, x: np.ndarray,
         params: dict[str, nn.Parameter], rank: int
         ) -> tuple[dict[str, np.ndarray], list[comm.CommEvent]]:
    """Forward and backward on this rank's shards, each output seeded with ones (whole: every
    rank holds the whole cotangent of its shard)."""
    local_in = [distribute(x, program.layouts[g.inputs[0].id], rank)]
    local_params = {n: distribute(p.data, program.param_layouts[n], rank)
                    for n, p in params.items()}
    with CommTrace() as trace:
        outs, tape = program.forward(local_in, local_params)
        seeds = [np.ones_like(o) for o in outs]
        grads = program.backward(tape, seeds)
    return grads, list(trace.events)


@pytest.mark.parametrize("name", list(CASES))
def test_off_path_graphs_run_their_schedule_and_match_one_device(name: str) -> None:
    f, params, x = CASES[name]()
    g = graph.trace(f, [(x.shape, x.dtype)])
    rank, n = comm.get_rank(), comm.get_group_size()
    with abort_job_on_error(f"{name}: the reference"):
        one = lower(g, plan_strategies(g, 1, "stand_alone"))
        want, _ = _run(one, g, x, params, 0)
    program = lower(g, plan_strategies(g, n, "semi_auto_parallel"))
    with abort_job_on_error(f"{name}: the parallel run"):
        grads, events = _run(program, g, x, params, rank)
    steps = program.schedule(rank)
    collectives = [s for s in steps if s.collective is not None]
    problems = []
    if [e.step for e in events] != [s.index for s in collectives]:
        problems.append(f"ran steps {[e.step for e in events]}, schedule "
                        f"{[s.index for s in collectives]}")
    problems += [f"{e} is not {steps[e.step]}" for e in events if e.step is not None and (
        e.kind, e.group, e.bytes_recv) != (steps[e.step].collective, steps[e.step].group,
                                           steps[e.step].recv_bytes)]
    for pname, p in params.items():
        got = grads[pname]
        if got.dtype != p.dtype:
            problems.append(f"{pname}'s gradient is {got.dtype}, its parameter {p.dtype}")
        block = want[pname][program.param_layouts[pname].slices(rank)]
        if not np.allclose(got, block, rtol=1e-6, atol=1e-6):
            problems.append(f"{pname}'s gradient differs from one device's by "
                            f"{np.max(np.abs(got - block)):.3g}")
    bad = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
    assert not bad, f"rank {rank}: " + ("; ".join(problems) or "another rank failed")
