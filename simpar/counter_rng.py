"""Counter-based random numbers: every value is a pure function of a key and its element's
*global* index, so any rank can draw exactly its own slice of a tensor, bit for bit what one
device would draw for the whole tensor, without drawing the rest.

Element ``k`` (C-order flat index in the global shape) hashes to
``splitmix64(key + (k + 1) * golden)``. Dropout masks and parameter initial values use it.

>>> whole = normal(7, (8, 16))
>>> np.array_equal(normal(7, (8, 16), ((4, 8), (4, 8))), whole[4:8, 4:8])
True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Box", "bits", "flat_index", "mix_int", "normal", "uniform"]

Box = Sequence[tuple[int, int]]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix_int(z: int) -> int:
    """splitmix64's finaliser on a Python int (for keys)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def flat_index(shape: Sequence[int], box: Box | None = None) -> np.ndarray:
    """C-order flat indices, in the global ``shape``, of the elements of ``box`` (per dim
    ``(start, stop)``; default: the whole tensor)."""
    shp = tuple(int(n) for n in shape)
    box = tuple((0, n) for n in shp) if box is None else tuple(box)
    idx = np.zeros(tuple(b - a for a, b in box), dtype=np.uint64)
    stride = 1
    for d in range(len(shp) - 1, -1, -1):
        a, b = box[d]
        view = [1] * len(shp)
        view[d] = b - a
        idx += (np.arange(a, b, dtype=np.uint64) * np.uint64(stride)).reshape(view)
        stride *= shp[d]
    return idx


def bits(key: int, shape: Sequence[int], box: Box | None = None) -> np.ndarray:
    """64 random bits per element of ``box`` of a tensor of global ``shape``."""
    idx = flat_index(shape, box)
    flat = idx.reshape(-1)  # 1-d, so that uint64 wrapping stays silent for a 0-d tensor
    h = _mix((flat + np.uint64(1)) * np.uint64(_GOLDEN) + np.uint64(key & _MASK64))
    return h.reshape(idx.shape)


def uniform(key: int, shape: Sequence[int], box: Box | None = None) -> np.ndarray:
    """Uniform floats in [0, 1) with 53 random bits each."""
    return (bits(key, shape, box) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def normal(key: int, shape: Sequence[int], box: Box | None = None) -> np.ndarray:
    """Standard normal floats (Box-Muller on two independent streams of the key)."""
    u1 = 1.0 - uniform(mix_int(key ^ 0x1), shape, box)  # (0, 1]: the log is finite
    u2 = uniform(mix_int(key ^ 0x2), shape, box)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
