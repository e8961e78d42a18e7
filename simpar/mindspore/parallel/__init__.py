"""``mindspore.parallel``: the algorithm parameters of the strategy searches, the
per-network :class:`~simpar.nn.AutoParallel` (``mindspore.parallel.auto_parallel``), and the
strategy file helpers simpar implements."""

from __future__ import annotations

from simpar.context import get_algo_parameters, reset_algo_parameters, set_algo_parameters
from simpar.mindspore._missing import missing
from simpar.mindspore.parallel import auto_parallel, nn
from simpar.pipeline.strategy_files import merge_pipeline_strategys

__all__ = ["auto_parallel", "get_algo_parameters", "merge_pipeline_strategys", "nn",
           "reset_algo_parameters", "set_algo_parameters"]

__getattr__ = missing("mindspore.parallel", {
    "build_searched_strategy": "simpar.strategy_file.load_strategy",
    "load_distributed_checkpoint": "simpar.checkpoint.load_training, or python -m "
                                   "simpar.checkpoint merge",
    "transform_checkpoints": "python -m simpar.checkpoint transform SRC DST --strategy FILE",
    "rank_list_for_transform": "python -m simpar.checkpoint transform (it reads only the "
                               "blocks a rank needs)",
    "unified_safetensors": "python -m simpar.checkpoint export DIR OUT.safetensors (every "
                           "tensor whole)",
    "shard": "mindspore.shard(cell, in_strategy, ...) or Cell.shard(...)",
    "Layout": "tuple strategies (MindSpore's higher-order layouts are not implemented)",
})
