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

# Every name a module lists in its __all__ is simpar.comm's: a new collective is public once
# its module lists it.
from simpar.comm import _world, agreement, collectives, exchange, prepared
from simpar.comm._world import *  # noqa: F403
from simpar.comm.agreement import *  # noqa: F403
from simpar.comm.collectives import *  # noqa: F403
from simpar.comm.exchange import *  # noqa: F403
from simpar.comm.prepared import *  # noqa: F403
from simpar.comm.trace import CommEvent, CommTrace, label

__all__ = ["CommEvent", "CommTrace", "label"]
__all__ += (_world.__all__ + agreement.__all__ + collectives.__all__ + exchange.__all__
            + prepared.__all__)
