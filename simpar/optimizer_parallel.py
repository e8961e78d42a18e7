"""Optimizer parallel (MindSpore's ``enable_parallel_optimizer`` and ``AutoParallel.hsdp``): a
parameter that several ranks would hold alike is stored, updated and has its gradient
reduced in slices, one slice per rank.

Which ranks share a parameter's slices: the ranks that hold the same block of it under its
layout (its *repeated* group: the data-parallel ranks, and for a model-parallel weight the
ranks of its replica axes). With ``shard_size`` k smaller than that group, each run of k
consecutive ranks of the group shares the slices, and the runs are one another's replicas
(MindSpore's opt-shard group and its mirror group). The slice is taken on dimension 0 of the
rank's block, as MindSpore takes it.

The levels, as MindSpore's ``hsdp`` documents them:

============ ==================================================================================
level1       the weight and its optimizer state are stored in slices. The forward all-gathers
             the weight before its first use; the backward reduce-scatters its gradient (the
             AllGather's adjoint) where an AllReduce would have summed it whole
level2       also the gradient accumulated over micro-batches is kept in slices: each
             micro-batch's gradient is reduce-scattered as it is made (MindSpore's
             ``gradient_accumulation_shard``). With one micro-batch it runs as level1
level3       also the weight the forward gathered is dropped after its last forward use and
             gathered again before the first backward use that needs it
============ ==================================================================================

A parameter stays whole (MindSpore skips it too, with a warning) when it is smaller than
``threshold`` KB (``prod(shape) * itemsize``, the whole parameter), when no rank holds it
alike, when ``shard_size`` does not divide its repeated group, or when dimension 0 of its block
does not divide into the slices. Only trainable parameters are sliced: the optimizer updates
nothing else.

On 8 data-parallel ranks, a ``(64, 32)`` weight sliced over all 8 is stored as rows
``8r..8r+7`` on rank ``r``::

    >>> from simpar.layout import TensorLayout
    >>> sliced = slice_layout(TensorLayout((8,), (-1, -1), (64, 32)), 8)
    >>> sliced.slice_of(5)
    ((40, 48), (0, 32))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from simpar._enums import StrEnum
from simpar.layout import TensorLayout

__all__ = ["LEVELS", "OptimizerLevel", "OptimizerParallel", "ParamShard", "ParamFacts",
           "shard_parameters", "slice_layout"]


class OptimizerLevel(StrEnum):
    """MindSpore's ``optimizer_level``."""

    LEVEL1 = "level1"
    LEVEL2 = "level2"
    LEVEL3 = "level3"

    @property
    def per_micro_batch(self) -> bool:
        """Whether each micro-batch's gradient is reduce-scattered as it is made (level2 and
        level3), rather than once per step on the gradients summed whole."""
        return self is not OptimizerLevel.LEVEL1

    @property
    def regathers(self) -> bool:
        """Whether the backward gathers the weight again (level3)."""
        return self is OptimizerLevel.LEVEL3


#: The ``optimizer_level`` values (simpar.context keeps its own copy: it imports no layer above).
LEVELS = tuple(level.value for level in OptimizerLevel)


@dataclass(frozen=True, slots=True)
class OptimizerParallel:
    """The optimizer-parallel settings of one plan request: ``level`` None is off (MindSpore's
    ``enable_parallel_optimizer=False``); ``shard_size`` -1 spreads each parameter over its
    whole repeated group; parameters under ``threshold_kb`` KB stay whole."""

    level: OptimizerLevel | None = None
    shard_size: int = -1
    threshold_kb: int = 64

    def __post_init__(self) -> None:
        if self.level is not None and not isinstance(self.level, OptimizerLevel):
            if self.level not in LEVELS:
                raise ValueError(f"optimizer_level must be one of {list(LEVELS)}, got "
                                 f"{self.level!r}")
            object.__setattr__(self, "level", OptimizerLevel(self.level))
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or (
                self.shard_size < 1 and self.shard_size != -1):
            raise ValueError(f"optimizer_weight_shard_size must be -1 (the whole repeated "
                             f"group) or an int >= 1, got {self.shard_size!r}")
        if isinstance(self.threshold_kb, bool) or not isinstance(self.threshold_kb, int) or \
                self.threshold_kb < 0:
            raise ValueError(f"parallel_optimizer_threshold must be an int >= 0 (KB), got "
                             f"{self.threshold_kb!r}")

    @property
    def enabled(self) -> bool:
        return self.level is not None


@dataclass(frozen=True, slots=True)
class ParamShard:
    """How one parameter is sliced: its level, how many ranks share its slices (``size``), and
    the slice every rank stores (``layout``: the parameter's layout with dimension 0 cut
    ``size`` times more, over the inner ``size`` ranks of its repeated group)."""

    level: OptimizerLevel
    size: int
    layout: TensorLayout

    def __post_init__(self) -> None:
        if not isinstance(self.level, OptimizerLevel):
            object.__setattr__(self, "level", OptimizerLevel(self.level))

    def __str__(self) -> str:
        return f"{self.level} over {self.size} ranks: {self.layout}"


@dataclass(frozen=True, slots=True)
class ParamFacts:
    """What deciding a parameter's slicing reads: its layout, bytes per element, and whether
    the optimizer updates it."""

    layout: TensorLayout
    itemsize: int
    trainable: bool


def slice_layout(layout: TensorLayout, size: int) -> TensorLayout:
    """``layout`` with dimension 0 of every rank's block cut ``size`` times more, over the
    ``size`` fastest-varying ranks of its repeated group (its replica axes, innermost first;
    an axis is split in two when only part of it is needed).

    On device matrix ``(2, 4)`` with the weight cut over axis 1 (``tensor_map (-1, 0)``) and
    repeated over axis 0, ``size`` 2 slices dimension 0 over axis 0: rank 5 (at (1, 1)) holds
    the second half of the rows of column block 1.

    >>> lay = slice_layout(TensorLayout((2, 4), (-1, 0), (8, 8)), 2)
    >>> lay.slice_of(5)
    ((4, 8), (2, 4))
    """
    if not layout.ndim:
        raise ValueError("slice_layout: a scalar has no dimension 0 to slice")
    dm = layout.device_matrix
    need, taken = size, {}   # device axis -> the inner factor of it the slices use
    for axis in reversed([a for a in layout.replica_axes if dm[a] > 1]):
        if need == 1:
            break
        if need % dm[axis] == 0:
            taken[axis], need = dm[axis], need // dm[axis]
        elif dm[axis] % need == 0:
            taken[axis], need = need, 1
        else:
            break
    repeated = math.prod(dm[a] for a in layout.replica_axes)
    if need != 1:
        raise ValueError(f"slice_layout: {size} ranks are not a run of consecutive ranks of "
                         f"the repeated group ({repeated} ranks) of layout {layout}")
    new_dm: list[int] = []
    at: dict[int, int] = {}          # old axis -> its (inner) new axis
    for axis, n in enumerate(dm):
        inner = taken.get(axis, n)
        if inner != n:
            new_dm.append(n // inner)
        new_dm.append(inner)
        at[axis] = len(new_dm) - 1
    dim_axes = [tuple(at[a] for a in axes) for axes in layout.dim_axes]
    dim_axes[0] = dim_axes[0] + tuple(sorted(at[a] for a in taken))
    return TensorLayout.from_dim_axes(new_dm, dim_axes, layout.shape)


def shard_parameters(params: Mapping[str, ParamFacts], settings: OptimizerParallel
                     ) -> tuple[dict[str, ParamShard], dict[str, str]]:
    """Each trainable parameter's slicing under ``settings``, and for every parameter that
    stays whole, why (``{name: reason}``); both empty when the settings are off."""
    if settings.level is None:
        return {}, {}
    shards: dict[str, ParamShard] = {}
    whole: dict[str, str] = {}
    for name, facts in params.items():
        lay = facts.layout
        repeated = math.prod(lay.device_matrix[a] for a in lay.replica_axes)
        size = repeated if settings.shard_size == -1 else min(settings.shard_size, repeated)
        nbytes = math.prod(lay.shape) * facts.itemsize
        if not facts.trainable:
            whole[name] = "not trainable"
        elif nbytes < settings.threshold_kb * 1024:
            whole[name] = (f"{nbytes} bytes, under parallel_optimizer_threshold "
                           f"{settings.threshold_kb} KB")
        elif repeated == 1:
            whole[name] = "no two ranks hold the same block of it"
        elif repeated % size:
            whole[name] = (f"optimizer_weight_shard_size {settings.shard_size} does not divide "
                           f"its repeated group of {repeated} ranks")
        elif size == 1:
            whole[name] = "a shard size of 1 slices nothing"
        elif not lay.ndim or lay.local_shape()[0] % size:
            rows = lay.local_shape()[0] if lay.ndim else "no"
            whole[name] = (f"dimension 0 of its block has {rows} rows, which do not divide "
                           f"into {size} slices")
        else:
            try:
                shards[name] = ParamShard(settings.level, size, slice_layout(lay, size))
            except ValueError as e:
                whole[name] = str(e)
    return shards, whole
