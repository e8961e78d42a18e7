"""Collectives on numpy arrays, through mpi4py's buffer interface (never pickled objects).

Every call accepts an array of any shape, contiguous or not, of dtype float32, float64, int32
or int64, and a ``group`` given as ``None`` (the world), a :class:`Group` or a list of world
ranks (group order is list order). Each call runs exactly one MPI collective on a contiguous
buffer, packing at most once on the way in and once on the way out, and records one
:class:`~simpar.comm.trace.CommEvent` (see trace.py for the byte-count convention; the
traffic formulas are :data:`simpar.collective_kinds.KINDS`'). Before it runs, the ranks of the
group check that they agree (:mod:`simpar.comm.agreement`).

The regular collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
``broadcast``) differ only in how they plan a call, where their result goes and how they run
it: each is one :class:`_Regular` record, and one method calls them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import numpy as np

from simpar.collective_kinds import broadcast_traffic, by_function
from simpar.comm import trace
from simpar.comm._arrays import (
    _DTYPE_CODE,
    _KIND_CODE,
    _OP_CODE,
    DTYPES,
    _apart,
    _array,
    _axis,
    _cached,
    _join_blocks,
    _keyable,
    _mpi,
    _reduce_op,
    _result,
    _same_memory,
    _split_blocks,
)
from simpar.comm._world import Group, _sleep_until, resolve, world
from simpar.comm.agreement import (
    CommMismatchError,
    _describe,
    _refuse,
    _settle,
    ring_claims,
    validation,
)

__all__ = ["RecvRequest", "SendRequest", "all_gather", "all_reduce", "all_to_all", "barrier",
           "broadcast", "irecv", "isend", "recv", "reduce_scatter", "send"]

# Each call looks up what it derives from its signature alone (kind, group, dtype, shape and
# arguments: validation, result shape, MPI op, byte counts, agreement claims) in a cache, so
# a repeated call does almost no Python before its MPI call: on 8 ranks sharing 2 cores every
# microsecond of a rank's bookkeeping shows up many times over in the collective's time.


@dataclass(frozen=True, slots=True)
class _Call:
    """One regular collective's signature, validated and worked out."""

    out_shape: tuple[int, ...]       # the result's shape
    mpi_shape: tuple[int, ...]       # the shape of the blocks MPI moves
    axes: tuple[int, ...]            # normalized axes (or the root's group index)
    mpi_op: Any
    bytes_sent: int
    bytes_recv: int
    claims: int                      # this rank's agreement claims (see ring_claims)
    args: tuple[int, ...]            # the agreed arguments, and their names for messages
    labels: tuple[str, ...]
    kind: str                        # CommTrace's name of it
    op: str | None = None            # the reduction, for a reducing collective
    late_error: str | None = None    # raised after the agreement, on every rank alike


_CALLS: dict[tuple[Any, ...], _Call] = {}

#: ``run(comm, group, call, x, out, in_place, at)``: the MPI call and its CommTrace event;
#: ``out`` None makes a new result, ``at`` is the program step that announced the call.
Run = Callable[[Any, Group, _Call, np.ndarray, np.ndarray | None, bool,
                tuple[int, str] | None], np.ndarray]


@dataclass(frozen=True, slots=True)
class _Regular:
    """One regular collective: what sets it apart from the others.

    ``plan(x, *args, group)`` validates a call and works it out (cached per signature);
    ``buffer(call, x, out)`` checks ``out`` and gives (the result buffer or None for a new
    one, whether it is ``x``'s memory); ``run`` is the MPI call; ``parameters`` its one or two
    arguments: (name, the type its value must have for the call to be cached, default or
    :data:`REQUIRED`). Calling the record is the collective: plan, refuse (a rank's own bad
    arguments reach every rank), agree, run; :func:`simpar.comm.prepare` plans it once.
    """

    name: str
    plan: Callable[..., _Call]
    buffer: Callable[[_Call, np.ndarray, np.ndarray | None], tuple[np.ndarray | None, bool]]
    run: Run
    parameters: tuple[tuple[str, type, object], ...]
    arg_types: tuple[type, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arg_types", tuple(t for _, t, _ in self.parameters))

    def __call__(self, x: np.ndarray, group: Group | Sequence[int] | None,
                 out: np.ndarray | None, *args: Any) -> np.ndarray:
        g, comm = resolve(group)
        try:
            types = self.arg_types  # (one or two arguments; spelled out, as this runs per call)
            key = ((self.name, g.ranks, x.shape, x.dtype.num, *args)
                   if _keyable(x) and type(args[0]) is types[0]
                   and (len(args) == 1 or type(args[1]) is types[1]) else None)
            c = _cached(_CALLS, key, self.plan, x, *args, g)
            out, in_place = self.buffer(c, x, out)
        except Exception as error:  # noqa: BLE001 (every error must reach the other ranks)
            _refuse(comm, g, self.name, error)
        _check(comm, g, self.name, x, c)
        return self.run(comm, g, c, x, out, in_place, None)


def _new_call(name: str, g: Group, x: np.ndarray, out_shape: tuple[int, ...],
              mpi_shape: tuple[int, ...], axes: tuple[int, ...], mpi_op: Any,
              args: tuple[int, ...], labels: tuple[str, ...], late_error: str | None = None,
              traffic: tuple[int, int] | None = None, op: str | None = None) -> _Call:
    """``traffic``: (bytes sent, bytes received), when not the kind's formula for every rank."""
    key = hash((_KIND_CODE[name], _DTYPE_CODE[x.dtype.num], x.shape, *args))
    claims = ring_claims(key, g.index(int(world().Get_rank())), g.size) if g.size > 1 else 0
    kind = by_function(name)
    if traffic is None:
        moved = kind.traffic(g.size, x.nbytes)
        traffic = (moved, moved)
    return _Call(out_shape, mpi_shape, axes, mpi_op, *traffic, claims, args, labels, kind.name,
                 op, late_error)


def _check(comm: Any, g: Group, name: str, x: np.ndarray, c: _Call) -> None:
    """The agreement check with ``c``'s claims, then the errors that depend only on what was
    agreed (so that every rank raises them alike)."""
    if g.size > 1 and validation():
        _settle(comm, g, name, c.claims, lambda: _describe(x, c.args, c.labels))
    if c.late_error is not None:
        raise ValueError(c.late_error)


def _blocks(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` checked for a collective that cuts or joins it along an axis (rank >= 1)."""
    x = _array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
    return x


def _indivisible(x: np.ndarray, axis: int, p: int, name: str) -> str | None:
    if x.shape[axis] % p == 0:
        return None
    return (f"{name}: axis {axis} of shape {x.shape} has length {x.shape[axis]}, which does "
            f"not split into {p} equal parts for a group of {p} ranks")


def _record(g: Group, c: _Call, x: np.ndarray, start: float, at: tuple[int, str] | None
            ) -> None:
    trace.record(c.kind, g.ranks, c.bytes_sent, c.bytes_recv, perf_counter() - start, x.dtype,
                 x.shape, c.op, at)


# ---------------------------------------------------------------- all_reduce
def all_reduce(x: np.ndarray, op: str = "sum", group: Group | Sequence[int] | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Elementwise reduction over the group; every rank gets the result (in ``out`` if given,
    a C-contiguous array like ``x``; it may be ``x`` itself when ``x`` is contiguous).

    On ranks 0..3 holding ``[r, r]``, ``all_reduce(x)`` gives ``[6, 6]`` everywhere.
    """
    return ALL_REDUCE(x, group, out, op)


def _plan_all_reduce(x: np.ndarray, op: str, g: Group) -> _Call:
    name = "all_reduce"
    x = _array(x, name)
    mpi_op = _reduce_op(op, name, x.dtype)
    return _new_call(name, g, x, x.shape, x.shape, (), mpi_op, (_OP_CODE[op],), ("op",),
                     op=op)


def _into_or_in_place(c: _Call, x: np.ndarray, out: np.ndarray | None
                      ) -> tuple[np.ndarray | None, bool]:
    out = _result(out, x.shape, x.dtype, "all_reduce")
    return out, _same_memory(x, out, "all_reduce")


def _run_all_reduce(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray | None,
                    in_place: bool, at: tuple[int, str] | None) -> np.ndarray:
    start = perf_counter()
    if out is None:
        out = np.empty(c.out_shape, x.dtype)
    send = np.ascontiguousarray(x)
    comm.Allreduce(_mpi().IN_PLACE if in_place else send, out, op=c.mpi_op)
    if c.op == "mean":
        out /= g.size
    _record(g, c, x, start, at)
    return out


# ---------------------------------------------------------------- all_gather
def all_gather(x: np.ndarray, axis: int = 0, group: Group | Sequence[int] | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate every rank's ``x`` along ``axis``, in group order (into ``out`` if given).

    Ranks 4..7 each holding a (2, 8) block get the (8, 8) concatenation, rank 4's rows first.
    """
    return ALL_GATHER(x, group, out, axis)


def _plan_all_gather(x: np.ndarray, axis: int, g: Group) -> _Call:
    name = "all_gather"
    x = _blocks(x, name)
    axis = _axis(axis, x.ndim, name)
    p = g.size
    shape = x.shape[:axis] + (p * x.shape[axis],) + x.shape[axis + 1:]
    return _new_call(name, g, x, shape, (p,) + x.shape, (axis,), None, (axis,), ("axis",))


def _apart_or_blocks(c: _Call, x: np.ndarray, out: np.ndarray | None, name: str, axis: int
                     ) -> tuple[np.ndarray | None, bool]:
    """``out`` checked and apart from ``x``; None when not given and the blocks MPI
    receives are joined along an ``axis`` other than 0 (they become the result)."""
    if c.late_error is None and (out is not None or axis == 0):  # else it fails later
        out = _result(out, c.out_shape, x.dtype, name)
        _apart(x, out, name)
    return out, False


def _run_gathered(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray | None,
                  axis: int, send: np.ndarray, mpi_call: Callable[[Any, Any], None]
                  ) -> np.ndarray:
    """MPI's blocks received along ``axis``: straight into the result along axis 0, else
    into blocks joined afterwards (into ``out`` when given)."""
    if axis == 0:  # the received blocks are the result: receive straight into it
        if out is None:
            out = np.empty(c.out_shape, dtype=x.dtype)
        mpi_call(send, out)  # MPI puts block i at the i-th p-th of out
        return out
    blocks = np.empty(c.mpi_shape, dtype=x.dtype)
    mpi_call(send, blocks)
    joined = _join_blocks(blocks, axis)
    if out is None:
        return joined
    out[...] = joined
    return out


def _run_all_gather(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray | None,
                    in_place: bool, at: tuple[int, str] | None) -> np.ndarray:
    start = perf_counter()
    out = _run_gathered(comm, g, c, x, out, c.axes[0], np.ascontiguousarray(x), comm.Allgather)
    _record(g, c, x, start, at)
    return out


# ---------------------------------------------------------------- reduce_scatter
def reduce_scatter(x: np.ndarray, axis: int = 0, op: str = "sum",
                   group: Group | Sequence[int] | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Reduce over the group, then give group rank ``i`` the ``i``-th piece along ``axis``.

    With 4 ranks and an (8, 4) input, each rank gets 2 rows of the sum; group rank 1 rows 2..3.
    """
    return REDUCE_SCATTER(x, group, out, axis, op)


def _plan_reduce_scatter(x: np.ndarray, axis: int, op: str, g: Group) -> _Call:
    name = "reduce_scatter"
    x = _blocks(x, name)
    axis = _axis(axis, x.ndim, name)
    mpi_op = _reduce_op(op, name, x.dtype)
    p = g.size
    piece = x.shape[:axis] + (x.shape[axis] // p,) + x.shape[axis + 1:]
    return _new_call(name, g, x, piece, piece, (axis,), mpi_op, (axis, _OP_CODE[op]),
                     ("axis", "op"), _indivisible(x, axis, p, name), op=op)


def _run_reduce_scatter(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray | None,
                        in_place: bool, at: tuple[int, str] | None) -> np.ndarray:
    start = perf_counter()
    if out is None:
        out = np.empty(c.out_shape, x.dtype)
    send = _split_blocks(x, c.axes[0], g.size)
    comm.Reduce_scatter_block(send, out, op=c.mpi_op)
    if c.op == "mean":
        out /= g.size
    _record(g, c, x, start, at)
    return out


# ---------------------------------------------------------------- all_to_all
def all_to_all(x: np.ndarray, split_axis: int, concat_axis: int,
               group: Group | Sequence[int] | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Split ``x`` into group-size pieces along ``split_axis``; piece ``j`` goes to group rank
    ``j``; the pieces received are concatenated along ``concat_axis`` in group order.

    On 8 ranks, a row block (256, 2048) becomes a column block (2048, 256):
    ``all_to_all(x, split_axis=1, concat_axis=0)``.
    """
    return ALL_TO_ALL(x, group, out, split_axis, concat_axis)


def _plan_all_to_all(x: np.ndarray, split_axis: int, concat_axis: int, g: Group) -> _Call:
    name = "all_to_all"
    x = _blocks(x, name)
    split_axis = _axis(split_axis, x.ndim, name, "split_axis")
    concat_axis = _axis(concat_axis, x.ndim, name, "concat_axis")
    p = g.size
    block = x.shape[:split_axis] + (x.shape[split_axis] // p,) + x.shape[split_axis + 1:]
    shape = block[:concat_axis] + (p * block[concat_axis],) + block[concat_axis + 1:]
    return _new_call(name, g, x, shape, (p,) + block, (split_axis, concat_axis), None,
                     (split_axis, concat_axis), ("split_axis", "concat_axis"),
                     _indivisible(x, split_axis, p, name))


def _run_all_to_all(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray | None,
                    in_place: bool, at: tuple[int, str] | None) -> np.ndarray:
    start = perf_counter()
    send = _split_blocks(x, c.axes[0], g.size)
    out = _run_gathered(comm, g, c, x, out, c.axes[1], send, comm.Alltoall)
    _record(g, c, x, start, at)
    return out


# ---------------------------------------------------------------- broadcast
def broadcast(x: np.ndarray, root: int, group: Group | Sequence[int] | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """Every rank gets the ``root`` rank's ``x`` (``root`` is a world rank inside the group).

    Every rank passes an array of the same shape and dtype, as MindSpore's Broadcast requires.
    With ``out`` the result lands there; ``out=x`` broadcasts in place.
    """
    return BROADCAST(x, group, out, root)


def _plan_broadcast(x: np.ndarray, root: int, g: Group) -> _Call:
    name = "broadcast"
    x = _array(x, name)
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool):
        raise TypeError(f"{name}: root must be an int (a world rank), got {root!r}")
    if root not in g.ranks:
        raise ValueError(f"{name}: root {root} is not in group {list(g.ranks)}")
    return _new_call(name, g, x, x.shape, x.shape, (g.index(root),), None, (int(root),),
                     ("root",), traffic=broadcast_traffic(g.size, x.nbytes))


def _into(c: _Call, x: np.ndarray, out: np.ndarray | None) -> tuple[np.ndarray | None, bool]:
    return _result(out, x.shape, x.dtype, "broadcast"), False


def _run_broadcast(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray | None,
                   in_place: bool, at: tuple[int, str] | None) -> np.ndarray:
    start = perf_counter()
    me, root = world().Get_rank(), c.args[0]
    if out is None:
        out = np.empty(c.out_shape, x.dtype)
    # Only the root's values matter: the others receive into fresh memory instead of copying
    # their own x first (on 8 ranks that copy made a 1 MiB broadcast 2-2.7x a raw Bcast).
    if me == root and out is not x:
        out[...] = x
    comm.Bcast(out, root=c.axes[0])
    sent, got = (c.bytes_sent, 0) if me == root else (0, c.bytes_recv)
    trace.record(c.kind, g.ranks, sent, got, perf_counter() - start, x.dtype, x.shape, None, at)
    return out


#: A parameter without a default.
REQUIRED = object()

ALL_REDUCE = _Regular("all_reduce", _plan_all_reduce, _into_or_in_place, _run_all_reduce,
                      (("op", str, "sum"),))
ALL_GATHER = _Regular("all_gather", _plan_all_gather,
                      lambda c, x, out: _apart_or_blocks(c, x, out, "all_gather", c.axes[0]),
                      _run_all_gather, (("axis", int, 0),))
REDUCE_SCATTER = _Regular(
    "reduce_scatter", _plan_reduce_scatter,
    lambda c, x, out: _apart_or_blocks(c, x, out, "reduce_scatter", 0), _run_reduce_scatter,
    (("axis", int, 0), ("op", str, "sum")))
ALL_TO_ALL = _Regular("all_to_all", _plan_all_to_all,
                      lambda c, x, out: _apart_or_blocks(c, x, out, "all_to_all", c.axes[1]),
                      _run_all_to_all,
                      (("split_axis", int, REQUIRED), ("concat_axis", int, REQUIRED)))
BROADCAST = _Regular("broadcast", _plan_broadcast, _into, _run_broadcast,
                     (("root", int, REQUIRED),))
#: Every regular collective, by its name.
REGULAR = {r.name: r for r in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST)}


# ---------------------------------------------------------------- point to point, barrier
def send(x: np.ndarray, dest: int, tag: int = 0) -> None:
    """Blocking send of ``x`` to world rank ``dest``."""
    x = _array(x, "send")
    start = perf_counter()
    buf = np.ascontiguousarray(x)
    world().Send(buf, dest=dest, tag=tag)
    me = world().Get_rank()
    trace.record("Send", (me, dest), buf.nbytes, 0, perf_counter() - start, x.dtype, x.shape)


class SendRequest:
    """A nonblocking send (:func:`isend`) in flight: it holds the buffer until :meth:`wait`."""

    __slots__ = ("_buf", "_dest", "_request", "_shape", "_start")

    def __init__(self, request: Any, buf: np.ndarray, dest: int, shape: tuple[int, ...],
                 posting: float) -> None:
        self._request, self._buf, self._dest, self._shape = request, buf, dest, shape
        self._start = posting   # seconds spent posting it

    def done(self) -> bool:
        """Whether the send has completed (then it is recorded, and its buffer let go);
        never blocks."""
        if self._request is None:
            return True
        start = perf_counter()
        if not self._request.Test():
            self._start += perf_counter() - start
            return False
        self._start += perf_counter() - start
        self._record()
        return True

    def wait(self) -> None:
        """Wait until the buffer may be reused (it is recorded then, as one "Send", with
        the time spent posting and waiting: not the time it was in flight meanwhile)."""
        if self._request is None:
            return
        start = perf_counter()
        self._request.Wait()
        self._start += perf_counter() - start
        self._record()

    def _record(self) -> None:
        self._request = None
        me = world().Get_rank()
        trace.record("Send", (me, self._dest), self._buf.nbytes, 0, self._start,
                     self._buf.dtype, self._shape)
        self._buf = np.empty(0, self._buf.dtype)   # let go of the array


def isend(x: np.ndarray, dest: int, tag: int = 0) -> SendRequest:
    """Nonblocking send of ``x`` to world rank ``dest``: returns at once; call ``wait()`` on
    the request before the step ends (the array is copied if it is not contiguous, and held
    until then)."""
    x = _array(x, "isend")
    start = perf_counter()
    buf = np.ascontiguousarray(x)
    request = world().Isend(buf, dest=dest, tag=tag)
    return SendRequest(request, buf, dest, tuple(x.shape), perf_counter() - start)


class RecvRequest:
    """A nonblocking receive (:func:`irecv`) posted: :meth:`wait` gives the array."""

    __slots__ = ("_out", "_request", "_source", "_status")

    def __init__(self, request: Any, out: np.ndarray, source: int, status: Any) -> None:
        self._request, self._out, self._source, self._status = request, out, source, status

    def wait(self, sleep: bool = False) -> np.ndarray:
        """The array, once it has arrived (recorded then, as one "Receive", with the time
        spent waiting); a message of another size raises ``CommMismatchError``. ``sleep``:
        test for it and sleep between tests (50 us, doubling up to 1 ms) instead of waiting
        in MPI, which spins or yields but stays runnable: where ranks outnumber the cores, a
        rank with nothing to do then leaves them to the ranks that compute."""
        start = perf_counter()
        if sleep:
            _sleep_until(self._request, 5e-5, 1e-3, self._status)
        else:
            self._request.Wait(self._status)
        got = self._status.Get_count(_mpi().BYTE)
        out = self._out
        if got != out.nbytes:
            raise CommMismatchError(f"irecv: expected {out.nbytes} bytes ({out.dtype}"
                                    f"{list(out.shape)}) from rank {self._source}, got {got}")
        me = world().Get_rank()
        trace.record("Receive", (self._source, me), 0, out.nbytes, perf_counter() - start,
                     out.dtype, out.shape)
        return out


def irecv(source: int, shape: Sequence[int], dtype: Any, tag: int = 0) -> RecvRequest:
    """Post a nonblocking receive of a ``shape``/``dtype`` array from world rank ``source``
    into a new buffer; ``wait()`` on the request gives it."""
    dt = np.dtype(dtype)
    if dt.num not in _DTYPE_CODE:
        raise TypeError(f"irecv: dtype {dt} is not supported; use one of "
                        f"{[str(d) for d in DTYPES]}")
    out = np.empty(tuple(shape), dtype=dt)
    status = _mpi().Status()
    return RecvRequest(world().Irecv(out, source=source, tag=tag), out, source, status)


def recv(source: int, shape: Sequence[int], dtype: Any, tag: int = 0) -> np.ndarray:
    """Blocking receive of a ``shape``/``dtype`` array from world rank ``source``."""
    dt = np.dtype(dtype)
    if dt.num not in _DTYPE_CODE:
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
