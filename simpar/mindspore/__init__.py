"""MindSpore's import paths for what simpar implements: ``import simpar.mindspore as ms`` in
place of ``import mindspore as ms``, and ``from simpar.mindspore import nn, ops`` in place of
``from mindspore import nn, ops``.

* ``ms.set_auto_parallel_context``, ``ms.set_algo_parameters``, ``ms.set_context``,
  ``ms.set_seed``, ``ms.ParallelMode``, ``ms.Tensor``, ``ms.Parameter``, ``ms.float32``, ...;
* ``ms.shard(cell, in_strategy, ...)``, ``ms.nn``, ``ms.ops``, ``ms.communication``,
  ``ms.parallel`` (``.auto_parallel.AutoParallel``), ``ms.dataset``, ``ms.train`` (``Model``
  and the callbacks; ``ms.Model`` too).

A name MindSpore documents in these modules that simpar does not implement raises
``NotImplementedError`` naming it and what to use instead. docs/mindspore.md lists every
auto-parallel API and context key: supported, supported with a difference, or not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from simpar.context import (
    NotHonouredWarning,
    ParallelMode,
    get_algo_parameters,
    get_auto_parallel_context,
    reset_algo_parameters,
    reset_auto_parallel_context,
    set_algo_parameters,
    set_auto_parallel_context,
)
from simpar.cost_model_context import (
    get_cost_model_context,
    reset_cost_model_context,
    set_cost_model_context,
    set_costmodel_context_for_device,
)
from simpar.mindspore import communication, dataset, nn, ops, parallel, train
from simpar.mindspore._missing import missing
from simpar.mindspore.tensor import (
    Tensor,
    bool_,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
)
from simpar.mindspore.train import Model
from simpar.nn import Cell, Parameter
from simpar.seed import get_seed as _get_seed
from simpar.seed import set_seed as _set_seed

__all__ = ["GRAPH_MODE", "PYNATIVE_MODE", "Model", "ParallelMode", "Parameter", "Tensor",
           "bool_", "communication", "dataset", "float16", "float32", "float64",
           "get_algo_parameters", "get_auto_parallel_context", "get_context",
           "get_cost_model_context", "get_seed", "reset_cost_model_context",
           "set_cost_model_context",
           "int8", "int16", "int32", "int64", "nn", "ops", "parallel",
           "reset_algo_parameters", "reset_auto_parallel_context", "set_algo_parameters",
           "set_auto_parallel_context", "set_context", "set_seed", "shard", "train", "uint8"]

GRAPH_MODE, PYNATIVE_MODE = 0, 1
_DEVICE_TARGETS = ("Ascend", "GPU", "CPU")
#: set_context keys simpar accepts without acting on them (each warns once).
_IGNORED = ("save_graphs", "save_graphs_path", "max_device_memory", "max_call_depth",
            "jit_config", "deterministic", "memory_optimize_level", "enable_graph_kernel",
            "pynative_synchronize", "enable_compile_cache", "compile_cache_path",
            "runtime_num_threads")
_context: dict[str, Any] = {"mode": GRAPH_MODE, "device_target": "Ascend", "device_id": 0}
_warned: set[str] = set()


def set_context(**kwargs: Any) -> None:
    """MindSpore's ``set_context``: ``mode`` (GRAPH_MODE or PYNATIVE_MODE: simpar traces the
    network either way), ``device_target`` ("Ascend", "GPU" or "CPU": the cost model's
    defaults follow it, as MindSpore's do: ``costmodel_beta`` 50 on GPU, 400 otherwise) and
    ``device_id`` (each MPI rank is one device: recorded only). The whole call is checked
    first; a key of :data:`_IGNORED` is accepted with a warning that it is not honoured."""
    for key, value in kwargs.items():
        if key == "mode" and value not in (GRAPH_MODE, PYNATIVE_MODE):
            raise ValueError(f"set_context: mode must be GRAPH_MODE (0) or PYNATIVE_MODE (1), "
                             f"got {value!r}")
        if key == "device_target" and value not in _DEVICE_TARGETS:
            raise ValueError(f"set_context: device_target must be one of "
                             f"{list(_DEVICE_TARGETS)}, got {value!r}")
        if key == "device_id" and (isinstance(value, bool) or not isinstance(value, int)
                                   or not 0 <= value < 4096):
            raise ValueError(f"set_context: device_id must be an int in [0, 4096), got "
                             f"{value!r}")
        if key not in _context and key not in _IGNORED:
            raise ValueError(f"set_context: unknown key {key!r}; simpar takes mode, "
                             f"device_target and device_id (and accepts {', '.join(_IGNORED)} "
                             "without acting on them)")
    for key, value in kwargs.items():
        if key in _IGNORED:
            if key not in _warned:
                _warned.add(key)
                warnings.warn(f"set_context: {key} is not honoured by simpar",
                              NotHonouredWarning, stacklevel=2)
            continue
        _context[key] = value
        if key == "device_target":
            set_costmodel_context_for_device(value)


def get_context(attr_key: str) -> Any:
    """The value ``set_context`` recorded for ``attr_key`` (mode, device_target, device_id)."""
    if attr_key not in _context:
        raise ValueError(f"get_context: unknown key {attr_key!r}; simpar keeps "
                         f"{sorted(_context)}")
    return _context[attr_key]


def set_seed(seed: int) -> None:
    """The global seed (parameters' initial values, dropout masks) and the dataset seed, as
    MindSpore's ``set_seed`` sets both (an int in [0, 2**32), checked before either)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
        raise ValueError(f"set_seed: seed must be an int in [0, 2**32), got {seed!r}")
    _set_seed(seed)
    dataset.config.set_seed(seed)


def get_seed() -> int:
    return _get_seed()


class _Sharded(Cell):
    """A function as a Cell, so that ``shard`` can set its inputs' strategy: calling it runs
    the function on the inputs redistributed to ``in_strategy``."""

    fn: Callable[..., Any]

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        object.__setattr__(self, "fn", fn)

    def construct(self, *args: Any) -> Any:
        return self.fn(*args)


def shard(fn: Cell | Callable[..., Any], in_strategy: Sequence[Any],
          out_strategy: Sequence[Any] | None = None,
          parameter_plan: dict[str, Sequence[int]] | None = None, device: str = "Ascend",
          level: int = 0) -> Cell:
    """MindSpore's functional ``shard``: ``fn.shard(in_strategy, out_strategy,
    parameter_plan)`` for a Cell, returned; a function is wrapped in a Cell first (call the
    result as the function, inside a ``construct``; ``parameter_plan`` needs a Cell, as in
    MindSpore). ``device`` and ``level`` are MindSpore's only values ("Ascend", 0)."""
    if device != "Ascend":
        raise ValueError(f"shard: device must be 'Ascend' (MindSpore's only value), got "
                         f"{device!r}")
    if level != 0:
        raise ValueError(f"shard: level must be 0 (MindSpore's only value), got {level!r}")
    if isinstance(fn, Cell):
        return fn.shard(in_strategy, out_strategy, parameter_plan)
    if not callable(fn):
        raise TypeError(f"shard: fn must be a Cell or a function, got {type(fn).__name__}")
    if parameter_plan is not None:
        raise TypeError(f"shard: parameter_plan needs fn to be a Cell (it names the Cell's "
                        f"parameters), got the function {getattr(fn, '__name__', fn)!r}")
    return _Sharded(fn).shard(in_strategy, out_strategy)


__getattr__ = missing("mindspore", {
    "jit": "nothing: simpar traces the network once per shape (decorate nothing)",
    "value_and_grad": "nn.TrainOneStepCell(...).value_and_grad(data, label), or train.Model",
    "grad": "nn.TrainOneStepCell(...).value_and_grad(data, label)",
    "load_checkpoint": "simpar.checkpoint.load_training",
    "save_checkpoint": "train.ModelCheckpoint, or simpar.checkpoint.save_training",
    "load_param_into_net": "simpar.checkpoint.load_training",
    "export": "nothing: simpar does not export graphs",
    "context": "set_context / set_auto_parallel_context here",
    "Layout": "tuple strategies (MindSpore's higher-order layouts are not implemented)",
    "lazy_inline": "nothing: decorate nothing",
    "mint": "ops (the primitives)",
})
