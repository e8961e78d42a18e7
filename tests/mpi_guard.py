"""Keep a multi-rank test from hanging when one rank fails inside collective work."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import simpar
import simpar.comm as comm
from simpar import launch


@contextmanager
def abort_job_on_error(what: object) -> Iterator[None]:
    """If the block raises on this rank, print the traceback and end the whole MPI job: the
    other ranks may be waiting inside a collective this rank will never join."""
    try:
        yield
    except BaseException:
        # Straight to file descriptor 2: pytest captures sys.stderr, and the Abort below
        # ends the process before pytest would print what it captured.
        os.write(2, f"[rank {comm.get_rank()}] {what} raised\n{traceback.format_exc()}"
                 .encode(errors="replace"))
        comm.world().Abort(1)
        raise


def shared_dir(tmp_path: Path) -> Path:
    """Rank 0's ``tmp_path`` on every rank (collective)."""
    buf = np.zeros(4096, dtype=np.int32)  # simpar.comm moves int32, not bytes
    if comm.get_rank() == 0:
        raw = str(tmp_path).encode()
        buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    buf = comm.broadcast(buf, root=0)
    return Path(bytes(buf.astype(np.uint8)).rstrip(b"\0").decode())


def raised_everywhere(fn: Callable[[], object], error: type[BaseException], match: str) -> None:
    """``fn`` raises ``error`` (message containing ``match``) on every rank: nobody hangs
    in a collective waiting for a rank that went on."""
    try:
        fn()
        ok = 0
    except error as e:
        ok = int(match in str(e))
    assert comm.all_gather(np.array([ok], dtype=np.int64)).tolist() == \
        [1] * comm.get_group_size()


def have_mpirun() -> bool:
    """Whether an MPI launcher simrun can drive is on this machine (tests that start jobs)."""
    try:
        return launch.detect_mpi_flavor(launch.find_mpirun()) != "unknown"
    except ValueError:
        return False


@contextmanager
def searched_context() -> Iterator[None]:
    """auto_parallel with recursive programming, the mean of the gradients, the batch split
    and AllToAll on, for the block; the context reset afterwards."""
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel",
                                     search_mode="recursive_programming", gradients_mean=True,
                                     dataset_strategy="data_parallel", enable_alltoall=True)
    try:
        yield
    finally:
        simpar.reset_auto_parallel_context()
