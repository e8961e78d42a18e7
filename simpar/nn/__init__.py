"""simpar.nn: Cells, Parameters, layers, losses, optimizers and training wrappers."""

from simpar.nn.cell import Cell, Parameter, initializer
from simpar.nn.layers import (
    GPT,
    MLP,
    Dense,
    Dropout,
    Embedding,
    FeedForward,
    LayerNorm,
    MultiHeadAttention,
    TransformerBlock,
)
from simpar.nn.loss import L1Loss, MSELoss, SoftmaxCrossEntropyWithLogits
from simpar.nn.optim import SGD, Adam, AdamW, Momentum, Optimizer
from simpar.nn.wrap import TrainOneStepCell, WithLossCell

__all__ = [
    "GPT",
    "MLP",
    "SGD",
    "Adam",
    "AdamW",
    "Cell",
    "Dense",
    "Dropout",
    "Embedding",
    "FeedForward",
    "L1Loss",
    "LayerNorm",
    "MSELoss",
    "Momentum",
    "MultiHeadAttention",
    "Optimizer",
    "Parameter",
    "SoftmaxCrossEntropyWithLogits",
    "TrainOneStepCell",
    "TransformerBlock",
    "WithLossCell",
    "initializer",
]
