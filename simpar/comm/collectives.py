"""Collectives on numpy arrays, through mpi4py's buffer interface (never pickled objects).

Every call accepts an array of any shape, contiguous or not, of dtype float32, float64, int32
or int64, and a ``group`` given as ``None`` (the world), a :class:`Group` or a list of world
ranks (group order is list order). Each call runs exactly one MPI collective on a contiguous
buffer, packing at most once on the way in and once on the way out, and records one
:class:`~simpar.comm.trace.CommEvent` (see trace.py for the byte-count convention).

When validation is on (the default; ``set_validation(False)`` or ``SIMPAR_COMM_CHECK=0`` turns
it off), each call first agrees on the shape, dtype and arguments across the group with one
8-byte-per-rank Allreduce, so that a mismatch raises the same ``ValueError`` on every rank,
naming each rank's shape, instead of hanging or corrupting memory.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate
from time import perf_counter
from typing import Any

import numpy as np

from simpar.comm import trace
from simpar.comm._world import Group, resolve, world

__all__ = [
    "CommMismatchError",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "barrier",
    "broadcast",
    "check_agreement",
    "recv",
    "reduce_scatter",
    "send",
    "set_validation",
    "validation",
    "validation_disabled",
]

DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
REDUCE_OPS = ("sum", "mean", "max", "min")
_DTYPE_NUMS = frozenset(d.num for d in DTYPES)  # a set lookup, not four dtype comparisons

_validate = os.environ.get("SIMPAR_COMM_CHECK", "1") not in ("0", "false", "no")


class CommMismatchError(ValueError):
    """Ranks of one group called a collective with different shapes, dtypes or arguments."""


def set_validation(on: bool) -> None:
    """Turn the cross-rank agreement check of every collective on or off."""
    global _validate
    if not isinstance(on, bool):
        raise TypeError(f"set_validation(on) takes a bool, got {on!r}")
    _validate = on


def validation() -> bool:
    """Whether collectives check that all ranks agree on shape, dtype and arguments."""
    return _validate


@contextmanager
def validation_disabled() -> Iterator[None]:
    """Skip the agreement check inside the block (for code whose shapes agree by
    construction, such as a planned program that every rank runs identically)."""
    global _validate
    before = _validate
    _validate = False
    try:
        yield
    finally:
        _validate = before


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def _array(x: object, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if x.dtype.num not in _DTYPE_NUMS:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported; use one of "
                        f"{[str(d) for d in DTYPES]}")
    return x


def _reduce_op(op: str, name: str, dtype: np.dtype) -> Any:
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: op must be one of {list(REDUCE_OPS)}, got {op!r}")
    if op == "mean" and dtype.kind != "f":
        raise TypeError(f"{name}: op 'mean' needs a floating dtype, got {dtype}")
    MPI = _mpi()
    return {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]


def _axis(axis: int, ndim: int, name: str, what: str = "axis") -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{name}: {what} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: {what}={axis} is out of range for an array of rank {ndim}")
    return int(axis) % ndim


def _agree(comm: Any, group: Group, name: str, x: np.ndarray, *args: object) -> None:
    """Raise CommMismatchError on every rank if the ranks disagree on (shape, dtype, args)."""
    if not _validate or group.size == 1:
        return
    _agree_on(comm, group, name, f"{x.dtype}{list(x.shape)}" + "".join(f" {a}" for a in args))


def check_agreement(name: str, description: str,
                    group: Group | Sequence[int] | None = None) -> None:
    """Raise the same :class:`CommMismatchError` on every rank of ``group`` unless all of
    them pass the same ``description`` (one 16-byte Allreduce when they agree).

    Callers that run many collectives from one plan check the plan once this way, then run
    them under :func:`validation_disabled`.
    """
    g, comm = resolve(group)
    if g.size > 1:
        _agree_on(comm, g, name, description)


def _agree_on(comm: Any, group: Group, name: str, desc: str) -> None:
    h = int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=7).digest(), "little")
    mine = np.array([h, -h], dtype=np.int64)
    top = np.empty_like(mine)
    comm.Allreduce(mine, top, op=_mpi().MAX)
    if top[0] == h and top[1] == -h:
        return
    # Only on a mismatch: share every rank's description (fixed-size bytes, no pickle).
    width = 160
    buf = np.zeros(width, dtype=np.uint8)
    raw = desc.encode()[:width]
    buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    allbuf = np.empty(width * group.size, dtype=np.uint8)
    comm.Allgather(buf, allbuf)
    descs = [bytes(allbuf[i * width:(i + 1) * width]).rstrip(b"\0").decode(errors="replace")
             for i in range(group.size)]
    seen: dict[str, list[int]] = {}
    for rank, d in zip(group.ranks, descs):
        seen.setdefault(d, []).append(rank)
    parts = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {d}"
                      for d, r in seen.items())
    raise CommMismatchError(f"{name}: the ranks of group {list(group.ranks)} passed different "
                            f"arrays or arguments ({parts}); every rank must pass the same")


def _result(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype, name: str
            ) -> np.ndarray:
    """``out`` checked (C-contiguous, this shape and dtype), or a new array."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: out must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"{name}: out must be a C-contiguous {dtype} array of shape {shape}, "
                         f"got {out.dtype}{list(out.shape)}"
                         f"{'' if out.flags.c_contiguous else ' (not contiguous)'}")
    return out


def _split_blocks(x: np.ndarray, axis: int, p: int) -> np.ndarray:
    """(p, *block) contiguous: block i is x's i-th of p equal pieces along ``axis``."""
    if axis == 0:
        return np.ascontiguousarray(x).reshape((p, x.shape[0] // p) + x.shape[1:])
    s = x.shape
    split = x.reshape(s[:axis] + (p, s[axis] // p) + s[axis + 1:])
    return np.ascontiguousarray(np.moveaxis(split, axis, 0))


def _join_blocks(blocks: np.ndarray, axis: int) -> np.ndarray:
    """Inverse of the gather side: concatenate (p, *block) along ``axis`` of the block."""
    p, block = blocks.shape[0], blocks.shape[1:]
    shape = block[:axis] + (p * block[axis],) + block[axis + 1:]
    if axis == 0:
        return blocks.reshape(shape)
    return np.moveaxis(blocks, 0, axis).reshape(shape)


def _divisible(x: np.ndarray, axis: int, p: int, name: str) -> None:
    if x.shape[axis] % p:
        raise ValueError(f"{name}: axis {axis} of shape {x.shape} has length {x.shape[axis]}, "
                         f"which does not split into {p} equal parts for a group of {p} ranks")


def all_reduce(x: np.ndarray, op: str = "sum", group: Group | Sequence[int] | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Elementwise reduction over the group; every rank gets the result (in ``out`` if given,
    a C-contiguous array like ``x``; it may be ``x`` itself when ``x`` is contiguous).

    On ranks 0..3 holding ``[r, r]``, ``all_reduce(x)`` gives ``[6, 6]`` everywhere.
    """
    name = "all_reduce"
    x = _array(x, name)
    g, comm = resolve(group)
    _agree(comm, g, name, x, op)
    mpi_op = _reduce_op(op, name, x.dtype)
    start = perf_counter()
    send = np.ascontiguousarray(x)
    out = _result(out, x.shape, x.dtype, name)
    comm.Allreduce(_mpi().IN_PLACE if out is send else send, out, op=mpi_op)
    if op == "mean":
        out /= g.size
    p, n = g.size, send.nbytes
    trace.record("AllReduce", g.ranks, 2 * (p - 1) * n // p, 2 * (p - 1) * n // p,
                 perf_counter() - start, x.dtype, x.shape, op)
    return out


def all_gather(x: np.ndarray, axis: int = 0, group: Group | Sequence[int] | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate every rank's ``x`` along ``axis``, in group order (into ``out`` if given).

    Ranks 4..7 each holding a (2, 8) block get the (8, 8) concatenation, rank 4's rows first.
    """
    name = "all_gather"
    x = _array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
    axis = _axis(axis, x.ndim, name)
    g, comm = resolve(group)
    _agree(comm, g, name, x, f"axis={axis}")
    start = perf_counter()
    send = np.ascontiguousarray(x)
    shape = x.shape[:axis] + (g.size * x.shape[axis],) + x.shape[axis + 1:]
    if axis == 0:  # the gathered blocks are the result: receive straight into it
        out = _result(out, shape, x.dtype, name)
        comm.Allgather(send, out.reshape((g.size,) + x.shape))
    else:
        blocks = np.empty((g.size,) + x.shape, dtype=x.dtype)
        comm.Allgather(send, blocks)
        joined = _join_blocks(blocks, axis)
        out = joined if out is None else _result(out, shape, x.dtype, name)
        if out is not joined:
            out[...] = joined
    n = (g.size - 1) * send.nbytes
    trace.record("AllGather", g.ranks, n, n, perf_counter() - start, x.dtype, x.shape)
    return out


def reduce_scatter(x: np.ndarray, axis: int = 0, op: str = "sum",
                   group: Group | Sequence[int] | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Reduce over the group, then give group rank ``i`` the ``i``-th piece along ``axis``.

    With 4 ranks and an (8, 4) input, each rank gets 2 rows of the sum; group rank 1 rows 2..3.
    """
    name = "reduce_scatter"
    x = _array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
    axis = _axis(axis, x.ndim, name)
    g, comm = resolve(group)
    # Agree first: a check that fails on one rank only would leave the others hanging.
    _agree(comm, g, name, x, f"axis={axis}", op)
    mpi_op = _reduce_op(op, name, x.dtype)
    _divisible(x, axis, g.size, name)
    start = perf_counter()
    send = _split_blocks(x, axis, g.size)
    out = _result(out, send.shape[1:], x.dtype, name)
    comm.Reduce_scatter_block(send, out, op=mpi_op)
    if op == "mean":
        out /= g.size
    n = (g.size - 1) * out.nbytes
    trace.record("ReduceScatter", g.ranks, n, n, perf_counter() - start, x.dtype, x.shape, op)
    return out


def all_to_all(x: np.ndarray, split_axis: int, concat_axis: int,
               group: Group | Sequence[int] | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Split ``x`` into group-size pieces along ``split_axis``; piece ``j`` goes to group rank
    ``j``; the pieces received are concatenated along ``concat_axis`` in group order.

    On 8 ranks, a row block (256, 2048) becomes a column block (2048, 256):
    ``all_to_all(x, split_axis=1, concat_axis=0)``.
    """
    name = "all_to_all"
    x = _array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
    split_axis = _axis(split_axis, x.ndim, name, "split_axis")
    concat_axis = _axis(concat_axis, x.ndim, name, "concat_axis")
    g, comm = resolve(group)
    _agree(comm, g, name, x, f"split_axis={split_axis}", f"concat_axis={concat_axis}")
    _divisible(x, split_axis, g.size, name)
    start = perf_counter()
    send = _split_blocks(x, split_axis, g.size)
    block = send.shape[1:]
    shape = block[:concat_axis] + (g.size * block[concat_axis],) + block[concat_axis + 1:]
    if concat_axis == 0:  # the received blocks are the result: receive straight into it
        out = _result(out, shape, x.dtype, name)
        comm.Alltoall(send, out.reshape(send.shape))
    else:
        blocks = np.empty_like(send)
        comm.Alltoall(send, blocks)
        joined = _join_blocks(blocks, concat_axis)
        out = joined if out is None else _result(out, shape, x.dtype, name)
        if out is not joined:
            out[...] = joined
    n = (g.size - 1) * send[0].nbytes
    trace.record("AllToAll", g.ranks, n, n, perf_counter() - start, x.dtype, x.shape)
    return out


def all_to_all_v(pieces: Sequence[np.ndarray | None], recv_shapes: Sequence[Sequence[int] | None],
                 group: Group | Sequence[int] | None = None, dtype: Any = None,
                 out: np.ndarray | None = None) -> list[np.ndarray | None]:
    """Send ``pieces[j]`` to group rank ``j`` and receive a ``recv_shapes[j]`` array from it.

    ``None`` means nothing goes that way. The piece for oneself is copied, not sent. ``out``
    (1-D, the sum of all ``recv_shapes`` sizes, own piece included) is the buffer the results
    are views of. All pieces
    travel in one ``MPI_Alltoallv`` on one packed buffer; the arrays returned are views of the
    receive buffer. Redistribution uses this for transitions no single regular collective does.
    """
    name = "all_to_all_v"
    g, comm = resolve(group)
    p, me = g.size, g.index(int(world().Get_rank()))
    if len(pieces) != p or len(recv_shapes) != p:
        raise ValueError(f"{name}: needs one piece and one receive shape per rank of the group "
                         f"({p}), got {len(pieces)} pieces and {len(recv_shapes)} shapes")
    given = [_array(a, name) for a in pieces if a is not None]
    dt = np.dtype(dtype) if dtype is not None else (given[0].dtype if given else None)
    if dt is None:
        raise ValueError(f"{name}: pass dtype= when this rank sends no piece")
    if dt.num not in _DTYPE_NUMS or any(a.dtype.num != dt.num for a in given):
        raise TypeError(f"{name}: all pieces must share one supported dtype, got "
                        f"{sorted({str(a.dtype) for a in given} | {str(dt)})}")
    shapes = [tuple(int(s) for s in rs) if rs is not None else None for rs in recv_shapes]
    own = pieces[me]
    if (own is None) != (shapes[me] is None) or (own is not None and own.shape != shapes[me]):
        raise ValueError(f"{name}: the piece a rank keeps for itself must match its own receive "
                         f"shape, got {None if own is None else own.shape} and {shapes[me]}")
    # Counts and offsets in Python ints: on 8 ranks sharing 2 cores every microsecond of a
    # rank's bookkeeping shows up in the collective, so none of it goes through numpy.
    scount = [0 if a is None or j == me else a.size for j, a in enumerate(pieces)]
    # The receive buffer also has a slot for the piece this rank keeps (MPI moves 0 of it).
    rsize = [0 if sh is None else math.prod(sh) for sh in shapes]
    rcount = list(rsize)
    rcount[me] = 0
    rdispl = list(accumulate(rsize, initial=0))
    start = perf_counter()
    if _validate and p > 1:
        _agree_counts(comm, g, np.array(scount, dtype=np.int64),
                      np.array(rcount, dtype=np.int64), name)
    sent = [a if a is not None and j != me else None for j, a in enumerate(pieces)]
    zero_copy = _one_buffer(sent)
    if zero_copy is not None:
        send, sdispl = zero_copy
    else:
        sdispl = list(accumulate(scount, initial=0))
        send = np.empty(sdispl[-1], dtype=dt)
        for j, a in enumerate(sent):
            if a is not None and a.size:
                send[sdispl[j]:sdispl[j] + a.size].reshape(a.shape)[...] = a
    recvbuf = _result(out, (rdispl[-1],), dt, name)
    if p > 1:
        comm.Alltoallv([send, (scount, sdispl[:p])], [recvbuf, (rcount, rdispl[:p])])
    result: list[np.ndarray | None] = [None] * p
    for j, sh in enumerate(shapes):
        if sh is not None:
            result[j] = recvbuf[rdispl[j]:rdispl[j + 1]].reshape(sh)
    if own is not None:
        result[me][...] = own  # type: ignore[index]
    item = dt.itemsize
    trace.record("AllToAllV", g.ranks, sum(scount) * item, sum(rcount) * item,
                 perf_counter() - start, dt, own.shape if own is not None else (0,))
    return result


def _one_buffer(pieces: Sequence[np.ndarray | None]) -> tuple[np.ndarray, list[int]] | None:
    """When every piece is a C-contiguous view into one contiguous array, that array and the
    pieces' element offsets in it: Alltoallv then sends straight from it, with no packing."""
    real = [a for a in pieces if a is not None and a.size]
    if not real:
        return None
    base = real[0]
    while isinstance(base.base, np.ndarray):
        base = base.base
    if not base.flags.c_contiguous or base.dtype != real[0].dtype:
        return None
    flat = base.reshape(-1)
    start = flat.__array_interface__["data"][0]
    item = base.dtype.itemsize
    displ = [0] * len(pieces)
    for j, a in enumerate(pieces):
        if a is None or not a.size:
            continue
        if not a.flags.c_contiguous or a.dtype != base.dtype:
            return None
        offset = a.__array_interface__["data"][0] - start
        if offset < 0 or offset % item or offset // item + a.size > flat.size:
            return None
        displ[j] = offset // item
    return flat, displ


def _agree_counts(comm: Any, g: Group, send_counts: np.ndarray, recv_counts: np.ndarray,
                  name: str) -> None:
    """One Allgather of every rank's (send row, expected receive row): every rank then checks
    every pair the same way and raises the same error."""
    p = g.size
    mine = np.concatenate([send_counts, recv_counts]).astype(np.int64)
    every = np.empty((p, 2 * p), dtype=np.int64)
    comm.Allgather(mine, every)
    sends, expects = every[:, :p], every[:, p:]
    bad = [(i, j) for i in range(p) for j in range(p) if i != j and sends[i, j] != expects[j, i]]
    if bad:
        detail = "; ".join(f"rank {g.ranks[i]} sends {sends[i, j]} elements to rank "
                           f"{g.ranks[j]}, which expects {expects[j, i]}" for i, j in bad[:4])
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        raise CommMismatchError(f"{name}: the ranks of group {list(g.ranks)} disagree on the "
                                f"piece sizes: {detail}{more}")


def broadcast(x: np.ndarray, root: int, group: Group | Sequence[int] | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """Every rank gets the ``root`` rank's ``x`` (``root`` is a world rank inside the group).

    Every rank passes an array of the same shape and dtype, as MindSpore's Broadcast requires.
    With ``out`` the result lands there; ``out=x`` broadcasts in place.
    """
    name = "broadcast"
    x = _array(x, name)
    g, comm = resolve(group)
    _agree(comm, g, name, x, f"root={root}")
    if root not in g.ranks:
        raise ValueError(f"{name}: root {root} is not in group {list(g.ranks)}")
    start = perf_counter()
    me = world().Get_rank()
    # Only the root's values matter: the others receive into fresh memory instead of copying
    # their own x first (on 8 ranks that copy made a 1 MiB broadcast 2-2.7x a raw Bcast).
    out = _result(out, x.shape, x.dtype, name)
    if me == root and out is not x:
        out[...] = x
    comm.Bcast(out, root=g.index(root))
    n = out.nbytes
    sent, got = ((g.size - 1) * n, 0) if me == root else (0, n)
    trace.record("Broadcast", g.ranks, sent, got, perf_counter() - start, x.dtype, x.shape)
    return out


def send(x: np.ndarray, dest: int, tag: int = 0) -> None:
    """Blocking send of ``x`` to world rank ``dest``."""
    x = _array(x, "send")
    start = perf_counter()
    buf = np.ascontiguousarray(x)
    world().Send(buf, dest=dest, tag=tag)
    me = world().Get_rank()
    trace.record("Send", (me, dest), buf.nbytes, 0, perf_counter() - start, x.dtype, x.shape)


def recv(source: int, shape: Sequence[int], dtype: Any, tag: int = 0) -> np.ndarray:
    """Blocking receive of a ``shape``/``dtype`` array from world rank ``source``."""
    dt = np.dtype(dtype)
    if dt not in DTYPES:
        raise TypeError(f"recv: dtype {dt} is not supported; use one of {[str(d) for d in DTYPES]}")
    start = perf_counter()
    out = np.empty(tuple(shape), dtype=dt)
    status = _mpi().Status()
    world().Recv(out, source=source, tag=tag, status=status)
    got = status.Get_count(_mpi().BYTE)
    if got != out.nbytes:
        raise CommMismatchError(f"recv: expected {out.nbytes} bytes ({dt}{list(out.shape)}) from "
                                f"rank {source}, got {got}")
    me = world().Get_rank()
    trace.record("Receive", (source, me), 0, out.nbytes, perf_counter() - start, dt, out.shape)
    return out


def barrier(group: Group | Sequence[int] | None = None) -> None:
    """Wait until every rank of the group arrives."""
    g, comm = resolve(group)
    start = perf_counter()
    comm.Barrier()
    trace.record("Barrier", g.ranks, 0, 0, perf_counter() - start, "none", ())
