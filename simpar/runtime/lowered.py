"""What lowering derives from a graph and its strategy map, and every rank's program runs
from: per op its sharding and the redistributions feeding it, every value's layout, every
parameter's. A frozen value: the backward plan (:mod:`simpar.runtime.backward_plan`), the
schedule (:mod:`simpar.runtime.program_schedule`) and the executor read it; nothing writes
it once lowered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from simpar.graph import Graph, Node, Value
from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding
from simpar.redistribution import RedistributionPlan
from simpar.search import Source

__all__ = ["LoweredGraph", "OpStep"]


@dataclass(frozen=True, slots=True)
class OpStep:
    """One node of the per-rank program: its sharding, the redistributions feeding it, where
    its strategy came from, and how many ranks compute each of its shards."""

    node: Node
    sharding: OpSharding
    in_plans: tuple[RedistributionPlan, ...]
    chosen: Source
    repeat: int = 1


@dataclass(frozen=True)
class LoweredGraph:
    """``graph`` lowered for ``device_num`` devices: its ops in trace order (``steps``), the
    layout of every value (by id) and of every parameter (by name). ``needs_grad`` holds the
    values on a path from a trainable parameter; ``grad_nodes`` the nodes reading one, whose
    forward keeps a tape."""

    graph: Graph
    device_num: int
    steps: tuple[OpStep, ...]
    layouts: Mapping[int, TensorLayout]            # value id -> layout of the value
    param_layouts: Mapping[str, TensorLayout]      # parameter name -> layout
    param_values: Mapping[str, Value]
    needs_grad: frozenset[int] = frozenset()
    enable_alltoall: bool = False
    grad_nodes: frozenset[int] = frozenset()
