"""Exchanges of pieces of different sizes: ``all_to_all_v`` (a piece per rank, any shapes) and
``all_to_all_single`` (rows of one array), each one ``MPI_Alltoallv``.

What a call derives from its pieces' shapes alone (counts, offsets, agreement claims: an
:class:`_Exchange`) is worked out once per distinct call. The ranks agree on the kind and
dtype of the call, and the sender and receiver of every piece on its size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import add, is_
from time import perf_counter
from typing import Any, cast

import numpy as np

from simpar.collective_kinds import by_function
from simpar.comm import trace
from simpar.comm._arrays import (
    _DTYPE_CODE,
    _INT,
    _KIND_CODE,
    DTYPES,
    _apart,
    _array,
    _cached,
    _keyable,
    _mpi,
    _result,
)
from simpar.comm._world import Group, resolve, world
from simpar.comm.agreement import _refuse, _settle, piece_claims, ring_claims, validation

__all__ = ["all_to_all_single", "all_to_all_v"]

#: CommTrace's name of both exchanges.
_KIND = by_function("all_to_all_v").name


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
    except Exception as error:  # noqa: BLE001 (every error must reach the other ranks)
        _refuse(comm, g, name, error)
    p, me = g.size, ex.me
    start = perf_counter()
    if p > 1 and validation():
        _settle(comm, g, name, ex.claims, lambda: str(ex.dtype), counts=(ex.scount, ex.rcount))
    if p > 1:
        zero_copy = _one_buffer(pieces, ex)
        if zero_copy is not None:
            send, sdispl = zero_copy
        else:
            sdispl = ex.sdispl
            send = np.empty(sdispl[-1], dtype=ex.dtype)
            for j, a in enumerate(pieces):
                if j != me and a is not None and a.size:
                    send[sdispl[j]:sdispl[j] + a.size].reshape(a.shape)[...] = a
        comm.Alltoallv([send, (ex.scount, sdispl[:p])], [recvbuf, (ex.rcount, ex.rdispl[:p])])
    result: list[np.ndarray | None] = [
        None if at is None else recvbuf[at] if sh is None else recvbuf[at].reshape(sh)
        for at, sh in ex.views]
    own = pieces[me]
    if own is not None:
        result[me][...] = own  # type: ignore[index]
    trace.record(_KIND, g.ranks, ex.bytes_sent, ex.bytes_recv, perf_counter() - start,
                 ex.dtype, ex.own_shape)
    return result


@dataclass(frozen=True, slots=True)
class _Exchange:
    """What an all_to_all_v needs besides the data, worked out once per distinct call: piece
    counts and offsets in elements, the receive shapes, and this rank's agreement claims."""

    me: int
    dtype: np.dtype
    shapes: tuple[tuple[int, ...] | None, ...]  # per source (all_to_all_single: the result's)
    scount: list[int]   # 0 for the piece kept, which MPI does not move
    sent: list[int]     # the group ranks a non-empty piece goes to
    sdispl: list[int]   # offsets of the pieces when packed (unused when sent in place)
    rcount: list[int]
    rdispl: list[int]   # the receive buffer keeps a slot for the piece kept, too
    claims: int
    bytes_sent: int
    bytes_recv: int
    own_shape: tuple[int, ...]
    rows: tuple[list[int], list[int]] | None = None  # all_to_all_single: counts in rows
    # all_to_all_v: the bytes of each piece sent (in ``sent`` order), whether they are all
    # 1-D (then Get_address alone proves them contiguous), and per source the slice of the
    # receive buffer its piece is and the shape to view it in (None: 1-D, as received)
    sent_bytes: tuple[int, ...] = ()
    sent_flat: bool = True
    views: tuple[tuple[slice | None, tuple[int, ...] | None], ...] = ()
    given: tuple[Any, ...] = ()  # all_to_all_v: the receive shapes it was built from, as given


_EXCHANGES: dict[tuple[Any, ...], _Exchange] = {}


def _exchange(g: Group, pieces: Sequence[np.ndarray | None],
              recv_shapes: Sequence[Sequence[int] | None], dtype: Any) -> _Exchange:
    """The exchange for these pieces and shapes: from the cache when the same call (group,
    dtype, piece shapes and dtypes, receive shapes) was seen before. On 8 ranks sharing 2 cores
    every microsecond of bookkeeping shows up several times over in the collective's time."""
    def build() -> _Exchange:
        return _new_exchange(g, pieces, recv_shapes, dtype)
    try:
        shapes = tuple(recv_shapes)
        # dtype objects compare by value, byte order included.
        key = (g.ranks, dtype, shapes,
               tuple([None if a is None else (a.shape, a.dtype) for a in pieces]))
        found = _EXCHANGES.get(key)
    except (TypeError, AttributeError):  # unhashable shapes or non-arrays: no cache
        return build()
    # (2.0,) == (2,) and (True,) == (1,): a hit serves shapes of ints only, which the very
    # tuples the exchange was built from are (the cheap test: callers pass the same ones)
    if found is not None and all(map(is_, shapes, found.given)):
        return found
    if not {type(n) for sh in shapes if sh is not None for n in sh} <= _INT:
        return build()  # shapes of other types get the full check every time
    return found if found is not None else _cached(_EXCHANGES, key, build)


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
    code = _DTYPE_CODE.get(dt.num)
    if code is None or not dt.isnative or any(_DTYPE_CODE.get(a.dtype.num) != code
                                              for a in given):
        raise TypeError(f"{name}: all pieces must share one supported dtype, got "
                        f"{sorted({a.dtype.str for a in given} | {dt.str})}")
    dt = DTYPES[code]  # numpy's two int64 type numbers travel as one MPI type
    for rs in recv_shapes:
        if rs is not None and not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool)
                                      and n >= 0 for n in rs):
            raise ValueError(f"{name}: a receive shape must be a sequence of non-negative ints "
                             f"or None, got {rs!r}")
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
    sent = [j for j, n in enumerate(scount) if n]
    rdispl = list(accumulate(rsize, initial=0))
    views = tuple((None, None) if sh is None else
                  (slice(rdispl[j], rdispl[j + 1]), None if len(sh) == 1 else sh)
                  for j, sh in enumerate(shapes))
    return _Exchange(me, dt, shapes, scount, sent, list(accumulate(scount, initial=0)),
                     rcount, rdispl, claims, sum(scount) * item, sum(rcount) * item,
                     own.shape if own is not None else (0,),
                     sent_bytes=tuple(scount[j] * item for j in sent),
                     sent_flat=all(pieces[j].ndim == 1 for j in sent),  # type: ignore[union-attr]
                     views=views, given=tuple(recv_shapes))


def all_to_all_single(x: np.ndarray, send_counts: Sequence[int], recv_counts: Sequence[int],
                      group: Group | Sequence[int] | None = None,
                      out: np.ndarray | None = None) -> np.ndarray:
    """The packed all_to_all_v (PyTorch's ``all_to_all_single``): the first
    ``send_counts[0]`` rows of ``x`` go to group rank 0, the next ``send_counts[1]`` to rank 1,
    and so on; the result stacks the ``recv_counts[j]`` rows from each rank ``j`` in group
    order. Rows are ``x[i]`` (every rank's rows have the same shape); the rows a rank keeps
    for itself (``send_counts[me] == recv_counts[me]``) are copied, not sent.

    On 2 ranks, rank 0 holding rows a, b, c with ``send_counts=[1, 2]`` and rank 1 holding d, e
    with ``send_counts=[1, 1]``: rank 0 gets ``[a, d]`` (``recv_counts=[1, 1]``) and rank 1
    ``[b, c, e]`` (``recv_counts=[2, 1]``). One ``MPI_Alltoallv``, straight from ``x`` when it
    is C-contiguous, into ``out``.
    """
    name = "all_to_all_single"
    g, comm = resolve(group)
    try:
        key = None
        if _keyable(x):
            key = (name, g.ranks, x.shape, x.dtype.num, tuple(send_counts), tuple(recv_counts))
            if set(map(type, key[4] + key[5])) != _INT:  # 1.0 == 1: only ints are keys
                key = None
        ex = _cached(_EXCHANGES, key, _new_single, g, x, send_counts, recv_counts)
        recvbuf = _result(out, ex.shapes[0], ex.dtype, name)
        _apart(x, recvbuf, name)
    except Exception as error:  # noqa: BLE001 (every error must reach the other ranks)
        _refuse(comm, g, name, error)
    p, me = g.size, ex.me
    start = perf_counter()
    if p > 1 and validation():
        _settle(comm, g, name, ex.claims, lambda: f"{ex.dtype} rows of {list(x.shape[1:])}",
                counts=ex.rows, unit="rows")
    send = np.ascontiguousarray(x)
    send = send if send.ndim == 1 else send.reshape(-1)
    flat = recvbuf if recvbuf.ndim == 1 else recvbuf.reshape(-1)
    if p > 1:
        comm.Alltoallv([send, (ex.scount, ex.sdispl[:p])], [flat, (ex.rcount, ex.rdispl[:p])])
    own = ex.own_shape[0]
    if own:
        flat[ex.rdispl[me]:ex.rdispl[me] + own] = send[ex.sdispl[me]:ex.sdispl[me] + own]
    trace.record(_KIND, g.ranks, ex.bytes_sent, ex.bytes_recv, perf_counter() - start,
                 ex.dtype, x.shape)
    return recvbuf


def _new_single(g: Group, x: np.ndarray, send_counts: Sequence[int],
                recv_counts: Sequence[int]) -> _Exchange:
    name = "all_to_all_single"
    x = _array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: needs an array of rank >= 1 (rows), got a 0-d array")
    p, me = g.size, g.index(int(world().Get_rank()))
    sc, rc = list(send_counts), list(recv_counts)
    if len(sc) != p or len(rc) != p:
        raise ValueError(f"{name}: needs one send count and one receive count per rank of the "
                         f"group ({p}), got {len(sc)} and {len(rc)}")
    for what, counts in (("send_counts", sc), ("recv_counts", rc)):
        if not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 0
                   for c in counts):
            raise ValueError(f"{name}: {what} must be non-negative ints, got {counts}")
    if sum(sc) != x.shape[0]:
        raise ValueError(f"{name}: send_counts {sc} add up to {sum(sc)} rows, but x has "
                         f"{x.shape[0]} (shape {x.shape})")
    if sc[me] != rc[me]:
        raise ValueError(f"{name}: a rank keeps as many rows as it sends itself, got "
                         f"send_counts[{me}]={sc[me]} and recv_counts[{me}]={rc[me]}")
    sc, rc = [int(c) for c in sc], [int(c) for c in rc]
    row = math.prod(x.shape[1:])
    sel = [c * row for c in sc]
    rel = [c * row for c in rc]
    scount, rcount = sel.copy(), rel.copy()
    scount[me] = rcount[me] = 0
    # Claims on rows, not elements: rows of size 0 still have to agree.
    srows, rrows = sc.copy(), rc.copy()
    srows[me] = rrows[me] = 0
    claims = (ring_claims(hash((_KIND_CODE[name], _DTYPE_CODE[x.dtype.num], x.shape[1:])), me, p)
              ^ piece_claims(me, srows, rrows))
    item = x.dtype.itemsize
    return _Exchange(me, x.dtype, ((sum(rc),) + x.shape[1:],), scount,
                     [j for j, n in enumerate(scount) if n], list(accumulate(sel, initial=0)),
                     rcount, list(accumulate(rel, initial=0)), claims, sum(scount) * item,
                     sum(rcount) * item, (sel[me],), (srows, rrows))


def _one_buffer(pieces: Sequence[np.ndarray | None], ex: _Exchange
                ) -> tuple[np.ndarray, list[int]] | None:
    """When every piece sent is a C-contiguous view into one contiguous array, that array
    and the pieces' element offsets in it: Alltoallv then sends straight from it, with no
    packing. (The per-piece loop is the hot path of a repeated exchange: the sizes and
    whether the pieces are 1-D come from the cached exchange.)"""
    sent = ex.sent
    if not sent:
        return None
    base = cast(np.ndarray, pieces[sent[0]])  # a piece sent is never None
    while isinstance(base.base, np.ndarray):
        base = base.base
    if not base.flags.c_contiguous or base.dtype != ex.dtype:
        return None
    address = _mpi().Get_address  # a buffer's address: ten times cheaper than .ctypes.data
    try:  # Get_address refuses a piece that is not contiguous
        at = [address(pieces[j]) for j in sent]
    except BufferError:
        return None
    if not ex.sent_flat and not all(pieces[j].flags.c_contiguous  # type: ignore[union-attr]
                                    for j in sent):
        return None
    start, item = address(base), ex.dtype.itemsize
    if min(at) < start or max(map(add, at, ex.sent_bytes)) > start + base.nbytes:
        return None
    offsets = [a - start for a in at]
    if any(o % item for o in offsets):  # a piece not aligned to whole elements of the base
        return None
    displ = [0] * len(pieces)
    for j, o in zip(sent, offsets):
        displ[j] = o // item
    flat = base.reshape(-1)
    # numpy's two int64 type numbers: send as the one the receive buffer has
    return (flat if flat.dtype.num == ex.dtype.num else flat.view(ex.dtype)), displ

