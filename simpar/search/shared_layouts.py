"""One layout per parameter that several ops read, for the searches that choose op by op
(recursive programming, sharding propagation): MindSpore keeps one per parameter. The cost
graph's searches hold it as a constraint instead (the virtual node of
:mod:`~simpar.search.dynamic_programming`, the equalities of :mod:`~simpar.search.exact`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from simpar.layout import TensorLayout
from simpar.ops._base import OpSharding
from simpar.search.pricing import Priced, Pricer, canonical, listed
from simpar.search.sites import Site

__all__ = ["one_layout_per_parameter", "users_read_one_layout"]


def _around(pricer: Pricer, shardings: Sequence[OpSharding], n: int, priced: Priced) -> float:
    """Op ``n``'s own cost under ``priced`` plus its edges to every neighbour as it stands."""
    total = priced.cost
    for e in pricer.in_edges[n]:
        total += pricer.edge_cost(e, shardings[pricer.edges[e].producer], priced.sharding)
    for e in pricer.out_edges[n]:
        total += pricer.edge_cost(e, priced.sharding, shardings[pricer.edges[e].consumer])
    return total


def one_layout_per_parameter(pricer: Pricer, shardings: list[OpSharding], search: str
                             ) -> None:
    """Give every parameter read by several ops one layout (the same block on every rank for
    every reader), in place, as MindSpore keeps one layout per parameter.

    Readers with a ``.shard()`` strategy decide it; two that disagree raise, naming both. Else
    each reader may take any of its strategies that reads the parameter in a layout every
    other reader can also read it in (keeping, where it can, the layouts already settled for
    the other parameters it reads); the common layout is the one cheapest for the readers
    together, each at its cheapest strategy for it against its neighbours as they stand.
    Readers that agree already are left alone. The whole parameter (replicated) is always
    common; an op reading several shared parameters may take further passes to agree, and if
    those keep undoing each other, every reader reads every shared parameter whole."""
    for _ in range(len(pricer.shared) + 1):
        settled: dict[str, Any] = {}
        for name, uses in pricer.shared.items():
            settled[name] = _one_layout(pricer, shardings, search, name, uses, settled)
        if all(len({canonical(shardings[n].in_layouts[k]) for n, k in uses}) == 1
               for uses in pricer.shared.values()):
            return
    # Readers of several shared parameters kept undoing each other: read them all whole.
    whole = {name: canonical(TensorLayout((pricer.device_num,), [-1] * len(shape), shape))
             for name, shape in ((v.name, v.shape) for v in pricer.graph.params)
             if name in pricer.shared}
    for n in sorted({n for uses in pricer.shared.values() for n, _ in uses}):
        site = pricer.sites[n]
        if site.user:
            continue
        found = [p for p in (pricer.price(n, strat) for strat in pricer.candidates(n, False))
                 if p is not None and _keeps(site, p.sharding, whole)]
        shardings[n] = min(found, key=lambda p: _around(pricer, shardings, n, p)).sharding
    if not all(len({canonical(shardings[n].in_layouts[k]) for n, k in uses}) == 1
               for uses in pricer.shared.values()):
        raise ValueError(f"{search}: the shared parameters {sorted(pricer.shared)} found no "
                         "layouts that all their readers can read them in together")


def users_read_one_layout(pricer: Pricer, shardings: Sequence[OpSharding], search: str
                          ) -> None:
    """Raise if two ops with ``.shard()`` strategies read one parameter in two layouts: a
    parameter has one layout (MindSpore refuses such strategies in every mode)."""
    for name, uses in pricer.shared.items():
        _users_agree(pricer, shardings, search, name, uses)


def _users_agree(pricer: Pricer, shardings: Sequence[OpSharding], search: str, name: str,
                 uses: Sequence[tuple[int, int]]) -> None:
    sites = pricer.sites
    readers = sorted({n for n, _ in uses})
    positions = {n: [k for m, k in uses if m == n] for n in readers}

    def key_of(n: int) -> Any:
        keys = {canonical(shardings[n].in_layouts[k]) for k in positions[n]}
        return keys.pop() if len(keys) == 1 else None

    users = [n for n in readers if sites[n].user]
    for a, b in zip(users, users[1:]):
        if key_of(a) != key_of(b):
            raise ValueError(
                f"{search}: {sites[a].name} (.shard({listed(shardings[a].strategy)})) "
                f"reads parameter {name} cut {_cuts_of(shardings[a], positions[a])}, and "
                f"{sites[b].name} (.shard({listed(shardings[b].strategy)})) reads it "
                f"cut {_cuts_of(shardings[b], positions[b])}; a shared parameter has one "
                "layout, so these strategies cannot both hold: make them agree")


def _one_layout(pricer: Pricer, shardings: list[OpSharding], search: str, name: str,
                uses: Sequence[tuple[int, int]], settled: Mapping[str, Any]) -> Any:
    """One parameter of :func:`one_layout_per_parameter`; returns its layout's block key."""
    sites = pricer.sites
    readers = sorted({n for n, _ in uses})
    positions = {n: [k for m, k in uses if m == n] for n in readers}

    def key_of(n: int, sh: OpSharding) -> Any:
        keys = {canonical(sh.in_layouts[k]) for k in positions[n]}
        return keys.pop() if len(keys) == 1 else None

    current = {key_of(n, shardings[n]) for n in readers}
    if len(current) == 1 and None not in current:
        return current.pop()
    _users_agree(pricer, shardings, search, name, uses)
    users = [n for n in readers if sites[n].user]

    def options(n: int, keep: Mapping[str, Any]) -> dict[Any, tuple[float, OpSharding]]:
        if sites[n].user:
            return {key_of(n, shardings[n]): (0.0, shardings[n])}
        found: dict[Any, tuple[float, OpSharding]] = {}
        for strat in pricer.candidates(n, False):
            priced = pricer.price(n, strat)
            if priced is None:
                continue
            key = key_of(n, priced.sharding)
            if key is None or not _keeps(sites[n], priced.sharding, keep):
                continue
            cost = _around(pricer, shardings, n, priced)
            if key not in found or cost < found[key][0]:
                found[key] = (cost, priced.sharding)
        return found

    found = {n: options(n, settled) for n in readers}
    common = set.intersection(*(set(f) for f in found.values()))
    if not common:  # the layouts settled for other parameters cannot all stay
        found = {n: options(n, {}) for n in readers}
        common = set.intersection(*(set(f) for f in found.values()))
    if not common:
        raise ValueError(
            f"{search}: no layout of parameter {name} can be read by all of "
            f"{[sites[n].name for n in readers]}"
            + (f" as {sites[users[0]].name}'s .shard() reads it" if users else ""))
    first = key_of(readers[0], shardings[readers[0]])  # ties keep the first reader's
    best = min(common, key=lambda key: (sum(found[n][key][0] for n in readers),
                                        key != first, repr(key)))
    for n in readers:
        shardings[n] = found[n][best][1]
    return best


def _keeps(site: Site, sh: OpSharding, settled: Mapping[str, Any]) -> bool:
    """Whether ``sh`` reads every parameter already given its one layout in that layout."""
    return all(canonical(lay) == settled[v.name] for v, lay in zip(site.node.inputs,
                                                                   sh.in_layouts)
               if v.kind == "param" and v.name in settled)


def _cuts_of(sh: OpSharding, positions: Sequence[int]) -> tuple[int, ...]:
    return sh.in_layouts[positions[0]].cuts
