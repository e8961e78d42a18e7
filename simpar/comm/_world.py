"""The MPI world and its sub-groups. The only module, with collectives.py, that touches mpi4py."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from simpar import _env, context

if TYPE_CHECKING:
    from mpi4py import MPI

# (what simpar.comm exports; resolve serves the collectives modules)
__all__ = ["Group", "allgather_text", "broadcast_text", "check_context", "create_group",
           "get_group_size", "get_rank", "init", "stage_world", "world", "world_rank"]


@dataclass(frozen=True, slots=True)
class Group:
    """A communication group: world ranks in group order (group rank ``i`` is ``ranks[i]``).

    >>> Group((4, 5, 6, 7)).index(6)
    2
    """

    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"group ranks must be non-empty and distinct, got {list(self.ranks)}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, world_rank: int) -> int:
        """This world rank's rank inside the group."""
        return self.ranks.index(world_rank)

    def __str__(self) -> str:
        return f"Group{list(self.ranks)}"


_WORLD: MPI.Intracomm | None = None
_RANK = -1  # _WORLD's rank, once MPI is up (asked on every collective of a program)
_WORLD_PAIR: tuple[Group, Any] | None = None  # what resolve(None) returns, once MPI is up
_COMMS: dict[tuple[int, ...], Any] = {}
_RESOLVED: dict[tuple[int, ...], tuple[Group, Any]] = {}  # resolve() of a tuple of ranks
#: Inside :func:`stage_world`: the world ranks that make this rank's world, else None.
_VIEW: tuple[int, ...] | None = None


def init() -> None:
    """Start MPI (once) and make an uncaught exception on any rank end the whole job.

    Called lazily by every collective; call it yourself to start MPI early.
    """
    global _WORLD, _WORLD_PAIR, _RANK
    if _WORLD is not None:
        return
    _env.apply()
    from mpi4py import MPI

    _WORLD = MPI.COMM_WORLD.Dup()  # simpar's traffic never mixes with the user's COMM_WORLD
    _RANK = int(_WORLD.Get_rank())
    _COMMS[tuple(range(_WORLD.Get_size()))] = _WORLD
    _WORLD_PAIR = (_world_group(_WORLD.Get_size()), _WORLD)
    if _WORLD.Get_size() > 1:
        _install_abort_hook()
    # A mismatch is raised by check_context below, on every rank, naming them all.
    with contextlib.suppress(context.WorldMismatchError):
        context.set_world(_WORLD.Get_size(), _WORLD.Get_rank())
    check_context()


def _install_abort_hook() -> None:
    previous = sys.excepthook

    def abort_job(kind: type[BaseException], value: BaseException,
                  tb: TracebackType | None) -> None:
        rank = get_rank()
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.stderr.write(f"[simpar rank {rank}] uncaught {kind.__name__}; aborting the job\n{text}")
        sys.stderr.flush()
        sys.stdout.flush()
        if os.environ.get("SIMPAR_NO_ABORT"):
            previous(kind, value, tb)
            return
        from mpi4py import MPI

        # mpiexec reads a rank's stderr through a pipe and stops reading once MPI_Abort tears
        # the job down: a moment for it to forward the message first (once seen lost under a
        # loaded CI host). The job is ending anyway.
        time.sleep(0.3)
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_job


def world() -> Any:
    """simpar's duplicate of ``MPI.COMM_WORLD``."""
    init()
    return _WORLD


def get_rank() -> int:
    """This process's world rank (0 without an MPI launcher)."""
    if _RANK < 0:
        init()
    return _RANK


def world_rank() -> int:
    """This process's rank in the whole MPI world, inside a :func:`stage_world` too."""
    init()
    assert _WORLD is not None
    return int(_WORLD.Get_rank())


def get_group_size(group: Group | Sequence[int] | None = None) -> int:
    """Number of ranks in ``group`` (the world when ``None``: a stage's, inside
    :func:`stage_world`)."""
    if group is None:
        return int(world().Get_size()) if _VIEW is None else len(_VIEW)
    return len(group.ranks if isinstance(group, Group) else tuple(group))


def broadcast_text(text: str | None) -> str:
    """Rank 0's ``text`` on every rank of the world (a stage's, inside :func:`stage_world`):
    UTF-8 bytes, no pickle; not traced (what a plan sends, not a step). The other ranks wait
    for its length asleep between polls rather than spinning in MPI, so that rank 0's work
    before the call (a search) keeps the cores to itself on an oversubscribed host; the
    text itself then goes in one blocking broadcast, which a rank that has the length
    enters at once (rank 0 may wait in it for a rank still asleep, 2 ms at most).
    ``text`` is read on rank 0 only."""
    _, comm = resolve(None)
    root = comm.Get_rank() == 0
    data = np.frombuffer(text.encode(), dtype=np.uint8) if root and isinstance(
        text, str) else None
    # -1: rank 0 has no str to send, and every rank raises
    size = np.array([-1 if data is None else data.size], dtype=np.int64)
    _sleep_until(comm.Ibcast(size, root=0))
    if size[0] < 0:
        raise TypeError(f"broadcast_text: text must be a str on rank 0, got "
                        f"{type(text).__name__ if root else 'another type'}")
    if data is None:
        data = np.empty(int(size[0]), dtype=np.uint8)
    comm.Bcast(data, root=0)
    return bytes(data).decode()


def allgather_text(text: str) -> list[str]:
    """Every rank's ``text``, in rank order, on every rank of the world (a stage's, inside
    :func:`stage_world`): UTF-8 bytes, no pickle; not traced. Waits for the lengths asleep
    between polls and gathers the texts in one blocking call, as :func:`broadcast_text`
    does; a rank that gives no str makes every rank raise."""
    _, comm = resolve(None)
    data = np.frombuffer(text.encode(), dtype=np.uint8) if isinstance(text, str) else None
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    _sleep_until(comm.Iallgather(np.array([-1 if data is None else data.size],
                                          dtype=np.int64), sizes))
    if (sizes < 0).any():
        raise TypeError(f"allgather_text: text must be a str on every rank; ranks "
                        f"{np.flatnonzero(sizes < 0).tolist()} gave another type")
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    comm.Allgatherv(data, [out, sizes])
    ends = np.cumsum(sizes)
    return [bytes(out[end - size:end]).decode() for size, end in zip(sizes, ends)]


def _sleep_until(request: Any, first: float = 1e-4, most: float = 2e-3,
                 status: Any = None) -> None:
    """Wait for a nonblocking MPI call, sleeping between tests (``first`` seconds, doubling up
    to ``most``); ``status`` (an MPI Status) receives the completed call's.

    A collective's tree moves on only when its ranks test it, so each level of it can wait
    out a whole pause: on 8 ranks over 2 cores, a plan sent after 56 ms of work on rank 0
    reached every rank 269 ms late with pauses of up to 20 ms, and 8 ms late with these,
    while 7 ranks testing every 2 ms take little from the one that works
    (``benchmarks/plan_broadcast.py``)."""
    pause = first
    while not (request.Test() if status is None else request.Test(status)):
        time.sleep(pause)
        pause = min(2 * pause, most)


def create_group(ranks: Sequence[int]) -> Group:
    """The group of these world ranks, in this order; its communicator is made once and cached.

    Creation is collective over the members only (``MPI_Comm_create_group``), so every member
    must call it, and non-members must not. On a world of 8, ``create_group([4, 5, 6, 7])``
    called by ranks 4..7 gives them a 4-rank communicator in which world rank 6 is rank 2.
    """
    group = Group(tuple(int(r) for r in ranks))
    resolve(group)
    return group


@functools.lru_cache(maxsize=4)
def _world_group(size: int) -> Group:
    return Group(tuple(range(size)))


def resolve(group: Group | Sequence[int] | None) -> tuple[Group, Any]:
    """(Group, communicator) for a group given as ``None`` (world), a Group (world ranks) or
    a tuple of ranks (world ranks; inside :func:`stage_world`, ranks of the stage)."""
    if group is None and _WORLD_PAIR is not None:  # the common case, on every collective call
        return _WORLD_PAIR
    if type(group) is tuple:          # a program's groups: the same tuples, call after call
        found = _RESOLVED.get(group)
        if found is not None:
            return found
        ranks = tuple(int(r) for r in group)
        if _VIEW is not None:
            bad = [r for r in ranks if not 0 <= r < len(_VIEW)]
            if bad:
                raise ValueError(f"group {list(ranks)} names ranks {bad} outside this stage's "
                                 f"{len(_VIEW)} ranks (world ranks {list(_VIEW)})")
            ranks = tuple(_VIEW[r] for r in ranks)
        found = _RESOLVED[group] = resolve(Group(ranks))
        return found
    comm = world()
    size, me = comm.Get_size(), comm.Get_rank()
    if group is None:
        return _world_group(size), comm
    g = group if isinstance(group, Group) else Group(tuple(int(r) for r in group))
    cached = _COMMS.get(g.ranks)
    if cached is not None:
        return g, cached
    bad = [r for r in g.ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"group {list(g.ranks)} names ranks {bad} outside the world of {size}")
    if me not in g.ranks:
        raise ValueError(f"rank {me} is not a member of group {list(g.ranks)}; only members may "
                         "use or create a group")
    mpi_group = comm.Get_group().Incl(list(g.ranks))
    # The tag keeps concurrent creations of different groups apart.
    sub = comm.Create_group(mpi_group, tag=hash(g.ranks) & 0x7FFF)
    mpi_group.Free()
    _COMMS[g.ranks] = sub
    return g, sub


_VIEWS: dict[tuple[int, ...], tuple[int, tuple[Group, Any], dict[tuple[int, ...], Any]]] = {}


@contextlib.contextmanager
def stage_world(ranks: Sequence[int]) -> Iterator[Group]:
    """Make ``ranks`` (world ranks, this rank among them) this rank's world inside the block:
    :func:`get_rank` is its index in them, :func:`get_group_size` their number, the world
    group (``None``) is theirs, and a group given as a tuple names ranks of the stage (stage
    rank ``i`` is world rank ``ranks[i]``). A pipeline stage's program, lowered for its own
    sub-mesh, runs inside unchanged. Every rank of ``ranks`` must enter it the first time
    (its communicator is created then, collectively over them); blocks do not nest.

    >>> with stage_world([0]):   # (one process: the whole world is rank 0)
    ...     get_rank(), get_group_size()
    (0, 1)
    """
    global _VIEW, _RANK, _WORLD_PAIR, _RESOLVED
    init()
    view = tuple(int(r) for r in ranks)
    me = world_rank()
    if _VIEW is not None:
        raise ValueError(f"stage_world: already inside the stage of world ranks {list(_VIEW)}; "
                         "stages do not nest")
    if me not in view:
        raise ValueError(f"stage_world: world rank {me} is not among the ranks {list(view)}")
    found = _VIEWS.get(view)
    if found is None:
        g = Group(view)
        found = _VIEWS[view] = (view.index(me), resolve(g), {})
    saved = _RANK, _WORLD_PAIR, _RESOLVED
    _VIEW, (_RANK, _WORLD_PAIR, _RESOLVED) = view, found
    try:
        yield found[1][0]
    finally:
        _VIEW = None
        _RANK, _WORLD_PAIR, _RESOLVED = saved


def check_context() -> None:
    """Check, collectively, that every rank's context agrees with the MPI world.

    Every rank must call it. Each rank shares its ``device_num`` and ``global_rank``; if any
    rank's ``device_num`` differs from the world size, or an explicitly set ``global_rank``
    differs from the MPI rank, every rank raises the same ``ValueError`` naming the ranks and
    the values, e.g. "device_num is 4 on ranks 0..7 but mpirun started 8 ranks".
    """
    comm = world()
    size, me = comm.Get_size(), comm.Get_rank()
    snap = context.auto_parallel_context()
    mine = np.array([snap.device_num, snap.global_rank if snap.global_rank_is_set else me],
                    dtype=np.int64)
    every = np.empty((size, 2), dtype=np.int64)
    comm.Allgather(mine, every)
    bad_num = {int(r): int(every[r, 0]) for r in range(size) if every[r, 0] != size}
    bad_rank = {int(r): int(every[r, 1]) for r in range(size) if every[r, 1] != r}
    problems = []
    if bad_num:
        values = sorted(set(bad_num.values()))
        problems.append(f"device_num is {values[0] if len(values) == 1 else values} on ranks "
                        f"{_ranges(sorted(bad_num))} but mpirun started {size} ranks (set "
                        f"device_num={size} or launch with -n {values[0]})")
    if bad_rank:
        pairs = ", ".join(f"rank {r} says global_rank={v}" for r, v in sorted(bad_rank.items()))
        problems.append(f"global_rank disagrees with the MPI rank: {pairs}")
    if problems:
        raise context.WorldMismatchError("; ".join(problems))


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}..{prev}" if prev > start else f"{start}")
        if r is not None:
            start = prev = r
    return ", ".join(out)
