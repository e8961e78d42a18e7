"""Dynamic programming's op elimination with one entry per table: a min-plus matrix product,
pruned exactly (pure numpy).

``u - v - w`` becomes ``u - w`` whose cost for (u, w) is the least over v of ``a[u, v] +
b[v, w]`` (``a`` already holds v's own cost), and whose memory is that v's; among equal costs
the least memory wins, then the first v. On a 1024-device GPT one such product has
``286 x 2821 x 896`` terms, but for most (v, w) no u can take v: a few probes per w (or the
v's of a similar product, a ``hint``) give every (u, w) an upper bound ``ub``, and a term
whose lower bound exceeds every bound of a group of u's is never evaluated. The lower bound
is ``min over the group of a[u, v] + b[v, w]``; rounding is monotone, so a pruned term is
strictly above an achieved cost and can be neither the least nor tie with it (a small margin
covers the rounding of the bound itself). What is left is evaluated exactly as the dense
product would, term for term, so the result is the same bit for bit.

>>> a = np.array([[0.0, 1.0]]); b = np.array([[5.0, 0.0], [0.0, 5.0]])
>>> cost, mem, via = min_plus(a, np.zeros((1, 2)), b, np.zeros((2, 2)))
>>> cost.tolist(), via.tolist()
([[1.0, 0.0]], [[1, 0]])
"""

from __future__ import annotations

import numpy as np

__all__ = ["min_plus"]

#: Up to this many (u, v, w) terms every term is evaluated.
_DENSE = 1 << 21
#: The v's per w that give the upper bounds.
_PROBES = 12
#: The u's that share one pruning mask, and the u's whose mask prefilters their groups'.
_GROUP = 8
_SUPER = 64
#: Above this share of the terms kept, every term is evaluated (cheaper than gathering).
_SPARSE = 0.25
#: Terms evaluated at once: gathered, and every term (smaller: they stay in cache).
_CHUNK = 1 << 22
_DENSE_CHUNK = 1 << 18
_BIG = np.iinfo(np.int64).max


def min_plus(a: np.ndarray, a_mem: np.ndarray, b: np.ndarray, b_mem: np.ndarray,
             distinct: bool = False, hint: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (u, w): the least ``a[u, v] + b[v, w]``, the memory ``a_mem[u, v] + b_mem[v, w]``
    of the v that gives it (the least memory among equal costs, then the first v), and that v
    (-1 where every term is infinite; the memory is then v 0's). Costs must be >= 0 or
    infinite for the pruning (otherwise every term is evaluated). ``distinct``: no two
    columns of (``b``, ``b_mem``) are equal (not checked again). ``hint``: a v per (u, w)
    whose term is likely near the least (the answer of a product of similar tables), used
    for the upper bounds instead of probing; any v gives the same result."""
    ku, kv = a.shape
    kw = b.shape[1]
    if hint is not None and (hint.shape != (ku, kw) or hint.dtype.kind not in "iu"
                             or not kv or hint.max(initial=0) >= kv):
        raise ValueError(f"min_plus: hint must be a ({ku}, {kw}) array of ints below {kv}, "
                         f"got shape {hint.shape} of {hint.dtype}")
    if not distinct:
        cols, back = _distinct_columns(b, b_mem)
        if len(cols) < kw:   # equal columns of b give equal columns of the product
            cost, mem, via = min_plus(a, a_mem, b[:, cols], b_mem[:, cols], True,
                                      None if hint is None else hint[:, cols])
            return cost[:, back], mem[:, back], via[:, back]
    cost = np.empty((ku, kw))
    via = np.empty((ku, kw), dtype=np.int64)
    kept = None
    if ku * kv * kw > _DENSE and kv > _PROBES and (
            np.nan_to_num(a.min(initial=0.0)) >= 0 and np.nan_to_num(b.min(initial=0.0)) >= 0):
        bt = np.ascontiguousarray(b.T)
        kept = _kept(a, bt, hint)
        if sum(len(g) * len(ws) for g, ws, _, _ in kept) > _SPARSE * ku * kv * kw:
            kept = None   # pruning keeps too much: every term, without gathering them
    if kept is None:
        rows = max(1, _DENSE_CHUNK // (kv * kw))
        for lo in range(0, ku, rows):
            cost[lo:lo + rows], via[lo:lo + rows] = _dense(
                a[lo:lo + rows], a_mem[lo:lo + rows], b, b_mem)
    else:
        bt_mem = np.ascontiguousarray(b_mem.T)
        for g, ws, vs, b_kept in kept:
            starts = np.flatnonzero(np.r_[True, ws[1:] != ws[:-1]])
            rows = max(1, _CHUNK // len(vs))
            for lo in range(0, len(g), rows):
                us = g[lo:lo + rows]
                cost[us], via[us] = _exact(a[us][:, vs] + b_kept, vs, ws, starts,
                                           a_mem[us], bt_mem)
    finite = np.isfinite(cost)
    pick = np.where(finite, via, 0)
    mem = np.take_along_axis(a_mem, pick, axis=1) + b_mem[pick, np.arange(kw)[None, :]]
    return cost, mem, np.where(finite, via, -1)


def _kept(a: np.ndarray, bt: np.ndarray, hint: np.ndarray | None = None
          ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Groups of u's, each with the (w, v) whose terms it must evaluate (ascending in w,
    then v) and their ``b``: those whose lower bound over the group does not exceed the
    group's largest upper bound, ``(top - low) + 1e-12 * (top + low) >= b[v, w]``. The
    pairs that pass over all u's at once are found first (a superset of every group's, as
    its top is larger and its low smaller), then those of each run of ``_SUPER`` u's; each
    group tests only its run's. A term at a w's least cost always passes (its lower bound
    is at most that cost, at most the bound), so every w with a finite term keeps one; a w
    that keeps none has only infinite terms in the group and is given v 0 (an infinite
    term) to stand for them."""
    kw, kv = bt.shape
    bound = _upper_bounds(a, bt) if hint is None else _hinted_bounds(a, bt, hint)
    order = np.argsort(a.min(axis=1), kind="stable")

    def margins(top: np.ndarray, low: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return top + 1e-12 * top, low - 1e-12 * low

    with np.errstate(invalid="ignore"):
        top, low = margins(bound.max(axis=0), a.min(axis=0))
        ws0, vs0 = np.nonzero(top[:, None] - low[None, :] >= bt)
    b0 = bt[ws0, vs0]
    out = []
    for slo in range(0, a.shape[0], _SUPER):   # a superset for the groups within
        sup = order[slo:slo + _SUPER]
        with np.errstate(invalid="ignore"):
            top, low = margins(bound[sup].max(axis=0), a[sup].min(axis=0))
            keep = np.flatnonzero(top[ws0] - low[vs0] >= b0)
        ws1, vs1, b1 = ws0[keep], vs0[keep], b0[keep]
        for lo in range(slo, slo + len(sup), _GROUP):
            g = order[lo:lo + _GROUP]
            with np.errstate(invalid="ignore"):
                top, low = margins(bound[g].max(axis=0), a[g].min(axis=0))
                keep = np.flatnonzero(top[ws1] - low[vs1] >= b1)
            ws, vs = ws1[keep], vs1[keep]
            missing = np.ones(kw, dtype=bool)
            missing[ws] = False
            if missing.any():   # only infinite terms there: one stands for them
                extra = np.flatnonzero(missing)
                ws = np.concatenate([ws, extra])
                vs = np.concatenate([vs, np.zeros_like(extra)])
                by_w = np.argsort(ws, kind="stable")
                ws, vs = ws[by_w], vs[by_w]
            out.append((g, ws, vs, bt[ws, vs]))
    return out


def _dense(a: np.ndarray, a_mem: np.ndarray, b: np.ndarray, b_mem: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_exact` over every term of rows ``a``: the least cost per (u, w), and its first
    v of least memory (v 0 if those memories are all infinite)."""
    terms = a[:, :, None] + b[None, :, :]               # (u, v, w)
    best = terms.min(axis=1)
    tie = terms == best[:, None, :]
    first = tie.argmax(axis=1)
    us, ws = np.nonzero(tie.sum(axis=1) > 1)            # several v: the memory decides
    if len(us):
        mems = np.where(tie[us, :, ws], a_mem[us] + b_mem[:, ws].T, np.inf)
        least = mems.min(axis=1, keepdims=True)
        first[us, ws] = np.where(np.isinf(least[:, 0]), 0, (mems == least).argmax(axis=1))
    return best, first


def _distinct_columns(b: np.ndarray, b_mem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first of every set of equal columns of ``b`` (with ``b_mem``), and for every column
    the index of its set's first among them. Columns are grouped by a fingerprint of their
    bits (integer arithmetic: equal columns always print alike), and a grouping whose
    columns are not all equal to their group's first (two prints that collide) is redone by
    comparing the columns' bytes."""
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore"):
        prints = sum((rng.integers(1, 1 << 62, x.shape[0], dtype=np.uint64)
                      @ np.ascontiguousarray(x).view(np.uint64)) for x in (b, b_mem))
    _, first, back = np.unique(prints, return_index=True, return_inverse=True)
    back = back.ravel()
    dup = np.flatnonzero(first[back] != np.arange(len(back)))
    if dup.size and not (np.array_equal(b[:, dup], b[:, first[back[dup]]])
                         and np.array_equal(b_mem[:, dup], b_mem[:, first[back[dup]]])):
        both = np.ascontiguousarray(np.concatenate([b, b_mem]).T)
        rows = both.view(np.dtype((np.void, both.dtype.itemsize * both.shape[1]))).ravel()
        _, first, back = np.unique(rows, return_index=True, return_inverse=True)
    return _in_order(first, back.ravel())


def _in_order(first: np.ndarray, back: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups given by their first column and each column's group, renumbered in the order
    of their first columns."""
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return first[order], rank[back.ravel()]


def _upper_bounds(a: np.ndarray, bt: np.ndarray) -> np.ndarray:
    """Per (u, w), an achieved ``a[u, v] + b[v, w]``: the least over the few v whose
    ``b[v, w]`` plus their least ``a`` is smallest (``bt`` is ``b.T``, contiguous)."""
    kw = bt.shape[0]
    guess = bt + a.min(axis=0)[None, :]
    probes = np.argpartition(guess, _PROBES - 1, axis=1)[:, :_PROBES].T   # (P, kw)
    bound = np.full((a.shape[0], kw), np.inf)
    cols = np.arange(kw)
    for v in probes:
        np.minimum(bound, a[:, v] + bt[cols, v][None, :], out=bound)
    return bound


def _hinted_bounds(a: np.ndarray, bt: np.ndarray, hint: np.ndarray) -> np.ndarray:
    """Per (u, w), the achieved ``a[u, v] + b[v, w]`` of the hinted v (0 for a negative
    hint): an upper bound like :func:`_upper_bounds`', without the probing."""
    v = np.maximum(hint, 0)
    return (np.take_along_axis(a, v, axis=1)
            + bt[np.arange(bt.shape[0])[None, :], v])


def _exact(terms: np.ndarray, vs: np.ndarray, ws: np.ndarray, starts: np.ndarray,
           a_mem: np.ndarray, bt_mem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The least of each row's terms per w (a run of ``starts``), and the first v of least
    memory among the terms of that cost (v 0 if those memories are all infinite); the
    memories (``a_mem`` of the rows, plus ``bt_mem[w, v]``) are gathered only where several
    v tie for the least cost."""
    best = np.minimum.reduceat(terms, starts, axis=1)
    tie = terms == best[:, ws]
    first = np.minimum.reduceat(np.where(tie, vs, _BIG), starts, axis=1)
    if np.count_nonzero(tie) == best.size:   # every run has one tie at least: exactly one
        return best, first
    mems = np.where(tie, a_mem[:, vs] + bt_mem[ws, vs], np.inf)
    least = np.minimum.reduceat(mems, starts, axis=1)
    first = np.minimum.reduceat(np.where(tie & (mems == least[:, ws]), vs, _BIG), starts,
                                axis=1)
    return best, np.where(np.isinf(least), 0, first)
