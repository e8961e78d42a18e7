"""simpar.nn: Cells, Parameters, layers, losses, optimizers, training wrappers and
``AutoParallel`` (MindSpore 2.x's per-network parallel settings)."""

from simpar.nn.auto_parallel import AutoParallel
from simpar.nn.cell import Cell, Parameter, initializer
from simpar.nn.conv_layers import (
    AvgPool2d,
    Conv2d,
    Conv2dTranspose,
    Flatten,
    MaxPool2d,
    ReLU,
    ReLU6,
    SequentialCell,
)
from simpar.nn.grad_accumulation import GradAccumulation, Pipeline, PipelineCell
from simpar.nn.layers import (
    GPT,
    MLP,
    BatchNorm1d,
    BatchNorm2d,
    Dense,
    Dropout,
    Embedding,
    FeedForward,
    LayerNorm,
    MultiHeadAttention,
    PReLU,
    TransformerBlock,
)
from simpar.nn.loss import L1Loss, MSELoss, SoftmaxCrossEntropyWithLogits
from simpar.nn.optim import SGD, Adam, AdamW, Momentum, Optimizer
from simpar.nn.resnet import ResNet, resnet, resnet18, resnet50
from simpar.nn.wrap import TrainOneStepCell, WithLossCell

__all__ = [
    "AvgPool2d",
    "Conv2d",
    "Conv2dTranspose",
    "Flatten",
    "MaxPool2d",
    "ReLU",
    "ReLU6",
    "ResNet",
    "SequentialCell",
    "resnet",
    "resnet18",
    "resnet50",
    "GPT",
    "MLP",
    "SGD",
    "Adam",
    "AdamW",
    "AutoParallel",
    "BatchNorm1d",
    "BatchNorm2d",
    "Cell",
    "Dense",
    "Dropout",
    "Embedding",
    "FeedForward",
    "GradAccumulation",
    "L1Loss",
    "LayerNorm",
    "MSELoss",
    "Momentum",
    "MultiHeadAttention",
    "Optimizer",
    "PReLU",
    "Parameter",
    "Pipeline",
    "PipelineCell",
    "SoftmaxCrossEntropyWithLogits",
    "TrainOneStepCell",
    "TransformerBlock",
    "WithLossCell",
    "initializer",
]
