"""``mindspore.nn``: simpar's Cells, layers, losses and optimizers under MindSpore's names,
with MindSpore's defaults where simpar's own differ:

* :class:`Cell` prefixes a sub-Cell's named Parameters with its attribute name, as
  MindSpore's ``auto_prefix`` does;
* :class:`TrainOneStepCell` feeds as MindSpore does: with ``full_batch=False`` (the default of
  every parallel mode but a ``dataset_strategy`` of ``"full_batch"``) each rank passes its own
  slice of the batch; simpar's :class:`simpar.nn.TrainOneStepCell` takes the global batch;
* :class:`SoftmaxCrossEntropyWithLogits` defaults to ``sparse=False, reduction="none"`` as
  MindSpore's does (``"none"`` is refused: simpar's losses reduce to one value);
* :class:`CrossEntropyLoss`: integer labels and a mean, MindSpore's defaults.
"""

from __future__ import annotations

from typing import Any

from simpar import context
from simpar import nn as _nn
from simpar.mindspore._missing import missing
from simpar.nn import (  # every Cell simpar has, under MindSpore's name
    GPT,
    MLP,
    SGD,
    Adam,
    AdamW,
    AutoParallel,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv2d,
    Conv2dTranspose,
    Dense,
    Dropout,
    Embedding,
    FeedForward,
    Flatten,
    GradAccumulation,
    L1Loss,
    LayerNorm,
    MaxPool2d,
    Momentum,
    MSELoss,
    MultiHeadAttention,
    Optimizer,
    Parameter,
    Pipeline,
    PipelineCell,
    PReLU,
    ReLU,
    ReLU6,
    ResNet,
    SequentialCell,
    TransformerBlock,
    WithLossCell,
    initializer,
    resnet,
    resnet18,
    resnet50,
)

__all__ = ["Adam", "AdamW", "AutoParallel", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Cell",
           "Conv2d", "Conv2dTranspose", "CrossEntropyLoss", "Dense", "Dropout", "Embedding",
           "FeedForward", "Flatten", "full_batch_feeding", "GPT", "GradAccumulation",
           "initializer", "L1Loss", "LayerNorm", "MaxPool2d", "MLP", "Momentum", "MSELoss",
           "MultiHeadAttention", "Optimizer", "Parameter", "Pipeline", "PipelineCell", "PReLU",
           "ReLU", "ReLU6", "ResNet", "resnet", "resnet18", "resnet50", "SequentialCell", "SGD",
           "SoftmaxCrossEntropyWithLogits", "TrainOneStepCell", "TransformerBlock", "WithLossCell"]


def full_batch_feeding(mode: str, ctx: context.ParallelContext | None = None) -> bool:
    """Whether a MindSpore script feeds the global batch to every rank in ``mode`` under
    ``ctx`` (default: the global context) (``full_batch=True``, or one device), rather than
    each rank its own slice."""
    ctx = ctx or context.auto_parallel_context()
    return mode == "stand_alone" or (mode != "data_parallel" and ctx.full_batch)


#: MindSpore 2.1-2.9's name of the wrapper (``mindspore.parallel.nn.GradAccumulation`` since).
GradAccumulationCell = GradAccumulation


class Cell(_nn.Cell):
    """MindSpore's ``nn.Cell``: a sub-Cell assigned to an attribute prefixes the names of its
    named Parameters with the attribute (``Parameter(..., name="weight")`` in ``dense1``
    becomes ``dense1.weight``), as MindSpore's ``auto_prefix`` does; unnamed ones take their
    dotted path when first listed, as in simpar."""

    def __setattr__(self, key: str, value: Any) -> None:
        if isinstance(value, _nn.Cell) and "_params" in self.__dict__:
            for _, param in value.parameters_and_names():
                if param.name:
                    param.name = f"{key}.{param.name}"
        super().__setattr__(key, value)


class TrainOneStepCell(_nn.TrainOneStepCell):
    """MindSpore's ``nn.TrainOneStepCell(network, optimizer, sens=1.0)``: one call, one step,
    fed as MindSpore feeds it (each rank its own slice unless ``full_batch``; decided by the
    context when the first step builds the program). As MindSpore's, it leaves the network's
    mode alone: call ``set_train()`` (``Model.train`` does)."""

    sets_train_mode = False

    def __init__(self, network: _nn.Cell, optimizer: Optimizer, sens: float = 1.0) -> None:
        super().__init__(network, optimizer, sens)

    def feeds_per_device(self, ctx: context.ParallelContext) -> bool:
        return not full_batch_feeding(self.mode, ctx)


class SoftmaxCrossEntropyWithLogits(_nn.SoftmaxCrossEntropyWithLogits):
    """MindSpore's defaults: ``sparse=False`` (label rows of probabilities), and
    ``reduction="none"``, which simpar refuses (its losses reduce to the value a step
    differentiates): pass "mean" or "sum"."""

    def __init__(self, sparse: bool = False, reduction: str = "none") -> None:
        if reduction == "none":
            raise NotImplementedError(
                "SoftmaxCrossEntropyWithLogits(reduction='none') (MindSpore's default) is not "
                "implemented by simpar: pass reduction='mean' or 'sum'")
        super().__init__(sparse, reduction)


class CrossEntropyLoss(_nn.SoftmaxCrossEntropyWithLogits):
    """MindSpore's ``nn.CrossEntropyLoss`` with integer class labels: ``weight``,
    ``ignore_index`` and ``label_smoothing`` at their defaults only."""

    def __init__(self, weight: Any = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> None:
        if weight is not None or ignore_index != -100 or label_smoothing != 0.0:
            raise NotImplementedError(
                "CrossEntropyLoss: simpar implements weight=None, ignore_index=-100 and "
                f"label_smoothing=0.0 only, got weight={weight!r}, ignore_index="
                f"{ignore_index!r}, label_smoothing={label_smoothing!r} (smoothed labels: "
                "simpar.nn.resnet.CrossEntropySmooth)")
        if reduction not in ("mean", "sum"):
            raise NotImplementedError(f"CrossEntropyLoss: reduction must be 'mean' or 'sum' in "
                                      f"simpar, got {reduction!r}")
        super().__init__(sparse=True, reduction=reduction)


__getattr__ = missing("mindspore.nn", {
    "Conv1d": "nn.Conv2d on a (N, C, 1, W) input",
    "Conv3d": "nn.Conv2d",
    "LSTM": "nothing yet: simpar's recurrent networks are not implemented",
    "GRU": "nothing yet: simpar's recurrent networks are not implemented",
    "RNN": "nothing yet: simpar's recurrent networks are not implemented",
    "Softmax": "ops.Softmax()",
    "GELU": "ops.GeLU()",
    "Sigmoid": "ops.Sigmoid()",
    "Tanh": "ops.Tanh()",
    "DistributedGradReducer": "nothing: TrainOneStepCell reduces the gradients itself",
    "TrainOneStepWithLossScaleCell": "nn.TrainOneStepCell (simpar does not scale losses)",
    "WithEvalCell": "train.Model(net, loss_fn, optimizer, metrics={'accuracy'}).eval(dataset)",
    "Accuracy": "train.Accuracy",
    "Loss": "train.Loss",
    "LAMB": "nn.Adam or nn.AdamW",
    "Lamb": "nn.Adam or nn.AdamW",
    "AdaFactor": "nn.Adam or nn.AdamW",
})
