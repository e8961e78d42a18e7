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

__all__ = ["GradAccumulation", "Pipeline", "PipelineCell"]


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


class PipelineCell(GradAccumulation):
    """``network`` trained in ``micro_size`` micro-batches that flow through the pipeline
    stages (MindSpore's ``nn.PipelineCell(network, micro_size, stage_config=None,
    segment_config=None)``; 2.x: ``mindspore.parallel.nn.Pipeline``). ``stage_config`` and
    ``segment_config`` map Cell paths inside ``network`` to stages and chunks, as setting
    their ``pipeline_stage`` and ``pipeline_segment`` does; a path that names no Cell is a
    ``KeyError``, as in MindSpore. With one stage it is gradient accumulation. (The ``1f1b``
    scheduler asks for ``micro_size >= pipeline_stages``, as MindSpore's does, and refuses
    fewer on every rank; ``gpipe`` runs fewer, with a larger bubble.)

    >>> from simpar import nn
    >>> mlp = nn.MLP(4, 8, 2, n_hidden=1)
    >>> cell = PipelineCell(nn.WithLossCell(mlp, nn.MSELoss()), 2,
    ...                     stage_config={"_backbone.fc2": 1})
    >>> cell.micro_size, mlp.fc2.pipeline_stage, mlp.fc1.pipeline_stage
    (2, 1, -1)
    """

    def __init__(self, network: Cell, micro_size: int,
                 stage_config: dict[str, int] | None = None,
                 segment_config: dict[str, int] | None = None) -> None:
        super().__init__(network, micro_size)
        cells = dict(network.cells_and_names())
        for what, config in (("stage_config", stage_config),
                             ("segment_config", segment_config)):
            if config is None:
                continue
            if not isinstance(config, dict):
                raise TypeError(f"For '{type(self).__name__}', the argument '{what}' must be "
                                f"dict type, but got the type : {type(config).__name__}.")
            unknown = [path for path in config if path not in cells]
            if unknown:
                known = [c for c in cells if c][:6]
                raise KeyError(f"For '{type(self).__name__}', {what} names {unknown}, which "
                               f"are no Cells of the network (e.g. {known})")
            for path, value in config.items():
                setattr(cells[path], "pipeline_stage" if what == "stage_config"
                        else "pipeline_segment", value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(micro_size={self.micro_size})"


class Pipeline(PipelineCell):
    """MindSpore 2.x's name of :class:`PipelineCell`
    (``mindspore.parallel.nn.Pipeline(network, micro_size, stage_config=None,
    segment_config=None)``)."""
