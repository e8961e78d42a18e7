"""Parameters and their initializers, shaped like MindSpore's ``Parameter`` and
``initializer``.

A :class:`Parameter`'s initial value is a function of the global seed, its name and the
global index of each element (:mod:`simpar.counter_rng`), so a rank can draw only its own
shard and still hold exactly the slice of what one device would draw. This module sits
below :mod:`simpar.graph` (a traced parameter is a graph value) and :mod:`simpar.nn`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from simpar import counter_rng

__all__ = ["Parameter", "initializer", "stable_seed"]


def stable_seed(seed: int, name: str) -> int:
    """A 64-bit seed derived from ``seed`` and ``name`` (the same on every rank and run), for
    streams that must differ per parameter or layer but not per process."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# Elements drawn per block by an initializer (its float64 temporaries are a few times this).
_DRAW_BLOCK = 1 << 16


def _checked_box(box: Sequence[tuple[int, int]], shape: tuple[int, ...], name: str
                 ) -> tuple[tuple[int, int], ...]:
    out = tuple((int(a), int(b)) for a, b in box)
    if len(out) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(out, shape)):
        raise ValueError(f"initial value of {name or 'a parameter'}: box {tuple(box)} must give "
                         f"one (start, stop) with 0 <= start <= stop <= size per dimension of "
                         f"shape {shape}")
    return out


def _sub_boxes(box: tuple[tuple[int, int], ...], limit: int
               ) -> Iterator[tuple[tuple[int, int], ...]]:
    """``box`` cut, in C order, into boxes of at most ``limit`` elements each."""
    if math.prod(b - a for a, b in box) <= limit:
        yield box
        return
    d = next(k for k, (a, b) in enumerate(box) if b - a > 1)
    inner = math.prod(b - a for a, b in box[d + 1:])
    step = max(1, limit // inner)
    a, b = box[d]
    for r in range(a, b, step):
        sub = (*box[:d], (r, min(r + step, b)), *box[d + 1:])
        yield from (_sub_boxes(sub, limit) if inner > limit else (sub,))


def initializer(kind: str, shape: Sequence[int], dtype: Any = np.float32, **kw: Any
                ) -> Callable[..., np.ndarray]:
    """A deferred initial value: ``init(seed, name, box=None)`` gives the *global* array, or
    only its block ``box`` (per dim ``(start, stop)``).

    Every element is a pure function of the seed, the parameter's name and the element's
    global index (:mod:`simpar.counter_rng`), never of the rank count: a rank draws exactly
    its shard, bit for bit the slice of the one-device tensor, without drawing the rest.
    Kinds: ``"normal"`` (``sigma``), ``"uniform"`` (``scale``), ``"xavier_uniform"``,
    ``"he_uniform"`` (MindSpore's HeUniform, ``negative_slope``: bound
    ``sqrt(6 / ((1 + a^2) fan_in))``, fan_in the product of the dims after the first),
    ``"zeros"``, ``"ones"``.

    >>> init = initializer("normal", (8, 16))
    >>> np.array_equal(init(0, "w", ((4, 8), (0, 16))), init(0, "w")[4:8])
    True
    """
    shp = tuple(int(s) for s in shape)
    if kind not in ("normal", "uniform", "xavier_uniform", "he_uniform", "zeros", "ones"):
        raise ValueError(f"initializer: kind must be normal, uniform, xavier_uniform, "
                         f"he_uniform, zeros or ones, got {kind!r}")

    if kind == "uniform":
        scale = kw.get("scale", 0.07)
    elif kind == "xavier_uniform":
        fan_in, fan_out = (shp[-1], shp[0]) if len(shp) >= 2 else (shp[0], shp[0])
        scale = math.sqrt(6.0 / (fan_in + fan_out))
    elif kind == "he_uniform":
        slope = float(kw.get("negative_slope", 0.0))
        scale = math.sqrt(6.0 / ((1.0 + slope * slope) * max(math.prod(shp[1:]), 1)))

    def draw(key: int, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        if kind == "normal":
            return counter_rng.normal(key, shp, box) * kw.get("sigma", 0.02)
        return (counter_rng.uniform(key, shp, box) * 2.0 - 1.0) * scale

    def make(seed: int, name: str, box: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
        whole = tuple((0, n) for n in shp) if box is None else _checked_box(box, shp, name)
        part = tuple(b - a for a, b in whole)
        if kind in ("zeros", "ones"):
            return (np.zeros if kind == "zeros" else np.ones)(part, dtype=dtype)
        key = stable_seed(seed, name)
        if not shp:
            return np.asarray(draw(key, whole), dtype=dtype)
        out = np.empty(part, dtype=dtype)
        # Drawn in sub-blocks of at most _DRAW_BLOCK elements, so the generator's float64
        # temporaries stay small next to the block itself: a rank's peak memory is its
        # shard, not a multiple of it, however the shard is shaped.
        for sub in _sub_boxes(whole, _DRAW_BLOCK):
            out[tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(sub, whole))] = draw(key, sub)
        return out

    make.shape = shp  # type: ignore[attr-defined]
    make.dtype = np.dtype(dtype)  # type: ignore[attr-defined]
    return make


class Parameter:
    """A trainable tensor. Its global initial value comes from an :func:`initializer` (or an
    array) and the global seed; a rank keeps only its shard once a program lays it out."""

    def __init__(self, default: np.ndarray | Callable[..., np.ndarray],
                 name: str | None = None, requires_grad: bool = True) -> None:
        if callable(default):
            self._init: Callable[..., np.ndarray] | None = default
            self.shape: tuple[int, ...] = tuple(default.shape)  # type: ignore[attr-defined]
            self.dtype = np.dtype(default.dtype)  # type: ignore[attr-defined]
            self._data: np.ndarray | None = None
        else:
            arr = np.asarray(default)
            if arr.dtype.kind != "f":
                raise TypeError(f"Parameter: the value must be floating point, got {arr.dtype}")
            self._init = None
            self._data = np.array(arr, copy=True)
            self.shape, self.dtype = arr.shape, arr.dtype
        self.name = name or ""
        self.requires_grad = requires_grad

    def initial_value(self, seed: int, box: Sequence[tuple[int, int]] | None = None
                      ) -> np.ndarray:
        """The initial value for ``seed``: the global array, or only its block ``box`` (per
        dim ``(start, stop)``), which is all a rank holding that shard draws or keeps."""
        if self._init is not None:
            return self._init(seed, self.name, box)
        assert self._data is not None
        if box is None:
            return self._data.copy()
        box = _checked_box(box, self.shape, self.name)
        return self._data[tuple(slice(a, b) for a, b in box)].copy()

    @property
    def data(self) -> np.ndarray:
        """The global value for eager (single-device) use; initialised with seed 0 if unset."""
        if self._data is None:
            self._data = self.initial_value(0)
        return self._data

    def set_data(self, value: np.ndarray) -> None:
        value = np.asarray(value)
        if value.shape != self.shape:
            raise ValueError(f"Parameter {self.name}: set_data got shape {value.shape}, expected "
                             f"{self.shape}")
        self._data = value.astype(self.dtype, copy=True)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.data if dtype is None else self.data.astype(dtype)

    def __repr__(self) -> str:
        return f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype})"
