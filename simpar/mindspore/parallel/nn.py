"""``mindspore.parallel.nn``: the wrappers of MindSpore 2.6+'s parallel package, simpar's
:class:`~simpar.nn.GradAccumulation` and :class:`~simpar.nn.Pipeline`."""

from __future__ import annotations

from simpar.mindspore._missing import missing
from simpar.nn import GradAccumulation, Pipeline

__all__ = ["GradAccumulation", "Pipeline"]

__getattr__ = missing("mindspore.parallel.nn", {
    "PipelineGradReducer": "nothing: nn.TrainOneStepCell reduces a pipelined step's gradients",
    "MicroBatchInterleaved": "nothing: simpar does not interleave micro-batches within a stage",
})
