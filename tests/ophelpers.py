"""Shared checks for operator tests (imported by tests/test_ops_*.py).

``check_strategies`` runs an op under every candidate strategy on the current MPI world and
asserts, on every rank: forward and backward equal the single-device kernel and VJP
(``run_op(check=True)``), each rank's shards have the strategy's slice shapes, and the
collectives traced equal ``get_parallel_info``'s forward_comm/backward_comm in kind, group and
bytes. ``fd_check`` compares a VJP with central finite differences (float64, one process).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import simpar.comm as comm
from simpar.check import relative_error
from simpar.comm import CommEvent
from simpar.ops import Primitive
from simpar.parallel import get_parallel_info, run_op


def _signature(events: Sequence[Any], phase: str) -> list[tuple[str, tuple[int, ...], int]]:
    return [(e.kind, e.group, e.bytes_recv) for e in events if f"run_op:{phase}" in e.label]


def _expected(info: dict[str, Any], key: str) -> list[tuple[str, tuple[int, ...], int]]:
    return [(c["op"], tuple(c["group"]), c["bytes"]) for c in info[key]]


def check_one(op: Primitive, inputs: Sequence[np.ndarray], grad: bool = True,
              seed: int = 0) -> None:
    """One strategy (the op's own) on the current world: values, shards and comm."""
    rank, size = comm.get_rank(), comm.get_group_size()
    rng = np.random.default_rng(seed)
    out = op.kernel(*inputs)
    dtype = inputs[0].dtype if inputs[0].dtype.kind == "f" else np.dtype(np.float64)
    dy: Any = None
    if grad:
        dys = tuple(rng.standard_normal(o.shape).astype(dtype)
                    for o in (out if isinstance(out, tuple) else (out,)))
        dy = dys if isinstance(out, tuple) else dys[0]
    with comm.CommTrace() as trace:
        run = run_op(op, *inputs, grad_output=dy, check=True, full=True)
    sh = run.sharding
    for x, lay in zip(run.local_inputs, sh.in_layouts):
        assert x.shape == lay.local_shape(), (op, x.shape, lay)
    local_outs = run.local_output if isinstance(run.local_output, tuple) else (run.local_output,)
    for o, (_, lay, _) in zip(local_outs, sh.outputs):
        assert o.shape == lay.local_shape()
    dtype = inputs[0].dtype.name
    info = get_parallel_info(op, [x.shape for x in inputs], size, rank, dtype=dtype)
    assert _signature(trace.events, "forward") == _expected(info, "forward_comm"), (
        op, _signature(trace.events, "forward"), _expected(info, "forward_comm"))
    if grad:
        assert _signature(trace.events, "backward") == _expected(info, "backward_comm"), (
            op, _signature(trace.events, "backward"), _expected(info, "backward_comm"))
        assert run.local_grads is not None
        for g, lay in zip(run.local_grads, sh.in_layouts):
            assert g is None or g.shape == lay.local_shape()


def check_strategies(make_op: Callable[[], Primitive], inputs: Sequence[np.ndarray],
                     grad: bool = True, limit: int | None = None,
                     strategies: Sequence[Any] | None = None) -> int:
    """Every candidate strategy (repeated calculation included), or ``strategies``; returns
    how many ran. ``limit`` keeps an evenly spaced sample."""
    size = comm.get_group_size()
    cands = list(strategies) if strategies is not None else make_op().candidate_strategies(
        [x.shape for x in inputs], size, fully_use_devices=False)
    if limit is not None and len(cands) > limit:
        step = len(cands) / limit
        cands = [cands[int(k * step)] for k in range(limit)]
    assert cands, "no candidate strategy"
    for s in cands:
        check_one(make_op().shard(s), inputs, grad=grad)
    return len(cands)


def fd_check(op: Primitive, inputs: Sequence[np.ndarray], diff: Sequence[int] | None = None,
             eps: float = 1e-6, tol: float = 1e-6, seed: int = 1) -> None:
    """The VJP against central finite differences of <dy, f(x)> (float64 inputs)."""
    rng = np.random.default_rng(seed)
    xs = [np.array(x, dtype=np.float64) if x.dtype.kind == "f" else x for x in inputs]
    y = op.kernel(*xs)
    dy = rng.standard_normal(y.shape)
    grads = op.vjp(xs, y, dy)
    for i in (diff if diff is not None else range(len(xs))):
        assert grads[i] is not None
        g = np.asarray(grads[i])
        num = np.zeros_like(xs[i])
        flat = xs[i].reshape(-1)
        for k in range(flat.size):
            old = flat[k]
            flat[k] = old + eps
            up = float(np.vdot(dy, op.kernel(*xs)))
            flat[k] = old - eps
            down = float(np.vdot(dy, op.kernel(*xs)))
            flat[k] = old
            num.reshape(-1)[k] = (up - down) / (2 * eps)
        # relative_error is inf for a NaN or inf on either side (np.max/abs/max could let a
        # NaN through); the 1.0 appended to both floors its scale at 1, as before: an
        # absolute error for gradients smaller than 1.
        err = relative_error(np.append(g.ravel(), 1.0), np.append(num.ravel(), 1.0))
        assert err < tol, (op, i, err)


def comm_site(e: CommEvent) -> str:
    """Where a collective ran, shortly: the cells under the backbone (or loss), the primitive
    and the node's sub-label, e.g. ``block1/ffn/fc1/MatMul:input0`` or ``Mirror``."""
    if e.label.startswith("Mirror:"):
        return "Mirror"
    parts = e.label.split("/")
    k = next(i for i, part in enumerate(parts) if re.fullmatch(r"\w+-op\d+(:.*)?", part))
    prim, _, tail = parts[k].partition(":")
    cells = [part.split("-")[0] for part in parts[3:k]]
    return "/".join([*cells, prim.split("-op")[0]]) + (f":{tail}" if tail else "")
