"""The main job's models (``--model gpt | mlp | resnet``): each one's network, its
semi_auto_parallel presets, the Cells it recomputes and cuts into pipeline stages, its batch
shapes and its generated data. :mod:`simpar.train` asks here and nowhere else what a model
is.

* ``gpt``: :class:`simpar.nn.GPT` on the shipped character corpus; presets Megatron's.
* ``mlp``: :class:`simpar.nn.MLP` on a random linear teacher's classes; presets Megatron's.
* ``resnet``: a small ResNet (MindSpore's structure, one block per stage, ``--depth`` 18 or
  50, ``--width`` channels in the stem) on generated images of ``--num-classes`` classes,
  with MindSpore's label-smoothed loss; the presets cut the batch (``dp``) and the
  classifier's classes (``mp``, :func:`simpar.nn.resnet.shard_classifier`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

from simpar import nn
from simpar.dataset import VOCAB_SIZE, CharCorpus, random_classification, random_images
from simpar.nn import presets
from simpar.nn.resnet import CrossEntropySmooth, ResNet, shard_classifier

__all__ = ["MODELS", "add_model_arguments", "batch_shapes", "batches", "make_loss", "make_model",
           "mesh_problem", "recompute_cells", "samples_unit", "shard_preset",
           "stage_units"]

MODELS = ("gpt", "mlp", "resnet")
#: Classes of the MLP's task.
MLP_CLASSES = 8


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The ResNet's own options (the GPT's and the MLP's are the job's older ones)."""
    p.add_argument("--depth", type=int, default=18, choices=(18, 50),
                   help="--model resnet: ResNet-18's basic blocks or ResNet-50's bottlenecks "
                   "(one block per stage)")
    p.add_argument("--width", type=int, default=8,
                   help="--model resnet: the stem's channels (64 in the paper); each stage "
                   "doubles them")
    p.add_argument("--image-size", type=int, default=16,
                   help="--model resnet: the generated images' height and width")
    p.add_argument("--num-classes", type=int, default=8,
                   help="--model resnet: classes of the generated images")


def make_model(args: argparse.Namespace, dtype: np.dtype) -> nn.Cell:
    if args.model == "gpt":
        return nn.GPT(VOCAB_SIZE, args.seq_length, args.d_model, args.n_layers, args.n_heads,
                      dtype=dtype)
    if args.model == "resnet":
        return nn.resnet(args.depth, args.num_classes, args.width, (1, 1, 1, 1), dtype=dtype)
    return nn.MLP(args.d_model, args.hidden, MLP_CLASSES, n_hidden=1, dtype=dtype)


def make_loss(args: argparse.Namespace) -> nn.Cell:
    """The loss: the sparse cross entropy; the ResNet's is MindSpore's ResNet recipe's,
    label smoothing 0.1 (:class:`~simpar.nn.resnet.CrossEntropySmooth`: OneHot, then the
    dense cross entropy)."""
    if args.model == "resnet":
        return CrossEntropySmooth(smooth_factor=0.1, num_classes=args.num_classes)
    return nn.SoftmaxCrossEntropyWithLogits()


def shard_preset(model: nn.Cell, loss: Any, dp: int, mp: int, data_parallel: bool,
                 device_num: int) -> None:
    """The semi_auto_parallel preset: ``data_parallel`` (preset ``dp``) cuts only the batch
    over every rank; else Megatron's dp x mp (GPT, MLP) or the ResNet's class cut."""
    if isinstance(model, ResNet):
        shard_classifier(model, dp, mp, loss)
    elif data_parallel:
        for _, cell in model.cells_and_names():
            if isinstance(cell, nn.Dense):
                cell.matmul.shard(((device_num, 1), (1, 1)))
    elif isinstance(model, nn.GPT):
        presets.megatron_gpt(model, dp, mp, loss)
    else:
        assert isinstance(model, nn.MLP)
        presets.megatron_mlp(model, dp, mp)


def mesh_problem(args: argparse.Namespace, mp: int, where: str) -> str | None:
    """Why the model does not split among ``mp`` model-parallel ranks, or None."""
    if args.model == "gpt" and VOCAB_SIZE % mp:
        return (f"the GPT's vocabulary of {VOCAB_SIZE} characters does not split among {mp} "
                f"model-parallel ranks ({where}; the embedding and the LM head are "
                f"vocabulary-parallel); use a number of ranks whose mp divides {VOCAB_SIZE}")
    if args.model == "gpt" and args.n_heads % mp:
        return (f"--n-heads {args.n_heads} does not split among {mp} model-parallel ranks "
                f"({where}; Megatron gives each rank whole heads); use a multiple of {mp}")
    if args.model == "mlp" and args.hidden % mp:
        return (f"--hidden {args.hidden} does not split among {mp} model-parallel ranks "
                f"({where}; Megatron splits the hidden layer); use a multiple of {mp}")
    if args.model == "resnet" and args.num_classes % mp:
        return (f"--num-classes {args.num_classes} does not split among {mp} model-parallel "
                f"ranks ({where}; the classifier's classes are cut); use a multiple of {mp}")
    return None


def recompute_cells(model: nn.Cell) -> list[nn.Cell]:
    """The Cells ``--recompute`` marks: every GPT block, every MLP layer but the last, every
    ResNet block."""
    if isinstance(model, nn.GPT):
        return list(model.blocks)
    if isinstance(model, ResNet):
        return [block for stage in model.stages for block in stage]
    return list(model.layers[:-1])  # type: ignore[attr-defined]


def stage_units(model: nn.Cell) -> list[nn.Cell]:
    """The Cells pipeline stages are cut between, in order (the stem and the head go with
    the first and the last)."""
    if isinstance(model, nn.GPT):
        return [model.embedding, *model.blocks, model.head]
    if isinstance(model, ResNet):
        return [model.conv1, *recompute_cells(model), model.end_point]
    return list(model.layers)   # type: ignore[attr-defined]


def batch_shapes(args: argparse.Namespace) -> list[tuple[tuple[int, ...], Any]]:
    if args.model == "gpt":
        shape = (args.batch_size, args.seq_length)
        return [(shape, np.dtype(np.int32)), (shape, np.dtype(np.int32))]
    if args.model == "resnet":
        size = args.image_size
        return [((args.batch_size, 3, size, size), np.dtype(args.dtype)),
                ((args.batch_size,), np.dtype(np.int32))]
    return [((args.batch_size, args.d_model), np.dtype(args.dtype)),
            ((args.batch_size,), np.dtype(np.int32))]


def batches(args: argparse.Namespace) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    """``get(k, rows=None)``: the global batch ``k``, or only its rows ``(start, stop)``."""
    if args.model == "gpt":
        corpus = CharCorpus(seed=args.seed)
        return lambda k, rows=None: corpus.batch(k, args.batch_size, args.seq_length, rows)
    if args.model == "resnet":
        return lambda k, rows=None: random_images(k, args.batch_size, 3, args.image_size,
                                                  args.num_classes, args.seed,
                                                  np.dtype(args.dtype), rows)
    return lambda k, rows=None: random_classification(k, args.batch_size, args.d_model,
                                                      MLP_CLASSES, args.seed,
                                                      np.dtype(args.dtype), rows)


def samples_unit(args: argparse.Namespace) -> tuple[int, str]:
    """(samples per batch row, their name): the GPT's tokens, one image, one sample."""
    if args.model == "gpt":
        return args.seq_length, "tokens"
    return 1, "images" if args.model == "resnet" else "samples"
