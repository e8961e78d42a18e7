"""One op's share of a whole training step, with the memory dimensions: what the searches
minimise when they choose the optimizer level, the recomputed Cells and the micro-batches
along with the cuts (``set_algo_parameters(memory_dimensions=...)``, simpar's own).

Per micro-batch the op runs its forward and backward kernels and collectives
(:meth:`SimparCostModel.op`'s terms), and a recomputed op its forward once more. Per step each
trainable parameter it reads first is synchronised and updated once:

* whole: the gradient's share of the fused Mirror AllReduce (bandwidth only, as ``op``);
* sliced by optimizer parallel over ``size`` ranks: a ReduceScatter of the gradient into the
  slice (over the rest of its replicas, an AllReduce of the slice too) and an AllGather of the
  weight before the forward, each a call of its own. level1 does both once per step; level2
  reduce-scatters every micro-batch; level3 also gathers every micro-batch, and again in the
  backward (it dropped the gathered copy);
* with micro-batches, each one's gradient added into the step's sum after the first (what the
  backward hands over: the slice where the level reduce-scatters every micro-batch;
  :data:`~simpar.cost.model.ACCUMULATE_PASSES` memory-bound passes and a call);
* the optimizer's update of what the rank stores (:data:`~simpar.cost.model.OPTIMIZER_PASSES`
  memory-bound passes and :data:`~simpar.cost.model.OPTIMIZER_KERNELS` calls), as
  :func:`~simpar.cost.model.evaluate` prices it.

The slices' group is the first ``size`` ranks of the parameter's replica group (slices spread
over its innermost replica axes, :func:`~simpar.optimizer_parallel.slice_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from simpar.collective_kinds import traffic
from simpar.cost.model import OPTIMIZER_KERNELS, OPTIMIZER_PASSES, gradient_add_seconds

__all__ = ["step_op_seconds"]


def step_op_seconds(model: Any, sharding: Any, parameters: Collection[int], itemsize: int,
                    input_itemsizes: Sequence[int] | None = None, *,
                    shards: Mapping[int, tuple[Any, int]] | None = None,
                    micro_batches: int = 1, recomputed: bool = False) -> float:
    """Seconds op ``sharding`` adds to a step of ``micro_batches`` micro-batches under
    simpar's cost ``model`` (a :class:`~simpar.cost.interface.SimparCostModel`): ``shards``
    maps a parameter position optimizer parallel slices to (its
    :class:`~simpar.optimizer_parallel.OptimizerLevel`, the ranks its slices spread over);
    ``recomputed``: the op's Cell runs its forward again in the backward."""
    sh, prof = sharding, model.profile
    sizes = input_itemsizes or (itemsize,) * len(sh.in_layouts)
    forward, backward = model.kernel_seconds(sh, itemsize, input_itemsizes)
    forward += sum(model._spec_seconds(spec, itemsize) for spec in sh.forward_comm)
    backward += sum(model._spec_seconds(spec, itemsize) for spec in sh.backward_moves)
    seconds = micro_batches * (forward + backward + (forward if recomputed else 0.0))
    optimizer = model.optimizer
    for i in parameters:
        block = sh.in_layouts[i].local_size() * sizes[i]
        mirror = sh.input_grad_spec(i)
        group = () if mirror is None else mirror.group(model.rank % math.prod(mirror.device_matrix))
        level, size = (shards or {}).get(i, (None, 1))
        summed = block // size if level is not None and level.per_micro_batch else block
        seconds += (micro_batches - 1) * gradient_add_seconds(summed, prof)
        if level is None:
            seconds += model._mirror_seconds(mirror, sizes[i]) if mirror is not None else 0.0
        else:
            ranks = sorted(group)[:size]
            scatters = micro_batches if level.per_micro_batch else 1
            gathers = (2 * micro_batches) if level.regathers else 1
            seconds += (scatters * prof.step_collective_seconds("ReduceScatter", ranks, block, 0)
                        + gathers * prof.step_collective_seconds("AllGather", ranks,
                                                                 block // size, 0))
            if len(group) > size:   # the rest of the replicas sum the slice
                link = prof.link(group)
                seconds += traffic("AllReduce", len(group) // size, block // size) / \
                    link.bandwidth
        stored = block // size
        seconds += (OPTIMIZER_KERNELS[optimizer] * prof.array_op_overhead
                    + OPTIMIZER_PASSES[optimizer] * stored / prof.memory_bandwidth)
    return seconds
