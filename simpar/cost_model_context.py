"""MindSpore's cost-model context (``set_cost_model_context``) and the search's cost model.

Process-global, as in MindSpore, and validated by the key-spec engine of
:mod:`simpar.context`: a call that raises changes nothing. The entry points that plan read
it once into their plan request (``simpar.search.request``); the pricing functions of
:mod:`simpar.cost.mindspore` take a :class:`CostModelContext` value.

Which model a search minimises, and under which memory cap:

* the model :func:`set_search_cost_model` named, if any;
* else, when a key of MindSpore's objective (``costmodel_alpha``/``beta``/``gamma``,
  ``costmodel_communi_*``, ``run_phase``) differs from its default, MindSpore's model with
  these settings: what a MindSpore user who tunes them expects;
* else simpar's model on the ``cpu-local`` profile.

``device_memory_capacity``, when set away from its default, is the memory cap under either
model; otherwise the model's own (the profile's memory for simpar's model).

Keys, defaults and ranges (``mindspore/parallel/_cost_model_context.py``; defaults in
``ccsrc/costmodel_context.{h,cc}`` and ``allreduce_fusion/allreduce_fusion.h``; ranges in
``CostModelContext::set_*`` and ``CostGraph::SetDeviceMemoryAndCostParameter``):

========================================================= =========== =========================
key                                                       default     allowed
========================================================= =========== =========================
device_memory_capacity                                    2**34 (16G) a float in (0, inf)
costmodel_alpha                                           1.0         a float in (0, inf)
costmodel_beta                                            400.0       a float in (0, inf)
costmodel_gamma                                           0.001       a float in [0, 1]
costmodel_communi_threshold                               2048.0      a float in [0, inf)
costmodel_communi_const                                   3072.0      a float in [0, inf)
costmodel_communi_bias                                    1024.0      a float in [0, inf)
run_phase                                                 0           an int in {0, 1}
costmodel_allreduce_fusion_algorithm                      0           an int in {0, 1, 2}
costmodel_allreduce_fusion_times                          0           an int in [0, inf)
costmodel_allreduce_fusion_tail_percent                   0.1         a float in [0, 1)
costmodel_allreduce_fusion_tail_time                      0.1         a float in [0, inf)
costmodel_allreduce_fusion_allreduce_inherent_time        0.1         a float in [0, inf)
costmodel_allreduce_fusion_allreduce_bandwidth            0.1         a float in [0, inf)
costmodel_allreduce_fusion_computation_time_parameter     0.1         a float in [0, inf)
========================================================= =========== =========================

``costmodel_beta`` is MindSpore's Ascend default; MindSpore switches it to 50.0 when the device
target is GPU (``set_costmodel_context_for_device``), and so does
:func:`set_costmodel_context_for_device` here (``simpar.mindspore.set_context(device_target=
"GPU")`` calls it): the default moves, so the objective does not count as changed by the user,
and a beta the user set stays. An int is taken where a float goes (``costmodel_beta=50``); a
bool is never a number. The allreduce-fusion keys are accepted and
validated but simpar does not fuse AllReduces (a :class:`~simpar.context.NotHonouredWarning`
says so once); MindSpore checks none of their ranges when they are set and silently skips
fusion for values outside them, so the ranges above are simpar's. ``multi_subgraphs`` is not a
key: MindSpore types it in ``set_cost_model_context`` but its setter map does not hold it, so
MindSpore refuses it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from simpar._keyspec import (
    Bounds,
    ContextTypeError,
    KeySpec,
    check_key,
    spec_defaults,
    stage_call,
    validate_value,
    warn_not_honoured,
)

__all__ = ["CostModelContext", "cost_model_context", "get_cost_model_context",
           "get_search_cost_model", "reset_cost_model_context", "set_cost_model_context",
           "set_costmodel_context_for_device", "set_search_cost_model"]

_TRAINING, _INFERENCE = 0, 1
_FUSION = "simpar does not fuse gradient AllReduces"


def _positive() -> Bounds:
    return Bounds(0.0, math.inf, lo_open=True, hi_open=True)


def _non_negative() -> Bounds:
    return Bounds(0.0, math.inf, hi_open=True)


def _float(default: float, bounds: Bounds) -> KeySpec:
    return KeySpec(float, default, bounds=bounds)


def _ints(default: int, choices: tuple[int, ...]) -> KeySpec:
    return KeySpec(int, default, choices=lambda: choices,
                   allowed=f"an int in {{{', '.join(map(str, choices))}}}")


_SPECS: dict[str, KeySpec] = {
    "device_memory_capacity": _float(1024.0 * 1024.0 * 1024.0 * 16.0, _positive()),
    "costmodel_alpha": _float(1.0, _positive()),
    "costmodel_beta": _float(400.0, _positive()),
    "costmodel_gamma": _float(0.001, Bounds(0.0, 1.0)),
    "costmodel_communi_threshold": _float(2048.0, _non_negative()),
    "costmodel_communi_const": _float(3072.0, _non_negative()),
    "costmodel_communi_bias": _float(1024.0, _non_negative()),
    "run_phase": _ints(0, (_TRAINING, _INFERENCE)),
    "costmodel_allreduce_fusion_algorithm": _ints(0, (0, 1, 2)),
    "costmodel_allreduce_fusion_times": KeySpec(int, 0, bounds=_non_negative()),
    "costmodel_allreduce_fusion_tail_percent": _float(0.1, Bounds(0.0, 1.0, hi_open=True)),
    "costmodel_allreduce_fusion_tail_time": _float(0.1, _non_negative()),
    "costmodel_allreduce_fusion_allreduce_inherent_time": _float(0.1, _non_negative()),
    "costmodel_allreduce_fusion_allreduce_bandwidth": _float(0.1, _non_negative()),
    "costmodel_allreduce_fusion_computation_time_parameter": _float(0.1, _non_negative()),
}
#: Keys simpar validates but does not act on (each warns once per process when set).
_NOT_HONOURED = {key: _FUSION for key in _SPECS if "allreduce_fusion" in key}
#: Keys of MindSpore's objective: setting one makes the search minimise MindSpore's model.
_OBJECTIVE = ("costmodel_alpha", "costmodel_beta", "costmodel_gamma",
              "costmodel_communi_threshold", "costmodel_communi_const",
              "costmodel_communi_bias", "run_phase")


#: costmodel_beta's default per device target (MindSpore's Ascend and GPU values).
_BETA_FOR_DEVICE = {"Ascend": 400.0, "GPU": 50.0, "CPU": 400.0}
_device_target = "Ascend"
_beta_set = False   # whether the user set costmodel_beta (the device target then leaves it)


def _default(key: str) -> Any:
    if key == "costmodel_beta":
        return _BETA_FOR_DEVICE[_device_target]
    return _SPECS[key].default


@dataclass(frozen=True, slots=True)
class CostModelContext:
    """An immutable snapshot of the cost-model context; built values are validated.

    :func:`cost_model_context` returns the current one. Build your own to price with other
    weights without touching the process-wide context:

    >>> CostModelContext().costmodel_beta
    400.0
    >>> CostModelContext(costmodel_gamma=2.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    simpar.context.ContextError: ...: costmodel_gamma must be a float in [0, 1], but got 2.0.
    """

    device_memory_capacity: float = _default("device_memory_capacity")
    costmodel_alpha: float = _default("costmodel_alpha")
    costmodel_beta: float = _default("costmodel_beta")
    costmodel_gamma: float = _default("costmodel_gamma")
    costmodel_communi_threshold: float = _default("costmodel_communi_threshold")
    costmodel_communi_const: float = _default("costmodel_communi_const")
    costmodel_communi_bias: float = _default("costmodel_communi_bias")
    run_phase: int = _default("run_phase")
    costmodel_allreduce_fusion_algorithm: int = _default("costmodel_allreduce_fusion_algorithm")
    costmodel_allreduce_fusion_times: int = _default("costmodel_allreduce_fusion_times")
    costmodel_allreduce_fusion_tail_percent: float = _default(
        "costmodel_allreduce_fusion_tail_percent")
    costmodel_allreduce_fusion_tail_time: float = _default(
        "costmodel_allreduce_fusion_tail_time")
    costmodel_allreduce_fusion_allreduce_inherent_time: float = _default(
        "costmodel_allreduce_fusion_allreduce_inherent_time")
    costmodel_allreduce_fusion_allreduce_bandwidth: float = _default(
        "costmodel_allreduce_fusion_allreduce_bandwidth")
    costmodel_allreduce_fusion_computation_time_parameter: float = _default(
        "costmodel_allreduce_fusion_computation_time_parameter")

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, validate_value(
                "CostModelContext", f.name, _SPECS[f.name], getattr(self, f.name)))

    @property
    def training(self) -> bool:
        """Whether ``run_phase`` is 0 (training), MindSpore's default."""
        return self.run_phase == _TRAINING

    @property
    def objective_changed(self) -> bool:
        """Whether a key of MindSpore's objective differs from its default (the search then
        minimises MindSpore's model unless :func:`set_search_cost_model` named another).

        >>> CostModelContext(costmodel_beta=50.0).objective_changed
        True
        """
        return any(getattr(self, key) != _default(key) for key in _OBJECTIVE)

    @property
    def memory_capacity_changed(self) -> bool:
        """Whether ``device_memory_capacity`` differs from its default (it is then the
        search's memory cap under any model).

        >>> CostModelContext(device_memory_capacity=2.0 ** 30).memory_capacity_changed
        True
        """
        return self.device_memory_capacity != _default("device_memory_capacity")


_state: dict[str, Any] = spec_defaults(_SPECS)
_warned: set[str] = set()
_snapshot: CostModelContext | None = None  # the current context, built once per change
_search_model: Any = None  # what set_search_cost_model named (a simpar.cost.CostModel)


def set_cost_model_context(**kwargs: Any) -> None:
    """Set cost-model keys, as ``mindspore.set_cost_model_context`` does (keys in the module
    docstring). The whole call is validated first: if one key is unknown or one value wrong,
    a :class:`~simpar.context.ContextError` (``ValueError``) or
    :class:`~simpar.context.ContextTypeError` (``TypeError``) is raised and nothing changes.
    Setting an allreduce-fusion key away from its default warns once per key per process.

    >>> set_cost_model_context(costmodel_beta=50.0, run_phase=1)
    >>> get_cost_model_context("costmodel_beta"), get_cost_model_context("run_phase")
    (50.0, 1)
    >>> set_cost_model_context(costmodel_bet=50.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    simpar.context.ContextError: ...: unknown key 'costmodel_bet' (did you mean 'costmodel_beta'...
    >>> set_cost_model_context(costmodel_beta=50)   # an int where a float goes: as a float
    >>> get_cost_model_context("costmodel_beta")
    50.0
    >>> set_cost_model_context(costmodel_alpha="1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    simpar.context.ContextTypeError: ...costmodel_alpha must be a float in (0, inf), but got '1'...
    >>> reset_cost_model_context()
    """
    global _state, _snapshot, _beta_set
    func = "set_cost_model_context"
    _state, _snapshot = stage_call(func, _SPECS, _state, kwargs), None
    _beta_set = _beta_set or "costmodel_beta" in kwargs
    warn_not_honoured(func, _SPECS, _state, _NOT_HONOURED, _warned)


def set_costmodel_context_for_device(device_target: str) -> None:
    """Use ``device_target``'s defaults (MindSpore's: ``costmodel_beta`` 50.0 on GPU, 400.0
    on Ascend and CPU). A beta the user set stays; otherwise it takes the new default.

    >>> set_costmodel_context_for_device("GPU")
    >>> get_cost_model_context("costmodel_beta"), cost_model_context().objective_changed
    (50.0, False)
    >>> reset_cost_model_context()
    """
    global _device_target, _state, _snapshot
    if device_target not in _BETA_FOR_DEVICE:
        raise ValueError(f"set_costmodel_context_for_device: device_target must be one of "
                         f"{sorted(_BETA_FOR_DEVICE)}, got {device_target!r}")
    _device_target = device_target
    if not _beta_set:
        _state, _snapshot = {**_state, "costmodel_beta": _default("costmodel_beta")}, None


def get_cost_model_context(attr_key: str) -> Any:
    """The current value of one key, as ``mindspore.get_cost_model_context`` returns it.

    >>> get_cost_model_context("device_memory_capacity") == 2.0 ** 34
    True
    >>> get_cost_model_context("costmodel_communi_threshold")
    2048.0
    """
    return _state[check_key("get_cost_model_context", attr_key, _SPECS)]


def reset_cost_model_context() -> None:
    """Restore every key to MindSpore's default, and the searches' cost model to the default
    choice (:func:`set_search_cost_model` ``(None)``).

    >>> set_cost_model_context(costmodel_gamma=0.5)
    >>> reset_cost_model_context()
    >>> get_cost_model_context("costmodel_gamma")
    0.001
    """
    global _state, _snapshot, _search_model, _device_target, _beta_set
    _state, _snapshot, _search_model = spec_defaults(_SPECS), None, None
    _device_target, _beta_set = "Ascend", False


def cost_model_context() -> CostModelContext:
    """An immutable snapshot of the current context.

    >>> cost_model_context().costmodel_communi_const
    3072.0
    """
    global _snapshot
    if _snapshot is None:  # searches price thousands of strategies: validate once per change
        _snapshot = CostModelContext(**_state)
    return _snapshot


#: What a search needs of a cost model: the members of ``simpar.cost.CostModel``.
_COST_MODEL_MEMBERS = ("name", "unit", "op", "edge", "program", "memory", "keeps_output",
                       "memory_capacity")


def set_search_cost_model(model: Any) -> None:
    """Name the cost model the searches minimise, a ``simpar.cost.CostModel`` (None: the
    choice the module docstring describes). Read when a plan request is built.

    >>> set_search_cost_model(None)
    >>> get_search_cost_model() is None
    True
    """
    global _search_model
    if model is not None and not all(hasattr(model, m) for m in _COST_MODEL_MEMBERS):
        raise ContextTypeError(f"set_search_cost_model: expected a simpar.cost.CostModel (op, "
                               f"edge, program), got {type(model).__name__}")
    _search_model = model


def get_search_cost_model() -> Any:
    """The cost model :func:`set_search_cost_model` named, or None.

    >>> get_search_cost_model() is None
    True
    """
    return _search_model
