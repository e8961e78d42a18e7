"""simpar.cost: what drives training time, computed from shapes alone (no MPI, no data).

* :mod:`simpar.cost.collective`: a collective's traffic and alpha-beta time, the single owner
  of those formulas;
* :mod:`simpar.cost.profile`: device profiles (``ascend910a``, ``ascend910b``, ``cpu-local``);
* :mod:`simpar.cost.model`: simpar's model: step time and per-rank memory of a lowered program
  on a profile (:func:`evaluate`, or ``program.cost(profile)``).
"""

from simpar.cost.collective import (
    ALPHA_SECONDS,
    BANDWIDTH_BYTES_PER_S,
    latency_rounds,
    sample_ranks,
    seconds,
    traffic,
)
from simpar.cost.model import OPTIMIZER_STATE, CostReport, MemoryRow, OpCostRow, evaluate
from simpar.cost.profile import DeviceProfile, Link, load_profile, profile_names

__all__ = ["ALPHA_SECONDS", "BANDWIDTH_BYTES_PER_S", "OPTIMIZER_STATE", "CostReport",
           "DeviceProfile", "Link", "MemoryRow", "OpCostRow", "evaluate", "latency_rounds",
           "load_profile", "profile_names", "sample_ranks", "seconds", "traffic"]
