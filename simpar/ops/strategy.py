"""Strategies: one tuple of cuts per input, checked where they are given; and iteration
spaces, the einsum-like description most sharding rules derive layouts from.

A strategy ``((2, 1), (1, 4))`` for ``MatMul`` cuts input 0's rows 2 ways and input 1's
columns 4 ways. :func:`iteration_cuts` reads a strategy against an op's :class:`IterSpace`
and refuses one whose inputs cut a shared dimension differently, in MindSpore's words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simpar import _checks as checks

__all__ = ["IterSpace", "Strategy", "StrategyError", "as_strategy", "check_device_num",
           "check_shard_strategy",
           "dim_names", "divisors", "iteration_cuts"]

Strategy = tuple[tuple[int, ...], ...]


class StrategyError(ValueError):
    """A strategy that does not fit the operator, its inputs or the devices."""


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order (for a power of two: the powers of two)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, slots=True)
class IterSpace:
    """An einsum-like description of an op: which iteration dim each tensor dim walks.

    ``inputs[i][d]`` is the iteration dim of input i's tensor dim d, or ``None`` for a
    broadcast dim of size 1. ``output`` lists the output's iteration dims. ``order`` is the
    canonical order of iteration dims in the device matrix. Iteration dims that are cut but
    not in ``output`` make the local output partial (``reduce`` says how: "sum" or "max").
    """

    inputs: tuple[tuple[str | None, ...], ...]
    output: tuple[str | None, ...]
    order: tuple[str, ...]
    reduce: str = "sum"
    unsplittable: frozenset[str] = frozenset()

    @classmethod
    def pointwise(cls, ndim: int) -> IterSpace:
        """One input whose every tensor dim is its own iteration dim, kept in the output:
        ``pointwise(2)`` walks ``d0, d1``, so a strategy ``((2, 4),)`` cuts rows 2 ways and
        columns 4 ways and rank 5 of the (2, 4) device matrix computes block (1, 1)."""
        names = dim_names(ndim)
        return cls((names,), names, names)


def dim_names(ndim: int) -> tuple[str, ...]:
    """Iteration dims ``d0 .. d{ndim-1}``, one per tensor dim, for ops that walk each dim of
    their tensor with an iteration dim of its own (``dim_names(3)`` is ``('d0', 'd1', 'd2')``)."""
    return tuple(f"d{d}" for d in range(ndim))


def check_shard_strategy(strategy: object, op: str, what: str) -> None:
    """What a user passes to ``.shard()``, checked as MindSpore's ``Primitive.shard`` checks
    it, with its messages: a tuple, of tuples, of ints (numpy ints too). Lists are refused, as
    MindSpore refuses them (simpar's own code, reading JSON, goes through :func:`as_strategy`)."""
    if not isinstance(strategy, tuple):
        raise TypeError(f"{op}: {what} must be tuple type, but got:{type(strategy)} "
                        f"({strategy!r}; one tuple of ints per input, e.g. ((2, 1), (1, 4)))")
    for s in strategy:
        if not isinstance(s, tuple):
            raise TypeError(f"{op}: The element of strategy must be tuple type, but got:"
                            f"{type(s)} ({s!r} in {what} {strategy!r})")
        for c in s:
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
                raise TypeError(f"The {what}: {strategy!r} of {op} is not valid, the value of "
                                f"strategy must be int type, but got:{type(c)}")


def as_strategy(strategy: object, op: str, what: str) -> Strategy:
    """``strategy`` (tuples or lists, as JSON gives them) as a tuple of tuples of ints, each
    cut >= 1."""
    if not isinstance(strategy, (tuple, list)):
        raise TypeError(f"{op}: {what} must be a tuple of tuples of ints, got "
                        f"{type(strategy).__name__} {strategy!r}")
    out = []
    for s in strategy:
        if not isinstance(s, (tuple, list)):
            raise TypeError(f"{op}: each entry of {what} must be a tuple of ints, got {s!r} in "
                            f"{strategy!r}")
        for c in s:
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
                raise TypeError(f"{op}: {what} entries must be ints, got {c!r} in {strategy!r}")
            if c < 1:
                raise StrategyError(f"{op}: {what} {strategy!r} holds the cut {c}; cuts must "
                                    "be >= 1 (1 leaves a dimension whole)")
        out.append(tuple(int(c) for c in s))
    return tuple(out)


def check_device_num(device_num: int, op: str) -> None:
    checks.positive_int(device_num, "device_num", where=op)


def iteration_cuts(op: str, space: IterSpace, strat: Strategy,
                    shapes: tuple[tuple[int, ...], ...]) -> dict[str, int]:
    """Cut of every iteration dim; inputs sharing a dim must agree (MindSpore's check)."""
    cuts: dict[str, int] = {}
    where: dict[str, tuple[int, int]] = {}
    for i, (dims, s) in enumerate(zip(space.inputs, strat)):
        for d, (it, c) in enumerate(zip(dims, s)):
            if it is None:
                if c != 1:
                    raise StrategyError(f"{op}: input {i} broadcasts dimension {d} (size 1 in "
                                        f"shape {shapes[i]}), so its cut must be 1, got {c}")
                continue
            if it in space.unsplittable and c != 1:
                raise StrategyError(f"{op}: dimension {d} of input {i} cannot be split "
                                    f"(strategy {s}); its cut must be 1")
            if it in cuts and cuts[it] != c:
                j, dj = where[it]
                raise StrategyError(
                    f"{op}: Strategies of relevant dimensions are not equal: input {j} dim "
                    f"{dj} is cut {cuts[it]} but input {i} dim {d} is cut {c} (strategy "
                    f"{strat})")
            cuts[it] = c
            where.setdefault(it, (i, d))
    for it in space.order:
        cuts.setdefault(it, 1)
    return cuts
