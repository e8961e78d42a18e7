"""The operator framework: primitives, strategies, sharding rules and their per-rank programs.

A :class:`Primitive` has a numpy kernel and its VJP (single device), and a sharding rule that
turns ``(input shapes, strategy, device_num)`` into an :class:`OpSharding`: the op's device
matrix, a layout for every input, the layout its local kernel produces (possibly partial), the
layout of its output after the op's own collectives, and the collectives it runs forward and
backward. The rule is pure; :meth:`OpSharding.forward` / :meth:`OpSharding.backward` run it on
this rank's shards through :mod:`simpar.comm`.

Most primitives are described by an *iteration space*, as in einsum: every tensor dimension
names an iteration dimension, the strategy cuts iteration dimensions, and an iteration
dimension that is cut but absent from the output leaves the local result a partial sum. The
device matrix lists the cuts of the iteration dimensions in the op's canonical order; when the
strategy uses fewer devices than ``device_num``, the remaining factor is a *repeated
calculation* axis put last (rightmost) in the device matrix, so that ``repeat`` consecutive
ranks compute the same shard. MindSpore's default puts it first; simpar puts it last so that
data-parallel-only ops line up with dp-outer, mp-inner hybrids (see README).

Gradients follow one rule everywhere (see README, "gradient semantics"): on every rank the
backward computes that rank's *contribution*; contributions of a value replicated over some
device axes sum, over those axes, to its true gradient. A replicated output's cotangent is
therefore divided by its number of replicas, and an input's gradient is completed by an
AllReduce over the input's replica axes (MindSpore's Mirror, for a parameter).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from simpar import comm, context, schedule
from simpar.cost.collective import traffic
from simpar.layout import TensorLayout
from simpar.mesh import DeviceMesh
from simpar.redistribution import (
    LOCAL_KINDS,
    RedistributionPlan,
    Step,
    StepKind,
    execute,
    execute_adjoint,
    plan,
)

__all__ = [
    "INLINE_NAMES",
    "CommSpec",
    "Inline",
    "IterSpace",
    "OpSharding",
    "Primitive",
    "StrategyError",
    "Strategy",
    "Tape",
    "dim_names",
    "divisors",
    "gradient_needed",
    "plan_adjoint_comm",
    "plan_comm",
    "recording",
    "register",
    "registry",
    "shape_only",
]

Strategy = tuple[tuple[int, ...], ...]


class StrategyError(ValueError):
    """A strategy that does not fit the operator, its inputs or the devices."""


# ------------------------------------------------------------------ registry
_REGISTRY: dict[str, type[Primitive]] = {}


def register(cls: type[Primitive]) -> type[Primitive]:
    """Class decorator: make a primitive findable by name (``registry()["MatMul"]``)."""
    _REGISTRY[cls.__name__] = cls
    return cls


def registry() -> dict[str, type[Primitive]]:
    """Every registered primitive class by MindSpore name."""
    return dict(_REGISTRY)


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order (for a power of two: the powers of two)."""
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------ gradients in use
_NEEDS: ContextVar[tuple[bool, ...] | None] = ContextVar("simpar_gradients_needed",
                                                         default=None)


def gradient_needed(i: int) -> bool:
    """Inside :meth:`OpSharding.backward`: whether input ``i``'s gradient is used. A VJP may
    skip computing the others (the first Dense's data gradient, say) and return None."""
    needs = _NEEDS.get()
    return needs is None or (i < len(needs) and needs[i])


# ------------------------------------------------------------------ communication specs
@dataclass(frozen=True, slots=True)
class CommSpec:
    """One collective an op runs, described without running it.

    ``device_axes`` index ``device_matrix`` from the left; rank r's group is
    ``DeviceMesh(device_matrix).group_of(r, device_axes)``. ``elements`` is the local input
    buffer of the collective (per rank), ``step`` the redistribution step when it is one (run
    backwards when ``adjoint``), ``how`` an AllReduce's reduction ("sum" or "max").
    """

    kind: StepKind
    device_matrix: tuple[int, ...]
    device_axes: tuple[int, ...]
    elements: int
    reason: str = ""
    step: Step | None = None
    on_output: bool = False  # the buffer has the output's dtype (else the input's)
    how: str = "sum"
    adjoint: bool = False

    @classmethod
    def from_step(cls, step: Step, reason: str, on_output: bool = False) -> CommSpec:
        return cls(step.kind, step.src.device_matrix, step.device_axes, step.src.local_size(),
                   reason, step, on_output)

    @classmethod
    def adjoint_of(cls, step: Step, reason: str, on_output: bool = False) -> CommSpec:
        """The collective that runs ``step`` backwards (AllGather's is a ReduceScatter); its
        input buffer is the size of the step's output shard."""
        return cls(step.kind.adjoint, step.src.device_matrix, step.device_axes,
                   step.dst.local_size(), reason, step, on_output, adjoint=True)

    def __str__(self) -> str:
        axes = f" over device axes {list(self.device_axes)} of {list(self.device_matrix)}"
        return f"{self.kind}({self.how}){axes}: {self.reason}" if self.how != "sum" else \
            f"{self.kind}{axes}: {self.reason}"

    @property
    def runs(self) -> object:
        """What the executor announces to :mod:`simpar.schedule` when it runs this collective:
        the redistribution step, or this spec for an op's own collective."""
        return self if self.step is None else self.step

    def group(self, rank: int) -> tuple[int, ...]:
        if not self.device_axes:
            return tuple(range(math.prod(self.device_matrix)))
        return DeviceMesh(self.device_matrix).group_of(rank, self.device_axes)

    def groups(self) -> list[tuple[int, ...]]:
        if not self.device_axes:
            return [tuple(range(math.prod(self.device_matrix)))]
        return DeviceMesh(self.device_matrix).groups(self.device_axes)

    def recv_bytes(self, rank: int, itemsize: int) -> int:
        """Bytes ``rank`` receives, by CommTrace's convention."""
        if self.step is not None:
            # A step's adjoint receives what the step sends (AllGather's ReduceScatter, the
            # reverse direct exchange).
            return (self.step.send_bytes(rank, itemsize) if self.adjoint
                    else self.step.recv_bytes(rank, itemsize))
        return traffic(self.kind, len(self.group(rank)), self.elements * itemsize)

    def describe(self, rank: int, in_itemsize: int, out_itemsize: int) -> dict[str, Any]:
        itemsize = out_itemsize if self.on_output else in_itemsize
        return {"op": str(self.kind), "group": list(self.group(rank)),
                "groups": [list(g) for g in self.groups()],
                "bytes": self.recv_bytes(rank, itemsize), "reason": self.reason}


def plan_comm(p: RedistributionPlan, reason: str, on_output: bool) -> list[CommSpec]:
    """The collectives of plan ``p`` (its local steps cost nothing and are left out)."""
    return [CommSpec.from_step(s, reason, on_output) for s in p.steps
            if s.kind not in LOCAL_KINDS]


def plan_adjoint_comm(p: RedistributionPlan, reason: str, on_output: bool) -> list[CommSpec]:
    """The collectives of plan ``p`` run backwards, in the order they run (last step first)."""
    return [CommSpec.adjoint_of(s, reason, on_output) for s in reversed(p.steps)
            if s.kind not in LOCAL_KINDS]


# ------------------------------------------------------------------ iteration spaces
@dataclass(frozen=True, slots=True)
class IterSpace:
    """An einsum-like description of an op: which iteration dim each tensor dim walks.

    ``inputs[i][d]`` is the iteration dim of input i's tensor dim d, or ``None`` for a
    broadcast dim of size 1. ``output`` lists the output's iteration dims. ``order`` is the
    canonical order of iteration dims in the device matrix. Iteration dims that are cut but
    not in ``output`` make the local output partial (``reduce`` says how: "sum" or "max").
    """

    inputs: tuple[tuple[str | None, ...], ...]
    output: tuple[str | None, ...]
    order: tuple[str, ...]
    reduce: str = "sum"
    unsplittable: frozenset[str] = frozenset()

    @classmethod
    def pointwise(cls, ndim: int) -> IterSpace:
        """One input whose every tensor dim is its own iteration dim, kept in the output:
        ``pointwise(2)`` walks ``d0, d1``, so a strategy ``((2, 4),)`` cuts rows 2 ways and
        columns 4 ways and rank 5 of the (2, 4) device matrix computes block (1, 1)."""
        names = dim_names(ndim)
        return cls((names,), names, names)


def dim_names(ndim: int) -> tuple[str, ...]:
    """Iteration dims ``d0 .. d{ndim-1}``, one per tensor dim, for ops that walk each dim of
    their tensor with an iteration dim of its own (``dim_names(3)`` is ``('d0', 'd1', 'd2')``)."""
    return tuple(f"d{d}" for d in range(ndim))


# ------------------------------------------------------------------ the sharding of one op
@dataclass(frozen=True)
class OpSharding:
    """Everything the runtime needs to run one op on its shards (per-rank program).

    ``raw_out`` is what the local kernel yields; ``out`` the output after the op's forward
    collectives (``out_plan``). ``inner_plan`` is a redistribution of input 0 that the op runs
    before its kernel (Reshape's). ``internal_forward``/``internal_backward`` are the op's own
    collectives, in the order its kernel runs them (split Softmax and LayerNorm statistics).
    ``forward_comm``/``backward_comm`` list every collective, with the input-gradient
    AllReduces (over each input's replica axes) at the end of backward.

    ``iter_order``/``iter_cuts`` record the iteration space the device matrix was built from:
    iteration dim ``iter_order[k]`` is cut ``iter_cuts[k]`` ways along device axis ``k``.
    """

    op: Primitive
    input_shapes: tuple[tuple[int, ...], ...]
    strategy: Strategy
    device_matrix: tuple[int, ...]
    in_layouts: tuple[TensorLayout, ...]
    raw_out: TensorLayout
    out: TensorLayout
    out_plan: RedistributionPlan
    internal_forward: tuple[CommSpec, ...] = ()
    internal_backward: tuple[CommSpec, ...] = ()
    iter_order: tuple[str, ...] = ()
    iter_cuts: tuple[int, ...] = ()
    inner_plan: RedistributionPlan | None = None
    #: (raw, out, plan) of outputs after the first, for multi-output ops such as Split.
    more_outs: tuple[tuple[TensorLayout, TensorLayout, RedistributionPlan], ...] = ()
    #: How many ranks compute each shard alike (MindSpore's repeated calculation): device_num
    #: over the devices the strategy uses. 1: every rank computes its own part.
    repeat: int = 1

    def rank(self) -> int:
        """This process's device rank in the op's devices: the MPI rank, or 0 when the op runs
        on one device (a stand-alone reference inside a multi-rank job)."""
        return self._rank

    @functools.cached_property
    def _rank(self) -> int:
        return 0 if math.prod(self.device_matrix) == 1 else comm.get_rank()

    @functools.cached_property
    def in_slices(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per input, what this rank holds: ``in_layouts[k].slice_of(self.rank())``, worked
        out once (a kernel that needs its offsets asks on every step)."""
        return tuple(lay.slice_of(self.rank()) for lay in self.in_layouts)

    def device_axes_cutting(self, iter_dims: Sequence[str]) -> tuple[int, ...]:
        """Device axes (from the left) that cut any of ``iter_dims`` into more than one piece: the
        groups over which a reduction along those dims must be completed. For Softmax over
        the last dim with strategy ((2, 4),) on 8 devices: ``("d1",)`` gives ``(1,)``."""
        return tuple(k for k, (it, c) in enumerate(zip(self.iter_order, self.iter_cuts))
                     if it in iter_dims and c > 1)

    # -- descriptions
    @property
    def outputs(self) -> list[tuple[TensorLayout, TensorLayout, RedistributionPlan]]:
        """(raw layout, final layout, plan) of every output, the first one first."""
        return [(self.raw_out, self.out, self.out_plan), *self.more_outs]

    def inner_comm(self) -> list[CommSpec]:
        """The collectives of :attr:`inner_plan` (forward)."""
        if self.inner_plan is None:
            return []
        return plan_comm(self.inner_plan, f"redistribute before {self.op.name.lower()}", False)

    def inner_adjoint_comm(self) -> list[CommSpec]:
        """The collectives of :attr:`inner_plan` run backwards, in the order they run."""
        if self.inner_plan is None:
            return []
        return plan_adjoint_comm(self.inner_plan, "adjoint of redistribution before "
                                 f"{self.op.name.lower()}", False)

    @property
    def forward_comm(self) -> list[CommSpec]:
        """Every collective of the forward, in the order it runs."""
        specs = self.inner_comm() + list(self.internal_forward)
        for k, (_, _, p) in enumerate(self.outputs):
            specs += plan_comm(p, "output" if k == 0 else f"output {k}", on_output=True)
        return specs

    def output_adjoint_comm(self) -> list[CommSpec]:
        """The adjoints of the output plans, in the order the backward runs them."""
        adj: list[CommSpec] = []
        for k, (_, _, p) in reversed(list(enumerate(self.outputs))):
            adj += [CommSpec.adjoint_of(s, f"adjoint of output {k} {s.kind}", on_output=True)
                    for s in reversed(p.steps) if s.kind not in LOCAL_KINDS]
        return adj

    @property
    def backward_comm(self) -> list[CommSpec]:
        """Every collective of ``run_op``'s backward, in order; a program runs all but the
        trailing input-gradient AllReduces (its Mirrors complete parameters' gradients)."""
        grads = []
        for i in range(len(self.in_layouts)):
            if self.op.differentiable(i):
                spec = self.input_grad_spec(i)
                if spec is not None:
                    grads.append(spec)
        return (self.output_adjoint_comm() + list(self.internal_backward)
                + self.inner_adjoint_comm() + grads)

    def share_axes(self, k: int = 0) -> tuple[int, ...]:
        """For an op that declares ``whole_over_split_inputs``: the device axes (from the
        left) over which output ``k``'s raw layout is replicated although an input is split
        there, ranks that computed the same output from different input pieces (a
        vocabulary-parallel loss, whole on every rank of the class split after its statistics
        AllReduces). Its local VJP takes the output's whole cotangent there, so ``run_op``,
        whose replicas otherwise share an output's cotangent, gives it whole over these axes.
        Empty for every other op (ReduceMax over a split axis sums the shares itself)."""
        if not self.op.whole_over_split_inputs:
            return ()
        raw = self.outputs[k][0]
        return tuple(a for a in raw.replica_axes if self.device_matrix[a] > 1
                     and any(a in lay.split_axes for lay in self.in_layouts))

    def input_grad_spec(self, i: int) -> CommSpec | None:
        lay = self.in_layouts[i]
        axes = tuple(a for a in lay.replica_axes if lay.device_matrix[a] > 1)
        if not axes:
            return None
        return CommSpec(StepKind.ALL_REDUCE, lay.device_matrix, axes, lay.local_size(),
                        f"gradient of input {i} (sum over its replicas)")

    def local_flops(self) -> int:
        return self.op.flops(tuple(lay.local_shape() for lay in self.in_layouts),
                             self.raw_out.local_shape())

    def memory_bytes(self, in_itemsize: int, out_itemsize: int | None = None) -> int:
        """Bytes of this rank's input and output shards."""
        out_itemsize = in_itemsize if out_itemsize is None else out_itemsize
        return (sum(lay.local_size() for lay in self.in_layouts) * in_itemsize
                + sum(o.local_size() for _, o, _ in self.outputs) * out_itemsize)

    # -- execution on this rank
    def forward(self, *local_inputs: np.ndarray) -> tuple[Any, Any]:
        """This rank's output shard (a tuple for multi-output ops) and what backward needs."""
        if self.inner_plan is not None:
            with comm.label(f"{self.op.name}:redistribute"):
                local_inputs = (execute(self.inner_plan, local_inputs[0]), *local_inputs[1:])
        raw, saved = self.op.local_forward(self, *local_inputs)
        if not self.more_outs and not self.out_plan.steps:   # most ops: nothing to move
            return raw, saved
        raws = raw if self.more_outs else (raw,)
        outs = []
        for k, (r, (_, _, p)) in enumerate(zip(raws, self.outputs)):
            if not p.steps:
                outs.append(r)
                continue
            with comm.label(f"{self.op.name}:output" + (f"{k}" if k else "")):
                outs.append(execute(p, r))
        return (tuple(outs) if self.more_outs else outs[0]), saved

    def backward(self, saved: Any, local_dout: Any, needs: Sequence[bool] | None = None
                 ) -> tuple[np.ndarray | None, ...]:
        """This rank's gradient *contributions* for every input, in the input layouts
        (sum over an input's replica axes to complete them, see :meth:`complete_grad`).
        For a multi-output op, ``local_dout`` is a tuple (None for an unused output).
        ``needs[k]`` False says input k's gradient is not used: the kernels may skip it
        (:func:`gradient_needed`) and give None."""
        douts = local_dout if self.more_outs else (local_dout,)
        draws: list[np.ndarray] = []
        for k, (d, (_, out, p)) in reversed(list(enumerate(zip(douts, self.outputs)))):
            if d is None:
                d = np.zeros(out.local_shape(), dtype=_float_of(saved))
            with comm.label(f"{self.op.name}:output-adjoint" + (f"{k}" if k else "")):
                draws.append(execute_adjoint(p, d))
        draws.reverse()
        grads = self.kernel_backward(saved, draws, needs)
        if self.inner_plan is None or grads[0] is None:
            return grads
        with comm.label(f"{self.op.name}:redistribute-adjoint"):
            return (execute_adjoint(self.inner_plan, grads[0]), *grads[1:])

    def kernel_backward(self, saved: Any, draws: Sequence[np.ndarray],
                        needs: Sequence[bool] | None = None) -> tuple[np.ndarray | None, ...]:
        """The local kernel's gradients (with its own collectives, ``internal_backward``) from
        the raw outputs' cotangents ``draws``, one per output; before :attr:`inner_plan`'s
        adjoint. ``needs`` as in :meth:`backward`."""
        run = self.backward_kernel((True,) * len(self.in_layouts) if needs is None else needs)
        return run(saved, tuple(draws) if self.more_outs else draws[0])

    def backward_kernel(self, needs: Sequence[bool]
                        ) -> Callable[[Any, Any], tuple[np.ndarray | None, ...]]:
        """:meth:`kernel_backward` bound once for a compiled program: ``f(saved, dout)`` with
        ``dout`` the raw output's cotangent (a tuple of them for a multi-output op). When
        every input's gradient is needed it is the op's own ``local_backward``, with nothing
        in between."""
        needs = tuple(bool(n) for n in needs)
        if all(needs):
            return functools.partial(self.op.local_backward, self)

        def run(saved: Any, dout: Any) -> tuple[np.ndarray | None, ...]:
            token = _NEEDS.set(needs)
            try:
                return self.op.local_backward(self, saved, dout)
            finally:
                _NEEDS.reset(token)
        return run

    def all_reduce(self, spec: CommSpec, x: np.ndarray, what: str) -> np.ndarray:
        """Run one of the op's own collectives (an entry of ``internal_forward`` or
        ``internal_backward``) on this rank's partial ``x``: ``what`` tags the trace. The
        collective is prepared (``simpar.comm.prepare``) the first time a spec runs on an
        array of a given shape and dtype, and reused after."""
        key = (id(spec), x.shape, x.dtype)
        run = self._prepared.get(key)
        if run is None:
            run = self._prepared[key] = comm.prepare("all_reduce", x.shape, x.dtype,
                                                     spec.group(self.rank()), op=spec.how)
        at = schedule.announce(spec)
        if at is None:
            with comm.label(f"{self.op.name}:{what}"):
                y = run(x)
        else:
            y = run(x, at)
        return y.reshape(np.shape(x))  # all_reduce hands a 0-d array back as shape (1,)

    @functools.cached_property
    def _prepared(self) -> dict[tuple[int, tuple[int, ...], np.dtype], comm.Prepared]:
        """The op's own collectives, prepared: by (id of the spec, which this sharding
        keeps alive; shape; dtype)."""
        return {}

    def complete_grad(self, i: int, contribution: np.ndarray) -> np.ndarray:
        """Sum input i's gradient contributions over its replica axes (one AllReduce)."""
        spec = self.input_grad_spec(i)
        if spec is None:
            return contribution
        rank = comm.get_rank()
        with comm.label(f"{self.op.name}:input{i}-grad"):
            return comm.all_reduce(contribution, group=spec.group(rank))


def _float_of(saved: Any) -> Any:
    """A float dtype for zero cotangents of unused outputs (from the saved forward values)."""
    def find(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return v.dtype if v.dtype.kind == "f" else None
        if isinstance(v, (tuple, list)):
            for item in v:
                found = find(item)
                if found is not None:
                    return found
        return None
    return find(saved) or np.dtype(np.float64)


# ------------------------------------------------------------------ kernels as expressions
@dataclass(frozen=True, slots=True)
class Inline:
    """An op's kernel and VJP as ``str.format`` templates of Python expressions
    (:meth:`Primitive.inline`): ``{x0}``, ``{x1}``, ... stand for the inputs, ``{y}`` for the
    output and ``{dy}`` for its cotangent; ``_sum`` is ``np.add.reduce``. ``grads[k]`` is
    input k's gradient, None where it has no expression (the executor then calls the VJP,
    unless that gradient is not needed). MatMul with ``transpose_b`` on 2-D shards:
    ``Inline("{x0} @ {x1}.T", ("{dy} @ {x1}", "{dy}.T @ {x0}"))``."""

    forward: str
    grads: tuple[str | None, ...]
    #: The forward as a statement that writes its result into ``{x0}`` (``{x0} += {x1}``),
    #: bit for bit the value ``forward`` gives when the output has x0's shape and dtype; the
    #: executor uses it where nothing else holds x0. None: the op has no such form.
    update: str | None = None


#: What an inline expression may call, besides the arrays' own operators and methods.
INLINE_NAMES: dict[str, Any] = {"_sum": np.add.reduce}


# ------------------------------------------------------------------ what a forward keeps
class Tape(str, enum.Enum):
    """What an op's forward keeps for its backward (``Primitive.tape``), as its
    ``local_forward`` saves it: the cost model counts activation memory from it."""

    INPUTS_AND_OUTPUT = "inputs+output"  # the default local_forward: (xs, y)
    INPUTS = "inputs"                    # MatMul, Mul: (xs, None); the VJP reads no y
    OUTPUT = "output"                    # Softmax: y
    NOTHING = "nothing"                  # Reshape, Add, BiasAdd, ReduceMean: shapes only
    NEW_LIKE_INPUT = "new-like-input"    # LayerNorm's xhat, the cross entropy's softmax
    INPUT_AND_NEW = "input+new"          # GeLU: x and the tanh it computed from x
    MASK = "mask"                        # Dropout: one byte per element of input 0
    INDICES = "indices"                  # Gather: input 1 (the ids)

    def __str__(self) -> str:
        return self.value


def shape_only(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A read-only array of this shape and dtype that holds one element (every element is
    0): what a tape keeps of an input whose values the VJP never reads."""
    return np.broadcast_to(np.zeros((), dtype), shape)


# ------------------------------------------------------------------ tracing hook
#: While set (by :func:`simpar.graph.trace`), calling a primitive records a graph node
#: through this function instead of running the kernel. The hook keeps ops below the graph.
_TRACER: ContextVar[Callable[[Primitive, tuple[Any, ...]], Any] | None] = ContextVar(
    "simpar_tracer", default=None)


@contextmanager
def recording(tracer: Callable[[Primitive, tuple[Any, ...]], Any]) -> Iterator[None]:
    """Inside the block, ``op(*args)`` returns ``tracer(op, args)``."""
    token = _TRACER.set(tracer)
    try:
        yield
    finally:
        _TRACER.reset(token)


# ------------------------------------------------------------------ primitives
class Primitive:
    """Base of every operator. Subclasses set ``n_inputs`` and implement the hooks.

    ``op.shard(in_strategy, out_strategy=None)`` records a strategy and returns the op, as in
    MindSpore: ``MatMul().shard(((2, 1), (1, 4)))``.
    """

    n_inputs: int = 1
    n_outputs: int = 1
    #: Inputs that are integer ids or otherwise not differentiable.
    nondiff_inputs: ClassVar[tuple[int, ...]] = ()
    #: Whether out_strategy is accepted (MindSpore supports it for a few ops).
    supports_out_strategy: ClassVar[bool] = False
    #: What the forward keeps for the backward (the cost model's activation memory).
    tape: ClassVar[Tape] = Tape.INPUTS_AND_OUTPUT
    #: Whether the local output is a view of the local input 0 (no new memory).
    output_aliases_input: ClassVar[bool] = False
    #: Whether ``fully_use_devices`` still admits the all-ones strategy (MindSpore's
    #: ``PrepareStrategyBase`` keeps a strategy of product 1 or device_num; MatMul's own
    #: ``MatMulBase::PrepareStrategy`` keeps device_num only).
    fully_used_keeps_unsplit: ClassVar[bool] = True
    #: Whether every output value is some input value, moved (Reshape, Transpose, Split): an
    #: input of indices read through such ops is still checked at the program's input.
    moves_values: ClassVar[bool] = False
    #: Whether the op's own collectives leave its output whole on ranks that hold different
    #: input pieces, its local VJP then taking the output's whole cotangent there (the
    #: vocabulary-parallel cross entropy): see :meth:`OpSharding.share_axes`.
    whole_over_split_inputs: ClassVar[bool] = False

    def __init__(self) -> None:
        self.in_strategy: Strategy | None = None
        self.out_strategy: Strategy | None = None
        self.instance_name: str = type(self).__name__

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        attrs = ", ".join(f"{k}={v!r}" for k, v in self.attrs().items())
        shard = f".shard({self.in_strategy})" if self.in_strategy is not None else ""
        return f"{self.name}({attrs}){shard}"

    def attrs(self) -> dict[str, Any]:
        """The primitive's attributes (for printing and strategy files)."""
        return {}

    def differentiable(self, i: int) -> bool:
        return i not in self.nondiff_inputs

    def gives_gradient(self, i: int, dtype: np.dtype) -> bool:
        """Whether the backward gives input ``i`` of ``dtype`` a gradient: differentiable
        positions of floating dtype (ids, labels and other integers get none). The per-rank
        program's schedule relies on it; a kernel that returns None there means zero."""
        return self.differentiable(i) and np.dtype(dtype).kind == "f"

    def check_values(self, *global_inputs: np.ndarray) -> None:
        """Reject bad input *values* (ids or labels out of range) on the global arrays.

        ``run_op`` calls it on every rank before sharding, so every rank raises the same
        error; a shard-local check inside the per-rank kernel would raise only on the ranks
        holding the bad value and leave the others waiting in a collective."""

    def index_limit(self, i: int, shapes: tuple[tuple[int, ...], ...]) -> int | None:
        """For an input of indices (ids, labels), the bound its values must stay under
        (``0 <= value < limit``) for inputs of global ``shapes``; None for other inputs.
        A training step checks its inputs against these before it runs (every rank, on its
        own shard), so that a bad id refuses the step on every rank instead of raising in a
        kernel on the ranks holding it while the others wait in a collective."""
        return None

    def index_error(self, i: int, value: int, limit: int) -> str:
        """The message for index ``value`` of input ``i`` outside ``0..limit - 1``."""
        return (f"{self.name}: input {i} holds {value}, outside the allowed range "
                f"0..{limit - 1}")

    def output_dtype(self, input_dtype: np.dtype) -> np.dtype:
        """The output's dtype for inputs of ``input_dtype`` (Cast changes it)."""
        return input_dtype

    # -- MindSpore API
    def shard(self, in_strategy: Sequence[Sequence[int]],
              out_strategy: Sequence[Sequence[int]] | None = None) -> Primitive:
        """Set the strategy: one tuple of cuts per input (and optionally per output)."""
        self.in_strategy = _as_strategy(in_strategy, self.name, "in_strategy")
        if out_strategy is not None:
            if not self.supports_out_strategy:
                raise StrategyError(f"{self.name}: out_strategy is not supported for this "
                                    "operator (MindSpore accepts it for MatMul/BatchMatMul)")
            self.out_strategy = _as_strategy(out_strategy, self.name, "out_strategy")
        else:
            self.out_strategy = None
        if len(self.in_strategy) != self.n_inputs:
            raise StrategyError(f"{self.name}: the strategy has {len(self.in_strategy)} "
                                f"entries but the operator has {self.n_inputs} inputs; give "
                                "one tuple of cuts per input")
        return self

    # -- single-device maths (subclasses)
    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError

    def kernel(self, *xs: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def vjp(self, xs: Sequence[np.ndarray], y: Any, dy: Any) -> tuple[np.ndarray | None, ...]:
        """Single-device gradients of every input (None for non-differentiable ones); ``y``
        and ``dy`` are tuples for multi-output ops."""
        raise NotImplementedError

    def __call__(self, *xs: Any) -> Any:
        """On arrays: the single-device kernel. Inside a traced Cell: a graph node (the
        tracer, installed by :func:`simpar.graph.trace`, records the call)."""
        tracer = _TRACER.get()
        if tracer is not None:
            return tracer(self, xs)
        arrays = [np.asarray(x) for x in xs]
        self.infer_shape(*(x.shape for x in arrays))  # kernels trust the shapes they get
        return self.kernel(*arrays)

    # -- sharding (subclasses override iter_space, or sharding() wholesale)
    def iter_space(self, *shapes: tuple[int, ...]) -> IterSpace:
        raise NotImplementedError(f"{self.name} has no iteration space")

    def flops(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]) -> int:
        """Floating-point operations of the local kernel (default: one per output element)."""
        return math.prod(local_out)

    def default_strategy(self, shapes: Sequence[tuple[int, ...]], device_num: int) -> Strategy:
        """Data parallel on the first dimension that fits, else fully replicated."""
        cands = self.candidate_strategies(shapes, device_num, fully_use_devices=False)
        for s in cands:
            if s and s[0] and s[0][0] == device_num and math.prod(s[0]) == device_num:
                return s
        return tuple((1,) * len(sh) for sh in shapes)

    def sharding(self, shapes: Sequence[Sequence[int]], device_num: int,
                 strategy: Sequence[Sequence[int]] | None = None,
                 out_strategy: Sequence[Sequence[int]] | None = None,
                 enable_alltoall: bool = False) -> OpSharding:
        """Validate ``strategy`` (default: the one set by :meth:`shard`) and derive layouts.
        ``enable_alltoall`` (the context's key, MindSpore's default False) governs the
        redistributions an op plans itself, such as Reshape's."""
        shapes_t = self._check_shapes(shapes)
        strat = self.in_strategy if strategy is None else _as_strategy(strategy, self.name,
                                                                        "strategy")
        if strat is None:
            strat = self.default_strategy(shapes_t, device_num)
        out_s = self.out_strategy if strategy is None else (
            None if out_strategy is None else _as_strategy(out_strategy, self.name,
                                                           "out_strategy"))
        _check_device_num(device_num, self.name)
        self._check_strategy_shape(strat, shapes_t)
        return self._sharding(shapes_t, strat, out_s, device_num, enable_alltoall)

    def _check_shapes(self, shapes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        if len(shapes) != self.n_inputs:
            raise ValueError(f"{self.name}: expected {self.n_inputs} input shapes, got "
                             f"{len(shapes)}")
        return tuple(tuple(int(d) for d in s) for s in shapes)

    def _check_strategy_shape(self, strat: Strategy, shapes: tuple[tuple[int, ...], ...]) -> None:
        if len(strat) != self.n_inputs:
            raise StrategyError(f"{self.name}: the strategy has {len(strat)} entries but the "
                                f"operator has {self.n_inputs} inputs; give one tuple of cuts "
                                "per input")
        for i, (s, shape) in enumerate(zip(strat, shapes)):
            if len(s) != len(shape):
                raise StrategyError(f"{self.name}: strategy {s} for input {i} has {len(s)} "
                                    f"entries but the input has {len(shape)} dimensions "
                                    f"(shape {shape})")
            for d, (c, n) in enumerate(zip(s, shape)):
                if c < 1:
                    raise StrategyError(f"{self.name}: strategy {s} for input {i} has cut {c} "
                                        f"on dimension {d}; cuts must be >= 1")
                if n == 1 and c > 1:
                    raise StrategyError(f"{self.name}: strategy {s} for input {i} cuts "
                                        f"dimension {d} of shape {shape} into {c} parts, but "
                                        "that dimension has size 1 (it broadcasts), so its cut "
                                        "must be 1")
                if n % c:
                    raise StrategyError(f"{self.name}: strategy {s} for input {i} cuts "
                                        f"dimension {d} of shape {shape} into {c} parts, but "
                                        f"{n} is not divisible by {c}")

    def _sharding(self, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                  out_strategy: Strategy | None, device_num: int,
                  enable_alltoall: bool = False) -> OpSharding:
        space = self.iter_space(*shapes)
        cuts = _iteration_cuts(self.name, space, strat, shapes)
        return build_sharding(self, shapes, strat, out_strategy, device_num, space, cuts)

    def candidate_strategies(self, shapes: Sequence[Sequence[int]], device_num: int,
                             fully_use_devices: bool | None = None,
                             slice_align: int | None = None) -> list[Strategy]:
        """Every valid strategy for these shapes on ``device_num`` devices.

        Cuts are divisors of ``device_num`` (for a power of two, MindSpore's powers of two).
        With ``fully_use_devices`` (default: the algo parameter) only strategies that use all
        devices are kept, and the all-ones one unless the op says otherwise
        (:attr:`fully_used_keeps_unsplit`): on 8 devices ``Cast`` keeps ``((1, 1),)`` and
        ``((2, 4),)`` but drops ``((2, 2),)``, ``MatMul`` drops ``((1, 1), (1, 1))``.
        ``slice_align`` (default: the algo parameters') is what MatMul's slice dimensions must
        be multiples of (1: anything); planners pass their request's.
        """
        if fully_use_devices is None:
            fully_use_devices = bool(context.get_algo_parameters("fully_use_devices"))
        if slice_align is None:
            slice_align = context.algo_parameters().slice_align
        shapes_t = self._check_shapes(shapes)
        space = self.iter_space(*shapes_t)
        sizes: dict[str, int] = {}
        for dims, shape in zip(space.inputs, shapes_t):
            for it, n in zip(dims, shape):
                if it is not None:
                    sizes[it] = n
        names = list(space.order)
        options = [[c for c in divisors(device_num) if sizes[it] % c == 0 and
                    (c == 1 or it not in space.unsplittable)] for it in names]
        out: list[Strategy] = []

        def walk(k: int, chosen: dict[str, int], used: int) -> None:
            if k == len(names):
                if fully_use_devices and used != device_num and not (
                        used == 1 and self.fully_used_keeps_unsplit):
                    return
                strat = tuple(tuple(chosen[it] if it is not None else 1 for it in dims)
                              for dims in space.inputs)
                if self._strategy_allowed(strat, shapes_t, slice_align):
                    out.append(strat)
                return
            for c in options[k]:
                if device_num % (used * c) == 0:
                    chosen[names[k]] = c
                    walk(k + 1, chosen, used * c)

        walk(0, {}, 1)
        return out

    def _strategy_allowed(self, strat: Strategy, shapes: tuple[tuple[int, ...], ...],
                          slice_align: int) -> bool:
        """Extra filters (tensor_slice_align for MatMul); default: everything allowed."""
        return True

    # -- per-rank kernels (default: the single-device kernel on shards)
    def local_forward(self, sh: OpSharding, *xs: np.ndarray) -> tuple[np.ndarray, Any]:
        """The kernel on the shards, and ``(xs, y)`` for :meth:`vjp` as :attr:`tape` says:
        without ``y`` for ``Tape.INPUTS``; for ``Tape.NOTHING``, each input's
        :func:`shape_only` stand-in (a VJP that reads only ``dy`` and the shapes)."""
        y = self.kernel(*xs)
        tape = self.tape
        if tape is Tape.INPUTS:
            return y, (xs, None)
        if tape is Tape.NOTHING:
            return y, (tuple(shape_only(x.shape, x.dtype) for x in xs), None)
        return y, (xs, y)

    def local_backward(self, sh: OpSharding, saved: Any, dy: Any
                       ) -> tuple[np.ndarray | None, ...]:
        xs, y = saved
        return self.vjp(xs, y, dy)

    def inline(self, shapes: tuple[tuple[int, ...], ...]) -> Inline | None:
        """For an op whose per-rank path is its kernel and VJP on shards (Primitive's own
        ``local_forward``/``local_backward``): both written as Python expressions for shards of
        these ``shapes``, for the compiled executor to put into the code it generates, with
        no call to the op in between. They must give the kernel's and the VJP's values bit for
        bit (tests/test_ops_inline.py checks). None, the default: the executor calls them."""
        return None

    def local_view(self, sh: OpSharding) -> tuple[Callable[[np.ndarray], np.ndarray],
                                                  Callable[[np.ndarray], np.ndarray]] | None:
        """For an op whose per-rank forward is one numpy view of its one input with nothing
        kept (Reshape, Transpose): ``(forward, backward)``, each array -> array, for the
        compiled executor to call with no Python in between; their ``local_forward`` and
        ``local_backward`` use the same pair. None for every other op."""
        return None


def _as_strategy(strategy: object, op: str, what: str) -> Strategy:
    if not isinstance(strategy, (tuple, list)):
        raise TypeError(f"{op}: {what} must be a tuple of tuples of ints, got "
                        f"{type(strategy).__name__} {strategy!r}")
    out = []
    for s in strategy:
        if not isinstance(s, (tuple, list)):
            raise TypeError(f"{op}: each entry of {what} must be a tuple of ints, got {s!r} in "
                            f"{strategy!r}")
        for c in s:
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
                raise TypeError(f"{op}: {what} entries must be ints, got {c!r} in {strategy!r}")
            if c < 1:
                raise StrategyError(f"{op}: {what} {strategy!r} holds the cut {c}; cuts must "
                                    "be >= 1 (1 leaves a dimension whole)")
        out.append(tuple(int(c) for c in s))
    return tuple(out)


def _check_device_num(device_num: int, op: str) -> None:
    if isinstance(device_num, bool) or not isinstance(device_num, (int, np.integer)) or \
            device_num < 1:
        raise ValueError(f"{op}: device_num must be a positive int, got {device_num!r}")


def _iteration_cuts(op: str, space: IterSpace, strat: Strategy,
                    shapes: tuple[tuple[int, ...], ...]) -> dict[str, int]:
    """Cut of every iteration dim; inputs sharing a dim must agree (MindSpore's check)."""
    cuts: dict[str, int] = {}
    where: dict[str, tuple[int, int]] = {}
    for i, (dims, s) in enumerate(zip(space.inputs, strat)):
        for d, (it, c) in enumerate(zip(dims, s)):
            if it is None:
                if c != 1:
                    raise StrategyError(f"{op}: input {i} broadcasts dimension {d} (size 1 in "
                                        f"shape {shapes[i]}), so its cut must be 1, got {c}")
                continue
            if it in space.unsplittable and c != 1:
                raise StrategyError(f"{op}: dimension {d} of input {i} cannot be split "
                                    f"(strategy {s}); its cut must be 1")
            if it in cuts and cuts[it] != c:
                j, dj = where[it]
                raise StrategyError(
                    f"{op}: Strategies of relevant dimensions are not equal: input {j} dim "
                    f"{dj} is cut {cuts[it]} but input {i} dim {d} is cut {c} (strategy "
                    f"{strat})")
            cuts[it] = c
            where.setdefault(it, (i, d))
    for it in space.order:
        cuts.setdefault(it, 1)
    return cuts


def _layout(device_matrix: tuple[int, ...], axis_of: dict[str, int],
            dims: Sequence[str | None], shape: tuple[int, ...],
            partial_axes: Sequence[int] = ()) -> TensorLayout:
    """The layout of a tensor whose dims walk iteration dims ``dims`` (None: broadcast),
    pending sums over device axes ``partial_axes`` (counted from the left)."""
    dim_axes = [() if it is None else (axis_of[it],) for it in dims]
    return TensorLayout.from_dim_axes(device_matrix, dim_axes, shape, partial_axes)


def build_sharding(op: Primitive, shapes: tuple[tuple[int, ...], ...], strat: Strategy,
                   out_strategy: Strategy | None, device_num: int, space: IterSpace,
                   cuts: dict[str, int], out_shape: tuple[int, ...] | None = None
                   ) -> OpSharding:
    """The generic rule: device matrix = cuts in canonical order [+ repeat]; layouts by map."""
    used = math.prod(cuts[it] for it in space.order)
    if device_num % used:
        raise StrategyError(f"{op.name}: strategy {strat} uses {used} devices, which does not "
                            f"divide device_num {device_num}")
    repeat = device_num // used
    # The repeated-calculation axis goes last (rightmost; MindSpore's default is the left).
    # With dp outermost and mp innermost, an op that uses only the dp cuts then holds the same
    # rows on the same ranks as its Megatron neighbours, so no redistribution is needed.
    dm = tuple(cuts[it] for it in space.order) + ((repeat,) if repeat > 1 else ())
    axis_of = {it: k for k, it in enumerate(space.order)}
    in_layouts = tuple(_layout(dm, axis_of, dims, shape)
                       for dims, shape in zip(space.inputs, shapes))
    oshape = out_shape if out_shape is not None else op.infer_shape(*shapes)
    reduced = [axis_of[it] for it in space.order if it not in space.output and cuts[it] > 1]
    raw_partial_axes = reduced if space.reduce == "sum" else []
    raw_out = _layout(dm, axis_of, space.output, oshape, raw_partial_axes)
    out = raw_out.with_partial(())
    if out_strategy is not None:
        out = _out_layout(op, raw_out, out_strategy, oshape)
    # Only partial axes are resolved here (AllReduce or ReduceScatter): no AllToAll involved.
    out_plan = plan(raw_out, out)
    return OpSharding(op, shapes, strat, dm, in_layouts, raw_out, out, out_plan,
                      iter_order=space.order, iter_cuts=tuple(cuts[it] for it in space.order),
                      repeat=repeat)


def _out_layout(op: Primitive, raw_out: TensorLayout, out_strategy: Strategy,
                shape: tuple[int, ...]) -> TensorLayout:
    """The output layout that out_strategy asks for: partial axes scattered onto the dims
    whose cut grows (MindSpore: ReduceScatter instead of AllReduce)."""
    if len(out_strategy) != 1 or len(out_strategy[0]) != len(shape):
        raise StrategyError(f"{op.name}: out_strategy {out_strategy} must hold one tuple of "
                            f"{len(shape)} cuts for the output of shape {shape}")
    want = out_strategy[0]
    dim_axes = [list(a) for a in raw_out.dim_axes]
    spare = list(raw_out.partial_axes)
    dm = raw_out.device_matrix
    for d, (c, axes) in enumerate(zip(want, raw_out.dim_axes)):
        have = math.prod(dm[a] for a in axes)
        if c == have:
            continue
        if c % have:
            raise StrategyError(f"{op.name}: out_strategy {out_strategy} cuts output dim {d} "
                                f"into {c}, which is not a multiple of its input cut {have}")
        need = c // have
        while need > 1 and spare:
            a = spare.pop(0)
            if need % dm[a]:
                raise StrategyError(f"{op.name}: out_strategy {out_strategy} cannot be made "
                                    f"from the partial axes of strategy (dim {d} needs {need})")
            dim_axes[d].append(a)
            need //= dm[a]
        if need != 1:
            raise StrategyError(f"{op.name}: out_strategy {out_strategy} asks output dim {d} "
                                f"for a cut of {c}, but only the reduced (partial) axes of the "
                                "input strategy can be scattered onto it")
    if spare:
        pending = sorted(raw_out.mesh.map_of_axis(a) for a in spare)  # as P[...] prints them
        raise StrategyError(f"{op.name}: out_strategy {out_strategy} leaves partial {pending} "
                            f"unresolved (raw output {raw_out}); every reduced axis must scatter "
                            "onto a dim")
    return TensorLayout.from_dim_axes(dm, dim_axes, shape)


Kernel = Callable[..., np.ndarray]
