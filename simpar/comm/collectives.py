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

import functools
import hashlib
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import add, is_
from time import perf_counter
from typing import Any, NoReturn, cast

import numpy as np

from simpar.comm import trace
from simpar.comm._world import Group, resolve, world
from simpar.cost.collective import broadcast_traffic, traffic

__all__ = [
    "CommMismatchError",
    "InputMismatchError",
    "PendingCheck",
    "Prepared",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "all_to_all_v",
    "barrier",
    "broadcast",
    "check_agreement",
    "check_same_arrays",
    "prepare",
    "recv",
    "reduce_scatter",
    "send",
    "set_validation",
    "start_check_same_arrays",
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
     "check_agreement", "all_to_all_single", "check_same_arrays"))}
_OP_CODE = {op: i for i, op in enumerate(REDUCE_OPS)}

_validate = os.environ.get("SIMPAR_COMM_CHECK", "1") not in ("0", "false", "no")


class CommMismatchError(ValueError):
    """Ranks of one group called a collective with different shapes, dtypes or arguments.

    ``detail`` holds what each rank passed ("rank 0: …; ranks 1,2: …") when that is known.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def set_validation(on: bool) -> None:
    """Turn the cross-rank agreement check of every collective on or off."""
    global _validate
    if not isinstance(on, bool):
        raise TypeError(f"set_validation(on) takes a bool, got {on!r}")
    _validate = on


def validation() -> bool:
    """Whether collectives check that all ranks agree on shape, dtype and arguments."""
    return _validate


class validation_disabled:  # noqa: N801  (used as a function: ``with validation_disabled():``)
    """Skip the agreement check inside the block (for code whose shapes agree by
    construction, such as a planned program that every rank runs identically). A class
    rather than a generator: every redistribution enters one."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        global _validate
        self._before = _validate
        _validate = False

    def __exit__(self, *exc: object) -> None:
        global _validate
        _validate = self._before


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
    if x.dtype.num not in _DTYPE_CODE or not x.dtype.isnative:
        raise TypeError(f"{name}: dtype {x.dtype.str if not x.dtype.isnative else x.dtype} is "
                        f"not supported; use one of {[str(d) for d in DTYPES]} in native "
                        "byte order")
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
            error: Exception | None = None, unit: str = "elements") -> None:
    """The one 8-byte XOR-Allreduce of every rank's ``claims``; on a nonzero result (some
    claim unmatched) every rank explains and raises."""
    _CLAIMS[0] = claims
    comm.Allreduce(_CLAIMS, _TOTAL, op=_mpi().BXOR)
    if _TOTAL[0]:
        _explain(comm, g, name, describe(), counts, error, unit)


# The largest group whose piece counts a mismatch message lists (2p^2 int64 on each rank).
_COUNT_TABLE_MAX = 512

# The check's buffers, reused: collectives are called from one thread at a time.
_CLAIMS = np.zeros(1, dtype=np.int64)
_TOTAL = np.zeros(1, dtype=np.int64)


def _describe(x: np.ndarray, args: tuple[int, ...], labels: tuple[str, ...]) -> str:
    words = [f"{x.dtype}{list(x.shape)}"]
    for label, value in zip(labels, args):
        words.append(REDUCE_OPS[value] if label == "op" else f"{label}={value}")
    return " ".join(words)


def _explain(comm: Any, g: Group, name: str, desc: str,
             counts: tuple[list[int], list[int]] | None, error: Exception | None,
             unit: str = "elements") -> NoReturn:
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
    table = None
    if p <= _COUNT_TABLE_MAX:  # every rank's counts: 2p^2 int64 on each rank
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
        refused = sorted(r for d, rs in seen.items() if d.startswith("raised ") for r in rs)
        if refused:
            raise CommMismatchError(f"{name}: rank{'s' if len(refused) > 1 else ''} "
                                    f"{','.join(map(str, refused))} of group {list(g.ranks)} "
                                    f"refused {'its' if len(refused) == 1 else 'their'} own "
                                    f"arguments, so no rank runs the collective ({parts})", parts)
        raise CommMismatchError(f"{name}: the ranks of group {list(g.ranks)} passed different "
                                f"arrays or arguments ({parts}); every rank must pass the same",
                                parts)
    if table is None:
        raise CommMismatchError(f"{name}: the ranks of group {list(g.ranks)[:8]}... ({p} "
                                f"ranks) disagree on the piece sizes")
    sends, expects = table[:, :p], table[:, p:]
    bad = [(i, j) for i, j in zip(*np.nonzero(sends != expects.T)) if i != j]
    detail = "; ".join(f"rank {g.ranks[i]} sends {sends[i, j]} {unit} to rank "
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
    _settle(comm, g, name, _agreement_claims(name, description, g), lambda: description)


def _agreement_claims(name: str, description: str, g: Group) -> int:
    """This rank's ring claims that every rank of ``g`` passes ``description`` to ``name``."""
    digest = hashlib.blake2b(f"{name}\0{description}".encode(), digest_size=8).digest()
    key = hash((_KIND_CODE["check_agreement"], int.from_bytes(digest, "little")))
    return _ring_claims(key, g)


class InputMismatchError(CommMismatchError):
    """The ranks passed different values where every rank must pass the same global array."""


def check_same_arrays(name: str, arrays: Sequence[tuple[str, Any]],
                      group: Group | Sequence[int] | None = None) -> None:
    """Raise the same :class:`InputMismatchError` on every rank of ``group`` unless every rank
    passes equal ``(label, array)`` pairs: same shape, dtype and bytes (a 64-bit hash of each
    array, :func:`_fingerprint`, then one 8-byte Allreduce; it is not recorded in a
    CommTrace).

    ``run_op`` and ``TrainOneStepCell`` call it on their global inputs: an unseeded
    ``np.random.rand`` on every rank gives each rank a different "global" array, and the
    parallel result would then differ from one device for a reason that is not the parallel
    math. ``check_same_arrays("run_op", [("a", a)])`` on ranks holding different ``a`` raises
    "run_op: the global inputs differ across ranks: ranks 0,2: a float64[8, 16] #…".
    """
    start_check_same_arrays(name, arrays, group).wait()


@dataclass(eq=False)
class PendingCheck:
    """A :func:`start_check_same_arrays` in flight: :meth:`wait` completes it."""

    _finish: Any = None     # () -> None: waits, then explains and raises on a mismatch
    _drop: Any = None       # () -> None: waits, explaining nothing

    def wait(self) -> None:
        """Complete the check: raise on every rank when the ranks' arrays differ (or when a
        rank's own input was refused). Every rank of the group must call it at the same point
        of its sequence of collectives."""
        finish, self._finish, self._drop = self._finish, None, None
        if finish is not None:
            finish()

    def abandon(self) -> None:
        """Complete the Allreduce without acting on it: for a rank leaving on an exception of
        its own, where the other ranks may be inside a collective it will never join."""
        drop, self._finish, self._drop = self._drop, None, None
        if drop is not None:
            drop()


def start_check_same_arrays(name: str, arrays: Sequence[tuple[str, Any]],
                            group: Group | Sequence[int] | None = None,
                            refused: Exception | None = None) -> PendingCheck:
    """Start :func:`check_same_arrays` without waiting for it: its 8-byte Allreduce is
    nonblocking, and MPI moves it along inside the collectives this rank runs before
    :meth:`PendingCheck.wait`, so a training step's check shares their synchronisation
    instead of costing one of its own (on oversubscribed cores, several milliseconds).
    Everything between the start and the wait must be safe to run on inputs that differ
    across ranks, in shape-agreeing stand-ins: no rank acts on its results before the wait.

    ``refused``: this rank cannot use its input (say, a shape the program does not take);
    it runs the step on stand-ins, and the wait raises ``refused`` here and an
    :class:`InputMismatchError` quoting it on the other ranks."""
    g, comm = resolve(group)
    if g.size == 1:
        def alone() -> None:
            if refused is not None:
                raise refused
        return PendingCheck(alone, lambda: None)
    me = g.index(int(world().Get_rank()))
    held: list[tuple[str, np.ndarray]] = []
    prints: list[int] = []
    if refused is not None:
        description = f"raised {type(refused).__name__}: {refused}"
        claims = hash((-2, me))
    else:
        # The claims hash integers only (a str's hash differs between processes; each text is
        # digested once): the readable description is written only for a mismatch's message.
        held = [(label, np.ascontiguousarray(x)) for label, x in arrays]
        prints = [_fingerprint(a) for _, a in held]
        key = hash((_KIND_CODE["check_same_arrays"], _text_code(name),
                    *((_text_code(label), _text_code(a.dtype.str), a.shape, word)
                      for (label, a), word in zip(held, prints))))
        claims = ring_claims(key, me, g.size)
        description = ""   # written by finish(), on a mismatch
    mine, total = np.array([claims], dtype=np.int64), np.zeros(1, dtype=np.int64)
    request = comm.Iallreduce(mine, total, op=_mpi().BXOR)
    buffers = [mine, total]

    def finish() -> None:
        request.Wait()
        del buffers[:]   # held until now: MPI writes into them until the Allreduce is done
        if not total[0]:
            return
        said = description or ", ".join(f"{label} {a.dtype}{list(a.shape)} #{word:016x}"
                                        for (label, a), word in zip(held, prints))
        try:
            _explain(comm, g, name, said, None, refused)
        except InputMismatchError:
            raise
        except CommMismatchError as e:
            found = re.search(r"(ranks? [\d,]+): raised (.*?)(?=; ranks? [\d,]+: |$)",
                              e.detail)
            if found:   # another rank refused its own input: its error, quoted
                raise InputMismatchError(f"{name}: {found[1]} refused its input with "
                                         f"{found[2]}; every rank refuses the step",
                                         e.detail) from None
            raise InputMismatchError(
                f"{name}: the global inputs differ across ranks ({e.detail or e}); every rank "
                "must pass the same global arrays: seed the random generator alike on every "
                "rank (e.g. np.random.default_rng(0)) or load the same data on each") from None

    def drop() -> None:
        request.Wait()
        del buffers[:]

    return PendingCheck(finish, drop)


@functools.lru_cache(maxsize=1024)
def _text_code(text: str) -> int:
    """A 64-bit digest of ``text``, the same in every process (``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _fingerprint(a: np.ndarray) -> int:
    """A 64-bit hash of a contiguous array's bytes that sees where each byte is (a batch
    whose rows are shuffled differently differs). Up to 16 KiB it is blake2b's, one C call:
    a training step's batch of token ids is 2 KiB, and the multilinear hash's five numpy
    calls cost it 48 us against blake2b's 20 on a rank of 8 sharing 2 cores. Above, it is
    a multilinear hash: the sum of the 8-byte words times fixed odd multipliers, mod 2**64,
    near memory speed (about 35 us per 256 KiB on this host, against 80 for zlib's CRC-32
    and 300 for blake2b). Two different arrays agree by accident with probability about
    2**-64."""
    if a.nbytes <= _SMALL:
        data = a.data if a.ndim and a.size else a.tobytes()
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    raw = np.frombuffer(a.data.cast("B"), np.uint8)
    size = raw.size
    if size % 8:
        raw = np.concatenate([raw, np.zeros(8 - size % 8, np.uint8)])
    words = raw.view(np.uint64)
    total = int(np.multiply(words, _multipliers(words.size)).sum(dtype=np.uint64))
    return total ^ size


_SMALL = 16 * 1024   # bytes: blake2b's per-call cost beats numpy's up to here


@functools.lru_cache(maxsize=8)
def _multipliers(n: int) -> np.ndarray:
    """``n`` odd 64-bit multipliers, the same on every rank and in every process."""
    out = np.random.default_rng(0x5EED5).integers(0, 2**63, n, dtype=np.uint64)
    out <<= np.uint64(1)
    out |= np.uint64(1)
    out.setflags(write=False)
    return out


def _result(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype, name: str
            ) -> np.ndarray:
    """``out`` checked (C-contiguous, this shape and dtype), or a new array."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name}: out must be a numpy.ndarray, got {type(out).__name__}")
    flags = out.flags
    if out.shape != shape or out.dtype != dtype or not (flags.c_contiguous and flags.writeable):
        flaw = (" (not contiguous)" if not flags.c_contiguous
                else " (read-only)" if not flags.writeable else "")
        raise ValueError(f"{name}: out must be a writeable C-contiguous {dtype} array of shape "
                         f"{shape}, got {out.dtype}{list(out.shape)}{flaw}")
    if out.dtype.num != dtype.num:  # int64 as numpy's "long" vs "longlong": one MPI type
        return out.view(dtype)
    return out


def _overlap(x: np.ndarray, out: np.ndarray) -> str | None:
    """"same" when ``out`` is exactly ``x``'s memory, "partial" when they overlap otherwise."""
    if out is x:
        return "same"
    xb, ob = x.base, out.base  # numpy makes every view's base the array that owns the memory
    if (x if xb is None else xb) is not (out if ob is None else ob):
        return None
    if not x.flags.c_contiguous or not x.nbytes or not out.nbytes:
        return None  # a non-contiguous x is packed into fresh memory first
    address = _mpi().Get_address
    a, b = address(x), address(out)
    if a == b and x.nbytes == out.nbytes:
        return "same"
    return "partial" if a < b + out.nbytes and b < a + x.nbytes else None


def _same_memory(x: np.ndarray, out: np.ndarray, name: str) -> bool:
    """Whether ``out`` is exactly ``x``'s memory (an in-place call); a partial overlap is an
    error, which MPI would report on this rank only."""
    overlap = _overlap(x, out)
    if overlap == "partial":
        raise ValueError(f"{name}: out overlaps the input's memory without being the input; "
                         "pass separate arrays, or out=x itself")
    return overlap == "same"


def _apart(x: np.ndarray, out: np.ndarray, name: str) -> None:
    """Refuse an ``out`` that shares memory with ``x`` (this collective has no in-place form)."""
    if _overlap(x, out) is not None:
        raise ValueError(f"{name}: out overlaps the input's memory; this collective cannot run "
                         "in place, pass separate arrays")


def _split_blocks(x: np.ndarray, axis: int, p: int) -> np.ndarray:
    """x contiguous, its i-th of p equal pieces along ``axis`` as the i-th p-th of its memory
    (what MPI sends to group rank i). Along axis 0 that is x itself, unreshaped: MPI cuts a
    buffer into p blocks itself."""
    if axis == 0:
        return np.ascontiguousarray(x)
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


# ---------------------------------------------------------------- the regular collectives
#
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
    late_error: str | None = None    # raised after the agreement, on every rank alike


_CALLS: dict[tuple[Any, ...], _Call] = {}


def _cached(cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...] | None, build: Any,
            *args: Any) -> Any:
    """``cache[key]``, ``build(*args)`` on a miss (``key`` None: arguments of unusual types,
    never cached). A full cache (4096 signatures) starts over."""
    if key is None:
        return build(*args)
    value = cache.get(key)
    if value is None:
        value = build(*args)
        if len(cache) >= 4096:
            cache.clear()
        cache[key] = value
    return value


def _new_call(name: str, g: Group, x: np.ndarray, out_shape: tuple[int, ...],
              mpi_shape: tuple[int, ...], axes: tuple[int, ...], mpi_op: Any, nbytes: int,
              args: tuple[int, ...], labels: tuple[str, ...],
              late_error: str | None = None, bytes_recv: int | None = None) -> _Call:
    key = hash((_KIND_CODE[name], _DTYPE_CODE[x.dtype.num], x.shape, *args))
    claims = ring_claims(key, g.index(int(world().Get_rank())), g.size) if g.size > 1 else 0
    return _Call(out_shape, mpi_shape, axes, mpi_op, nbytes,
                 nbytes if bytes_recv is None else bytes_recv, claims, args, labels, late_error)


def _check(comm: Any, g: Group, name: str, x: np.ndarray, c: _Call) -> None:
    """The agreement check with ``c``'s claims, then the errors that depend only on what was
    agreed (so that every rank raises them alike)."""
    if _validate and g.size > 1:
        _settle(comm, g, name, c.claims, lambda: _describe(x, c.args, c.labels))
    if c.late_error is not None:
        raise ValueError(c.late_error)


def _indivisible(x: np.ndarray, axis: int, p: int, name: str) -> str | None:
    if x.shape[axis] % p == 0:
        return None
    return (f"{name}: axis {axis} of shape {x.shape} has length {x.shape[axis]}, which does "
            f"not split into {p} equal parts for a group of {p} ranks")


def _keyable(x: object) -> bool:
    """An array whose (shape, dtype number) identify its plan: a plain, native-order ndarray
    (anything else is validated in full on every call)."""
    return type(x) is np.ndarray and x.dtype.isnative


# The one type a count may have in a cache key: 1.0 and True equal 1 and hash like it, and the
# first call with them must still be refused, not served the plan of an earlier int call.
_INT = {int}


def all_reduce(x: np.ndarray, op: str = "sum", group: Group | Sequence[int] | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Elementwise reduction over the group; every rank gets the result (in ``out`` if given,
    a C-contiguous array like ``x``; it may be ``x`` itself when ``x`` is contiguous).

    On ranks 0..3 holding ``[r, r]``, ``all_reduce(x)`` gives ``[6, 6]`` everywhere.
    """
    name = "all_reduce"
    g, comm = resolve(group)
    try:
        key = (name, g.ranks, x.shape, x.dtype.num, op) if (_keyable(x)
                                                            and type(op) is str) else None
        c = _cached(_CALLS, key, _plan_all_reduce, x, op, g)
        out = _result(out, x.shape, x.dtype, name)
        in_place = _same_memory(x, out, name)
    except Exception as error:  # noqa: BLE001 (every error must reach the other ranks)
        _refuse(comm, g, name, error)
    _check(comm, g, name, x, c)
    return _run_all_reduce(comm, g, c, x, out, in_place, op)


def _run_all_reduce(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray,
                    in_place: bool, op: str, at: tuple[int, str] | None = None) -> np.ndarray:
    start = perf_counter()
    send = np.ascontiguousarray(x)
    comm.Allreduce(_mpi().IN_PLACE if in_place else send, out, op=c.mpi_op)
    if op == "mean":
        out /= g.size
    trace.record("AllReduce", g.ranks, c.bytes_sent, c.bytes_recv, perf_counter() - start,
                 x.dtype, x.shape, op, at)
    return out


def _plan_all_reduce(x: np.ndarray, op: str, g: Group) -> _Call:
    name = "all_reduce"
    x = _array(x, name)
    mpi_op = _reduce_op(op, name, x.dtype)
    p = g.size
    n = traffic("AllReduce", p, x.nbytes)
    return _new_call(name, g, x, x.shape, x.shape, (), mpi_op, n, (_OP_CODE[op],), ("op",))


def all_gather(x: np.ndarray, axis: int = 0, group: Group | Sequence[int] | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate every rank's ``x`` along ``axis``, in group order (into ``out`` if given).

    Ranks 4..7 each holding a (2, 8) block get the (8, 8) concatenation, rank 4's rows first.
    """
    name = "all_gather"
    g, comm = resolve(group)
    try:
        key = (name, g.ranks, x.shape, x.dtype.num, axis) if (_keyable(x)
                                                              and type(axis) is int) else None
        c = _cached(_CALLS, key, _plan_all_gather, x, axis, g)
        if out is not None or c.axes[0] == 0:
            out = _result(out, c.out_shape, x.dtype, name)
            _apart(x, out, name)
    except Exception as error:  # noqa: BLE001 (every error must reach the other ranks)
        _refuse(comm, g, name, error)
    _check(comm, g, name, x, c)
    return _run_all_gather(comm, g, c, x, out)


def _run_all_gather(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray | None,
                    at: tuple[int, str] | None = None) -> np.ndarray:
    start = perf_counter()
    send = np.ascontiguousarray(x)
    if c.axes[0] == 0:  # the gathered blocks are the result: receive straight into it
        if out is None:
            out = np.empty(c.out_shape, dtype=x.dtype)
        comm.Allgather(send, out)  # MPI puts block i at the i-th p-th of out
    else:
        blocks = np.empty(c.mpi_shape, dtype=x.dtype)
        comm.Allgather(send, blocks)
        joined = _join_blocks(blocks, c.axes[0])
        if out is None:
            out = joined
        else:
            out[...] = joined
    trace.record("AllGather", g.ranks, c.bytes_sent, c.bytes_recv, perf_counter() - start,
                 x.dtype, x.shape, None, at)
    return out


def _plan_all_gather(x: np.ndarray, axis: int, g: Group) -> _Call:
    name = "all_gather"
    x = _array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
    axis = _axis(axis, x.ndim, name)
    p = g.size
    shape = x.shape[:axis] + (p * x.shape[axis],) + x.shape[axis + 1:]
    return _new_call(name, g, x, shape, (p,) + x.shape, (axis,), None,
                     traffic("AllGather", p, x.nbytes), (axis,), ("axis",))


def reduce_scatter(x: np.ndarray, axis: int = 0, op: str = "sum",
                   group: Group | Sequence[int] | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Reduce over the group, then give group rank ``i`` the ``i``-th piece along ``axis``.

    With 4 ranks and an (8, 4) input, each rank gets 2 rows of the sum; group rank 1 rows 2..3.
    """
    name = "reduce_scatter"
    g, comm = resolve(group)
    try:
        key = (name, g.ranks, x.shape, x.dtype.num, axis, op) if (
            _keyable(x) and type(axis) is int and type(op) is str) else None
        c = _cached(_CALLS, key, _plan_reduce_scatter, x, axis, op, g)
        if c.late_error is None:  # else it fails after the agreement, on every rank alike
            out = _result(out, c.out_shape, x.dtype, name)
            _apart(x, out, name)
    except Exception as error:  # noqa: BLE001 (every error must reach the other ranks)
        _refuse(comm, g, name, error)
    _check(comm, g, name, x, c)
    out = cast(np.ndarray, out)  # set in the try, unless a late error that _check raised
    return _run_reduce_scatter(comm, g, c, x, out, op)


def _run_reduce_scatter(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray, op: str,
                        at: tuple[int, str] | None = None) -> np.ndarray:
    start = perf_counter()
    send = _split_blocks(x, c.axes[0], g.size)
    comm.Reduce_scatter_block(send, out, op=c.mpi_op)
    if op == "mean":
        out /= g.size
    trace.record("ReduceScatter", g.ranks, c.bytes_sent, c.bytes_recv, perf_counter() - start,
                 x.dtype, x.shape, op, at)
    return out


def _plan_reduce_scatter(x: np.ndarray, axis: int, op: str, g: Group) -> _Call:
    name = "reduce_scatter"
    x = _array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
    axis = _axis(axis, x.ndim, name)
    mpi_op = _reduce_op(op, name, x.dtype)
    p = g.size
    piece = x.shape[:axis] + (x.shape[axis] // p,) + x.shape[axis + 1:]
    n = traffic("ReduceScatter", p, x.nbytes)
    return _new_call(name, g, x, piece, piece, (axis,), mpi_op, n, (axis, _OP_CODE[op]),
                     ("axis", "op"), _indivisible(x, axis, p, name))


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
        key = (name, g.ranks, x.shape, x.dtype.num, split_axis, concat_axis) if (
            _keyable(x) and type(split_axis) is int and type(concat_axis) is int) else None
        c = _cached(_CALLS, key, _plan_all_to_all, x, split_axis, concat_axis, g)
        if c.late_error is None and (out is not None or c.axes[1] == 0):  # else: fails below
            out = _result(out, c.out_shape, x.dtype, name)
            _apart(x, out, name)
    except Exception as error:  # noqa: BLE001 (every error must reach the other ranks)
        _refuse(comm, g, name, error)
    _check(comm, g, name, x, c)
    return _run_all_to_all(comm, g, c, x, out)


def _run_all_to_all(comm: Any, g: Group, c: _Call, x: np.ndarray, out: np.ndarray | None,
                    at: tuple[int, str] | None = None) -> np.ndarray:
    start = perf_counter()
    send = _split_blocks(x, c.axes[0], g.size)
    if c.axes[1] == 0:  # the received blocks are the result: receive straight into it
        if out is None:
            out = np.empty(c.out_shape, dtype=x.dtype)
        comm.Alltoall(send, out)
    else:
        blocks = np.empty(c.mpi_shape, dtype=x.dtype)
        comm.Alltoall(send, blocks)
        joined = _join_blocks(blocks, c.axes[1])
        if out is None:
            out = joined
        else:
            out[...] = joined
    trace.record("AllToAll", g.ranks, c.bytes_sent, c.bytes_recv, perf_counter() - start,
                 x.dtype, x.shape, None, at)
    return out


def _plan_all_to_all(x: np.ndarray, split_axis: int, concat_axis: int, g: Group) -> _Call:
    name = "all_to_all"
    x = _array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: needs an array of rank >= 1, got a 0-d array")
    split_axis = _axis(split_axis, x.ndim, name, "split_axis")
    concat_axis = _axis(concat_axis, x.ndim, name, "concat_axis")
    p = g.size
    block = x.shape[:split_axis] + (x.shape[split_axis] // p,) + x.shape[split_axis + 1:]
    shape = block[:concat_axis] + (p * block[concat_axis],) + block[concat_axis + 1:]
    n = traffic("AllToAll", p, x.nbytes)
    return _new_call(name, g, x, shape, (p,) + block, (split_axis, concat_axis), None, n,
                     (split_axis, concat_axis), ("split_axis", "concat_axis"),
                     _indivisible(x, split_axis, p, name))


#: What :func:`prepare` returns: ``run(x, at=None)``, ``at`` the program step that announced
#: the call (its CommTrace index and label), None outside a program.
Prepared = Callable[..., np.ndarray]


def prepare(name: str, shape: Sequence[int], dtype: Any,
            group: Group | Sequence[int] | None = None, *, consume: bool = False,
            **args: Any) -> Prepared:
    """One collective worked out once for a call site that runs it over and over on arrays of
    one shape and dtype, as MPI-4's persistent collectives are set up once by
    ``MPI_Allreduce_init``: a compiled program's AllReduce after a row-parallel MatMul, say.

    ``name`` is ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``
    and ``args`` its keyword arguments (``op``, ``axis``, ``split_axis``/``concat_axis``);
    they, the group, the shape and the dtype are checked here, once, raising what the call
    itself would. The returned ``run(x)`` then does only the MPI call and the CommTrace event:
    no signature lookup, no group lookup, no argument checks and no agreement check (every
    rank of the group prepared the same call: a compiled program agrees by construction, as
    ``validation_disabled`` assumes). An ``x`` of another shape or dtype, or a call that must
    fail on every rank alike (an indivisible axis), takes the general path with every check.

    ``consume=True`` (all_reduce only): the caller gives ``x`` up, and the sum is written into
    it, as ``all_reduce(x, out=x)`` (MPI_IN_PLACE), whenever ``x`` is a writeable C-contiguous
    array; the executor reduces a row-parallel MatMul's fresh product so, and a Mirror's
    freshly packed bucket.

    >>> run = prepare("all_reduce", (128, 64), np.float32, group=(0, 1, 2, 3))  # doctest: +SKIP
    >>> y = run(x)  # as all_reduce(x, group=(0, 1, 2, 3))                     # doctest: +SKIP
    """
    calls: dict[str, Callable[..., np.ndarray]] = {
        "all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
        "all_to_all": all_to_all}
    general = calls.get(name)
    if general is None:
        raise ValueError(f"prepare: name must be one of 'all_reduce', 'all_gather', "
                         f"'reduce_scatter', 'all_to_all', got {name!r}")
    if consume is not False and (consume is not True or name != "all_reduce"):
        raise ValueError(f"prepare: consume must be a bool, and True only for 'all_reduce' "
                         f"(the one collective whose result has its input's shape), got "
                         f"consume={consume!r} for {name!r}")
    g, comm = resolve(group)
    shape = tuple(int(n) for n in shape)
    dtype = np.dtype(dtype)
    x = _array(np.empty(shape, dtype), "prepare")
    op = args.get("op", "sum")
    if name == "all_reduce":
        c = _plan_all_reduce(x, op, g)
    elif name == "all_gather":
        c = _plan_all_gather(x, args.get("axis", 0), g)
    elif name == "reduce_scatter":
        c = _plan_reduce_scatter(x, args.get("axis", 0), op, g)
    else:
        c = _plan_all_to_all(x, args["split_axis"], args["concat_axis"], g)
    slow = functools.partial(general, group=g, **args)

    def other(x: np.ndarray, at: tuple[int, str] | None = None) -> np.ndarray:
        if at is None:
            return slow(x)
        with trace.program_step(*at):
            return slow(x)

    if c.late_error is not None:
        return other
    out_shape = c.out_shape

    def reduce_into(x: np.ndarray, at: tuple[int, str] | None) -> np.ndarray:
        flags = x.flags
        if flags.c_contiguous and flags.writeable:
            return _run_all_reduce(comm, g, c, x, x, True, op, at)
        return _run_all_reduce(comm, g, c, x, np.empty(out_shape, dtype), False, op, at)

    body: Callable[[np.ndarray, tuple[int, str] | None], np.ndarray] = {
        "all_reduce": reduce_into if consume else lambda x, at: _run_all_reduce(
            comm, g, c, x, np.empty(out_shape, dtype), False, op, at),
        "all_gather": lambda x, at: _run_all_gather(comm, g, c, x, None, at),
        "reduce_scatter": lambda x, at: _run_reduce_scatter(
            comm, g, c, x, np.empty(out_shape, dtype), op, at),
        "all_to_all": lambda x, at: _run_all_to_all(comm, g, c, x, None, at)}[name]

    def run(x: np.ndarray, at: tuple[int, str] | None = None) -> np.ndarray:
        if type(x) is not np.ndarray or x.shape != shape or x.dtype != dtype:
            return other(x, at)
        return body(x, at)
    return run


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
    if _validate and p > 1:
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
    trace.record("AllToAllV", g.ranks, ex.bytes_sent, ex.bytes_recv, perf_counter() - start,
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
    if _validate and p > 1:
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
    trace.record("AllToAllV", g.ranks, ex.bytes_sent, ex.bytes_recv, perf_counter() - start,
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


def broadcast(x: np.ndarray, root: int, group: Group | Sequence[int] | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """Every rank gets the ``root`` rank's ``x`` (``root`` is a world rank inside the group).

    Every rank passes an array of the same shape and dtype, as MindSpore's Broadcast requires.
    With ``out`` the result lands there; ``out=x`` broadcasts in place.
    """
    name = "broadcast"
    g, comm = resolve(group)
    try:
        key = (name, g.ranks, x.shape, x.dtype.num, root) if (_keyable(x)
                                                              and type(root) is int) else None
        c = _cached(_CALLS, key, _plan_broadcast, x, root, g)
        out = _result(out, x.shape, x.dtype, name)
    except Exception as error:  # noqa: BLE001 (every error must reach the other ranks)
        _refuse(comm, g, name, error)
    _check(comm, g, name, x, c)
    start = perf_counter()
    me = world().Get_rank()
    # Only the root's values matter: the others receive into fresh memory instead of copying
    # their own x first (on 8 ranks that copy made a 1 MiB broadcast 2-2.7x a raw Bcast).
    if me == root and out is not x:
        out[...] = x
    comm.Bcast(out, root=c.axes[0])
    sent, got = (c.bytes_sent, 0) if me == root else (0, c.bytes_recv)
    trace.record("Broadcast", g.ranks, sent, got, perf_counter() - start, x.dtype, x.shape)
    return out


def _plan_broadcast(x: np.ndarray, root: int, g: Group) -> _Call:
    name = "broadcast"
    x = _array(x, name)
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool):
        raise TypeError(f"{name}: root must be an int (a world rank), got {root!r}")
    if root not in g.ranks:
        raise ValueError(f"{name}: root {root} is not in group {list(g.ranks)}")
    sent, received = broadcast_traffic(g.size, x.nbytes)
    return _new_call(name, g, x, x.shape, x.shape, (g.index(root),), None, sent, (int(root),),
                     ("root",), bytes_recv=received)


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
