"""What lowering derives from a graph and its strategy map, and every rank's program runs
from: per op its sharding and the redistributions feeding it, every value's layout, every
parameter's. A frozen value: the backward plan (:mod:`simpar.runtime.backward_plan`), the
schedule (:mod:`simpar.runtime.program_schedule`) and the executor read it; nothing writes
it once lowered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from simpar.comm_fusion import AllReduceFusion
from simpar.graph import Graph, Node, Value
from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding
from simpar.optimizer_parallel import ParamShard
from simpar.redistribution import RedistributionPlan
from simpar.search import Source

__all__ = ["LoweredGraph", "OpStep", "Segment"]


@dataclass(frozen=True, slots=True)
class OpStep:
    """One node of the per-rank program: its sharding, the redistributions feeding it, where
    its strategy came from, and how many ranks compute each of its shards."""

    node: Node
    sharding: OpSharding
    in_plans: tuple[RedistributionPlan, ...]
    chosen: Source
    repeat: int = 1


@dataclass(frozen=True, slots=True)
class Segment:
    """A recomputed Cell in the program: its ops are steps ``first..last`` (a run), and the
    backward runs their forward again before the VJP of ``last``. ``mp_comm``: their
    redistributions' collectives run again (else the moved arrays are kept); ``opt_comm``:
    sliced weights they read are gathered again (else the gathered copy is kept; level3
    gathers again anyway)."""

    name: str
    first: int
    last: int
    mp_comm: bool = True
    opt_comm: bool = False

    def __contains__(self, index: int) -> bool:
        return self.first <= index <= self.last


@dataclass(frozen=True)
class LoweredGraph:
    """``graph`` lowered for ``device_num`` devices: its ops in trace order (``steps``), the
    layout of every value (by id) and of every parameter (by name). ``needs_grad`` holds the
    values on a path from a trainable parameter; ``grad_nodes`` the nodes reading one, whose
    forward keeps a tape. ``param_shards`` names the parameters optimizer parallel slices
    (each stored as its shard's layout says, :mod:`simpar.optimizer_parallel`), and
    ``weight_gathers`` the plan that makes each one whole again (its layout in
    ``param_layouts``) before the forward's first use."""

    graph: Graph
    device_num: int
    steps: tuple[OpStep, ...]
    layouts: Mapping[int, TensorLayout]            # value id -> layout of the value
    param_layouts: Mapping[str, TensorLayout]      # parameter name -> layout
    param_values: Mapping[str, Value]
    needs_grad: frozenset[int] = frozenset()
    enable_alltoall: bool = False
    grad_nodes: frozenset[int] = frozenset()
    param_shards: Mapping[str, ParamShard] = field(default_factory=dict)
    weight_gathers: Mapping[str, RedistributionPlan] = field(default_factory=dict)
    #: Micro-batches per training step (gradient accumulation): the graph is one
    #: micro-batch's, and the gradients that sync once per step do so after the last.
    micro_batches: int = 1
    segments: tuple[Segment, ...] = ()
    #: How the Mirrors bucket the gradients they sum (:mod:`simpar.comm_fusion`).
    comm_fusion: AllReduceFusion = AllReduceFusion()

    def segment_of(self, index: int) -> Segment | None:
        """The recomputed segment op ``index`` (its step's place) belongs to, if any."""
        return next((seg for seg in self.segments if index in seg), None)

    def storage_layout(self, name: str) -> TensorLayout:
        """The layout parameter ``name`` is stored (and updated, and its optimizer state
        kept) in: its shard's under optimizer parallel, else its own."""
        shard = self.param_shards.get(name)
        return shard.layout if shard is not None else self.param_layouts[name]
