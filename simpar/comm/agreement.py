"""Agreement across ranks: before a collective runs, the ranks of its group check that they
called it alike, so that a mismatch raises on every rank instead of hanging.

When validation is on (the default; ``set_validation(False)`` or ``SIMPAR_COMM_CHECK=0`` turns
it off), every call first checks that the ranks of the group agree, with one 8-byte
``MPI_Allreduce(BXOR)`` that is the same whatever the call, so that a mismatch raises on every
rank, naming each rank's shape, instead of hanging or corrupting memory. Each rank XORs hashed
*claims* into one word: for every edge ``(i, i+1)`` of a ring over the group, each of its two
ends claims "this edge carries my call signature" (kind, dtype, shape, arguments), and for
``all_to_all_v`` the sender and the receiver of every piece each claim its element count.
When all claims agree they cancel in pairs and the XOR is 0, on every rank alike; any
disagreement leaves it nonzero (a false 0 has probability 2**-64), and only then do the ranks
exchange readable descriptions for the message. A rank whose own arguments are bad (a wrong
axis, dtype, op, ``out``) takes part in the same check with its error in place of a
signature, so the error reaches every rank: that rank raises its own
``TypeError``/``ValueError`` and the others a :class:`CommMismatchError` that quotes it.

:func:`check_agreement` and :func:`check_same_arrays` make the same check for a whole plan or
for a step's global inputs.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from simpar.comm._arrays import _KIND_CODE, REDUCE_OPS, _mpi
from simpar.comm._world import Group, resolve, world

__all__ = ["CommMismatchError", "InputMismatchError", "PendingCheck", "check_agreement",
           "check_same_arrays", "set_validation", "start_check_same_arrays", "validation",
           "validation_disabled"]

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

