"""The strategy map: every op's strategy, and every parameter's and graph input's layout.

It is the one value between planning and lowering (``../shared/DESIGN.md``): a planner (the
semi-auto propagation, data parallel, the searches, a strategy file) produces it; ``lower``
consumes it and chooses nothing. It is keyed by the MindSpore-style op names of the traced
graph ("Default/network-WithLossCell/_backbone-MLP/fc1-Dense/MatMul-op3"), is immutable,
prints as a table, and round-trips through JSON::

    smap = StrategyMap(8, "semi_auto_parallel",
                       {"…/fc1-Dense/MatMul-op1": OpStrategy("MatMul", ((2, 1), (4, 1)),
                                                             source=Source.USER)}, ...)
    StrategyMap.from_dict(json.loads(json.dumps(smap.to_dict()))) == smap
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from simpar._enums import StrEnum
from simpar.comm_fusion import AllReduceFusion, check_comm_fusion
from simpar.graph import Graph, Value
from simpar.layout import TensorLayout
from simpar.ops.strategy import Strategy, as_strategy
from simpar.optimizer_parallel import ParamShard

__all__ = ["MAP_MODES", "OpStrategy", "Source", "StrategyMap", "lay_out_by_consumer"]

# The parallel modes a map can be planned for.
MAP_MODES = ("stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel")


class Source(StrEnum):
    """Where an op's strategy came from. The values are the strings simpar has always
    printed, and compare equal to them ("annotated" is a strategy set with ``.shard()``)."""

    USER = "annotated"
    PROPAGATED = "propagated"
    DATA_PARALLEL = "data_parallel"
    SEARCHED = "searched"
    FILE = "file"


@dataclass(frozen=True, slots=True)
class OpStrategy:
    """One op's strategy: one tuple of cuts per input (and optionally per output), as in
    ``MatMul().shard(((2, 1), (1, 4)))``, and where it came from."""

    op_type: str
    in_strategy: Strategy
    out_strategy: Strategy | None = None
    source: Source = Source.USER

    def __post_init__(self) -> None:
        object.__setattr__(self, "in_strategy",
                           as_strategy(self.in_strategy, self.op_type, "in_strategy"))
        if self.out_strategy is not None:
            object.__setattr__(self, "out_strategy",
                               as_strategy(self.out_strategy, self.op_type, "out_strategy"))
        if not isinstance(self.source, Source):
            object.__setattr__(self, "source", Source(self.source))

    def __str__(self) -> str:
        out = f" out {_cuts(self.out_strategy)}" if self.out_strategy is not None else ""
        return f"{self.op_type} {_cuts(self.in_strategy)}{out} ({self.source})"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.op_type,
                             "in_strategy": [list(c) for c in self.in_strategy],
                             "source": self.source.value}
        if self.out_strategy is not None:
            d["out_strategy"] = [list(c) for c in self.out_strategy]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpStrategy:
        return cls(d["type"], d["in_strategy"], d.get("out_strategy"),
                   Source(d.get("source", Source.FILE.value)))


def lay_out_by_consumer(params: dict[str, TensorLayout], inputs: Sequence[Value],
                        layouts: Sequence[TensorLayout]) -> None:
    """Give every parameter among one op's ``inputs`` that ``params`` lays out not yet the
    layout that op reads it in (``layouts``, one per input), as MindSpore lays a weight out
    by the op that reads it. Called per op, first consumer first: a parameter takes its
    first consumer's layout."""
    for v, lay in zip(inputs, layouts):
        if v.kind == "param":
            params.setdefault(v.name, lay)


def _cuts(strategy: Strategy | None) -> str:
    return str([list(c) for c in strategy or ()]).replace(" ", "")


@dataclass(frozen=True)
class StrategyMap:
    """Every op's :class:`OpStrategy` by op name, every parameter's layout by parameter name,
    and every graph input's layout by input name, for ``device_num`` devices in ``mode``.

    ``optimality_gap`` says how sure the search that made it is: 0.0 when its objective is the
    proven optimum, ``g`` in (0, 1] when a time-limited exact search stopped early (the optimum
    costs at least ``1 - g`` of this plan's objective), None when the planner proves nothing.
    Two maps that choose the same strategies are equal whatever their gaps.

    ``shards`` holds, per parameter that optimizer parallel slices, its
    :class:`~simpar.optimizer_parallel.ParamShard` (the level, and the slice each rank
    stores); a parameter it does not name is stored in its own layout. ``micro_batches`` is
    how many micro-batches a training step runs (gradient accumulation); the graph is one
    micro-batch's. ``recompute`` names the recomputed Cells (the graph's segments);
    ``dimensions`` says how auto_parallel chose these three, when it did. ``comm_fusion``
    buckets the Mirrors' gradient AllReduces (:mod:`simpar.comm_fusion`)."""

    device_num: int
    mode: str
    ops: Mapping[str, OpStrategy] = field(default_factory=dict)
    params: Mapping[str, TensorLayout] = field(default_factory=dict)
    inputs: Mapping[str, TensorLayout] = field(default_factory=dict)
    optimality_gap: float | None = None
    shards: Mapping[str, ParamShard] = field(default_factory=dict)
    micro_batches: int = 1
    recompute: tuple[str, ...] = ()
    comm_fusion: AllReduceFusion = AllReduceFusion()
    #: How auto_parallel chose the memory dimensions, when it did
    #: (:class:`~simpar.search.dimensions.DimensionSearch`; not saved, not compared).
    dimensions: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.device_num, bool) or not isinstance(self.device_num,
                                                               (int, np.integer)) or \
                self.device_num < 1:
            raise ValueError(f"StrategyMap: device_num must be an int >= 1, got "
                             f"{self.device_num!r}")
        object.__setattr__(self, "device_num", int(self.device_num))
        if self.mode not in MAP_MODES:
            raise ValueError(f"StrategyMap: mode must be one of {list(MAP_MODES)}, got "
                             f"{self.mode!r}")
        for name, what in (("ops", OpStrategy), ("params", TensorLayout),
                           ("inputs", TensorLayout), ("shards", ParamShard)):
            table = getattr(self, name)
            for key, value in table.items():
                if not isinstance(value, what):
                    raise TypeError(f"StrategyMap: {name}[{key!r}] must be a "
                                    f"{what.__name__}, got {type(value).__name__}")
            object.__setattr__(self, name, MappingProxyType(dict(table)))
        if isinstance(self.micro_batches, bool) or not isinstance(
                self.micro_batches, (int, np.integer)) or self.micro_batches < 1:
            raise ValueError(f"StrategyMap: micro_batches must be an int >= 1, got "
                             f"{self.micro_batches!r}")
        if not isinstance(self.comm_fusion, AllReduceFusion):
            raise TypeError(f"StrategyMap: comm_fusion must be an AllReduceFusion, got "
                            f"{type(self.comm_fusion).__name__}")
        gap = self.optimality_gap
        if gap is not None:
            if isinstance(gap, bool) or not isinstance(gap, (int, float, np.floating)) or \
                    not 0.0 <= gap <= 1.0:
                raise ValueError(f"StrategyMap: optimality_gap must be None or a float in "
                                 f"[0, 1], got {gap!r}")
            object.__setattr__(self, "optimality_gap", float(gap))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StrategyMap):
            return NotImplemented
        return (self.device_num, self.mode, dict(self.ops), dict(self.params),
                dict(self.inputs), dict(self.shards), self.micro_batches,
                tuple(self.recompute), self.comm_fusion) == (
                    other.device_num, other.mode, dict(other.ops), dict(other.params),
                    dict(other.inputs), dict(other.shards), other.micro_batches,
                    tuple(other.recompute), other.comm_fusion)

    __hash__ = None  # type: ignore[assignment]  # holds mappings; compare, don't hash

    def complete(self, graph: Graph, in_layouts: Sequence[Sequence[TensorLayout]]
                 ) -> StrategyMap:
        """This map with a layout for every parameter of ``graph``: one the map gives none
        takes the layout its first consumer reads it in (:func:`lay_out_by_consumer`, nodes
        in trace order; ``in_layouts[i]`` are node i's input layouts), and one no op reads is
        held whole by every rank. On 8 devices, a weight read first by a MatMul of strategy
        ``((2, 1), (1, 4))`` takes that MatMul's ``(1, 4)`` layout."""
        params = dict(self.params)
        for node, layouts in zip(graph.nodes, in_layouts):
            lay_out_by_consumer(params, node.inputs, layouts)
        for v in graph.params:
            params.setdefault(v.name, TensorLayout((self.device_num,), [-1] * v.ndim, v.shape))
        return dataclasses.replace(self, params=params)

    def count(self, source: Source) -> int:
        return sum(1 for s in self.ops.values() if s.source == source)

    def __str__(self) -> str:
        by_source = ", ".join(f"{self.count(s)} {s}" for s in Source if self.count(s))
        gap = (f", optimality gap {self.optimality_gap:.2%}" if self.optimality_gap else "")
        micro = f", {self.micro_batches} micro-batches" if self.micro_batches > 1 else ""
        lines = [f"StrategyMap: {self.mode}, {self.device_num} devices, {len(self.ops)} ops "
                 f"({by_source}), {len(self.params)} parameters{gap}{micro}"]
        lines += [f"  {name}: {s}" for name, s in self.ops.items()]
        lines += [f"  param {name}: {lay}" for name, lay in self.params.items()]
        lines += [f"  input {name}: {lay}" for name, lay in self.inputs.items()]
        lines += [f"  optimizer shard {name}: {s}" for name, s in self.shards.items()]
        lines += [f"  recompute {name}" for name in self.recompute]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready. Layouts are MindSpore's dictionaries (plus shape); ``optimality_gap``
        only when the search gave one."""
        d: dict[str, Any] = {"device_num": self.device_num, "mode": self.mode,
                             "ops": {n: s.to_dict() for n, s in self.ops.items()},
                             "params": {n: lay.to_dict() for n, lay in self.params.items()},
                             "inputs": {n: lay.to_dict() for n, lay in self.inputs.items()}}
        if self.optimality_gap is not None:
            d["optimality_gap"] = self.optimality_gap
        if self.micro_batches > 1:
            d["micro_batches"] = self.micro_batches
        if self.recompute:
            d["recompute"] = list(self.recompute)
        if self.comm_fusion != AllReduceFusion():
            d["comm_fusion"] = self.comm_fusion.as_dict()
        if self.shards:
            d["shards"] = {n: {"level": str(s.level), "size": s.size,
                               "layout": s.layout.to_dict()} for n, s in self.shards.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StrategyMap:
        """Inverse of :meth:`to_dict`; a malformed dict raises ``ValueError`` naming the key."""
        try:
            return cls._from_dict(d)
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"StrategyMap.from_dict: not a strategy map dict ({type(e).__name__}"
                             f": {e}); it needs device_num, mode and ops {{name: {{type, "
                             "in_strategy, ...}}}}") from None

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> StrategyMap:
        return cls(int(d["device_num"]), str(d["mode"]),
                   {n: OpStrategy.from_dict(s) for n, s in d.get("ops", {}).items()},
                   {n: TensorLayout.from_dict(v) for n, v in d.get("params", {}).items()},
                   {n: TensorLayout.from_dict(v) for n, v in d.get("inputs", {}).items()},
                   d.get("optimality_gap"),
                   {n: ParamShard(s["level"], int(s["size"]), TensorLayout.from_dict(s["layout"]))
                    for n, s in d.get("shards", {}).items()},
                   int(d.get("micro_batches", 1)),
                   tuple(str(n) for n in d.get("recompute", ())),
                   check_comm_fusion("StrategyMap.from_dict", "comm_fusion",
                                     d.get("comm_fusion", AllReduceFusion().as_dict())))
