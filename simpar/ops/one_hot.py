"""OneHot: integer labels to rows of ``on_value`` at the label and ``off_value`` elsewhere.

MindSpore's ``OneHot(axis=-1)(indices, depth, on_value, off_value)``; simpar keeps ``depth``
as an attribute set at the call (or at construction, ``OneHot(depth=10)``), so the op's
inputs are the tensors ``indices``, ``on_value`` and ``off_value`` (the last two 0-d).

Sharding follows MindSpore's OneHotInfo: the strategy's first entry cuts the *output* (the
index dims, then the class dim), the two values take ``()``. ``OneHot(depth=16).shard(((2,
4), (), ()))`` on 8 devices, indices (8,): device matrix (2, 4); rank 5 (coordinate (1, 1))
holds labels 4..7 and writes columns 4..7 of their rows: ``on_value`` where a label falls in
4..7, ``off_value`` elsewhere. Nothing is communicated, forward or backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from simpar.ops._base import OpSharding, Primitive, build_sharding, register
from simpar.ops.comm_spec import ONE_DEVICE, Collectives
from simpar.ops.facts import CostClass
from simpar.ops.kernels import Tape
from simpar.ops.strategy import IterSpace, Strategy, StrategyError, dim_names

__all__ = ["OneHot"]

_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


@register(mindspore_cost=CostClass.ONE_HOT, elementwise=False)
class OneHot(Primitive):
    """``out[..., c] = on_value if indices[...] == c else off_value``, of ``on_value``'s
    dtype, with the class dim last (``axis=-1``, the one MindSpore's OneHotInfo shards).
    Labels outside ``[0, depth)`` give a row of ``off_value`` (MindSpore's kernel's rule). No
    input gets a gradient (MindSpore's bprop gives zeros)."""

    n_inputs = 3
    nondiff_inputs = (0, 1, 2)
    tape = Tape.NOTHING

    def __init__(self, axis: int = -1, depth: int | None = None) -> None:
        super().__init__()
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or axis != -1:
            raise ValueError(f"OneHot: axis must be -1 (the class dim last, the layout "
                             f"MindSpore's OneHotInfo shards), got {axis!r}")
        self.axis = -1
        self.depth = None if depth is None else self._check_depth(depth)

    @staticmethod
    def _check_depth(depth: object) -> int:
        if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)):
            raise TypeError(f"OneHot: depth must be an int, got {type(depth).__name__} "
                            f"{depth!r}")
        if depth < 1:
            raise ValueError(f"OneHot: depth must be >= 1, got {depth}")
        return int(depth)

    def __call__(self, *xs: Any) -> Any:
        if len(xs) == 4:   # MindSpore's order: indices, depth, on_value, off_value
            self.depth = self._check_depth(xs[1])
            xs = (xs[0], xs[2], xs[3])
        return super().__call__(*xs)

    def attrs(self) -> dict[str, Any]:
        return {"axis": self.axis, "depth": self.depth}

    def _depth(self) -> int:
        if self.depth is None:
            raise ValueError("OneHot: no depth; call op(indices, depth, on_value, off_value) "
                             "or give OneHot(depth=...)")
        return self.depth

    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        indices, on, off = (tuple(s) for s in shapes)
        if on != () or off != ():
            raise ValueError(f"OneHot: on_value and off_value must be scalars (0-d), got "
                             f"shapes {on} and {off}")
        return indices + (self._depth(),)

    def output_dtype(self, input_dtype: np.dtype) -> np.dtype:
        return input_dtype   # the first floating input's: on_value's

    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        out = dim_names(len(self.infer_shape(*shapes)))
        return IterSpace((out[:-1], (), ()), out, out)

    # -- strategies: the first entry cuts the output (MindSpore's OneHotInfo)
    def _check_strategy_shape(self, strat: Strategy, shapes: tuple[tuple[int, ...], ...]
                              ) -> None:
        out = self.infer_shape(*shapes)
        if len(strat) != 3 or len(strat[0]) != len(out) or strat[1] or strat[2]:
            raise StrategyError(f"OneHot: the strategy must be ((cuts of the {len(out)} "
                                f"output dims), (), ()) for indices {shapes[0]} and depth "
                                f"{self._depth()}, got {strat}")
        for d, (c, n) in enumerate(zip(strat[0], out)):
            if n % c:
                raise StrategyError(f"OneHot: strategy {strat[0]} cuts output dim {d} of "
                                    f"shape {out} into {c} parts, but {n} is not divisible "
                                    f"by {c}")

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        space = self.iter_space(*shapes)
        cuts = dict(zip(dim_names(len(strat[0])), strat[0]))
        return build_sharding(self, shapes, strat, None, device_num, space, cuts)

    def strategy_of(self, space: IterSpace, cuts: Mapping[str, int]) -> Strategy:
        return (tuple(cuts[it] for it in space.output if it is not None), (), ())

    def strategy_dims(self, space: IterSpace, shapes: Sequence[tuple[int, ...]]
                      ) -> tuple[tuple[tuple[str | None, ...], tuple[int, ...]], ...]:
        return ((space.output, self.infer_shape(*shapes)), ((), ()), ((), ()))

    def default_strategy(self, shapes: Sequence[tuple[int, ...]], device_num: int
                         ) -> Strategy:
        out = self.infer_shape(*shapes)
        lead = device_num if out[0] % device_num == 0 else 1
        return ((lead,) + (1,) * (len(out) - 1), (), ())

    # -- values
    def index_limit(self, i: int, shapes: tuple[tuple[int, ...], ...]) -> int | None:
        return None   # out-of-range labels are not an error: their row is off_value

    def _check(self, indices: np.ndarray, on: np.ndarray, off: np.ndarray) -> None:
        if indices.dtype not in _INDEX_DTYPES:
            raise TypeError(f"OneHot: indices must be int32 or int64, got dtype "
                            f"{indices.dtype}")
        if on.dtype.kind != "f" or off.dtype != on.dtype:
            raise TypeError(f"OneHot: on_value and off_value must be floats of one dtype, "
                            f"got {on.dtype} and {off.dtype}")

    @staticmethod
    def _encode(indices: np.ndarray, on: np.ndarray, off: np.ndarray, first: int, count: int
                ) -> np.ndarray:
        hit = indices[..., None] == np.arange(first, first + count)
        return np.where(hit, on, off).astype(on.dtype)

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        indices, on, off = xs
        self._check(indices, on, off)
        return self._encode(indices, on, off, 0, self._depth())

    def vjp(self, xs: Sequence[np.ndarray], y: Any, dy: Any) -> tuple[np.ndarray | None, ...]:
        return None, None, None

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        return 0

    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        indices, on, off = xs
        self._check(indices, on, off)
        start, stop = sh.raw_out.slice_of(collectives.rank)[-1]
        return self._encode(indices, on, off, start, stop - start), None

    def local_backward(self, sh: OpSharding, saved: Any, dy: np.ndarray,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        return None, None, None
