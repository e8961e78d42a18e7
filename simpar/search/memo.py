"""Memos the searches' pricers share, kept while their owner lives (pure).

The memory dimensions' search makes a pricer per combination (micro-batches x optimizer
level x recomputed Cells), and each would price again what another already has: the
redistributions between the same layouts, under the same cost model
(:func:`simpar.search.moves.move_memo`). A memo is owned by an object (the cost model) and
keyed by what else its entries depend on; it is dropped when its owner is collected, so a
long session does not keep the memos of the searches it finished. (An op's layouts under a
strategy depend on no model: :meth:`simpar.ops.Primitive.sharding` keeps them itself.)

>>> class Owner: ...
>>> a = Owner()
>>> memo = owned_memo(a, ("moves", 8), dict)
>>> memo is owned_memo(a, ("moves", 8), dict), memo is owned_memo(Owner(), ("moves", 8), dict)
(True, False)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["owned_memo"]

M = TypeVar("M")

#: Per owner (by identity, while it lives), per key: its memo.
_MEMOS: dict[int, dict[Any, Any]] = {}


def owned_memo(owner: object, key: Any, make: Callable[[], M]) -> M:
    """The memo ``key`` of ``owner`` (made by ``make`` the first time); a new one, not kept,
    when ``owner`` cannot be weakly referenced."""
    mine = _MEMOS.get(id(owner))
    if mine is None:
        try:
            weakref.finalize(owner, _MEMOS.pop, id(owner), None)
        except TypeError:   # not weakly referable: nothing would drop the memo
            return make()
        mine = _MEMOS[id(owner)] = {}
    found = mine.get(key)
    if found is None:
        found = mine[key] = make()
    return found
