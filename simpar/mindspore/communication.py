"""``mindspore.communication``: the world of MPI ranks as MindSpore's HCCL/NCCL world.

``init()`` starts MPI (simpar's ranks are started by ``mpirun``, not by a rank table);
``get_rank`` and ``get_group_size`` answer for the world group, under MindSpore's names for
it. Other groups are simpar's own (:func:`simpar.comm.create_group`)."""

from __future__ import annotations

from simpar import _env, comm
from simpar.mindspore._missing import missing

__all__ = ["HCCL_WORLD_COMM_GROUP", "NCCL_WORLD_COMM_GROUP", "get_group_size", "get_local_rank",
           "get_local_rank_size", "get_rank", "init", "release"]

HCCL_WORLD_COMM_GROUP = "hccl_world_group"
NCCL_WORLD_COMM_GROUP = "nccl_world_group"
_WORLD = (None, HCCL_WORLD_COMM_GROUP, NCCL_WORLD_COMM_GROUP)
_BACKENDS = (None, "hccl", "nccl", "mccl")


def _world_only(func: str, group: object) -> None:
    if group not in _WORLD:
        raise NotImplementedError(
            f"mindspore.communication.{func}: simpar answers for the world group only "
            f"({HCCL_WORLD_COMM_GROUP!r}), got group={group!r}; a group of ranks is "
            "simpar.comm.create_group(ranks), and simpar.comm.get_group_size(group) its size")


def init(backend_name: str | None = None) -> None:
    """Start MPI: every rank of the ``mpirun`` job is one device. ``backend_name`` may be
    MindSpore's "hccl", "nccl" or "mccl" (all mean MPI here) or None."""
    if backend_name not in _BACKENDS:
        raise ValueError(f"init: backend_name must be one of {list(_BACKENDS)}, got "
                         f"{backend_name!r}")
    comm.init()


def release() -> None:
    """Nothing to release: MPI ends with the process."""


def get_rank(group: str | None = None) -> int:
    """This process's rank in the world (``group``: None or the world group's name)."""
    _world_only("get_rank", group)
    return comm.get_rank()


def get_group_size(group: str | None = None) -> int:
    """The world's size: the devices of the job."""
    _world_only("get_group_size", group)
    return comm.get_group_size()


def get_local_rank(group: str | None = None) -> int:
    """This process's rank among the ranks of its host."""
    _world_only("get_local_rank", group)
    return _env.local_rank()


def get_local_rank_size(group: str | None = None) -> int:
    """How many ranks share this process's host."""
    _world_only("get_local_rank_size", group)
    return _env.local_ranks()


__getattr__ = missing("mindspore.communication", {
    "create_group": "simpar.comm.create_group(ranks) (collective over its members)",
    "destroy_group": "nothing: simpar's groups live as long as the process",
    "get_world_rank_from_group_rank": "simpar.comm.create_group(ranks).ranks[group_rank]",
    "get_group_rank_from_world_rank": "simpar.comm.create_group(ranks).ranks.index(world_rank)",
    "GlobalComm": "get_rank() and get_group_size() for the world",
    "get_process_group_ranks": "range(get_group_size()) for the world",
    "comm_func": "simpar.comm's collectives (all_reduce, all_gather, ...)",
})
