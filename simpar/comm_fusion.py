"""MindSpore's ``comm_fusion`` for the gradient AllReduces: how the Mirrors pack the gradients
of replicated parameters into AllReduce calls.

A Mirror sums a replicated parameter's gradient over its replicas. Per group of ranks and
dtype, the gradients go into buckets in the program's parameter order, and each bucket is one
AllReduce of one packed buffer:

* ``"index"`` with ``config`` a list of increasing indices ``[20, 35]``: parameters 0-19 in
  one bucket, 20-34 in the next, the rest in the last (MindSpore's ``all_reduce_fusion_config``).
  ``[]``, the default, is one bucket per group: every gradient in one AllReduce;
* ``"size"`` with ``config`` a threshold in MB: a bucket closes before a gradient that would
  take it over the threshold (a gradient larger than it goes alone);
* ``"auto"``: ``"size"`` with MindSpore's 64 MB;
* ``"openstate": False``: no fusion, one AllReduce per gradient.

Fewer calls cost less latency; a bucket is also the largest buffer a step holds beside its
arrays (the packed gradients), so on a large data-parallel model one bucket of every gradient
can be gigabytes (:func:`simpar.cost.evaluate` prices it). AllGather and ReduceScatter fusion
(optimizer parallel's) are not implemented: each parameter's slice moves by itself.

>>> AllReduceFusion("size", 1).buckets([2**19, 2**19, 2**19, 2**21])
[range(0, 2), range(2, 3), range(3, 4)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simpar._keyspec import ContextError, type_error

__all__ = ["AUTO_THRESHOLD_MB", "AllReduceFusion", "check_comm_fusion", "check_fusion_indices"]

#: The fusion threshold of ``"auto"`` mode (MindSpore's).
AUTO_THRESHOLD_MB = 64
_MODES = ("auto", "size", "index")
_KEYS = ("openstate", "allreduce", "allgather", "reducescatter")


@dataclass(frozen=True, slots=True)
class AllReduceFusion:
    """The gradient AllReduces' fusion (module docstring): ``mode`` and its ``config``, and
    ``openstate`` (False: no fusion)."""

    mode: str = "index"
    config: int | tuple[int, ...] | None = ()
    openstate: bool = True

    def buckets(self, nbytes: Sequence[int]) -> list[range]:
        """The buckets of gradients of ``nbytes`` bytes each (in order): ranges of their
        positions, covering every one once, in order."""
        n = len(nbytes)
        if not self.openstate:
            return [range(k, k + 1) for k in range(n)]
        if self.mode == "index":
            assert isinstance(self.config, tuple)
            edges = [0, *(c for c in self.config if 0 < c < n), n]
            return [range(a, b) for a, b in zip(edges, edges[1:]) if b > a]
        limit = self.threshold_bytes
        out, start, total = [], 0, 0
        for k, size in enumerate(nbytes):
            if k > start and total + size > limit:
                out.append(range(start, k))
                start, total = k, 0
            total += size
        return out + [range(start, n)] if n else out

    @property
    def indices(self) -> list[int]:
        """MindSpore's ``all_reduce_fusion_config``: the "index" mode's indices ([] in the
        other modes)."""
        return list(self.config) if self.mode == "index" and isinstance(self.config,
                                                                        tuple) else []

    @property
    def packs_all(self) -> bool:
        """Whether one bucket may pack every gradient of its group ("index" mode: its largest
        bucket is bounded only by the sum of the gradients)."""
        return self.openstate and self.mode == "index"

    @property
    def threshold_bytes(self) -> int:
        """The size a bucket of several gradients stays within ("size" and "auto" modes; 0
        otherwise). A gradient larger than it goes alone."""
        if not self.openstate or self.mode == "index":
            return 0
        mb = AUTO_THRESHOLD_MB if self.mode == "auto" else self.config
        assert isinstance(mb, int)
        return mb * 2**20

    def as_dict(self) -> dict[str, Any]:
        """MindSpore's dict: ``{"openstate": ..., "allreduce": {"mode": ..., "config": ...}}``."""
        config = list(self.config) if isinstance(self.config, tuple) else self.config
        return {"openstate": self.openstate,
                "allreduce": {"mode": self.mode, "config": config}}


def check_comm_fusion(func: str, key: str, value: object) -> AllReduceFusion:
    """``comm_fusion`` validated as MindSpore validates it: a dict of ``openstate`` (bool) and
    ``allreduce`` (``{"mode": ..., "config": ...}``); ``allgather`` and ``reducescatter``
    raise ``NotImplementedError``. Errors name the key, the value and what is allowed."""
    if not isinstance(value, Mapping):
        raise type_error(func, key, "a dict with keys from openstate, allreduce", value)
    unknown = [k for k in value if k not in _KEYS]
    if unknown:
        raise ContextError(f"{func}: {key} has no key {unknown[0]!r}; allowed: "
                           f"{', '.join(_KEYS)}.")
    for kind in ("allgather", "reducescatter"):
        if kind in value:
            raise NotImplementedError(
                f"{func}: {key}[{kind!r}]: simpar fuses only the gradient AllReduces "
                "(allreduce); optimizer parallel's gathers and reduce-scatters run one "
                "parameter at a time")
    openstate = value.get("openstate", True)
    if not isinstance(openstate, bool):
        raise type_error(func, f"{key}['openstate']", "a bool", openstate)
    spec = value.get("allreduce", {"mode": "index", "config": []})
    if not isinstance(spec, Mapping) or set(spec) - {"mode", "config"} or "mode" not in spec:
        raise type_error(func, f"{key}['allreduce']",
                         'a dict {"mode": "auto" | "size" | "index", "config": ...}', spec)
    mode, config = spec["mode"], spec.get("config")
    if mode not in _MODES:
        raise ContextError(f"{func}: {key}['allreduce']['mode'] must be one of "
                           f"{list(_MODES)}, but got {mode!r}.")
    where = f"{key}['allreduce']['config']"
    if mode == "auto":
        if config is not None:
            raise ContextError(f"{func}: {where} must be None in 'auto' mode (the threshold "
                               f"is {AUTO_THRESHOLD_MB} MB), but got {config!r}.")
        return AllReduceFusion("auto", None, openstate)
    if mode == "size":
        if isinstance(config, bool) or not isinstance(config, int) or config <= 0:
            raise ContextError(f"{func}: {where} must be an int > 0 (MB) in 'size' mode, but "
                               f"got {config!r}.")
        return AllReduceFusion("size", config, openstate)
    if not isinstance(config, (list, tuple)) or any(
            isinstance(c, bool) or not isinstance(c, int) for c in config) or any(
            b <= a for a, b in zip([0, *config], config)):
        raise ContextError(f"{func}: {where} must be a list of increasing ints > 0 (parameter "
                           f"indices) in 'index' mode, but got {config!r}.")
    return AllReduceFusion("index", tuple(config), openstate)


def check_fusion_indices(func: str, key: str, value: object) -> AllReduceFusion:
    """MindSpore's ``all_reduce_fusion_config``: a list of increasing parameter indices > 0,
    the ``"index"`` mode of ``comm_fusion`` (``[20, 35]``: parameters 0-19 in one bucket,
    20-34 in the next, the rest in the last; ``[]``: one bucket)."""
    allowed = "a list of increasing ints > 0 (parameter indices)"
    if not isinstance(value, (list, tuple)):
        raise type_error(func, key, allowed, value)
    if any(isinstance(c, bool) or not isinstance(c, int) for c in value) or any(
            b <= a for a, b in zip([0, *value], value)):
        raise ContextError(f"{func}: {key} must be {allowed}, but got {value!r}.")
    return AllReduceFusion("index", tuple(value))
