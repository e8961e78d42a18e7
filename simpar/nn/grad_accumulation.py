"""``GradAccumulation``: MindSpore 2.x's gradient accumulation wrapper
(``mindspore.parallel.nn.GradAccumulation(network, micro_size)``).

A :class:`~simpar.nn.TrainOneStepCell` whose network holds one splits every batch into
``micro_size`` micro-batches along dimension 0 and runs the forward and backward of each in
turn on the program planned for one micro-batch; the gradients are summed over them, scaled
by ``1 / micro_size`` (MindSpore's training cell sets ``sens = 1 / micro_size``), and one
optimizer step follows. The loss it returns is the mean of the micro-batches' losses: with a
loss that averages over the batch, the loss and the gradients are those of the whole batch.

As in MindSpore, each rank splits its own part of the batch: micro-batch ``k`` is the ``k``-th
``1 / micro_size`` of every rank's rows (with ``full_batch``, of the whole batch). The
gradient synchronisation runs once per step, after the last micro-batch, on the summed
gradients, except under optimizer parallel level2 and level3, where each micro-batch's
gradient is reduce-scattered into its slice as it is made (MindSpore's
``gradient_accumulation_shard``). Dropout masks are drawn per micro-batch (each its own
global indices), so with dropout the masks differ from the whole batch's.
"""

from __future__ import annotations

from simpar.nn.cell import Cell, Wrapper

__all__ = ["GradAccumulation"]


class GradAccumulation(Wrapper):
    """``network`` trained in ``micro_size`` micro-batches per step (see the module).

    >>> from simpar import nn
    >>> net = nn.WithLossCell(nn.Dense(4, 2), nn.MSELoss())
    >>> GradAccumulation(net, 4).micro_size
    4
    """

    def __init__(self, network: Cell, micro_size: int) -> None:
        if not isinstance(network, Cell):
            raise TypeError(f"For 'GradAccumulation', the argument 'network' must cell type, "
                            f"but got the type : {type(network).__name__}.")
        if isinstance(micro_size, bool) or not isinstance(micro_size, int):
            raise TypeError(f"For 'GradAccumulation', the argument 'micro_size' must be "
                            f"integer, but got the type : {type(micro_size).__name__}.")
        if micro_size <= 0:
            raise ValueError(f"For 'GradAccumulation', the argument 'micro_size' must be large "
                             f"than 0, but got {micro_size}.")
        super().__init__(network)
        self.micro_size = micro_size

    def __repr__(self) -> str:
        return f"GradAccumulation(micro_size={self.micro_size})"
