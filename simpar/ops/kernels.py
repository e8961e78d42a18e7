"""What the runtime knows of an op's per-rank kernels beyond calling them: what a forward
keeps for its backward (:class:`Tape`), the kernel and VJP written as expressions the
executor puts into its generated code (:class:`Inline`), and which input gradients a
backward needs (:func:`gradient_needed`, set by the runtime with :func:`needing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np

from simpar._enums import StrEnum

__all__ = ["INLINE_NAMES", "Inline", "Tape", "gradient_needed", "needing", "shape_only"]

_NEEDS: ContextVar[tuple[bool, ...] | None] = ContextVar("simpar_gradients_needed",
                                                         default=None)


def gradient_needed(i: int) -> bool:
    """Inside an op's ``local_backward``: whether input ``i``'s gradient is used. A VJP may
    skip computing the others (the first Dense's data gradient, say) and return None."""
    needs = _NEEDS.get()
    return needs is None or (i < len(needs) and needs[i])


class needing:  # noqa: N801  (used as a function: ``with needing(needs):``)
    """Inside the block, :func:`gradient_needed(k) <gradient_needed>` is ``needs[k]``. A
    class rather than a generator: the runtime enters one per backward kernel call."""

    __slots__ = ("_needs", "_token")

    def __init__(self, needs: Sequence[bool]) -> None:
        self._needs = needs if isinstance(needs, tuple) else tuple(bool(n) for n in needs)

    def __enter__(self) -> None:
        self._token = _NEEDS.set(self._needs)

    def __exit__(self, *exc: object) -> None:
        _NEEDS.reset(self._token)


@dataclass(frozen=True, slots=True)
class Inline:
    """An op's kernel and VJP as ``str.format`` templates of Python expressions
    (:meth:`Primitive.inline`): ``{x0}``, ``{x1}``, ... stand for the inputs, ``{y}`` for the
    output and ``{dy}`` for its cotangent; ``_sum`` is ``np.add.reduce``. ``grads[k]`` is
    input k's gradient, None where it has no expression (the executor then calls the VJP,
    unless that gradient is not needed). MatMul with ``transpose_b`` on 2-D shards:
    ``Inline("{x0} @ {x1}.T", ("{dy} @ {x1}", "{dy}.T @ {x0}"))``."""

    forward: str
    grads: tuple[str | None, ...]
    #: The forward as a statement that writes its result into ``{x0}`` (``{x0} += {x1}``),
    #: bit for bit the value ``forward`` gives when the output has x0's shape and dtype; the
    #: executor uses it where nothing else holds x0. None: the op has no such form.
    update: str | None = None


#: What an inline expression may call, besides the arrays' own operators and methods.
INLINE_NAMES: dict[str, Any] = {"_sum": np.add.reduce}


class Tape(StrEnum):
    """What an op's forward keeps for its backward (``Primitive.tape``), as its
    ``local_forward`` saves it: the cost model counts activation memory from it."""

    INPUTS_AND_OUTPUT = "inputs+output"  # the default local_forward: (xs, y)
    INPUTS = "inputs"                    # MatMul, Mul: (xs, None); the VJP reads no y
    OUTPUT = "output"                    # Softmax: y
    NOTHING = "nothing"                  # Reshape, Add, BiasAdd, ReduceMean: shapes only
    NEW_LIKE_INPUT = "new-like-input"    # LayerNorm's xhat, the cross entropy's softmax
    INPUT_AND_NEW = "input+new"          # GeLU: x and the tanh it computed from x
    MASK = "mask"                        # Dropout: one byte per element of input 0
    INDICES = "indices"                  # Gather: input 1 (the ids)


def shape_only(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A read-only array of this shape and dtype that holds one element (every element is
    0): what a tape keeps of an input whose values the VJP never reads."""
    return np.broadcast_to(np.zeros((), dtype), shape)
