"""``mindspore.parallel.auto_parallel``: :class:`AutoParallel`, MindSpore 2.x's per-network
parallel settings (simpar's :class:`simpar.nn.AutoParallel`)."""

from __future__ import annotations

from simpar.nn.auto_parallel import AutoParallel

__all__ = ["AutoParallel"]
