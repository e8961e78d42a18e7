"""Pipeline parallelism: stages of a network on sub-meshes of the ranks, micro-batches
scheduled across them (MindSpore's ``pipeline_stages``, ``Cell.pipeline_stage``,
``PipelineCell``).

Modules: ``stages`` (which stage runs each op; each stage's own graph), ``schedules`` (GPipe,
1F1B, interleaved), ``runner`` (a step over MPI), ``price`` (what a step costs),
``strategy_files`` (a pipelined plan's strategy files, MindSpore's per-stage files and
``merge_pipeline_strategys``).
"""

from simpar.pipeline.price import PipelineCost, StageCost, price_pipeline, timeline
from simpar.pipeline.runner import PipelineRunner, Transfer, plan_pipeline, plan_stages
from simpar.pipeline.schedules import bubble_fraction, in_flight, schedule
from simpar.pipeline.stages import Boundary, Stage, split_stages, stages_of
from simpar.pipeline.strategy_files import merge_pipeline_strategys

__all__ = ["Boundary", "PipelineCost", "PipelineRunner", "Stage", "StageCost", "Transfer",
           "bubble_fraction", "in_flight", "merge_pipeline_strategys", "plan_pipeline",
           "plan_stages", "price_pipeline", "schedule", "split_stages", "stages_of", "timeline"]
