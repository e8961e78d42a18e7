"""The small argument checks that many modules share, each written once.

Every check raises a one-sentence ``TypeError`` (wrong type) or ``ValueError`` (right type,
value not allowed) that names the parameter, the value and what is allowed. ``what`` is the
parameter as the caller's errors name it, with the function in front where the caller's
errors carry one::

    >>> integer(-1, "save_shards: rank", low=0)
    Traceback (most recent call last):
    ValueError: save_shards: rank must be >= 0, got -1
    >>> axis(2, 2, "Concat: axis")
    Traceback (most recent call last):
    ValueError: Concat: axis=2 is out of range for an input of rank 2; allowed -2..1

This module sits in the bottom layer: it imports numpy and nothing of simpar.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["axis", "instance", "integer", "ints", "path", "positive_float_arg",
           "positive_int", "positive_int_arg", "shown"]


def shown(value: object) -> str:
    """A value as an error shows it: its type and its repr (``str '4'``, ``float 2.5``),
    or ``None``."""
    return "None" if value is None else f"{type(value).__name__} {value!r}"


def instance(value: object, kind: type | tuple[type, ...], what: str, allowed: str) -> Any:
    """``value``, refused unless it is a ``kind``: "``what`` must be ``allowed``, got <type>".
    (Returned as ``Any``: mypy narrows no abstract class through a ``type[T]`` parameter.)

    >>> instance(3, dict, "f: extra", "a mapping")
    Traceback (most recent call last):
    TypeError: f: extra must be a mapping, got int
    """
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be {allowed}, got {type(value).__name__}")
    return value


def integer(value: object, what: str, low: int | None = None, *, expected: str = "an int",
            got: Callable[[object], str] = shown) -> int:
    """``value`` as an int (a numpy integer too, never a bool), at least ``low`` if given.
    ``expected`` says what was wanted ("an int or None" where None is handled before);
    ``got`` shows a value of the wrong type (a JSON reader shows JSON kinds)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be {expected}, got {got(value)}")
    if low is not None and value < low:
        raise ValueError(f"{what} must be >= {low}, got {value}")
    return int(value)


def positive_int(value: object, what: str, detail: str = "", where: str = "") -> int:
    """``value`` as an int >= 1 (a numpy integer too, never a bool); ``detail`` follows "a
    positive int" in the message (" (bytes per element)"), ``where`` (the function or op)
    precedes ``what``. Cheap when ``value`` is good: hot paths call it per candidate.

    >>> positive_int(0, "Split: output_num")
    Traceback (most recent call last):
    ValueError: Split: output_num must be a positive int, got 0
    """
    if type(value) is int and value >= 1:
        return value
    what = f"{where}: {what}" if where else what
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be a positive int{detail}, got {shown(value)}")
    if value < 1:
        raise ValueError(f"{what} must be a positive int{detail}, got {value!r}")
    return int(value)


def ints(values: Sequence[object], what: str, low: int) -> tuple[int, ...]:
    """Every entry of ``values`` as an int >= ``low``; an error shows the whole sequence.

    >>> ints([2, 0], "device_matrix", 1)
    Traceback (most recent call last):
    ValueError: device_matrix entries must be >= 1, got 0 in [2, 0]
    """
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} entries must be ints, got {shown(v)} in {values!r}")
        if v < low:
            raise ValueError(f"{what} entries must be >= {low}, got {v} in {values!r}")
        out.append(int(v))
    return tuple(out)


def shapes(value: object, what: str) -> list[tuple[int, ...]]:
    """A sequence of shapes (each a sequence of ints >= 0), as a list of tuples.

    >>> shapes(None, "f: input_shapes")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: f: input_shapes must be a list of shapes (tuples of ints), one per input, ...
    """
    if not isinstance(value, (list, tuple)) or isinstance(value, str):
        raise TypeError(f"{what} must be a list of shapes (tuples of ints), one per input, got "
                        f"{shown(value)}")
    out = []
    for k, shape in enumerate(value):
        if not isinstance(shape, (list, tuple)):
            raise TypeError(f"{what}[{k}] must be a shape (a tuple of ints), got {shown(shape)}")
        out.append(ints(shape, f"{what}[{k}]", 0))
    return out


def input_specs(value: object, what: str) -> list[tuple[tuple[int, ...], np.dtype]]:
    """A sequence of ``(shape, dtype)`` pairs, one per input, checked.

    >>> input_specs([(8, 4)], "trace: input_specs")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: trace: input_specs[0] must be a (shape, dtype) pair such as ..., got tuple (8, 4)
    """
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must be a list of (shape, dtype) pairs, one per input, got "
                        f"{shown(value)}")
    out = []
    for k, spec in enumerate(value):
        if not (isinstance(spec, (list, tuple)) and len(spec) == 2
                and isinstance(spec[0], (list, tuple))):
            raise TypeError(f"{what}[{k}] must be a (shape, dtype) pair such as ((8, 16), "
                            f"np.float32), got {shown(spec)}")
        try:
            dtype = np.dtype(spec[1])
        except TypeError:
            raise TypeError(f"{what}[{k}]: {shown(spec[1])} is not a dtype") from None
        out.append((ints(spec[0], f"{what}[{k}] shape", 0), dtype))
    return out


def axis(value: object, ndim: int, what: str) -> int:
    """A tensor axis of an input of rank ``ndim``, counted from either end, as ``0..ndim-1``."""
    value = integer(value, what)
    if not -ndim <= value < ndim:
        raise ValueError(f"{what}={value} is out of range for an input of rank {ndim}; "
                         f"allowed {-ndim}..{ndim - 1}")
    return value % ndim


def path(value: object, what: str) -> str:
    """A file system path given as ``str`` or ``os.PathLike`` (not bytes), as a ``str``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a str or os.PathLike, got {shown(value)}")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"{what} must be given as text, got bytes {text!r}")
    return text


# ---------------------------------------------------------------- command-line option types
# argparse prefixes an ArgumentTypeError with "argument --flag: ".
def positive_int_arg(text: str) -> int:
    """An option's value as an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def positive_float_arg(text: str) -> float:
    """An option's value as a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
