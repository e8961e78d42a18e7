"""The ops and edges of a traced graph as the searches' pricer sees them (pure): what an op's
candidates, costs and memories depend on (its *signature*: equal for the same op at the same
place of two identical layers, which are then priced once), and how its memory treats each
input (:func:`memory_roles`, MindSpore's ``is_parameter_involve`` among them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simpar.graph import Node
from simpar.layout import TensorLayout

__all__ = ["Site", "SiteEdge", "memory_roles", "signature"]


@dataclass(frozen=True)
class Site:
    """One op as the pricer sees it. ``roles[k]`` says how the op's memory treats input k
    ("new" trainable parameter, "frozen" parameter, "held" elsewhere, "free") and whether it
    is computed from a parameter; ``inputs`` maps input positions to graph-input layouts."""

    index: int
    node: Node
    signature: tuple[Any, ...]
    #: A small number equal for equal signatures (cheap to hash).
    kind: int
    shapes: tuple[tuple[int, ...], ...]
    roles: tuple[tuple[str, bool], ...]
    user: bool
    inputs: Mapping[int, TensorLayout]

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def params(self) -> frozenset[int]:
        """Input positions that read a parameter."""
        return frozenset(k for k, v in enumerate(self.node.inputs) if v.kind == "param")

    def positions(self, role: str) -> frozenset[int]:
        return frozenset(k for k, (r, _) in enumerate(self.roles) if r == role)


@dataclass(frozen=True)
class SiteEdge:
    """``producer``'s output ``output`` feeds ``consumer``'s input ``input`` (node indices);
    ``follows``: the producer is elementwise and elementwise_op_strategy_follow is on."""

    producer: int
    output: int
    consumer: int
    input: int
    itemsize: int
    follows: bool = False


def memory_roles(node: Node, counted: set[str], involved: set[int], kept: set[int],
                 array: Mapping[int, int]) -> tuple[tuple[str, bool], ...]:
    """Per input, how the op's memory treats it: "new" (a trainable parameter no earlier op
    counts; its first position only), "frozen" (the same, not trainable), "held" (a parameter
    counted already, or a value an earlier op's memory holds), "free" (the op's to keep or
    not); and whether it is computed from a parameter (MindSpore's ``is_parameter_involve``)."""
    roles = []
    seen: set[str] = set()
    for v in node.inputs:
        if v.kind == "param":
            role = "held" if v.name in counted or v.name in seen else (
                "new" if v.param is None or v.param.requires_grad else "frozen")
            seen.add(v.name)
        else:
            role = "held" if array.get(v.id, v.id) in kept else "free"
        roles.append((role, v.kind == "param" or v.id in involved))
    return tuple(roles)


def signature(node: Node, inputs: Mapping[int, TensorLayout],
              plans: Mapping[str, tuple[int, ...]], roles: tuple[tuple[str, bool], ...]
              ) -> tuple[Any, ...]:
    """What a node's candidates, costs and memories depend on: equal signatures (the same op
    at the same place of two identical layers) share one computation."""
    ins = []
    for v in node.inputs:
        where: Any = v.kind
        if v.id in inputs:
            where = ("input", inputs[v.id])
        elif v.kind == "param":
            where = ("param", plans.get(v.name))
        ins.append((v.shape, v.dtype.str, where))
    return (type(node.op), repr(node.op), node.op.out_strategy, tuple(ins), roles,
            tuple((v.shape, v.dtype.str) for v in node.outputs))
