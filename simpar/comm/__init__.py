"""simpar.comm: the only package that imports mpi4py.

World and groups (``init``, ``get_rank``, ``get_group_size``, ``create_group``), collectives on
numpy arrays (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
``all_to_all_v``, ``all_to_all_single``, ``broadcast``, ``send``/``recv``, ``barrier``; and
``prepare``, a regular collective worked out once for a call site that repeats it) and
:class:`CommTrace`.
Modules: ``_world`` (the world and groups), ``agreement`` (the ranks' check that they called
a collective alike), ``collectives`` (the regular collectives, point to point), ``exchange``
(``all_to_all_v``, ``all_to_all_single``), ``prepared`` (``prepare``), ``trace``
(:class:`CommTrace`). Importing this package does not start MPI; the first call does.
"""

from simpar.comm._world import (
    Group,
    check_context,
    create_group,
    get_group_size,
    get_rank,
    init,
    world,
)
from simpar.comm.agreement import (
    CommMismatchError,
    InputMismatchError,
    PendingCheck,
    check_agreement,
    check_same_arrays,
    set_validation,
    start_check_same_arrays,
    validation,
    validation_disabled,
)
from simpar.comm.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    recv,
    reduce_scatter,
    send,
)
from simpar.comm.exchange import all_to_all_single, all_to_all_v
from simpar.comm.prepared import Prepared, prepare
from simpar.comm.trace import CommEvent, CommTrace, label

__all__ = [
    "CommEvent",
    "CommMismatchError",
    "CommTrace",
    "Group",
    "InputMismatchError",
    "PendingCheck",
    "Prepared",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "all_to_all_v",
    "barrier",
    "broadcast",
    "check_agreement",
    "check_context",
    "check_same_arrays",
    "create_group",
    "get_group_size",
    "get_rank",
    "init",
    "label",
    "prepare",
    "recv",
    "reduce_scatter",
    "send",
    "set_validation",
    "start_check_same_arrays",
    "validation",
    "validation_disabled",
    "world",
]
