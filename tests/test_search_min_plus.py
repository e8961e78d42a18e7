"""Dynamic programming's one-entry op elimination (simpar.search.min_plus) against the dense
product it prunes: the same costs, memories and choices, bit for bit (one process)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from simpar.search import min_plus as mp
from simpar.search.tables import pareto as _pareto


def dense(a: np.ndarray, a_mem: np.ndarray, b: np.ndarray, b_mem: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every term, reduced as the elimination reduces a table of one entry."""
    terms = (a[:, :, None] + b[None]).transpose(0, 2, 1)
    mems = (a_mem[:, :, None] + b_mem[None]).transpose(0, 2, 1)
    ku, kw, kv = terms.shape
    c, m, i, _ = _pareto(terms.reshape(-1, kv), mems.reshape(-1, kv), 1, math.inf)
    return c.reshape(ku, kw), m.reshape(ku, kw), i.reshape(ku, kw)


def tables(rng: np.random.Generator, ku: int, kv: int, kw: int, levels: int
           ) -> tuple[np.ndarray, ...]:
    """Costs on a few levels (many ties, zero moves), some infinite, memories that tie too."""
    a = rng.integers(0, levels, (ku, kv)) * 0.25
    b = rng.integers(0, levels, (kv, kw)) * 0.5
    a[rng.random(a.shape) < 0.05] = np.inf
    b[rng.random(b.shape) < 0.1] = np.inf
    b[:, 0] = np.inf                                  # a w no v reaches
    a[0] = np.inf                                     # a u that reaches no v
    return a, rng.integers(0, 3, (ku, kv)) * 1.0, b, rng.integers(0, 2, (kv, kw)) * 1.0


@pytest.mark.parametrize("shape", [(5, 7, 6), (40, 60, 50), (33, 9, 70)])
@pytest.mark.parametrize("levels", [2, 6, 1000])
@pytest.mark.parametrize("pruned", [False, True])
@pytest.mark.parametrize("hint", [None, "any", "best"])
def test_min_plus_equals_the_dense_product(shape: tuple[int, int, int], levels: int,
                                           pruned: bool, hint: str | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruned or not, with upper bounds from probes or from a hint (any v per (u, w), or the
    dense product's own, -1 where all is infinite), the result is the dense product's."""
    if pruned:  # every size goes through the bounds, a few u's per group, and is pruned
        monkeypatch.setattr(mp, "_DENSE", 0)
        monkeypatch.setattr(mp, "_GROUP", 3)
        monkeypatch.setattr(mp, "_SUPER", 7)
        monkeypatch.setattr(mp, "_PROBES", 2)
        monkeypatch.setattr(mp, "_SPARSE", 1.0)
    else:       # every term, a few u's at a time
        monkeypatch.setattr(mp, "_DENSE_CHUNK", 200)
    rng = np.random.default_rng(sum(shape) + levels)
    a, a_mem, b, b_mem = tables(rng, *shape, levels)
    want = dense(a, a_mem, b, b_mem)
    ku, kv, kw = shape
    hints = {None: None, "any": rng.integers(0, kv, (ku, kw)), "best": want[2]}
    got = mp.min_plus(a, a_mem, b, b_mem, hint=hints[hint])
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert g.tolist() == w.tolist()


def test_a_hint_of_the_wrong_shape_or_range_is_refused_by_name() -> None:
    a, a_mem, b, b_mem = tables(np.random.default_rng(2), 4, 5, 6, 3)
    for hint in (np.zeros((4, 5), dtype=int), np.full((4, 6), 5), np.zeros((4, 6))):
        with pytest.raises(ValueError, match=r"min_plus: hint must be a \(4, 6\) array of "
                                             "ints below 5"):
            mp.min_plus(a, a_mem, b, b_mem, hint=hint)


def test_a_good_hint_keeps_fewer_terms_than_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hint at each (u, w)'s least term gives the tightest bounds: no more terms kept than
    with the probes, and here fewer."""
    rng = np.random.default_rng(21)
    a, b = rng.random((64, 90)), rng.random((90, 70))   # each u's best v its own
    kept: list[int] = []
    real = mp._kept

    def counting(*args: np.ndarray) -> list[tuple[np.ndarray, ...]]:
        out = real(*args)
        kept.append(sum(len(g) * len(ws) for g, ws, _, _ in out))
        return out

    monkeypatch.setattr(mp, "_kept", counting)
    monkeypatch.setattr(mp, "_DENSE", 0)
    monkeypatch.setattr(mp, "_PROBES", 2)
    zeros_a, zeros_b = np.zeros_like(a), np.zeros_like(b)
    probed = mp.min_plus(a, zeros_a, b, zeros_b)
    hinted = mp.min_plus(a, zeros_a, b, zeros_b, hint=probed[2])
    assert all(p.tolist() == h.tolist() for p, h in zip(probed, hinted))
    assert kept[1] < 0.5 * kept[0]


def test_negative_costs_are_not_pruned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mp, "_DENSE", 0)
    rng = np.random.default_rng(3)
    a, a_mem, b, b_mem = tables(rng, 20, 30, 25, 5)
    b -= 1.0
    got = mp.min_plus(a, a_mem, b, b_mem)
    assert all(g.tolist() == w.tolist() for g, w in zip(got, dense(a, a_mem, b, b_mem)))


def test_pruning_leaves_most_terms_unevaluated(monkeypatch: pytest.MonkeyPatch) -> None:
    # Moves into w cost 0 from its own layout and much more from others: few v are worth it.
    rng = np.random.default_rng(5)
    k = 120
    a = rng.random((50, k))
    b = 1.0 + rng.random((k, k))
    np.fill_diagonal(b, 0.0)
    evaluated = []
    exact = mp._exact

    def counting(terms: np.ndarray, *rest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        evaluated.append(terms.size)
        return exact(terms, *rest)

    monkeypatch.setattr(mp, "_exact", counting)
    monkeypatch.setattr(mp, "_DENSE", 0)
    got = mp.min_plus(a, np.zeros_like(a), b, np.zeros_like(b))
    assert all(g.tolist() == w.tolist() for g, w in zip(got, dense(a, np.zeros_like(a), b,
                                                                     np.zeros_like(b))))
    assert sum(evaluated) < 0.2 * a.shape[0] * k * k


def test_equal_columns_are_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(11)
    a, a_mem, b, b_mem = tables(rng, 30, 40, 12, 4)
    b, b_mem = b[:, [0, 1, 2, 1, 3, 0, 4, 2, 2]], b_mem[:, [0, 1, 2, 1, 3, 0, 4, 2, 2]]
    b_mem[0, 8] += 1.0                               # equal costs, another memory: kept apart
    widths = []
    real = mp._dense

    def counting(a: np.ndarray, a_mem: np.ndarray, b: np.ndarray, b_mem: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
        widths.append(b.shape[1])
        return real(a, a_mem, b, b_mem)

    monkeypatch.setattr(mp, "_dense", counting)
    got = mp.min_plus(a, a_mem, b, b_mem)
    assert widths == [6]
    assert all(g.tolist() == w.tolist() for g, w in zip(got, dense(a, a_mem, b, b_mem)))


def test_columns_whose_fingerprints_collide_are_told_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal columns are grouped by a fingerprint of their bits; a grouping in which some
    column differs from its group's first (a collision) is redone byte by byte."""
    class Ones:
        def integers(self, low: int, high: int, size: int, dtype: type) -> np.ndarray:
            return np.ones(size, dtype=dtype)   # a column's print: the sum of its words

    rng = np.random.default_rng(13)
    a, a_mem, b, b_mem = tables(rng, 20, 6, 4, 1000)
    b = np.concatenate([b, b[::-1, 1:2], b[:, 1:2]], axis=1)   # a permuted column, a copy
    b_mem = np.concatenate([b_mem, b_mem[::-1, 1:2], b_mem[:, 1:2]], axis=1)
    assert b[:, 4].tolist() != b[:, 1].tolist()
    monkeypatch.setattr(np.random, "default_rng", lambda seed=None: Ones())
    cols, back = mp._distinct_columns(b, b_mem)
    assert cols.tolist() == [0, 1, 2, 3, 4] and back.tolist() == [0, 1, 2, 3, 4, 1]
    got = mp.min_plus(a, a_mem, b, b_mem)
    assert all(g.tolist() == w.tolist() for g, w in zip(got, dense(a, a_mem, b, b_mem)))
