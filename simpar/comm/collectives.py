"""Collectives on numpy arrays, through mpi4py's buffer interface (never pickled objects).

Every call accepts an array of any shape, contiguous or not, of dtype float32, float64, int32
or int64, and a ``group`` given as ``None`` (the world), a :class:`Group` or a list of world
ranks (group order is list order). Each call runs exactly one MPI collective on a contiguous
buffer, packing at most once on the way in and once on the way out, and records one
:class:`~simpar.comm.trace.CommEvent` (see trace.py for the byte-count convention).

Agreement. When validation is on (the default; ``set_validation(False)`` or
``SIMPAR_COMM_CHECK=0`` turns it off), every call first checks that the ranks of the group
agree, with one 8-byte ``MPI_Allreduce(BXOR)`` that is the same whatever the call, so that a
mismatch raises on every rank, naming each rank's shape, instead of hanging or corrupting
memory. Each rank XORs hashed *claims* into one word: for every edge ``(i, i+1)`` of a ring
over the group, each of its two ends claims "this edge carries my call signature" (kind,
dtype, shape, arguments), and for ``all_to_all_v`` the sender and the receiver of every piece
each claim its element count. When all claims agree they cancel in pairs and the XOR is 0, on
every rank alike; any disagreement leaves it nonzero (a false 0 has probability 2**-64), and
only then do the ranks exchange readable descriptions for the message. A rank whose own
arguments are bad (a wrong axis, dtype, op, ``out``) takes part in the same check with its
error in place of a signature, so the error reaches every rank: that rank raises its own
``TypeError``/``ValueError`` and the others a :class:`CommMismatchError` that quotes it.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from time import perf_counter
from typing import Any, NoReturn

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
# dtype.num -> index in DTYPES, for every type number that means one of them (int64 is both
# numpy's "long" and "longlong" on Linux): one dict lookup per call, and a hashable int.
_DTYPE_CODE = {np.dtype(c).num: DTYPES.index(np.dtype(c))
               for c in np.typecodes["All"] if np.dtype(c) in DTYPES}
# Signatures are hashed from ints only: Python salts the hash of str per process.
_KIND_CODE = {name: i for i, name in enumerate(
    ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "broadcast",
     "check_agreement"))}
_OP_CODE = {op: i for i, op in enumerate(REDUCE_OPS)}

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


_MPI: Any = None


def _mpi() -> Any:
    """mpi4py's MPI module, imported on first use (importing simpar.comm starts no MPI)."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI

        _MPI = MPI
    return _MPI


def _array(x: object, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if x.dtype.num not in _DTYPE_CODE:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported; use one of "
                        f"{[str(d) for d in DTYPES]}")
    return x


def _reduce_op(op: str, name: str, dtype: np.dtype) -> Any:
    if op not in _OP_CODE:
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


# ---------------------------------------------------------------- agreement across ranks


def _agree(comm: Any, g: Group, name: str, x: np.ndarray, args: tuple[int, ...] = (),
           labels: tuple[str, ...] = ()) -> None:
    """Check that every rank of ``g`` calls ``name`` on the same dtype and shape with the same
    ``args`` (ints; ``labels`` name them in a mismatch message); raise on every rank if not."""
    if not _validate or g.size == 1:
        return
    key = (_KIND_CODE[name], _DTYPE_CODE[x.dtype.num], x.shape, *args)
    _settle(comm, g, name, _ring_claims(hash(key), g), lambda: _describe(x, args, labels))


def _refuse(comm: Any, g: Group, name: str, error: Exception) -> NoReturn:
    """This rank's own arguments are bad: with validation on, tell the other ranks through the
    agreement check (so they raise too, instead of waiting in the collective), then raise."""
    if _validate and g.size > 1:
        me = g.index(int(world().Get_rank()))
        _settle(comm, g, name, hash((-2, me)),
                lambda: f"raised {type(error).__name__}: {error}", error=error)
    raise error


def ring_claims(key: int, me: int, p: int) -> int:
    """Group rank ``me``'s two claims on the ring edges it ends: "edge (me-1, me) and edge
    (me, me+1) carry ``key``" (edge ``e`` joins ranks ``e`` and ``e+1`` mod ``p``). Its
    neighbours claim the same edges with their own keys, so the XOR over all ranks is 0 when
    all keys agree."""
    return hash((me, key)) ^ hash(((me - 1) % p, key))


def piece_claims(me: int, send_counts: Sequence[int], recv_counts: Sequence[int]) -> int:
    """Group rank ``me``'s claims on the pieces of an all_to_all_v: as the sender of piece
    ``(me, j)`` it claims ``send_counts[j]`` elements, as the receiver of piece ``(j, me)`` it
    claims ``recv_counts[j]``. A piece's two claims cancel when the counts agree."""
    claims = 0
    for j in range(len(send_counts)):
        if j != me:
            claims ^= hash((me, j, send_counts[j])) ^ hash((j, me, recv_counts[j]))
    return claims


def _ring_claims(key: int, g: Group) -> int:
    return ring_claims(key, g.index(int(world().Get_rank())), g.size)


def _settle(comm: Any, g: Group, name: str, claims: int, describe: Any,
            counts: tuple[list[int], list[int]] | None = None,
            error: Exception | None = None) -> None:
    """The one 8-byte XOR-Allreduce of every rank's ``claims``; on a nonzero result (some
    claim unmatched) every rank explains and raises."""
    _CLAIMS[0] = claims
    comm.Allreduce(_CLAIMS, _TOTAL, op=_mpi().BXOR)
    if _TOTAL[0]:
        _explain(comm, g, name, describe(), counts, error)


# The check's buffers, reused: collectives are called from one thread at a time.
_CLAIMS = np.zeros(1, dtype=np.int64)
_TOTAL = np.zeros(1, dtype=np.int64)


def _describe(x: np.ndarray, args: tuple[int, ...], labels: tuple[str, ...]) -> str:
    words = [f"{x.dtype}{list(x.shape)}"]
    for label, value in zip(labels, args):
        words.append(REDUCE_OPS[value] if label == "op" else f"{label}={value}")
    return " ".join(words)


def _explain(comm: Any, g: Group, name: str, desc: str,
             counts: tuple[list[int], list[int]] | None, error: Exception | None) -> NoReturn:
    """Share every rank's description (fixed-size bytes, no pickle) and, for all_to_all_v,
    its send and expected-receive counts; raise the same message on every rank (a rank that
    raised on its own arguments raises that error)."""
    p = g.size
    width = 256
    raw = f"{name}: {desc}".encode()[:width]
    buf = np.zeros(width, dtype=np.uint8)
    buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    every = np.empty((p, width), dtype=np.uint8)
    comm.Allgather(buf, every)
    descs = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]
    rows = np.full(2 * p, -1, dtype=np.int64)
    if counts is not None:
        rows[:p], rows[p:] = counts
    table = np.empty((p, 2 * p), dtype=np.int64)
    comm.Allgather(rows, table)
    if error is not None:
        raise error
    names = {d.split(": ", 1)[0] for d in descs}
    if len(names) == 1:  # one kind of call everywhere: the kind is the message's prefix
        descs = [d.split(": ", 1)[1] for d in descs]
    seen: dict[str, list[int]] = {}
    for rank, d in zip(g.ranks, descs):
        seen.setdefault(d, []).append(rank)
    if len(seen) > 1 or counts is None:
        parts = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {d}"
                          for d, r in seen.items())
        raise CommMismatchError(f"{name}: the ranks of group {list(g.ranks)} passed different "
                                f"arrays or arguments ({parts}); every rank must pass the same")
    sends, expects = table[:, :p], table[:, p:]
    bad = [(i, j) for i, j in zip(*np.nonzero(sends != expects.T)) if i != j]
    detail = "; ".join(f"rank {g.ranks[i]} sends {sends[i, j]} elements to rank "
                       f"{g.ranks[j]}, which expects {expects[j, i]}" for i, j in bad[:4])
    more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
    raise CommMismatchError(f"{name}: the ranks of group {list(g.ranks)} disagree on the "
                            f"piece sizes: {detail}{more}")


def check_agreement(name: str, description: str,
                    group: Group | Sequence[int] | None = None) -> None:
    """Raise the same :class:`CommMismatchError` on every rank of ``group`` unless all of
    them pass the same ``description`` (one 8-byte Allreduce when they agree).

    Callers that run many collectives from one plan check the plan once this way, then run
    them under :func:`validation_disabled`.
    """
    g, comm = resolve(group)
    if g.size == 1:
        return
    digest = hashlib.blake2b(f"{name}\0{description}".encode(), digest_size=8).digest()
    key = hash((_KIND_CODE["check_agreement"], int.from_bytes(digest, "little")))
    _settle(comm, g, name, _ring_claims(key, g), lambda: description)


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
    g, comm = resolve(group)
    try:
        x = _array(x, name)
        mpi_op = _reduce_op(op, name, x.dtype)
        out = _result(out, x.shape, x.dtype, name)
    except (TypeError, ValueError) as error:
        _refuse(comm, g, name, error)
    _agree(comm, g, name, x, (_OP_CODE[op],), ("op",))
    start = perf_counter()
    send = np.ascontiguousarray(x)
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
    g, comm = resolve(group)
    try:
        x = _array(x, name)
        if x.ndim == 0:
            raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
        axis = _axis(axis, x.ndim, name)
        shape = x.shape[:axis] + (g.size * x.shape[axis],) + x.shape[axis + 1:]
        if out is not None or axis == 0:
            out = _result(out, shape, x.dtype, name)
    except (TypeError, ValueError) as error:
        _refuse(comm, g, name, error)
    _agree(comm, g, name, x, (axis,), ("axis",))
    start = perf_counter()
    send = np.ascontiguousarray(x)
    if axis == 0:  # the gathered blocks are the result: receive straight into it
        comm.Allgather(send, out.reshape((g.size,) + x.shape))
    else:
        blocks = np.empty((g.size,) + x.shape, dtype=x.dtype)
        comm.Allgather(send, blocks)
        joined = _join_blocks(blocks, axis)
        if out is None:
            out = joined
        else:
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
    g, comm = resolve(group)
    try:
        x = _array(x, name)
        if x.ndim == 0:
            raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
        axis = _axis(axis, x.ndim, name)
        mpi_op = _reduce_op(op, name, x.dtype)
        if x.shape[axis] % g.size == 0:  # else it fails below, on every rank alike
            piece = x.shape[:axis] + (x.shape[axis] // g.size,) + x.shape[axis + 1:]
            out = _result(out, piece, x.dtype, name)
    except (TypeError, ValueError) as error:
        _refuse(comm, g, name, error)
    _agree(comm, g, name, x, (axis, _OP_CODE[op]), ("axis", "op"))
    _divisible(x, axis, g.size, name)
    start = perf_counter()
    send = _split_blocks(x, axis, g.size)
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
    g, comm = resolve(group)
    try:
        x = _array(x, name)
        if x.ndim == 0:
            raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
        split_axis = _axis(split_axis, x.ndim, name, "split_axis")
        concat_axis = _axis(concat_axis, x.ndim, name, "concat_axis")
        n, p = x.shape[split_axis], g.size
        if n % p == 0 and (out is not None or concat_axis == 0):  # else: fails below
            block = x.shape[:split_axis] + (n // p,) + x.shape[split_axis + 1:]
            shape = block[:concat_axis] + (p * block[concat_axis],) + block[concat_axis + 1:]
            out = _result(out, shape, x.dtype, name)
    except (TypeError, ValueError) as error:
        _refuse(comm, g, name, error)
    _agree(comm, g, name, x, (split_axis, concat_axis), ("split_axis", "concat_axis"))
    # Whether the axis divides depends only on what the ranks just agreed on: every rank
    # raises here alike, or none does.
    _divisible(x, split_axis, g.size, name)
    start = perf_counter()
    send = _split_blocks(x, split_axis, g.size)
    if concat_axis == 0:  # the received blocks are the result: receive straight into it
        comm.Alltoall(send, out.reshape(send.shape))
    else:
        blocks = np.empty_like(send)
        comm.Alltoall(send, blocks)
        joined = _join_blocks(blocks, concat_axis)
        if out is None:
            out = joined
        else:
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
    are views of. All pieces travel in one ``MPI_Alltoallv`` on one packed buffer (no packing
    at all when the pieces are views into one contiguous array); the arrays returned are views
    of the receive buffer. Pieces travel as elements: a receiver may view the elements it gets
    in any shape of the same size. Redistribution uses this for transitions no single regular
    collective does.
    """
    name = "all_to_all_v"
    g, comm = resolve(group)
    try:
        ex = _exchange(g, pieces, recv_shapes, dtype)
        recvbuf = _result(out, (ex.rdispl[-1],), ex.dtype, name)
    except (TypeError, ValueError) as error:
        _refuse(comm, g, name, error)
    p, me = g.size, ex.me
    start = perf_counter()
    if _validate and p > 1:
        _settle(comm, g, name, ex.claims, lambda: str(ex.dtype), counts=(ex.scount, ex.rcount))
    if p > 1:
        zero_copy = _one_buffer(pieces, ex.sent)
        if zero_copy is not None:
            send, sdispl = zero_copy
        else:
            sdispl = ex.sdispl
            send = np.empty(sdispl[-1], dtype=ex.dtype)
            for j, a in enumerate(pieces):
                if j != me and a is not None and a.size:
                    send[sdispl[j]:sdispl[j] + a.size].reshape(a.shape)[...] = a
        comm.Alltoallv([send, (ex.scount, sdispl[:p])], [recvbuf, (ex.rcount, ex.rdispl[:p])])
    result: list[np.ndarray | None] = [None] * p
    rdispl = ex.rdispl
    for j, sh in enumerate(ex.shapes):
        if sh is not None:
            view = recvbuf[rdispl[j]:rdispl[j + 1]]
            result[j] = view if len(sh) == 1 else view.reshape(sh)
    own = pieces[me]
    if own is not None:
        result[me][...] = own  # type: ignore[index]
    trace.record("AllToAllV", g.ranks, ex.bytes_sent, ex.bytes_recv, perf_counter() - start,
                 ex.dtype, ex.own_shape)
    return result


@dataclass(frozen=True, slots=True)
class _Exchange:
    """What an all_to_all_v needs besides the data, worked out once per distinct call: piece
    counts and offsets in elements, the receive shapes, and this rank's agreement claims."""

    me: int
    dtype: np.dtype
    shapes: tuple[tuple[int, ...] | None, ...]
    scount: list[int]   # 0 for the piece kept, which MPI does not move
    sent: list[int]     # the group ranks a non-empty piece goes to
    sdispl: list[int]   # offsets of the pieces when packed (unused when sent in place)
    rcount: list[int]
    rdispl: list[int]   # the receive buffer keeps a slot for the piece kept, too
    claims: int
    bytes_sent: int
    bytes_recv: int
    own_shape: tuple[int, ...]


_EXCHANGES: dict[tuple[Any, ...], _Exchange] = {}


def _exchange(g: Group, pieces: Sequence[np.ndarray | None],
              recv_shapes: Sequence[Sequence[int] | None], dtype: Any) -> _Exchange:
    """The exchange for these pieces and shapes: from the cache when the same call (group,
    dtype, piece shapes and dtypes, receive shapes) was seen before. On 8 ranks sharing 2 cores
    every microsecond of bookkeeping shows up several times over in the collective's time."""
    try:
        key = (g.ranks, dtype, tuple(recv_shapes),
               tuple([None if a is None else (type(a), a.shape, a.dtype.num) for a in pieces]))
        hit = _EXCHANGES.get(key)
    except (TypeError, AttributeError):  # unhashable shapes or non-arrays: no cache
        key, hit = None, None
    if hit is not None:
        return hit
    ex = _new_exchange(g, pieces, recv_shapes, dtype)
    if key is not None:
        if len(_EXCHANGES) >= 1024:
            _EXCHANGES.clear()
        _EXCHANGES[key] = ex
    return ex


def _new_exchange(g: Group, pieces: Sequence[np.ndarray | None],
                  recv_shapes: Sequence[Sequence[int] | None], dtype: Any) -> _Exchange:
    name = "all_to_all_v"
    p, me = g.size, g.index(int(world().Get_rank()))
    if len(pieces) != p or len(recv_shapes) != p:
        raise ValueError(f"{name}: needs one piece and one receive shape per rank of the group "
                         f"({p}), got {len(pieces)} pieces and {len(recv_shapes)} shapes")
    given = [_array(a, name) for a in pieces if a is not None]
    dt = np.dtype(dtype) if dtype is not None else (given[0].dtype if given else None)
    if dt is None:
        raise ValueError(f"{name}: pass dtype= when this rank sends no piece")
    if dt.num not in _DTYPE_CODE or any(a.dtype.num != dt.num for a in given):
        raise TypeError(f"{name}: all pieces must share one supported dtype, got "
                        f"{sorted({str(a.dtype) for a in given} | {str(dt)})}")
    shapes = tuple(tuple(int(s) for s in rs) if rs is not None else None for rs in recv_shapes)
    own = pieces[me]
    if (own is None) != (shapes[me] is None) or (own is not None and own.shape != shapes[me]):
        raise ValueError(f"{name}: the piece a rank keeps for itself must match its own receive "
                         f"shape, got {None if own is None else own.shape} and {shapes[me]}")
    scount = [0 if a is None or j == me else a.size for j, a in enumerate(pieces)]
    rsize = [0 if sh is None else math.prod(sh) for sh in shapes]
    rcount = rsize.copy()
    rcount[me] = 0
    claims = (ring_claims(hash((_KIND_CODE[name], _DTYPE_CODE[dt.num])), me, p)
              ^ piece_claims(me, scount, rcount))
    item = dt.itemsize
    return _Exchange(me, dt, shapes, scount, [j for j, n in enumerate(scount) if n],
                     list(accumulate(scount, initial=0)), rcount,
                     list(accumulate(rsize, initial=0)), claims, sum(scount) * item,
                     sum(rcount) * item, own.shape if own is not None else (0,))


def _one_buffer(pieces: Sequence[np.ndarray | None], sent: Sequence[int]
                ) -> tuple[np.ndarray, list[int]] | None:
    """When every piece sent (``pieces[j]`` for ``j`` in ``sent``, all non-empty) is a
    C-contiguous view into one contiguous array, that array and the pieces' element offsets
    in it: Alltoallv then sends straight from it, with no packing."""
    if not sent:
        return None
    first = base = pieces[sent[0]]
    while isinstance(base.base, np.ndarray):  # type: ignore[union-attr]
        base = base.base  # type: ignore[union-attr]
    if not base.flags.c_contiguous or base.dtype != first.dtype:  # type: ignore[union-attr]
        return None
    address = _mpi().Get_address  # a buffer's address: ten times cheaper than .ctypes.data
    start, item = address(base), first.itemsize  # type: ignore[union-attr]
    end = start + base.nbytes  # type: ignore[union-attr]
    displ = [0] * len(pieces)
    for j in sent:
        a = pieces[j]
        if a.ndim > 1 and not a.flags.c_contiguous:  # type: ignore[union-attr]
            return None  # (1-D and contiguous is C-contiguous)
        try:
            at = address(a)
        except BufferError:  # not contiguous
            return None
        if at < start or at + a.nbytes > end or (at - start) % item:  # type: ignore[union-attr]
            return None
        displ[j] = (at - start) // item
    return base.reshape(-1), displ  # type: ignore[union-attr]


def broadcast(x: np.ndarray, root: int, group: Group | Sequence[int] | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """Every rank gets the ``root`` rank's ``x`` (``root`` is a world rank inside the group).

    Every rank passes an array of the same shape and dtype, as MindSpore's Broadcast requires.
    With ``out`` the result lands there; ``out=x`` broadcasts in place.
    """
    name = "broadcast"
    g, comm = resolve(group)
    try:
        x = _array(x, name)
        if root not in g.ranks:
            raise ValueError(f"{name}: root {root} is not in group {list(g.ranks)}")
        out = _result(out, x.shape, x.dtype, name)
    except (TypeError, ValueError) as error:
        _refuse(comm, g, name, error)
    _agree(comm, g, name, x, (int(root),), ("root",))
    start = perf_counter()
    me = world().Get_rank()
    # Only the root's values matter: the others receive into fresh memory instead of copying
    # their own x first (on 8 ranks that copy made a 1 MiB broadcast 2-2.7x a raw Bcast).
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
