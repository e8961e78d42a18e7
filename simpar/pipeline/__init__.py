"""Pipeline parallelism: stages of a network on sub-meshes of the ranks, micro-batches
scheduled across them (MindSpore's ``pipeline_stages``, ``Cell.pipeline_stage``,
``PipelineCell``).

Modules: ``stages`` (which stage runs each op; each stage's own graph), ``schedules`` (GPipe
and 1F1B), ``runner`` (a step over MPI).
"""

from simpar.pipeline.runner import PipelineRunner, Transfer, plan_stages
from simpar.pipeline.schedules import bubble_fraction, in_flight, schedule
from simpar.pipeline.stages import Boundary, Stage, split_stages, stages_of

__all__ = ["Boundary", "PipelineRunner", "Stage", "Transfer", "bubble_fraction", "in_flight",
           "plan_stages", "schedule", "split_stages", "stages_of"]
