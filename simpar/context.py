"""MindSpore's parallel context: ``set_auto_parallel_context`` and ``set_algo_parameters``.

Both contexts are process-global, as in MindSpore. Every call is validated as a whole before
any value is applied, so a call that raises changes nothing. The entry points that plan read
the immutable snapshots, :func:`auto_parallel_context` / :func:`algo_parameters`, once into a
plan request (``simpar.search.request``); planners read the request only. ``simpar.comm``
reports the MPI world through :func:`set_world` once MPI has started.

Defaults and ranges follow the documented behaviour of MindSpore 2.2 and later (up to the
current 2.x stable API pages). They were looked up in the ``set_auto_parallel_context``
docstring of ``mindspore/python/mindspore/context.py`` (master), in ``_auto_parallel_context.py``,
``parallel/algo_parameter_config.py``, and the C++ ``ParallelContext::Reset`` and
``CostModelContext::set_dp_algo_approxi_epsilon``. The facts are MindSpore's; the code is not.

=============================== ========================== ======================================
key                             default                    allowed / note
=============================== ========================== ======================================
parallel_mode                   ``"stand_alone"``          stand_alone, data_parallel,
                                                           semi_auto_parallel, auto_parallel
device_num                      1, or the MPI world size   int in [1, 4096]
                                once simpar.comm started
global_rank                     0, or the MPI rank         int in [0, 4095]
gradients_mean                  False                      bool
gradient_fp32_sync              True                       bool
loss_repeated_mean              True                       bool
search_mode                     recursive_programming      plus dynamic_programming,
                                                           sharding_propagation, simpar's exact
                                                           and :func:`register_search_mode`'s
strategy_ckpt_config            (see note)                 load_file="", save_file="",
                                                           only_trainable_params=True
dataset_strategy                ``"data_parallel"``        "full_batch", or ((int, ...), ...)
full_batch                      False                      bool; a view of dataset_strategy
enable_alltoall                 False                      bool
enable_parallel_optimizer       False                      bool (:mod:`simpar.optimizer_parallel`)
parallel_optimizer_config       (see note)                 parallel_optimizer_threshold=64 (KB,
                                                           int >= 0), optimizer_weight_shard_size
                                                           =-1 (or int >= 2; 1 warns, ignored),
                                                           optimizer_level="level1" (level1-3),
                                                           gradient_accumulation_shard (a view:
                                                           True is level2)
pipeline_stages                 1                          int >= 1 (:mod:`simpar.pipeline`)
pipeline_config                 (see note)                 pipeline_interleave=False (bool),
                                                           pipeline_scheduler="1f1b" ("1f1b" or
                                                           "gpipe")
auto_pipeline                   False                      bool: the stage count searched, up
                                                           to pipeline_stages (auto_parallel,
                                                           recursive_programming)
comm_fusion                     one bucket per group       :mod:`simpar.comm_fusion`
all_reduce_fusion_config        []                         a view of comm_fusion's "index" mode
strategy_ckpt_load_file/_save   ""                         str; views of strategy_ckpt_config
auto_parallel_search_mode       (search_mode)              old name of search_mode
=============================== ========================== ======================================

``set_algo_parameters``: the keys and defaults of :class:`AlgoParameters`, with
``algo_approxi_epsilon`` a float in (0, 1] and ``tensor_slice_align_size`` an int in [1, 1024].
simpar's own ``exact_time_limit`` (None, or seconds > 0) bounds ``search_mode="exact"``: when
it runs out, the search returns its best plan with the optimality gap and warns
(``simpar.search.exact.TimeLimitWarning``), or raises ``TimeoutError`` when it has none.
simpar's own ``memory_dimensions`` (:data:`MEMORY_DIMENSIONS`) lets auto_parallel choose the
optimizer level, the recomputed Cells and the micro-batches with the cuts
(:mod:`simpar.search.dimensions`): "fixed" (the default, as MindSpore: the user's), "when_needed"
(search them only when the user's settings leave no plan within the memory cap), "search" (always
the fastest combination that fits).

Two defaults moved, and simpar follows the newer value of each. ``search_mode``: MindSpore 2.0 (and
the older C++ ``Reset``) ``"dynamic_programming"``, 2.2 and later ``"recursive_programming"``.
``fully_use_devices``: True up to 2.3, False from 2.4 on (the ``set_algo_parameters`` and
``reset_algo_parameters`` pages of 2.4.0, 2.5.0 and master). ``enable_alltoall`` is False and
``loss_repeated_mean`` True in every version looked at.

Where simpar decides differently from MindSpore, on purpose:

* Types are checked strictly, as MindSpore's ``args_type_check`` does: ``gradients_mean=1`` and
  ``device_num=True`` raise ``TypeError`` (bool is a subclass of int, but never an int here).
  numpy integers and floats are accepted where an int or a float is.
* ``parallel_mode="hybrid_parallel"`` (hand-written communication) raises ``ValueError``:
  simpar's executor inserts every collective itself. Use ``"semi_auto_parallel"`` with
  ``.shard()`` strategies for manual model parallelism.
* ``full_batch`` and ``dataset_strategy`` are one piece of state (MindSpore keeps two), so
  they never disagree. ``dataset_strategy="full_batch"`` is ``full_batch=True``, and
  ``"data_parallel"`` or a tuple strategy reads as ``full_batch=False``. Setting
  ``full_batch=True`` replaces a tuple strategy; ``full_batch=False`` keeps it. Both keys in
  one call with contradicting values raise. That ``full_batch`` needs a (semi-)auto mode is
  left to the code that builds the program (as MindSpore does): keys come in any order.
* The legacy keys ``strategy_ckpt_load_file`` / ``strategy_ckpt_save_file`` write into
  ``strategy_ckpt_config``. ``auto_parallel_search_mode`` is the old name of ``search_mode``
  and warns. Unlike MindSpore, setting ``save_file`` creates no directory: the strategy-file
  writer does that when it writes.
* ``device_num`` and ``global_rank`` left unset follow the MPI world once it is known. Once it
  is known, setting them to anything else raises at once (see :func:`validate_against_world`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from simpar._keyspec import (
    Bounds,
    ContextError,
    ContextTypeError,
    KeySpec,
    NotHonouredWarning,
    Writes,
    check_key,
    has_kind,
    spec_defaults,
    stage_call,
    type_error,
    validate_dict,
    validate_value,
    warn_not_honoured,
)
from simpar.comm_fusion import AllReduceFusion, check_comm_fusion, check_fusion_indices

__all__ = ["AlgoParameters", "BUILTIN_SEARCH_MODES", "ContextError", "ContextTypeError",
           "MINDSPORE_KEYS_NOT_IMPLEMENTED", "MEMORY_DIMENSIONS",
           "NotHonouredWarning", "ParallelContext", "ParallelMode", "ParallelOptimizerConfig",
           "PIPELINE_SCHEDULERS", "PipelineConfig",
           "StrategyCkptConfig",
           "WorldMismatchError", "algo_parameters", "auto_parallel_context",
           "check_dataset_strategy", "get_algo_parameters", "get_auto_parallel_context",
           "register_search_mode", "reset_algo_parameters", "reset_auto_parallel_context",
           "scoped_auto_parallel_context", "search_modes", "set_algo_parameters",
           "set_auto_parallel_context", "set_world", "validate_against_world"]


class WorldMismatchError(ContextError):
    """``device_num`` or ``global_rank`` disagrees with the MPI world the job runs in."""


class ParallelMode:
    """The values of ``parallel_mode``, named as MindSpore's ``ParallelMode`` names them.

    >>> ParallelMode.SEMI_AUTO_PARALLEL
    'semi_auto_parallel'
    """

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    MODES = (STAND_ALONE, DATA_PARALLEL, SEMI_AUTO_PARALLEL, AUTO_PARALLEL)


@dataclass(frozen=True, slots=True)
class StrategyCkptConfig:
    """The ``strategy_ckpt_config`` dict as a value. Empty paths mean "do not load/save"."""

    load_file: str = ""
    save_file: str = ""
    only_trainable_params: bool = True

    def as_dict(self) -> dict[str, Any]:
        """The MindSpore-shaped dict, e.g. ``{"load_file": "", "save_file": "s.json", ...}``."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ParallelOptimizerConfig:
    """The ``parallel_optimizer_config`` dict as a value (MindSpore's keys and defaults):
    parameters under ``parallel_optimizer_threshold`` KB stay whole, each parameter is spread
    over ``optimizer_weight_shard_size`` ranks (-1: its whole repeated group), and
    ``optimizer_level`` says what is sliced (:mod:`simpar.optimizer_parallel`).
    ``gradient_accumulation_shard`` is a view: True exactly when the level is ``"level2"``."""

    parallel_optimizer_threshold: int = 64
    optimizer_weight_shard_size: int = -1
    optimizer_level: str = "level1"

    @property
    def gradient_accumulation_shard(self) -> bool:
        return self.optimizer_level == "level2"

    def as_dict(self) -> dict[str, Any]:
        """The MindSpore-shaped dict, ``gradient_accumulation_shard`` included."""
        return {**asdict(self), "gradient_accumulation_shard": self.gradient_accumulation_shard}


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """The ``pipeline_config`` dict as a value (MindSpore's keys and defaults): the schedule
    of the micro-batches over the stages (:mod:`simpar.pipeline`), and whether each rank
    runs several interleaved virtual stages."""

    pipeline_interleave: bool = False
    pipeline_scheduler: str = "1f1b"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """An immutable snapshot of the auto-parallel context, with unset values resolved.

    ``device_num`` is the world size when it was left unset and simpar.comm has started, and
    ``global_rank`` likewise is this process's MPI rank. ``*_is_set`` tell whether the user
    gave them explicitly.

    >>> ctx = auto_parallel_context()
    >>> ctx.parallel_mode, ctx.search_mode, ctx.full_batch
    ('stand_alone', 'recursive_programming', False)
    """

    parallel_mode: str
    device_num: int
    global_rank: int
    gradients_mean: bool
    gradient_fp32_sync: bool
    loss_repeated_mean: bool
    search_mode: str
    strategy_ckpt_config: StrategyCkptConfig
    dataset_strategy: str | tuple[tuple[int, ...], ...]
    enable_alltoall: bool
    pipeline_stages: int
    device_num_is_set: bool
    global_rank_is_set: bool
    enable_parallel_optimizer: bool = False
    parallel_optimizer_config: ParallelOptimizerConfig = ParallelOptimizerConfig()
    pipeline_config: PipelineConfig = PipelineConfig()
    comm_fusion: AllReduceFusion = AllReduceFusion()   # the gradient AllReduces' buckets
    #: MindSpore's ``auto_pipeline``: auto_parallel chooses the stage count, up to
    #: ``pipeline_stages`` (:func:`simpar.pipeline.auto.choose_stages`).
    auto_pipeline: bool = False
    #: The keys the user set (views name the key they write), e.g. ``{"dataset_strategy"}``.
    explicit: frozenset[str] = frozenset()

    @property
    def full_batch(self) -> bool:
        """Whether every device loads the whole batch (``dataset_strategy == "full_batch"``)."""
        return self.dataset_strategy == "full_batch"


@dataclass(frozen=True, slots=True)
class AlgoParameters:
    """An immutable snapshot of the strategy-search parameters (``set_algo_parameters``).

    >>> algo_parameters().tensor_slice_align_size
    16
    """

    fully_use_devices: bool = False
    elementwise_op_strategy_follow: bool = False
    enable_algo_approxi: bool = False
    algo_approxi_epsilon: float = 0.1
    tensor_slice_align_enable: bool = False
    tensor_slice_align_size: int = 16
    exact_time_limit: float | None = None  # simpar's own: seconds for search_mode "exact"
    memory_dimensions: str = "fixed"       # simpar's own: MEMORY_DIMENSIONS

    @property
    def slice_align(self) -> int:
        """What MatMul's slice dimensions must be multiples of (1: no constraint)."""
        return self.tensor_slice_align_size if self.tensor_slice_align_enable else 1


# MindSpore's reason-free rejection deserves a reason here.
_HYBRID = ("is MindSpore's mode for hand-written communication, which simpar does not have "
           "because its executor inserts every collective itself; use 'semi_auto_parallel' with "
           ".shard() strategies for manual model parallelism")

#: The search modes simpar.search has a planner for (it checks so when imported): MindSpore's
#: three, then simpar's ``exact``. :func:`register_search_mode` adds more.
BUILTIN_SEARCH_MODES = ("recursive_programming", "dynamic_programming", "sharding_propagation",
                        "exact")
_SEARCH_MODES: list[str] = list(BUILTIN_SEARCH_MODES)
#: ``set_algo_parameters(memory_dimensions=...)``: whether auto_parallel chooses the optimizer
#: level, the recomputed Cells and the micro-batches ("fixed": never; see the module).
MEMORY_DIMENSIONS = ("fixed", "when_needed", "search")


_CKPT_SPECS: dict[str, KeySpec] = {
    "load_file": KeySpec(str, ""),
    "save_file": KeySpec(str, ""),
    "only_trainable_params": KeySpec(bool, True),
}


def _check_ckpt_config(func: str, key: str, value: object) -> dict[str, Any]:
    return validate_dict(func, key, value, _CKPT_SPECS)


_DATASET_STRATEGY_WORDS = ("full_batch", "data_parallel")
_DATASET_STRATEGY_ALLOWED = ("'full_batch', 'data_parallel' or a tuple of tuples of positive "
                             "ints such as ((2, 1), (2,))")


def check_dataset_strategy(func: str, key: str, value: object
                           ) -> str | tuple[tuple[int, ...], ...]:
    """Validate a dataset strategy as ``set_auto_parallel_context(dataset_strategy=...)`` does,
    for an entry point ``func`` whose parameter is ``key``; return it normalised (numpy ints
    to Python ints).

    >>> check_dataset_strategy("AutoParallel.dataset_strategy", "config", ((2, 1), (2,)))
    ((2, 1), (2,))
    >>> check_dataset_strategy("AutoParallel.dataset_strategy", "config", "half")
    Traceback (most recent call last):
    ...
    simpar.context.ContextError: AutoParallel.dataset_strategy: config must be 'full_batch', \
'data_parallel' or a tuple of tuples of positive ints such as ((2, 1), (2,)), but got 'half'.
    """
    if isinstance(value, str):
        if value not in _DATASET_STRATEGY_WORDS:
            raise ContextError(f"{func}: {key} must be {_DATASET_STRATEGY_ALLOWED}, "
                               f"but got {value!r}.")
        return value
    if not isinstance(value, tuple) or not value or not all(isinstance(s, tuple) and s
                                                            for s in value):
        raise type_error(func, key, _DATASET_STRATEGY_ALLOWED, value)
    for s in value:
        for cut in s:
            if not has_kind(cut, int):
                raise type_error(func, key, _DATASET_STRATEGY_ALLOWED, value)
            if cut < 1:
                raise ContextError(f"{func}: {key} must be {_DATASET_STRATEGY_ALLOWED}, "
                                   f"but got {value!r} (cut {cut} is not positive).")
    return tuple(tuple(int(cut) for cut in s) for s in value)


_LEVELS = ("level1", "level2", "level3")
_OPT_SPECS: dict[str, KeySpec] = {
    "gradient_accumulation_shard": KeySpec(bool, False),
    "parallel_optimizer_threshold": KeySpec(int, 64, bounds=Bounds(0, math.inf)),
    "optimizer_weight_shard_size": KeySpec(
        int, -1, check=lambda f, k, v: _check_shard_size(f, k, v)),
    "optimizer_level": KeySpec(str, "level1", choices=lambda: _LEVELS),
}
_SHARD_SIZE_ALLOWED = "-1 (the whole repeated group) or an int >= 1"
#: The pipeline schedules simpar runs (MindSpore also offers seqpipe, seqvpp, seqsmartvpp
#: and zero_bubble_v).
PIPELINE_SCHEDULERS = ("1f1b", "gpipe")
_PIPE_SPECS: dict[str, KeySpec] = {
    "pipeline_interleave": KeySpec(bool, False),
    "pipeline_scheduler": KeySpec(str, "1f1b", choices=lambda: PIPELINE_SCHEDULERS),
}


def _check_shard_size(func: str, key: str, value: object) -> int:
    if not has_kind(value, int):
        raise type_error(func, key, _SHARD_SIZE_ALLOWED, value)
    size = int(value)  # type: ignore[call-overload]
    if size != -1 and size < 1:
        raise ContextError(f"{func}: {key} must be {_SHARD_SIZE_ALLOWED}, but got {size}.")
    if size == 1:   # MindSpore warns and keeps its default too
        warnings.warn(f"{func}: {key}=1 slices nothing and is ignored, as in MindSpore; the "
                      "whole repeated group (-1) is used", UserWarning, stacklevel=5)
        return -1
    return size


def _check_optimizer_config(func: str, key: str, value: object) -> dict[str, Any]:
    """The ``parallel_optimizer_config`` dict validated: its keys are MindSpore's four, and
    ``gradient_accumulation_shard=True`` is ``optimizer_level="level2"`` (MindSpore refuses
    the two together with another level)."""
    out = validate_dict(func, key, value, _OPT_SPECS)
    level = out.get("optimizer_level")
    if out.get("gradient_accumulation_shard") and level not in (None, "level2"):
        raise ContextError(f"{func}: {key} sets optimizer_level={level!r} and "
                           "gradient_accumulation_shard=True, which means level2; pass one "
                           "of them.")
    return out


def _optimizer_fields(value: dict[str, Any], staged: Mapping[str, Any]) -> Writes:
    """Each key into the config; ``gradient_accumulation_shard`` into the level (True:
    level2; False: level1 where it was level2, else the level stays)."""
    value = dict(value)
    shard = value.pop("gradient_accumulation_shard", None)
    if shard is not None and "optimizer_level" not in value:
        now = staged["parallel_optimizer_config"].optimizer_level
        value["optimizer_level"] = "level2" if shard else ("level1" if now == "level2" else now)
    return [(f"parallel_optimizer_config.{sub}", v) for sub, v in value.items()]


def _pipeline_fields(value: dict[str, Any], staged: Mapping[str, Any]) -> Writes:
    return [(f"pipeline_config.{sub}", v) for sub, v in value.items()]


def _ckpt_fields(value: dict[str, Any], staged: Mapping[str, Any]) -> Writes:
    return [(f"strategy_ckpt_config.{sub}", v) for sub, v in value.items()]


def _full_batch_fields(value: bool, staged: Mapping[str, Any]) -> Writes:
    if value:
        return [("dataset_strategy", "full_batch")]
    # False keeps a tuple strategy, which already means "not full batch".
    if staged["dataset_strategy"] == "full_batch":
        return [("dataset_strategy", "data_parallel")]
    return []


def _old_search_mode_fields(value: str, staged: Mapping[str, Any]) -> Writes:
    warnings.warn("auto_parallel_search_mode is the old name of search_mode, as in MindSpore; "
                  "use search_mode", FutureWarning, stacklevel=4)
    return [("search_mode", value)]


_AUTO_SPECS: dict[str, KeySpec] = {
    "parallel_mode": KeySpec(str, ParallelMode.STAND_ALONE, choices=lambda: ParallelMode.MODES,
                             unsupported=(("hybrid_parallel", _HYBRID),)),
    # None = unset: follows the MPI world once known, else MindSpore's 1 and 0.
    "device_num": KeySpec(int, None, bounds=Bounds(1, 4096)),
    "global_rank": KeySpec(int, None, bounds=Bounds(0, 4095)),
    "gradients_mean": KeySpec(bool, False),
    "gradient_fp32_sync": KeySpec(bool, True),
    "loss_repeated_mean": KeySpec(bool, True),
    "search_mode": KeySpec(str, "recursive_programming", choices=lambda: _SEARCH_MODES),
    "strategy_ckpt_config": KeySpec(None, StrategyCkptConfig(), check=_check_ckpt_config,
                                    fields=_ckpt_fields),
    "dataset_strategy": KeySpec(None, "data_parallel", check=check_dataset_strategy),
    "enable_alltoall": KeySpec(bool, False),
    "enable_parallel_optimizer": KeySpec(bool, False),
    "parallel_optimizer_config": KeySpec(None, ParallelOptimizerConfig(),
                                         check=_check_optimizer_config,
                                         fields=_optimizer_fields),
    "pipeline_stages": KeySpec(int, 1, bounds=Bounds(1, math.inf)),
    "auto_pipeline": KeySpec(bool, False),
    "comm_fusion": KeySpec(None, AllReduceFusion(), check=check_comm_fusion),
    "pipeline_config": KeySpec(None, PipelineConfig(),
                               check=lambda f, k, v: validate_dict(f, k, v, _PIPE_SPECS),
                               fields=_pipeline_fields),
}

# Keys that are views of the fields above (MindSpore's older names).
_AUTO_VIEWS: dict[str, KeySpec] = {
    "full_batch": KeySpec(bool, None, fields=_full_batch_fields, late=True),
    "strategy_ckpt_load_file": KeySpec(
        str, None, fields=lambda v, _: [("strategy_ckpt_config.load_file", v)]),
    "strategy_ckpt_save_file": KeySpec(
        str, None, fields=lambda v, _: [("strategy_ckpt_config.save_file", v)]),
    "auto_parallel_search_mode": KeySpec(str, None, choices=lambda: _SEARCH_MODES,
                                         fields=_old_search_mode_fields),
    "all_reduce_fusion_config": KeySpec(None, None, check=check_fusion_indices,
                                        fields=lambda v, _: [("comm_fusion", v)]),
}

_AUTO_KEYS: dict[str, KeySpec] = {**_AUTO_SPECS, **_AUTO_VIEWS}
_VIEW_OF = {"full_batch": "dataset_strategy", "strategy_ckpt_load_file": "strategy_ckpt_config",
            "strategy_ckpt_save_file": "strategy_ckpt_config",
            "auto_parallel_search_mode": "search_mode", "all_reduce_fusion_config": "comm_fusion"}

_TIME_LIMIT_ALLOWED = "None (no limit) or a finite number of seconds > 0"


def _check_time_limit(func: str, key: str, value: object) -> float | None:
    if value is None:
        return None
    if not (has_kind(value, int) or has_kind(value, float)):
        raise type_error(func, key, _TIME_LIMIT_ALLOWED, value)
    seconds = float(value)  # type: ignore[arg-type]
    if not (math.isfinite(seconds) and seconds > 0):
        raise ContextError(f"{func}: {key} must be {_TIME_LIMIT_ALLOWED}, but got {value!r}.")
    return seconds


_ALGO = AlgoParameters()  # the defaults
_ALGO_SPECS: dict[str, KeySpec] = {
    "fully_use_devices": KeySpec(bool, _ALGO.fully_use_devices),
    "elementwise_op_strategy_follow": KeySpec(bool, _ALGO.elementwise_op_strategy_follow),
    "enable_algo_approxi": KeySpec(bool, _ALGO.enable_algo_approxi),
    "algo_approxi_epsilon": KeySpec(float, _ALGO.algo_approxi_epsilon,
                                    bounds=Bounds(0, 1, lo_open=True)),
    "tensor_slice_align_enable": KeySpec(bool, _ALGO.tensor_slice_align_enable),
    "tensor_slice_align_size": KeySpec(int, _ALGO.tensor_slice_align_size,
                                       bounds=Bounds(1, 1024)),
    "exact_time_limit": KeySpec(None, _ALGO.exact_time_limit, allowed=_TIME_LIMIT_ALLOWED,
                                check=_check_time_limit),
    "memory_dimensions": KeySpec(str, _ALGO.memory_dimensions,
                                 choices=lambda: MEMORY_DIMENSIONS),
}


# State fields that simpar validates but does not act on yet when they differ from their
# default, with what is missing. Each warns once per process.
_NOT_HONOURED: dict[str, str] = {
    "search_mode": "no strategy search is registered under this name yet",
    "gradient_fp32_sync": "simpar has no float16 gradients, so there is nothing to cast",
}

#: set_auto_parallel_context keys MindSpore documents that simpar does not implement, with
#: what to use instead: setting one raises NotImplementedError, not "unknown key".
MINDSPORE_KEYS_NOT_IMPLEMENTED: dict[str, str] = {
    "parameter_broadcast": "every rank draws its own block of each parameter from the same "
                           "seed (simpar.set_seed): nothing to broadcast",
    "force_fp32_communication": "simpar communicates in the tensors' own dtype",
    "pipeline_result_broadcast": "the pipelined step's loss is returned on every rank already",
    "group_ckpt_save_file": "simpar.checkpoint's manifest lists each tensor's ranks",
    "dump_local_norm": "nothing: simpar does not dump norms",
    "dump_local_norm_path": "nothing: simpar does not dump norms",
    "dump_device_local_norm": "nothing: simpar does not dump norms",
    "grad_accumulation_step": "nn.GradAccumulation(network, micro_size) (MindSpore 1.x's key)",
}
_warned: set[str] = set()
_HONOURED_SEARCHES: set[str] = set(BUILTIN_SEARCH_MODES)  # and what register_search adds


def _not_honoured(staged: Mapping[str, Any]) -> dict[str, str]:
    """:data:`_NOT_HONOURED`, less search_mode when its value has a planner."""
    out = dict(_NOT_HONOURED)
    if staged.get("search_mode") in _HONOURED_SEARCHES:
        del out["search_mode"]
    else:
        out["search_mode"] += f" (search_mode {sorted(_HONOURED_SEARCHES)} is)"
    return out


_AUTO_DEFAULTS: Mapping[str, Any] = {**spec_defaults(_AUTO_SPECS), "explicit": frozenset()}
_auto: dict[str, Any] = dict(_AUTO_DEFAULTS)
_algo: dict[str, Any] = spec_defaults(_ALGO_SPECS)

_world: tuple[int, int] | None = None  # (world_size, world_rank), set by simpar.comm


# ----------------------------------------------------------------------------------------------
# The MPI world.


def _check_world_args(func: str, world_size: object, world_rank: object) -> None:
    size = validate_value(func, "world_size", _AUTO_SPECS["device_num"], world_size)
    allowed = f"an int in [0, {size - 1}] for a world of {size} ranks"
    if not has_kind(world_rank, int):
        raise type_error(func, "world_rank", allowed, world_rank)
    if not 0 <= int(world_rank) < size:  # type: ignore[call-overload]
        raise ContextError(f"{func}: world_rank must be {allowed}, but got {world_rank!r}.")


def _check_world(state: Mapping[str, Any], world_size: int, world_rank: int) -> None:
    device_num, global_rank = state["device_num"], state["global_rank"]
    if device_num is not None and device_num != world_size:
        raise WorldMismatchError(
            f"device_num is {device_num} on rank {world_rank}, but the MPI world has {world_size} "
            f"ranks (mpirun -n {world_size}); set device_num={world_size} or launch with -n "
            f"{device_num}.")
    if global_rank is not None and global_rank != world_rank:
        raise WorldMismatchError(
            f"global_rank is {global_rank} but this process is MPI rank {world_rank} of "
            f"{world_size}; leave global_rank unset (it follows the MPI rank) or set "
            f"global_rank={world_rank}.")


def _check_ranks(func: str, state: Mapping[str, Any]) -> None:
    device_num, global_rank = state["device_num"], state["global_rank"]
    if device_num is not None and global_rank is not None and global_rank >= device_num:
        raise ContextError(f"{func}: global_rank must be in [0, {device_num - 1}] for "
                           f"device_num={device_num}, but got {global_rank}.")


def set_world(world_size: int, world_rank: int) -> None:
    """Record the MPI world; simpar.comm calls this once MPI has started.

    From then on an unset ``device_num`` reads as ``world_size`` and an unset ``global_rank``
    as ``world_rank``, and values set explicitly must match them. The world is recorded even
    when the current context disagrees with it: the world is a fact of the job, the context is
    what is wrong, and later calls are checked against it.

    Example, on rank 5 of ``mpirun -n 8``::

        set_world(8, 5)                          # done by simpar.comm.init()
        get_auto_parallel_context("device_num")  # 8
        get_auto_parallel_context("global_rank") # 5
        set_auto_parallel_context(device_num=4)  # WorldMismatchError: device_num is 4 on
                                                 # rank 5, but the MPI world has 8 ranks ...
    """
    global _world
    _check_world_args("set_world", world_size, world_rank)
    _world = (int(world_size), int(world_rank))
    _check_world(_auto, *_world)


def validate_against_world(world_size: int, world_rank: int) -> None:
    """Raise :class:`WorldMismatchError` if the context disagrees with the given MPI world
    (only values set explicitly are checked; unset ones follow the world).

    >>> set_auto_parallel_context(device_num=4)
    >>> validate_against_world(4, 2)
    >>> validate_against_world(8, 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    simpar.context.WorldMismatchError: device_num is 4 on rank 2, but the MPI world has 8 ranks ...
    >>> reset_auto_parallel_context()
    """
    _check_world_args("validate_against_world", world_size, world_rank)
    _check_world(_auto, int(world_size), int(world_rank))


# ----------------------------------------------------------------------------------------------
# set_auto_parallel_context and friends.


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Set auto-parallel keys, as ``mindspore.set_auto_parallel_context`` does.

    The whole call is validated first; if any key is unknown or any value wrong, a
    :class:`ContextError` (a ``ValueError``) or :class:`ContextTypeError` (a ``TypeError``) is
    raised and nothing changes. ``strategy_ckpt_config`` may be partial: the keys given replace
    the current ones. See the module docstring for the keys and their defaults.

    >>> set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
    ...                           dataset_strategy=((8, 1), (8,)))
    >>> get_auto_parallel_context("full_batch")
    False
    >>> set_auto_parallel_context(gradients_mean=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    simpar.context.ContextTypeError: ...: gradients_mean must be a bool, but got 1 of type int.
    >>> reset_auto_parallel_context()
    """
    global _auto
    func = "set_auto_parallel_context"
    _auto = _staged_auto(func, kwargs)
    warn_not_honoured(func, _AUTO_SPECS, _auto, _not_honoured(_auto), _warned)


def _staged_auto(func: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The auto-parallel state ``kwargs`` would give, validated against the world."""
    for key in kwargs:
        if key in MINDSPORE_KEYS_NOT_IMPLEMENTED:
            raise NotImplementedError(f"{func}: {key} is MindSpore's, but simpar does not "
                                      f"implement it: {MINDSPORE_KEYS_NOT_IMPLEMENTED[key]}")
    staged = stage_call(func, _AUTO_KEYS, _auto, kwargs)
    staged["explicit"] = staged["explicit"] | {_VIEW_OF.get(key, key) for key in kwargs}
    if _world is not None:
        _check_world(staged, *_world)
    _check_ranks(func, staged)
    return staged


def auto_parallel_context() -> ParallelContext:
    """Return an immutable snapshot of the current auto-parallel context.

    >>> set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation")
    >>> ctx = auto_parallel_context()
    >>> ctx.parallel_mode, ctx.search_mode, ctx.device_num, ctx.device_num_is_set
    ('auto_parallel', 'sharding_propagation', 1, False)
    >>> reset_auto_parallel_context()
    """
    world_size, world_rank = _world if _world is not None else (1, 0)
    state = dict(_auto)
    state["device_num_is_set"] = state["device_num"] is not None
    state["global_rank_is_set"] = state["global_rank"] is not None
    if state["device_num"] is None:
        state["device_num"] = world_size
    if state["global_rank"] is None:
        state["global_rank"] = world_rank
    return ParallelContext(**state)


def get_auto_parallel_context(key: str) -> Any:
    """Return the current value of one auto-parallel key (unset ones resolved).

    ``strategy_ckpt_config`` comes back as a fresh dict; ``full_batch``,
    ``strategy_ckpt_load_file``, ``strategy_ckpt_save_file`` and ``auto_parallel_search_mode``
    are read through to the state they view.

    >>> get_auto_parallel_context("strategy_ckpt_config")
    {'load_file': '', 'save_file': '', 'only_trainable_params': True}
    >>> get_auto_parallel_context("search_mode")
    'recursive_programming'
    """
    check_key("get_auto_parallel_context", key, _AUTO_KEYS)
    ctx = auto_parallel_context()
    if key == "strategy_ckpt_config":
        return ctx.strategy_ckpt_config.as_dict()
    if key in ("parallel_optimizer_config", "pipeline_config", "comm_fusion"):
        return getattr(ctx, key).as_dict()
    if key == "all_reduce_fusion_config":   # a view of comm_fusion's "index" mode
        return ctx.comm_fusion.indices
    if key.startswith("strategy_ckpt_"):
        return getattr(ctx.strategy_ckpt_config, key.removeprefix("strategy_ckpt_"))
    return getattr(ctx, "search_mode" if key == "auto_parallel_search_mode" else key)


def reset_auto_parallel_context() -> None:
    """Restore every auto-parallel key to its default. The MPI world stays known.

    >>> set_auto_parallel_context(enable_alltoall=True)
    >>> reset_auto_parallel_context()
    >>> get_auto_parallel_context("enable_alltoall")
    False
    """
    global _auto
    _auto = dict(_AUTO_DEFAULTS)


@contextmanager
def scoped_auto_parallel_context(**kwargs: Any) -> Iterator[ParallelContext]:
    """Set auto-parallel keys for the ``with`` block only, then restore the context exactly.

    The keys are validated as :func:`set_auto_parallel_context` validates them, and laid over
    the current state. On leaving the block, even when it raises, the state from before is
    put back whole: keys the block changed itself are undone too, and an unset ``device_num``
    is unset again. ``simpar.nn.AutoParallel`` applies its settings to the compilation of its
    own network this way, so that they never leak to other networks. Yields the snapshot in
    force inside the block.

    >>> with scoped_auto_parallel_context(parallel_mode="semi_auto_parallel",
    ...                                   gradients_mean=True) as ctx:
    ...     ctx.parallel_mode, get_auto_parallel_context("gradients_mean")
    ('semi_auto_parallel', True)
    >>> get_auto_parallel_context("parallel_mode"), get_auto_parallel_context("gradients_mean")
    ('stand_alone', False)
    """
    global _auto
    func = "scoped_auto_parallel_context"
    staged = _staged_auto(func, kwargs)
    saved, _auto = _auto, staged
    try:
        warn_not_honoured(func, _AUTO_SPECS, staged, _not_honoured(staged), _warned)
        yield auto_parallel_context()
    finally:
        _auto = saved


def register_search_mode(name: str, honoured: bool = False) -> None:
    """Allow ``name`` as a ``search_mode`` beside the built-in ones
    (:data:`BUILTIN_SEARCH_MODES`). ``simpar.search.register_search`` calls it with
    ``honoured`` True for a planner registered at run time: setting it then does not warn
    that it is not honoured. Registering a name twice is harmless.

    >>> register_search_mode("my_search")
    >>> "my_search" in search_modes()
    True
    """
    if not isinstance(name, str):
        raise type_error("register_search_mode", "name", "a str", name)
    if not name or not name.replace("_", "").isalnum():
        raise ContextError(f"register_search_mode: name must be a non-empty identifier such as "
                           f"'exact_search', but got {name!r}.")
    if name not in _SEARCH_MODES:
        _SEARCH_MODES.append(name)
    if honoured:
        _HONOURED_SEARCHES.add(name)


def search_modes() -> tuple[str, ...]:
    """The ``search_mode`` values currently allowed: MindSpore's three, simpar's ``exact``,
    then those :func:`register_search_mode` added.

    >>> search_modes()[:4]
    ('recursive_programming', 'dynamic_programming', 'sharding_propagation', 'exact')
    """
    return tuple(_SEARCH_MODES)


# ----------------------------------------------------------------------------------------------
# set_algo_parameters and friends.


def set_algo_parameters(**kwargs: Any) -> None:
    """Set strategy-search parameters, as ``mindspore.set_algo_parameters`` does.

    Validated as a whole first, like :func:`set_auto_parallel_context`.

    >>> set_algo_parameters(enable_algo_approxi=True, algo_approxi_epsilon=0.2)
    >>> get_algo_parameters("algo_approxi_epsilon")
    0.2
    >>> set_algo_parameters(algo_approxi_epsilon=0.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    simpar.context.ContextError: ...: algo_approxi_epsilon must be a float in (0, 1], but got 0.0.
    >>> reset_algo_parameters()
    """
    global _algo
    _algo = stage_call("set_algo_parameters", _ALGO_SPECS, _algo, kwargs)
    warn_not_honoured("set_algo_parameters", _ALGO_SPECS, _algo, _NOT_HONOURED, _warned)


def algo_parameters() -> AlgoParameters:
    """Return an immutable snapshot of the strategy-search parameters.

    >>> algo_parameters().fully_use_devices
    False
    """
    return AlgoParameters(**_algo)


def get_algo_parameters(key: str) -> Any:
    """Return the current value of one strategy-search parameter.

    >>> get_algo_parameters("tensor_slice_align_size")
    16
    """
    return _algo[check_key("get_algo_parameters", key, _ALGO_SPECS)]


def reset_algo_parameters() -> None:
    """Restore every strategy-search parameter to MindSpore's default.

    >>> set_algo_parameters(fully_use_devices=True)
    >>> reset_algo_parameters()
    >>> get_algo_parameters("fully_use_devices")
    False
    """
    global _algo
    _algo = spec_defaults(_ALGO_SPECS)
