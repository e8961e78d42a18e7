"""What every collective of simpar.comm checks and reuses: the dtypes it takes, its argument
checks, result buffers, memory overlap, block layouts, and the per-signature cache.

A private module of :mod:`simpar.comm`; it does not start MPI.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from simpar.collective_kinds import KINDS

DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
REDUCE_OPS = ("sum", "mean", "max", "min")
# dtype.num -> index in DTYPES, for every type number that means one of them (int64 is both
# numpy's "long" and "longlong" on Linux): one dict lookup per call, and a hashable int.
_DTYPE_CODE = {np.dtype(c).num: DTYPES.index(np.dtype(c))
               for c in np.typecodes["All"] if np.dtype(c) in DTYPES}
# Signatures are hashed from ints only: Python salts the hash of str per process.
# (every collective of the kinds table has one, in a fixed order: the same on every rank)
_KIND_CODE = {name: i for i, name in enumerate(dict.fromkeys(
    ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "broadcast",
     "check_agreement", "all_to_all_single", "check_same_arrays",
     *(kind.function for kind in KINDS.values() if kind.function))))}
_OP_CODE = {op: i for i, op in enumerate(REDUCE_OPS)}


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



def _keyable(x: object) -> bool:
    """An array whose (shape, dtype number) identify its plan: a plain, native-order ndarray
    (anything else is validated in full on every call)."""
    return type(x) is np.ndarray and x.dtype.isnative


# The one type a count may have in a cache key: 1.0 and True equal 1 and hash like it, and the
# first call with them must still be refused, not served the plan of an earlier int call.
_INT = {int}
