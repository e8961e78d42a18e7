"""The cost graph's bulk pricing of moves (simpar.search.moves, Pricer.move_matrix) against the
real planner and the model's own edge price, pair by pair (one process, no MPI)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from simpar import graph, nn
from simpar.cost import MindSporeCostModel, SimparCostModel
from simpar.layout import TensorLayout
from simpar.mesh import DeviceMesh
from simpar.ops import _base
from simpar.redistribution import plan
from simpar.search.moves import (
    COLUMNS,
    decode,
    move_steps,
    plan_moves,
    plan_signatures,
    signature_of,
)
from simpar.search.pricing import Pricer
from simpar.search.request import dataset_layouts
from tests.layout_strategies import factorizations


def random_layouts(rng: np.random.Generator, shape: tuple[int, ...], device_num: int,
                   count: int, partial: bool) -> list[TensorLayout]:
    """``count`` valid layouts of ``shape`` on ``device_num`` devices: device matrices written
    in 1 to 3 axes, each axis splitting a dimension (when it divides), pending or replicated."""
    out: list[TensorLayout] = []
    while len(out) < count:
        dm = factorizations(device_num, int(rng.integers(1, 4)))
        matrix = dm[int(rng.integers(len(dm)))]
        dims: list[list[int]] = [[] for _ in shape]
        pending = []
        cuts = [1] * len(shape)
        for axis in rng.permutation(len(matrix)):
            where = int(rng.integers(-2 if partial else -1, len(shape)))
            if where >= 0 and shape[where] % (cuts[where] * matrix[axis]) == 0:
                dims[where].append(int(axis))
                cuts[where] *= matrix[axis]
            elif where == -2:
                pending.append(int(axis))
        out.append(TensorLayout.from_dim_axes(matrix, dims, shape, pending))
    return out


CASES = [  # (p, k, shape): small dimensions make some ReduceScatters fall back to AllReduce
    (2, 3, (8, 4, 2)),
    (2, 4, (16, 4)),
    (2, 5, (64, 8, 4, 2)),
    (3, 2, (9, 3, 27)),
    (2, 6, (128, 2, 64)),
]


@pytest.mark.parametrize("p,k,shape", CASES)
@pytest.mark.parametrize("partial", [False, True])
def test_signatures_replay_the_planner_on_every_pair(p: int, k: int, shape: tuple[int, ...],
                                                     partial: bool) -> None:
    rng = np.random.default_rng(p * 100 + k + partial)
    srcs = random_layouts(rng, shape, p**k, 40, partial)
    dsts = random_layouts(rng, shape, p**k, 40, partial)
    rows = plan_signatures(srcs, dsts, p, k)
    assert rows.shape[0] == len(srcs) * len(dsts)
    kinds = set()
    for n, (s, d) in enumerate((s, d) for s in srcs for d in dsts):
        expected = signature_of(plan(s, d), p, k)
        assert decode(rows[n], len(shape)) == expected, (s, d)
        kinds.add(tuple(step[0] for step in expected))
    # The pairs exercise every kind of step the planner makes without AllToAll.
    steps = {kind for seq in kinds for kind in seq}
    assert {"AllGather", "Slice"} <= steps
    if partial:
        assert {"ReduceScatter", "AllReduce", "Zero"} <= steps
        assert len(kinds) >= 8


@pytest.mark.parametrize("p,k,shape", CASES[:3])
def test_blocks_cover_every_source_once_and_say_which_steps(p: int, k: int,
                                                           shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(k)
    srcs = random_layouts(rng, shape, p**k, 25, True)
    dsts = random_layouts(rng, shape, p**k, 15, True)
    whole = plan_signatures(srcs, dsts, p, k)
    seen = []
    for block in plan_moves(srcs, dsts, p, k, block_pairs=40):  # a few sources a block
        assert len(block.sources) <= 3
        seen += block.sources.tolist()
        rows = block.rows(np.arange(len(block.sources) * len(dsts)))
        at = (block.sources[:, None] * len(dsts) + np.arange(len(dsts))).ravel()
        assert (rows == whole[at]).all()
        present = (rows[:, 0::COLUMNS] >= 0) << np.arange(rows.shape[1] // COLUMNS)
        assert (block.kinds == present.sum(axis=1)).all()
        # Its steps are the collectives of the rows, in plan order.
        for step in block.steps:
            assert not step.kind.local and step.present.shape == block.kinds.shape
    assert sorted(seen) == list(range(len(srcs)))


@pytest.mark.parametrize("p,k,shape", CASES)
@pytest.mark.parametrize("profile", ["ascend910b", "cpu-local"])
def test_simpar_model_prices_every_pair_bit_for_bit(p: int, k: int, shape: tuple[int, ...],
                                                    profile: str) -> None:
    # ascend910b puts 8 devices in a server: groups inside one and across two price apart.
    for rank in (0, p**k - 1):
        model = SimparCostModel(profile, rank=rank)
        rng = np.random.default_rng(k + rank)
        srcs = random_layouts(rng, shape, p**k, 30, True)
        dsts = random_layouts(rng, shape, p**k, 30, True)
        rows = plan_signatures(srcs, dsts, p, k)
        for itemsize in (2, 4):
            bulk = model.edge_prices(DeviceMesh((p,) * k), move_steps(rows, shape, p),
                                     itemsize)
            one = [model.edge(plan(s, d), itemsize) for s in srcs for d in dsts]
            assert bulk.tolist() == one


def _gpt_pricer(model: object, device_num: int) -> tuple[Pricer, list[tuple[list, list, int]]]:
    net = nn.GPT(64, 16, 32, 1, 4)
    g = graph.trace(net, [((48, 16), np.int32)], ["ids"])
    pricer = Pricer(g, device_num, model, dataset_layouts([v.shape for v in g.inputs],
                                                          device_num, "data_parallel"))
    edges = []
    for se in pricer.edges[:40]:
        sides = []
        for n in (se.producer, se.consumer):
            site = pricer.sites[n]
            strategies = site.node.op.candidate_strategies(site.shapes, device_num)
            sides.append([p.sharding for p in (pricer.price(n, s) for s in strategies)
                          if p is not None])
        edges.append(([sh.outputs[se.output][1] for sh in sides[0]],
                      [sh.in_layouts[se.input] for sh in sides[1]], se.itemsize))
    return pricer, edges


@pytest.mark.parametrize("model", [SimparCostModel("ascend910b"), MindSporeCostModel()],
                         ids=["simpar", "mindspore"])
@pytest.mark.parametrize("device_num", [16, 12])
def test_move_matrix_equals_pair_by_pair(model: object, device_num: int) -> None:
    # 16 devices in bulk (simpar) or pair by pair (MindSpore's model has no bulk pricing);
    # 12 is no prime power, so its moves are planned exactly, pair by pair.
    # Two instances of the model: pricers of one instance share the moves they price.
    pricer, edges = _gpt_pricer(replace(model), device_num)
    reference, _ = _gpt_pricer(replace(model), device_num)
    checked = 0
    for srcs, dsts, itemsize in edges:
        matrix = pricer.move_matrix(srcs, dsts, itemsize)
        assert matrix.shape == (len(srcs), len(dsts))
        expected = [[reference.move(s, d, itemsize) for d in dsts] for s in srcs]
        assert matrix.tolist() == expected
        checked += matrix.size
    assert checked > 2000
    if device_num == 16 and isinstance(model, SimparCostModel):
        # Only one pair per kind of plan went through the real planner.
        assert pricer.moves_priced < reference.moves_priced / 5


@pytest.mark.parametrize("device_num", [16, 12])
def test_edge_transients_equal_pair_by_pair(device_num: int) -> None:
    # What each move holds for a while (its largest collective's buffer and result): on 16
    # devices from the bulk replay of every pair, on 12 (no prime power) planned one by one;
    # either way what the real planner's plan of each pair holds.
    pricer, _ = _gpt_pricer(SimparCostModel("ascend910b"), device_num)
    reference, _ = _gpt_pricer(SimparCostModel("ascend910b"), device_num)
    checked = held = 0
    for e, se in enumerate(pricer.edges[:40]):
        if se.follows:
            continue
        producers, consumers = (_candidates(pricer, n) for n in (se.producer, se.consumer))
        matrix = pricer.edge_transients(e, producers, consumers)
        expected = [[reference._move_transient(pc.outputs[se.output][1],
                                               cc.in_layouts[se.input], se.itemsize)
                     for cc in consumers] for pc in producers]
        assert matrix.tolist() == expected, pricer.sites[se.producer].name
        checked += matrix.size
        held += int(np.count_nonzero(matrix))
    assert checked > 2000 and held > 100
    if device_num == 16:   # one pair of every kind of plan went through the real planner
        assert len(pricer._transients) < len(reference._transients) / 5


def _candidates(pricer: Pricer, n: int) -> list[Any]:
    site = pricer.sites[n]
    strategies = site.node.op.candidate_strategies(site.shapes, pricer.device_num)
    return [p.sharding for p in (pricer.price(n, s) for s in strategies) if p is not None]


def test_the_pricers_of_one_model_share_the_moves_they_price() -> None:
    """The memory dimensions' combinations each make a pricer of one model: what one prices,
    the next reads; another instance, another device count, or a MindSpore model reading the
    process's context when priced keeps its own."""
    model = SimparCostModel("ascend910b")
    first, edges = _gpt_pricer(model, 16)
    srcs, dsts, itemsize = edges[0]
    matrix = first.move_matrix(srcs, dsts, itemsize)
    assert first.moves_priced > 0
    again, _ = _gpt_pricer(model, 16)
    assert again.moves_priced == first.moves_priced
    assert again.move_matrix(srcs, dsts, itemsize).tolist() == matrix.tolist()
    # (building a pricer here prices the ops' candidates, which move the graph input)
    alone = _gpt_pricer(replace(model), 16)[0].moves_priced
    assert alone < first.moves_priced
    assert _gpt_pricer(model, 8)[0].moves_priced == _gpt_pricer(replace(model), 8)[0].moves_priced
    ms = MindSporeCostModel()
    one, _ = _gpt_pricer(ms, 16)
    built = one.moves_priced
    one.move_matrix(srcs, dsts, itemsize)
    assert one.moves_priced > built and _gpt_pricer(ms, 16)[0].moves_priced == built


def test_equal_ops_are_sharded_once_per_process_for_every_pricer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An op's layouts under a strategy are derived once for every op equal to it (type and
    repr) on the same shapes: the two blocks of one GPT, every pricer of its graph (the
    memory dimensions' combinations price the same candidates), and a graph traced again (a
    process plans the same model again and again). The memo keeps the newest
    ``SHARDINGS_KEPT``, and what it gives is what deriving again gives."""
    monkeypatch.setattr(_base, "_SHARDINGS", {})
    net = nn.GPT(64, 16, 32, 2, 4)
    layouts: Any = None

    def priced(model: object, kept: int | None = None) -> list[Any]:
        nonlocal layouts
        if kept is not None:
            monkeypatch.setattr(_base, "SHARDINGS_KEPT", kept)
        g = graph.trace(net, [((48, 16), np.int32)], ["ids"])
        layouts = dataset_layouts([v.shape for v in g.inputs], 8, "data_parallel")
        pricer = Pricer(g, 8, model, layouts)
        found = [pricer.price(n, s) for n, site in enumerate(pricer.sites)
                 for s in site.node.op.candidate_strategies(site.shapes, 8)]
        return [None if p is None else (repr(p.sharding.op) == repr(site.node.op),
                                        p.sharding.strategy,
                                        p.sharding.in_layouts, p.sharding.outputs, p.cost,
                                        p.memory)
                for p, site in zip(found, [site for site in pricer.sites
                                           for _ in site.node.op.candidate_strategies(
                                               site.shapes, 8)])]

    first = priced(SimparCostModel("ascend910b"))
    made = len(_base._SHARDINGS)
    assert 0 < made < sum(p is not None for p in first)     # the blocks' ops are alike
    assert all(p is None or p[0] for p in first)             # an op equal to its own
    again = priced(SimparCostModel("ascend910b"))
    assert len(_base._SHARDINGS) == made and again == first
    assert priced(SimparCostModel("cpu-local", "adam")) and len(_base._SHARDINGS) == made
    monkeypatch.setattr(_base, "_SHARDINGS", {})
    assert priced(SimparCostModel("ascend910b"), kept=10) == first
    assert len(_base._SHARDINGS) == 10


def test_one_device_and_empty_lists() -> None:
    pricer, _ = _gpt_pricer(SimparCostModel("ascend910b"), 1)
    lay = TensorLayout((1,), (-1, -1), (4, 4))
    assert pricer.move_matrix([lay], [lay, lay], 4).tolist() == [[0.0, 0.0]]
    assert pricer.move_matrix([], [lay], 4).shape == (0, 1)
    assert plan_signatures([], [lay], 2, 0).shape[0] == 0


def test_layouts_of_other_shapes_are_refused() -> None:
    a = TensorLayout((4,), (0, -1), (8, 4))
    b = TensorLayout((4,), (0, -1), (8, 8))
    with pytest.raises(ValueError, match=r"every layout must have shape \(8, 4\)"):
        plan_signatures([a], [b], 2, 2)
