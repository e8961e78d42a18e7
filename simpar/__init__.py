"""simpar: MindSpore-style automatic parallelism, executed for real on MPI ranks.

Each MPI rank is one simulated Ascend device that holds only its own tensor shards.
"""

from simpar import _env

_env.apply()  # before numpy's BLAS and MPI start (see simpar/_env.py)

from simpar.context import (  # noqa: E402
    get_algo_parameters,
    get_auto_parallel_context,
    reset_algo_parameters,
    reset_auto_parallel_context,
    set_algo_parameters,
    set_auto_parallel_context,
)
from simpar.cost_model_context import (  # noqa: E402
    get_cost_model_context,
    reset_cost_model_context,
    set_cost_model_context,
)
from simpar.mesh import DeviceMesh  # noqa: E402
from simpar.seed import get_seed, set_seed  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DeviceMesh",
    "__version__",
    "get_algo_parameters",
    "get_auto_parallel_context",
    "get_cost_model_context",
    "get_seed",
    "reset_algo_parameters",
    "reset_auto_parallel_context",
    "reset_cost_model_context",
    "set_algo_parameters",
    "set_auto_parallel_context",
    "set_cost_model_context",
    "set_seed",
]
