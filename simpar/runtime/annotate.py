"""Cell-level annotations: ``Cell.shard(in_strategy, parameter_plan=...)`` while tracing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from simpar import graph

__all__ = ["reshard_inputs"]


def reshard_inputs(cell: Any, args: Sequence[Any]) -> tuple[Any, ...]:
    """Insert an Identity with the cell's strategy on each annotated input: the lowering then
    redistributes the input to that layout."""
    from simpar.ops import Identity

    strategies = cell.in_strategy
    if len(strategies) > len(args):
        raise ValueError(f"{type(cell).__name__}.shard: in_strategy has {len(strategies)} "
                         f"entries but construct got {len(args)} inputs")
    out = list(args)
    for k, cuts in enumerate(strategies):
        if cuts is None:
            continue
        value = args[k]
        if not isinstance(value, graph.Value) or len(cuts) != value.ndim:
            raise ValueError(f"{type(cell).__name__}.shard: in_strategy {cuts} for input {k} "
                             f"must have one cut per dimension of {getattr(value, 'shape', '?')}")
        out[k] = Identity().shard((cuts,))(value)
    return tuple(out)
