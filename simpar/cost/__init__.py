"""simpar.cost: what drives training time, computed from shapes alone (no MPI, no data).

* :mod:`simpar.cost.collective`: a collective's traffic and alpha-beta time, the single owner
  of those formulas;
* :mod:`simpar.cost.profile`: device profiles (``ascend910a``, ``ascend910b``, ``cpu-local``);
* :mod:`simpar.cost.model`: simpar's model: step time and per-rank memory of a lowered program
  on a profile (:func:`evaluate`, or ``program.cost(profile)``);
* :mod:`simpar.cost.mindspore`: MindSpore's own cost model (bytes of slices; ``op_cost``,
  ``objective``, ``redistribution_cost``), reproduced term by term, under the settings of
  ``set_cost_model_context`` (:mod:`simpar.cost_model_context`, re-exported here);
* :mod:`simpar.cost.interface`: one interface for both (``CostModel``: ``op``, ``edge``,
  ``program``), so a search can use either, and :func:`compare` to show both.
"""

from simpar.cost.collective import (
    ALPHA_SECONDS,
    BANDWIDTH_BYTES_PER_S,
    latency_rounds,
    sample_ranks,
    seconds,
    traffic,
)
from simpar.cost.interface import CostModel, MindSporeCostModel, SimparCostModel, compare
from simpar.cost.mindspore import (
    MindSporeCost,
    MindSporeOpCost,
    RedistributionCost,
    edge_objective,
    fits,
    objective,
    op_cost,
    redistribution_cost,
)
from simpar.cost.model import OPTIMIZER_STATE, CostReport, MemoryRow, OpCostRow, evaluate
from simpar.cost.profile import DeviceProfile, Link, load_profile, profile_names
from simpar.cost_model_context import (
    CostModelContext,
    cost_model_context,
    get_cost_model_context,
    reset_cost_model_context,
    set_cost_model_context,
)

__all__ = ["ALPHA_SECONDS", "BANDWIDTH_BYTES_PER_S", "OPTIMIZER_STATE", "CostModel",
           "CostModelContext", "MindSporeCostModel", "SimparCostModel", "compare",
           "CostReport", "DeviceProfile", "Link", "MemoryRow", "MindSporeCost",
           "MindSporeOpCost", "OpCostRow", "RedistributionCost", "cost_model_context",
           "edge_objective", "evaluate", "fits", "get_cost_model_context", "latency_rounds",
           "load_profile", "objective", "op_cost", "profile_names", "redistribution_cost",
           "reset_cost_model_context", "sample_ranks", "seconds", "set_cost_model_context",
           "traffic"]
