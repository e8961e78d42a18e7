"""simpar.cost: what drives training time, computed from shapes alone (no MPI, no data).

* a collective's traffic and alpha-beta time are re-exported from their owner,
  :mod:`simpar.collective_kinds` (the table of collective kinds, in simpar's bottom layer);
* :mod:`simpar.cost.profile`: device profiles (``ascend910a``, ``ascend910b``, ``cpu-local``);
* :mod:`simpar.cost.model`: simpar's model: step time and per-rank memory of a lowered program
  on a profile (:func:`evaluate`, or ``program.cost(profile)``);
* :mod:`simpar.cost.mindspore`: MindSpore's own cost model (bytes of slices; ``objective``),
  reproduced term by term under the settings of ``set_cost_model_context``
  (:mod:`simpar.cost_model_context`, re-exported here), with its operator costs
  (:mod:`simpar.cost.mindspore_ops`: ``op_cost``, the formulas of each cost class an op
  declares) and redistribution costs (:mod:`simpar.cost.mindspore_redistribution`:
  ``redistribution_cost``);
* :mod:`simpar.cost.interface`: one interface for both (``CostModel``: ``op``, ``edge``,
  ``program``), so a search can use either, and :func:`compare` to show both.
"""

from simpar.collective_kinds import (
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
    edge_objective,
    fits,
    objective,
)
from simpar.cost.mindspore_ops import MindSporeOpCost, op_cost
from simpar.cost.mindspore_redistribution import RedistributionCost, redistribution_cost
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
