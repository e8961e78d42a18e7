"""Prepared collectives: one regular collective worked out once for a call site that runs it
over and over on arrays of one shape and dtype (:func:`prepare`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from simpar.collective_kinds import by_function
from simpar.comm import trace
from simpar.comm._arrays import _array
from simpar.comm._world import Group, resolve
from simpar.comm.collectives import REGULAR, REQUIRED

__all__ = ["Prepared", "prepare"]

#: What :func:`prepare` returns: ``run(x, at=None)``, ``at`` the program step that announced
#: the call (its CommTrace index and label), None outside a program.
Prepared = Callable[..., np.ndarray]

#: The collectives that can write their result into their input.
_IN_PLACE = [name for name in REGULAR if by_function(name).in_place]


def prepare(name: str, shape: Sequence[int], dtype: Any,
            group: Group | Sequence[int] | None = None, *, consume: bool = False,
            **args: Any) -> Prepared:
    """One collective worked out once for a call site that runs it over and over on arrays of
    one shape and dtype, as MPI-4's persistent collectives are set up once by
    ``MPI_Allreduce_init``: a compiled program's AllReduce after a row-parallel MatMul, say.

    ``name`` is a regular collective (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``,
    ``"all_to_all"``, ``"broadcast"``) and ``args`` its keyword arguments (``op``, ``axis``,
    ``split_axis``/``concat_axis``, ``root``);
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
    collective = REGULAR.get(name)
    if collective is None:
        raise ValueError(f"prepare: name must be one of "
                         f"{', '.join(repr(n) for n in REGULAR)}, got {name!r}")
    if consume is not False and (consume is not True or name not in _IN_PLACE):
        raise ValueError(f"prepare: consume must be a bool, and True only for "
                         f"{', '.join(repr(n) for n in _IN_PLACE)} (the one collective whose "
                         f"result has its input's shape), got consume={consume!r} for {name!r}")
    parameters = collective.parameters
    unknown = sorted(set(args) - {key for key, _, _ in parameters})
    missing = [key for key, _, default in parameters if default is REQUIRED and key not in args]
    if unknown or missing:
        raise TypeError(f"prepare: {name} takes the keyword arguments "
                        f"{[key for key, _, _ in parameters]}, got {sorted(args)}")
    values = tuple(args.get(key, default) for key, _, default in parameters)
    g, comm = resolve(group)
    shape = tuple(int(n) for n in shape)
    dtype = np.dtype(dtype)
    c = collective.plan(_array(np.empty(shape, dtype), "prepare"), *values, g)

    def other(x: np.ndarray, at: tuple[int, str] | None = None) -> np.ndarray:
        if at is None:
            return collective(x, g, None, *values)
        with trace.program_step(*at):
            return collective(x, g, None, *values)

    if c.late_error is not None:
        return other
    run_mpi = collective.run

    def into(x: np.ndarray, at: tuple[int, str] | None) -> np.ndarray:
        flags = x.flags
        if flags.c_contiguous and flags.writeable:
            return run_mpi(comm, g, c, x, x, True, at)
        return run_mpi(comm, g, c, x, None, False, at)

    def run(x: np.ndarray, at: tuple[int, str] | None = None) -> np.ndarray:
        if type(x) is not np.ndarray or x.shape != shape or x.dtype != dtype:
            return other(x, at)
        if consume:
            return into(x, at)
        return run_mpi(comm, g, c, x, None, False, at)
    return run
