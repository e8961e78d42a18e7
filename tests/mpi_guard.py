"""Keep a multi-rank test from hanging when one rank fails inside collective work."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import simpar.comm as comm


@contextmanager
def abort_job_on_error(what: object) -> Iterator[None]:
    """If the block raises on this rank, print the traceback and end the whole MPI job: the
    other ranks may be waiting inside a collective this rank will never join."""
    try:
        yield
    except BaseException:
        sys.stderr.write(f"[rank {comm.get_rank()}] {what} raised\n{traceback.format_exc()}")
        sys.stderr.flush()
        comm.world().Abort(1)
        raise
