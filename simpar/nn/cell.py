"""Cells and Parameters, shaped like MindSpore's ``nn.Cell`` and ``Parameter``.

A Cell registers the Parameters and sub-Cells assigned to its attributes; parameter names are
their dotted paths (``"blocks.0.attn.q.weight"``). ``construct`` describes the computation; it
runs eagerly on numpy arrays (single device) or, under :func:`simpar.graph.trace`, records
the global graph that the runtime lowers to a per-rank program.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from simpar import graph, ops
from simpar.context import NotHonouredWarning
from simpar.parameter import Parameter, initializer

__all__ = ["Cell", "Parameter", "Wrapper", "initializer"]


class Cell:
    """Base class of layers and models (MindSpore's ``nn.Cell``).

    Subclasses set Parameters and Cells as attributes in ``__init__`` and implement
    ``construct``. ``cell.shard(in_strategy, parameter_plan=...)`` sets cell-level strategies:
    the layouts the cell's inputs are redistributed to, and layouts for its parameters.
    """

    _params: dict[str, Parameter]
    _cells: dict[str, Cell]
    #: Set by :meth:`recompute`: (mp_comm_recompute, parallel_optimizer_comm_recompute).
    recompute_settings: tuple[bool, bool] | None = None
    in_strategy: tuple[tuple[int, ...] | None, ...] | None
    parameter_plan: dict[str, tuple[int, ...]]
    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_params", {})
        object.__setattr__(self, "_cells", {})
        object.__setattr__(self, "in_strategy", None)
        object.__setattr__(self, "parameter_plan", {})
        object.__setattr__(self, "training", False)   # MindSpore's: set_train() switches it

    def __setattr__(self, key: str, value: Any) -> None:
        if "_params" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}: call super().__init__() before "
                               "assigning attributes")
        if isinstance(value, Parameter):
            self._params[key] = value
        elif isinstance(value, Cell):
            self._cells[key] = value
            object.__setattr__(value, "_scope_name", key)
        object.__setattr__(self, key, value)

    # -- structure
    def cells_and_names(self, prefix: str = "") -> Iterator[tuple[str, Cell]]:
        yield prefix, self
        for name, cell in self._cells.items():
            yield from cell.cells_and_names(f"{prefix}.{name}" if prefix else name)

    def parameters_and_names(self) -> Iterator[tuple[str, Parameter]]:
        """Every Parameter with its dotted name, each once."""
        seen: set[int] = set()
        for path, cell in self.cells_and_names():
            for name, p in cell._params.items():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                yield (f"{path}.{name}" if path else name), p

    def name_parameters(self) -> None:
        """Give every Parameter its dotted path as name (done once, before tracing)."""
        for full, p in self.parameters_and_names():
            if not p.name:
                p.name = full

    def trainable_params(self) -> list[Parameter]:
        """Parameters with ``requires_grad``, named by their dotted paths."""
        self.name_parameters()
        return [p for _, p in self.parameters_and_names() if p.requires_grad]

    def get_parameters(self) -> list[Parameter]:
        self.name_parameters()
        return [p for _, p in self.parameters_and_names()]

    def set_train(self, mode: bool = True) -> Cell:
        """Put this Cell and every Cell inside it in training mode (``mode=True``: Dropout
        drops, BatchNorm normalises by the batch's statistics and updates its moving ones) or
        in evaluation mode. A Cell starts in evaluation mode, as MindSpore's do;
        :class:`~simpar.nn.TrainOneStepCell` puts its network in training mode."""
        if not isinstance(mode, bool):
            raise TypeError(f"{type(self).__name__}.set_train: mode must be a bool, got "
                            f"{mode!r}")
        for _, cell in self.cells_and_names():
            object.__setattr__(cell, "training", mode)
        return self

    # -- MindSpore's cell-level sharding
    def shard(self, in_strategy: Sequence[Sequence[int] | None] | None,
              out_strategy: Sequence[Sequence[int]] | None = None,
              parameter_plan: dict[str, Sequence[int]] | None = None) -> Cell:
        """Cell-level strategy: one tuple of cuts per input of ``construct`` (None to leave
        that input as it arrives) and ``parameter_plan`` {parameter name relative to this
        cell: cuts}, checked as MindSpore's ``shard`` checks them, with its messages (tuples,
        not lists). ``out_strategy`` is accepted and ignored with a warning, as MindSpore
        ignores it."""
        name = f"{type(self).__name__}.shard"
        if in_strategy is not None:
            if not isinstance(in_strategy, tuple):
                raise TypeError(f"For 'Shard', the 'in_strategy' should be a tuple, but got "
                                f"{type(in_strategy).__name__} ({name}: {in_strategy!r})")
            for cuts in in_strategy:
                if cuts is None:
                    continue
                if not isinstance(cuts, tuple):
                    raise TypeError(f"The 'in_strategy' should be a tuple(tuple(int)), but got "
                                    f"{type(cuts).__name__} ({name}: {cuts!r} in "
                                    f"{in_strategy!r})")
                if not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool)
                           and c >= 1 for c in cuts):
                    raise TypeError(f"The tuple strategy for each dimension should be "
                                    f"tuple(int) ({name}: {cuts!r} in {in_strategy!r}; each "
                                    "cut an int >= 1)")
        if out_strategy is not None:
            if not isinstance(out_strategy, tuple):
                raise TypeError(f"For 'Shard', the 'out_strategy' should be None or tuple, but "
                                f"got {type(out_strategy).__name__} ({name})")
            warnings.warn(f"{name}: out_strategy is not in use, and is ignored (as MindSpore "
                          "ignores it); shard the op that produces the output instead",
                          NotHonouredWarning, stacklevel=2)
        if parameter_plan is not None and not isinstance(parameter_plan, dict):
            raise TypeError(f"For 'Shard', the 'parameter_plan' should be a dict or None, but "
                            f"got {type(parameter_plan).__name__} ({name})")
        plan = {}
        for key, cuts in (parameter_plan or {}).items():
            if not isinstance(key, str) or not isinstance(cuts, tuple) or not all(
                    isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in cuts):
                raise TypeError(f"For 'Shard', the type of each key and value in "
                                f"'parameter_plan' must be str and tuple, but got "
                                f"{type(key).__name__} and {type(cuts).__name__} ({name}: "
                                f"{key!r}: {cuts!r}; a tuple of int cuts, one per dimension)")
            plan[key] = tuple(int(c) for c in cuts)
        object.__setattr__(self, "in_strategy", None if in_strategy is None else tuple(
            None if c is None else tuple(int(x) for x in c) for c in in_strategy))
        object.__setattr__(self, "parameter_plan", plan)
        return self

    # -- recomputation
    def recompute(self, **kwargs: Any) -> Cell:
        """Recompute this Cell in the backward (MindSpore's ``Cell.recompute``): its forward
        keeps only its inputs, and the backward runs its forward again, collectives
        included, before its VJPs; the gradients are bitwise those without.

        ``mp_comm_recompute`` (default True): the collectives of its ops' redistributions
        run again; False keeps their results from the forward. ``parallel_optimizer_comm_
        recompute`` (default False): weights optimizer parallel slices are gathered again;
        False keeps the gathered copy (level3 gathers again anyway). As in MindSpore, a Cell
        inside a recomputed Cell is recomputed with it, and a second call changes nothing.

        >>> from simpar import nn
        >>> block = nn.Dense(4, 4).recompute()
        >>> block.recompute_settings
        (True, False)
        """
        known = ("mp_comm_recompute", "parallel_optimizer_comm_recompute")
        for key, value in kwargs.items():
            if key not in known:
                raise ValueError(f"For 'recompute', keyword {key!r} is not recognized! The "
                                 f"key kwargs must be {' or '.join(map(repr, known))}.")
            if not isinstance(value, bool):
                raise TypeError(f"For 'recompute', the argument {key!r} must be bool, but got "
                                f"{value!r} of type {type(value).__name__}.")
        if self.recompute_settings is None:
            object.__setattr__(self, "recompute_settings", (
                kwargs.get("mp_comm_recompute", True),
                kwargs.get("parallel_optimizer_comm_recompute", False)))
        return self

    # -- running
    def construct(self, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement construct")

    @property
    def pipeline_stage(self) -> int:
        """The pipeline stage this Cell's ops run on (MindSpore's ``Cell.pipeline_stage``;
        -1, the default: its enclosing Cell's, else its inputs' producers')."""
        return int(self.__dict__.get("_pipeline_stage", -1))

    @pipeline_stage.setter
    def pipeline_stage(self, value: int) -> None:
        object.__setattr__(self, "_pipeline_stage", _index("pipeline_stage", value))

    @property
    def pipeline_segment(self) -> int:
        """Which chunk of its stage this Cell's ops are in, with interleaved virtual stages
        (MindSpore's ``Cell.pipeline_segment``; -1, the default: its enclosing Cell's, else
        0). Chunk ``v`` of stage ``s`` is virtual stage ``v * pipeline_stages + s``."""
        return int(self.__dict__.get("_pipeline_segment", -1))

    @pipeline_segment.setter
    def pipeline_segment(self, value: int) -> None:
        object.__setattr__(self, "_pipeline_segment", _index("pipeline_segment", value))

    def __call__(self, *args: Any) -> Any:
        if not graph.tracing():
            return self.construct(*args)
        with graph.scope(f"{getattr(self, '_scope_name', 'network')}-{type(self).__name__}"), \
                graph.stage_scope(self.pipeline_stage, self.pipeline_segment):
            if self.in_strategy is not None:
                args = _reshard_inputs(self, args)
            if self.recompute_settings is None:
                return self.construct(*args)
            with graph.recompute_scope(self, *self.recompute_settings):
                return self.construct(*args)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Wrapper(Cell):
    """A Cell around one ``network`` that adds settings, not computation (``AutoParallel``,
    ``GradAccumulation``): transparent in names, as MindSpore's ``auto_prefix=False`` is.
    The network takes the wrapper's place in the scope names, so its ops are named as without
    the wrapper, and its parameters keep the names they have in ``network``."""

    network: Cell

    def __init__(self, network: Cell) -> None:
        super().__init__()
        self.network = network

    @property
    def _scope_name(self) -> str:
        return str(getattr(self.network, "_scope_name", "network"))

    @_scope_name.setter
    def _scope_name(self, name: str) -> None:
        object.__setattr__(self.network, "_scope_name", name)

    def cells_and_names(self, prefix: str = "") -> Iterator[tuple[str, Cell]]:
        yield prefix, self
        yield from self.network.cells_and_names(prefix)

    def construct(self, *args: Any) -> Any:
        return self.network(*args)

    def __call__(self, *args: Any) -> Any:
        return self.network(*args)   # no scope of its own


def _index(prop: str, value: object) -> int:
    """A Cell's ``pipeline_stage`` or ``pipeline_segment``, checked as MindSpore checks it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"For 'Cell', the property '{prop}' must be int type, but got type : "
                        f"{type(value)}")
    if value < 0:
        raise ValueError(f"For 'Cell', the property '{prop}' can not be less than 0, but got "
                         f"{value}")
    return value


def _reshard_inputs(cell: Any, args: Sequence[Any]) -> tuple[Any, ...]:
    """Insert an Identity with the cell's strategy on each annotated input: the lowering then
    redistributes the input to that layout."""
    strategies = cell.in_strategy
    if len(strategies) != len(args):
        raise ValueError(f"{type(cell).__name__}.shard: in_strategy has {len(strategies)} "
                         f"entries but construct got {len(args)} inputs: give one per input "
                         "(None leaves an input as it arrives)")
    out = list(args)
    for k, cuts in enumerate(strategies):
        if cuts is None:
            continue
        value = args[k]
        if not isinstance(value, graph.Value) or len(cuts) != value.ndim:
            raise ValueError(f"{type(cell).__name__}.shard: in_strategy {cuts} for input {k} "
                             f"must have one cut per dimension of {getattr(value, 'shape', '?')}")
        out[k] = ops.Identity().shard((cuts,))(value)
    return tuple(out)
