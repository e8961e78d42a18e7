"""Tracing: run a Cell's ``construct`` once on symbolic values and record a global graph.

While tracing, every primitive call records a :class:`Node` (a snapshot of the op, so that
attributes set at call time, like a Reshape's shape, are kept per call) and returns
:class:`Value` s that carry only global shapes and dtypes. Parameters, graph inputs and
constants become values too. No data flows and no MPI is touched: the graph is what the
planner lowers into a per-rank program.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpar import _checks as checks
from simpar import ops
from simpar.ops._base import Primitive, recording
from simpar.parameter import Parameter

__all__ = ["Graph", "Node", "ParameterUpdate", "RecomputeSegment", "Value", "current_scope",
           "record", "recompute_scope", "scope", "stage_scope", "trace", "tracing",
           "update_parameter"]


def _arithmetic(op: type[Primitive], reflected: bool = False) -> Callable[[Value, Any], Any]:
    """A :class:`Value` operator that records ``op`` on the value and the other operand
    (the other operand first when ``reflected``: ``2 * v`` is ``Mul()(2, v)``)."""
    if reflected:
        return lambda value, other: op()(other, value)
    return lambda value, other: op()(value, other)


@dataclass(eq=False)
class Value:
    """A tensor in a traced graph: global shape and dtype, and where it comes from."""

    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str                       # "input", "param", "const" or "op"
    name: str
    producer: Node | None = None
    index: int = 0                  # which output of the producer
    param: Parameter | None = None
    const: np.ndarray | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"%{self.id}:{self.name}{list(self.shape)}"

    # MindSpore tensors support arithmetic; so do traced values: each operator records its op.
    __add__ = _arithmetic(ops.Add)
    __radd__ = _arithmetic(ops.Add, reflected=True)
    __sub__ = _arithmetic(ops.Sub)
    __mul__ = _arithmetic(ops.Mul)
    __rmul__ = _arithmetic(ops.Mul, reflected=True)
    __truediv__ = _arithmetic(ops.RealDiv)


@dataclass(eq=False)
class Node:
    """One primitive call: ``outputs = op(*inputs)``; ``name`` is MindSpore-style, e.g.
    ``"Default/network-WithLossCell/_backbone-MLP/fc1-Dense/MatMul-op3"``."""

    id: int
    op: Primitive
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...] = ()
    name: str = ""
    #: The recomputed Cell it was recorded in (its index in ``Graph.segments``), or -1.
    segment: int = -1
    #: The pipeline stage of the innermost Cell with a ``pipeline_stage`` it was recorded
    #: in, or -1 (:func:`simpar.pipeline.stages_of` gives it its producers').
    stage: int = -1
    #: That Cell's ``pipeline_segment`` (its chunk of the stage, interleaved), or -1.
    chunk: int = -1

    def __repr__(self) -> str:
        ins = ", ".join(repr(v) for v in self.inputs)
        outs = ", ".join(repr(v) for v in self.outputs)
        return f"{outs} = {self.op!r}({ins})"


@dataclass(frozen=True)
class RecomputeSegment:
    """The ops one Cell marked with ``Cell.recompute()`` recorded (a run of nodes, in trace
    order): its scope name, the nodes, and MindSpore's two switches. ``mp_comm``: the
    collectives of its ops' redistributions run again in the backward (else their results
    are kept from the forward); ``opt_comm``: optimizer-parallel weights it reads are gathered
    again (else the gathered copy is kept)."""

    name: str
    nodes: tuple[int, ...]
    mp_comm: bool = True
    opt_comm: bool = False


@dataclass(frozen=True)
class ParameterUpdate:
    """A Parameter the forward writes (a BatchNorm's moving statistics): after every
    forward, ``param = (1 - weight) * param + weight * value``, on each rank's own shard,
    ``value`` being the id of a value the forward computes, laid out as the parameter is
    stored (lowering checks)."""

    param: str
    value: int
    weight: float


@dataclass
class Graph:
    """A traced global graph; ``segments`` are the Cells marked for recomputation, each
    with the nodes it recorded; ``grad_inputs`` the inputs that get gradients."""

    inputs: list[Value] = field(default_factory=list)
    params: list[Value] = field(default_factory=list)
    consts: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    segments: list[RecomputeSegment] = field(default_factory=list)
    #: Ids of the inputs whose cotangents the backward returns (a pipeline stage's inputs
    #: that an earlier stage computed).
    grad_inputs: tuple[int, ...] = ()
    #: The Parameters the forward writes, in trace order (:func:`update_parameter`).
    updates: list[ParameterUpdate] = field(default_factory=list)

    def consumers(self) -> dict[int, list[tuple[Node, int]]]:
        """For every value id, the (node, input position) pairs that read it."""
        out: dict[int, list[tuple[Node, int]]] = {}
        for n in self.nodes:
            for k, v in enumerate(n.inputs):
                out.setdefault(v.id, []).append((n, k))
        return out

    def __str__(self) -> str:
        lines = [f"graph({', '.join(repr(v) for v in self.inputs)}):"]
        lines += [f"  {n!r}" for n in self.nodes]
        lines.append(f"  return {', '.join(repr(v) for v in self.outputs)}")
        return "\n".join(lines)


class _Tracer:
    def __init__(self) -> None:
        self.graph = Graph()
        self.next_id = 0
        self.op_count = 0
        self.scopes: list[str] = ["Default"]
        self.params: dict[int, Value] = {}
        self.param_names: set[str] = set()
        self.segment = -1          # the recomputed Cell being traced (outermost), or -1
        self.stage = -1            # the pipeline stage of the innermost Cell that has one
        self.chunk = -1            # and its pipeline_segment
        self.traced_cells: set[int] = set()   # ids of marked Cells whose construct ran

    def new_value(self, shape: Sequence[int], dtype: Any, kind: str, name: str,
                  **kw: Any) -> Value:
        v = Value(self.next_id, tuple(int(s) for s in shape), np.dtype(dtype), kind, name, **kw)
        self.next_id += 1
        return v

    def as_value(self, x: Any) -> Value:
        if isinstance(x, Value):
            return x
        if isinstance(x, Parameter):
            v = self.params.get(id(x))
            if v is None:
                if x.name in self.param_names:
                    raise ValueError(f"trace: two Parameters are named {x.name!r} (shape "
                                     f"{x.shape}); parameters are keyed by unique names: name "
                                     "them with Parameter(..., name=), or trace the Cell that "
                                     "holds them (tracing a Cell names them by dotted path)")
                v = self.new_value(x.shape, x.dtype, "param", x.name, param=x)
                self.params[id(x)] = v
                self.param_names.add(x.name)
                self.graph.params.append(v)
            return v
        arr = np.asarray(x)
        if arr.dtype.kind not in "fiu":
            raise TypeError(f"cannot use {type(x).__name__} {x!r} as a tensor in a traced graph")
        if arr.dtype == np.float64 and not isinstance(x, np.ndarray):
            arr = arr.astype(np.float64)
        v = self.new_value(arr.shape, arr.dtype, "const", f"const{self.next_id}", const=arr)
        self.graph.consts.append(v)
        return v


_state = threading.local()


def _tracer() -> _Tracer | None:
    return getattr(_state, "tracer", None)


def tracing() -> bool:
    """True while a graph is being traced on this thread."""
    return _tracer() is not None


@contextmanager
def scope(name: str) -> Iterator[None]:
    """Name the ops recorded inside (Cells push ``"name-ClassName"``)."""
    t = _tracer()
    if t is None:
        yield
        return
    t.scopes.append(name)
    try:
        yield
    finally:
        t.scopes.pop()


@contextmanager
def recompute_scope(cell: Any, mp_comm: bool, opt_comm: bool) -> Iterator[None]:
    """Record the ops traced inside as one recomputed segment (``Cell.recompute()``); inside
    another segment, the outer one holds them (MindSpore configures recomputation once per
    Cell hierarchy)."""
    t = _tracer()
    if t is None:
        yield
        return
    t.traced_cells.add(id(cell))
    if t.segment >= 0:
        yield
        return
    t.segment = len(t.graph.segments)
    first = len(t.graph.nodes)
    try:
        yield
    finally:
        nodes = tuple(range(first, len(t.graph.nodes)))
        t.graph.segments.append(RecomputeSegment("/".join(t.scopes), nodes, mp_comm, opt_comm))
        t.segment = -1


@contextmanager
def stage_scope(stage: int, chunk: int = -1) -> Iterator[None]:
    """Record the ops traced inside as of pipeline stage ``stage`` and chunk ``chunk`` (a
    Cell's ``pipeline_stage`` and ``pipeline_segment``; an inner Cell's own win)."""
    t = _tracer()
    if t is None or (stage < 0 and chunk < 0):
        yield
        return
    outer = t.stage, t.chunk
    t.stage = stage if stage >= 0 else t.stage
    t.chunk = chunk if chunk >= 0 else t.chunk
    try:
        yield
    finally:
        t.stage, t.chunk = outer


def traced_cells() -> set[int]:
    """Ids of the Cells marked for recomputation whose ``construct`` this trace ran."""
    t = _tracer()
    return set(t.traced_cells) if t is not None else set()


def current_scope() -> str:
    """The scope path ops recorded now would get (``"Default/network-WithLossCell/..."``)."""
    t = _tracer()
    return "/".join(t.scopes) if t is not None else ""


def record(op: Primitive, args: Sequence[Any]) -> Any:
    """Add one node for ``op(*args)`` and return its output value(s)."""
    t = _tracer()
    assert t is not None, "record() outside trace()"
    inputs = tuple(t.as_value(a) for a in args)
    snapshot = copy.copy(op)
    shapes = [v.shape for v in inputs]
    out_shapes = snapshot.output_shapes(*shapes)
    node = Node(len(t.graph.nodes), snapshot, inputs,
                name="/".join(t.scopes) + f"/{op.name}-op{t.op_count}", segment=t.segment,
                stage=t.stage, chunk=t.chunk)
    t.op_count += 1
    first_float = next((v.dtype for v in inputs if v.dtype.kind == "f"), inputs[0].dtype)
    dtype = snapshot.output_dtype(first_float)
    n_out = snapshot.n_outputs
    outs = tuple(t.new_value(out_shapes[k], dtype, "op", f"{op.name}{node.id}" + (
        f".{k}" if n_out > 1 else ""), producer=node, index=k) for k in range(n_out))
    node.outputs = outs
    t.graph.nodes.append(node)
    return outs if n_out > 1 else outs[0]


def update_parameter(param: Parameter, value: Any, weight: float) -> None:
    """Fold ``value`` into ``param`` after the forward: ``param = (1 - weight) * param +
    weight * value`` (MindSpore's BatchNorm writes its moving statistics so). Traced, it is
    recorded (:attr:`Graph.updates`) and every training step applies it to each rank's shard;
    called eagerly on arrays, it updates the Parameter's value at once."""
    if not isinstance(param, Parameter):
        raise TypeError(f"update_parameter: param must be a Parameter, got "
                        f"{type(param).__name__}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or \
            not 0.0 <= weight <= 1.0:
        raise ValueError(f"update_parameter: weight must be a float in [0, 1], got {weight!r}")
    t = _tracer()
    if t is None:
        new = np.asarray(value)
        if new.shape != param.shape:
            raise ValueError(f"update_parameter: {param.name or 'the parameter'} has shape "
                             f"{param.shape}, the value {new.shape}")
        param.set_data((1.0 - weight) * param.data + weight * new)
        return
    v = t.as_value(value)
    p = t.as_value(param)
    if v.shape != p.shape:
        raise ValueError(f"update_parameter: {p.name} has shape {p.shape}, the value "
                         f"{v.shape}")
    if any(u.param == p.name for u in t.graph.updates):
        raise ValueError(f"update_parameter: {p.name} is written twice in one forward")
    t.graph.updates.append(ParameterUpdate(p.name, v.id, float(weight)))


def trace(fn: Callable[..., Any], input_specs: Sequence[tuple[Sequence[int], Any]],
          input_names: Sequence[str] | None = None, training: bool | None = None) -> Graph:
    """Trace ``fn(*inputs)`` for inputs of the given ``(shape, dtype)``. ``training``, when
    given, traces a Cell in that mode (``set_train``) and gives every Cell inside it its own
    mode back afterwards; None traces it as it stands."""
    cells = getattr(fn, "cells_and_names", None)
    if training is None or not callable(cells):
        return _trace(fn, input_specs, input_names)
    modes = [(cell, cell.training) for _, cell in cells()]
    fn.set_train(training)  # type: ignore[attr-defined]
    try:
        return _trace(fn, input_specs, input_names)
    finally:
        for cell, mode in modes:
            object.__setattr__(cell, "training", mode)


def _trace(fn: Callable[..., Any], input_specs: Sequence[tuple[Sequence[int], Any]],
           input_names: Sequence[str] | None) -> Graph:
    if tracing():
        raise RuntimeError("trace() cannot nest")
    if not callable(fn):
        raise TypeError(f"trace: the network must be a Cell or a function, got "
                        f"{checks.shown(fn)}")
    input_specs = checks.input_specs(input_specs, "trace: input_specs")
    if input_names is not None and (
            not isinstance(input_names, (list, tuple)) or len(input_names) != len(input_specs)
            or not all(isinstance(n, str) for n in input_names)):
        raise TypeError(f"trace: input_names must be None or {len(input_specs)} strings, one "
                        f"per input, got {checks.shown(input_names)}")
    name_parameters = getattr(fn, "name_parameters", None)  # a Cell: dotted-path names
    if callable(name_parameters):
        name_parameters()
    t = _Tracer()
    _state.tracer = t
    try:
        with recording(record):
            names = list(input_names or [f"input{i}" for i in range(len(input_specs))])
            ins = [t.new_value(shape, dtype, "input", names[i]) for i, (shape, dtype)
                   in enumerate(input_specs)]
            t.graph.inputs = ins
            out = fn(*ins)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            t.graph.outputs = [t.as_value(o) for o in outs]
    finally:
        _state.tracer = None
    cells = getattr(fn, "cells_and_names", None)
    if callable(cells):
        unused = [path or "the network itself" for path, cell in cells()
                  if getattr(cell, "recompute_settings", None) is not None
                  and id(cell) not in t.traced_cells]
        if unused:
            raise ValueError(f"recompute: the Cell {unused[0]!r} is marked with "
                             f"Cell.recompute(), but its construct never ran while the network "
                             f"was traced, so it is not in the graph and nothing of it could be "
                             f"recomputed ({len(unused)} such Cells); call recompute() on Cells "
                             "the network uses")
    return t.graph
