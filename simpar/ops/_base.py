"""The operator framework: primitives, their registry, and the sharding of one op.

A :class:`Primitive` has a numpy kernel and its VJP (single device), and a sharding rule that
turns ``(input shapes, strategy, device_num)`` into an :class:`OpSharding`: the op's device
matrix, a layout for every input, the layout its local kernel produces (possibly partial), the
layout of its output after the op's own collectives, and the collectives it runs forward and
backward (:class:`~simpar.ops.comm_spec.CommSpec`). The rule is pure, and so is its result:
:mod:`simpar.runtime` runs it on this rank's shards, handing the op's per-rank kernels
(``local_forward``/``local_backward``) the :class:`~simpar.ops.comm_spec.Collectives` they
call mid-kernel.

Most primitives are described by an *iteration space* (:class:`~simpar.ops.strategy.IterSpace`),
as in einsum: every tensor dimension names an iteration dimension, the strategy cuts iteration
dimensions, and an iteration dimension that is cut but absent from the output leaves the
local result a partial sum. The device matrix lists the cuts of the iteration dimensions in
the op's canonical order; when the strategy uses fewer devices than ``device_num``, the
remaining factor is a *repeated calculation* axis put last (rightmost) in the device matrix,
so that ``repeat`` consecutive ranks compute the same shard. MindSpore's default puts it
first; simpar puts it last so that data-parallel-only ops line up with dp-outer, mp-inner
hybrids (docs/design.md#repeated-calculation-goes-on-the-right).

Run by itself (``run_op``; a cost model pricing one op), an op's backward computes on every
rank that rank's *contribution*; contributions of a value replicated over some device axes
sum, over those axes, to its true gradient. Its replicated output's cotangent is therefore
divided by its number of replicas, and an input's gradient is completed by an AllReduce over
the axes it is pending on (MindSpore's Mirror, for a parameter): :attr:`OpSharding.solo_backward`,
planned by :func:`simpar.cotangent.solo_backward` as a program's backward is (a program keeps
a cotangent whole where the replicas compute alike:
docs/design.md#gradient-semantics-the-backward-is-planned-with-layouts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, overload

import numpy as np

from simpar import context
from simpar.cotangent import SoloBackward, solo_backward
from simpar.layout import TensorLayout
from simpar.ops.comm_spec import ONE_DEVICE, Collectives, CommSpec, action_comm, plan_comm
from simpar.ops.facts import DEFAULTS, CostClass, undeclared
from simpar.ops.kernels import Inline, Tape, shape_only
from simpar.ops.strategy import (
    IterSpace,
    Strategy,
    StrategyError,
    as_strategy,
    check_device_num,
    check_shard_strategy,
    divisors,
    iteration_cuts,
)
from simpar.redistribution import RedistributionPlan, StepKind, plan

__all__ = ["OpSharding", "Primitive", "build_sharding", "recording", "register", "registry"]


# ------------------------------------------------------------------ registry
_REGISTRY: dict[str, type[Primitive]] = {}


_P = TypeVar("_P", bound="type[Primitive]")


@overload
def register(cls: _P, /) -> _P: ...
@overload
def register(*, mindspore_cost: CostClass = ..., elementwise: bool = ...
             ) -> Callable[[_P], _P]: ...
def register(cls: _P | None = None, /, **facts: Any) -> _P | Callable[[_P], _P]:
    """Class decorator: make a primitive findable by name (``registry()["MatMul"]``).
    ``@register(mindspore_cost=..., elementwise=...)`` also declares the op's facts
    (:mod:`simpar.ops.facts`), as a class body may.

    >>> @register(mindspore_cost=CostClass.RELU6, elementwise=True)
    ... class Exp2(Primitive):
    ...     pass
    >>> Exp2.mindspore_cost, Exp2.undeclared_facts
    (<CostClass.RELU6: 'ReLU6Cost'>, ())
    >>> _ = _REGISTRY.pop("Exp2")
    """
    unknown = sorted(set(facts) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"register: {unknown[0]!r} is not an op fact; the facts are "
                        f"{', '.join(DEFAULTS)}")
    for fact, value in facts.items():
        kind = type(DEFAULTS[fact])
        if type(value) is not kind:
            raise TypeError(f"register: {fact} must be a {kind.__name__}, got {value!r} of "
                            f"type {type(value).__name__}")

    def add(op: _P) -> _P:
        for fact, value in facts.items():
            setattr(op, fact, value)
        op.undeclared_facts = tuple(f for f in op.undeclared_facts if f not in facts)
        _REGISTRY[op.__name__] = op
        return op

    return add if cls is None else add(cls)


def registry() -> dict[str, type[Primitive]]:
    """Every registered primitive class by MindSpore name."""
    return dict(_REGISTRY)


#: How many shardings :meth:`Primitive.sharding` keeps (the searches price the same ops'
#: candidates in every pricer, lowering shards what they chose, and a process plans the same
#: model again and again: a test suite, the memory dimensions, a pipeline's stage counts).
SHARDINGS_KEPT = 16384
_SHARDINGS: dict[tuple[Any, ...], OpSharding] = {}


# ------------------------------------------------------------------ the sharding of one op
@dataclass(frozen=True)
class OpSharding:
    """One op's sharding rule applied: everything the runtime needs to run the op on its
    shards, as values (nothing here runs).

    ``raw_out`` is what the local kernel yields; ``out`` the output after the op's forward
    collectives (``out_plan``). ``inner_plan`` is a redistribution of input 0 that the op runs
    before its kernel (Reshape's). ``internal_forward``/``internal_backward`` are the op's own
    collectives, in the order its kernel runs them (split Softmax and LayerNorm statistics).
    ``forward_comm``/``backward_comm`` list every collective of the op run by itself, with the
    input-gradient AllReduces (over each input's replica axes) at the end of backward.

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

    def in_slices_on(self, rank: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per input, what ``rank`` (of the op's devices, :attr:`Collectives.rank`) holds:
        ``in_layouts[k].slice_of(rank)``. On rank 5 of a Gather whose table (64, 16) is split
        ``((8, 1), (1, 1))``, input 0 holds rows ``(40, 48)``."""
        return tuple(lay.slice_of(rank) for lay in self.in_layouts)

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

    @property
    def forward_comm(self) -> list[CommSpec]:
        """Every collective of the forward, in the order it runs."""
        specs = self.inner_comm() + list(self.internal_forward)
        for k, (_, _, p) in enumerate(self.outputs):
            specs += plan_comm(p, "output" if k == 0 else f"output {k}", on_output=True)
        return specs

    @functools.cached_property
    def solo_backward(self) -> SoloBackward:
        """The backward of this op run by itself (``run_op``; a cost model pricing one op),
        planned by :func:`simpar.cotangent.solo_backward` as a program's backward is: each
        output's cotangent held as contributions (divided among its replicas, but whole over
        :meth:`share_axes`), each input's gradient summed over the axes it is pending on."""
        return solo_backward(self, [self.share_axes(k) for k in range(len(self.outputs))])

    @property
    def backward_moves(self) -> list[CommSpec]:
        """The collectives of :attr:`solo_backward` before its gradient sums, in the order
        they run: the outputs' adjoints (last output first), the op's own
        (``internal_backward``), the adjoint of its inner redistribution."""
        planned = self.solo_backward.op
        specs: list[CommSpec] = []
        for k in reversed(range(len(self.outputs))):
            for a in planned.out_actions[k]:
                specs += action_comm((a,), f"adjoint of output {k} {a.step.kind}", True)
        return (specs + list(self.internal_backward)
                + action_comm(planned.inner_actions, "adjoint of redistribution before "
                              f"{self.op.name.lower()}", False))

    @property
    def backward_comm(self) -> list[CommSpec]:
        """Every collective of ``run_op``'s backward, in order: :attr:`backward_moves`, then
        the AllReduce completing each differentiable input's gradient (a program runs its
        own backward plan instead, whose Mirrors complete parameters' gradients)."""
        grads = []
        for i in range(len(self.in_layouts)):
            if self.op.differentiable(i):
                spec = self.input_grad_spec(i)
                if spec is not None:
                    grads.append(spec)
        return self.backward_moves + grads

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
        """The AllReduce that completes input ``i``'s gradient when the op runs by itself:
        over the axes :attr:`solo_backward` leaves it pending on (its replicas); None if
        none."""
        lay = self.in_layouts[i]
        pending = self.solo_backward.sums[i]
        axes = tuple(a for a in lay.replica_axes if a in pending)
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
    #: The op's facts (:mod:`simpar.ops.facts`): which MindSpore cost class prices it and
    #: whether MindSpore counts it elementwise. Each op declares them where it registers
    #: (:func:`register`) or in its own body; they are not inherited (:meth:`__init_subclass__`).
    mindspore_cost: ClassVar[CostClass] = CostClass.DEFAULT
    elementwise: ClassVar[bool] = False
    #: The facts this class's own body left out, which hold the defaults.
    undeclared_facts: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A subclass is another op (its name is its class name): it gets its own facts or
        # the defaults, never its parent's (MindSpore keys its tables by op name).
        super().__init_subclass__(**kwargs)
        cls.undeclared_facts = undeclared(cls)
        for fact in cls.undeclared_facts:
            setattr(cls, fact, DEFAULTS[fact])

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
        """The primitive's attributes (for printing and strategy files). Every attribute its
        sharding depends on must be here: equal reprs share one derived sharding
        (:meth:`sharding`), as they share one signature in the searches."""
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
        """Set the strategy: one tuple of cuts per input (and optionally per output), checked
        as MindSpore checks it (tuples, not lists)."""
        check_shard_strategy(in_strategy, self.name, "in_strategy")
        strategy = as_strategy(in_strategy, self.name, "in_strategy")
        out = None
        if out_strategy is not None:
            check_shard_strategy(out_strategy, self.name, "out_strategy")
            if not self.supports_out_strategy:
                raise StrategyError(f"{self.name}: out_strategy is not supported for this "
                                    "operator (MindSpore accepts it for MatMul/BatchMatMul)")
            out = as_strategy(out_strategy, self.name, "out_strategy")
        if len(strategy) != self.n_inputs:
            raise StrategyError(f"{self.name}: the strategy has {len(strategy)} "
                                f"entries but the operator has {self.n_inputs} inputs; give "
                                "one tuple of cuts per input")
        self.in_strategy, self.out_strategy = strategy, out   # only once every check passed
        return self

    # -- single-device maths (subclasses)
    def infer_shape(self, *shapes: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError

    def output_shapes(self, *shapes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Every output's shape (default: :meth:`infer_shape`'s, for each of ``n_outputs``;
        a training BatchNorm's statistics are (C,))."""
        return (self.infer_shape(*shapes),) * self.n_outputs

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

    def strategy_of(self, space: IterSpace, cuts: Mapping[str, int]) -> Strategy:
        """The strategy that cuts the iteration dims as ``cuts`` says: each input's dims'
        cuts (OneHot's strategy cuts its output instead). Searches that walk iteration dims
        (recursive programming) build their strategies with it."""
        return tuple(tuple(cuts[it] if it is not None else 1 for it in dims)
                     for dims in space.inputs)

    def strategy_dims(self, space: IterSpace, shapes: Sequence[tuple[int, ...]]
                      ) -> tuple[tuple[tuple[str | None, ...], tuple[int, ...]], ...]:
        """Per entry of a strategy: the iteration dims it cuts and their sizes (each input's,
        by default; :meth:`strategy_of`'s inverse)."""
        return tuple(zip(space.inputs, (tuple(s) for s in shapes)))

    def workspace(self, local_in: tuple[tuple[int, ...], ...], local_out: tuple[int, ...]
                  ) -> int:
        """Elements (of the output's dtype) the local kernels hold at once beside their
        inputs, outputs, tape, cotangent and input gradients, forward or backward: what the
        cost model adds to the op's backward transient. Default 0 (an op's temporaries are a
        few arrays of its own sizes); a convolution's unrolled windows are many times its
        input."""
        return 0

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
        strat = self.in_strategy if strategy is None else as_strategy(strategy, self.name,
                                                                        "strategy")
        if strat is None:
            strat = self.default_strategy(shapes_t, device_num)
        out_s = self.out_strategy if strategy is None else (
            None if out_strategy is None else as_strategy(out_strategy, self.name,
                                                           "out_strategy"))
        check_device_num(device_num, self.name)
        self._check_strategy_shape(strat, shapes_t)
        self._check_settings(strat, shapes_t)
        # Equal ops (type and repr, as the searches' signatures) on equal shapes under equal
        # strategies shard alike: derived once per process, while the memo keeps it.
        key = (type(self), repr(self), shapes_t, strat, out_s, device_num, enable_alltoall)
        found = _SHARDINGS.get(key)
        if found is None:
            found = _SHARDINGS[key] = self._sharding(shapes_t, strat, out_s, device_num,
                                                     enable_alltoall)
            if len(_SHARDINGS) > SHARDINGS_KEPT:
                del _SHARDINGS[next(iter(_SHARDINGS))]   # the oldest
        return found if found.op is self else dataclasses.replace(found, op=self)

    def _check_settings(self, strat: Strategy, shapes: tuple[tuple[int, ...], ...]) -> None:
        """Refuse a strategy for a reason of the settings, not of the op (MatMul's slice
        alignment): checked on every call, before the memo of derived shardings, whose key
        is the op, the shapes and the strategy only."""

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
        cuts = iteration_cuts(self.name, space, strat, shapes)
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
        for dims, shape in self.strategy_dims(space, shapes_t):
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
                strat = self.strategy_of(space, chosen)
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
    def local_forward(self, sh: OpSharding, *xs: np.ndarray,
                      collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray, Any]:
        """The kernel on the shards, and ``(xs, y)`` for :meth:`vjp` as :attr:`tape` says:
        without ``y`` for ``Tape.INPUTS``; for ``Tape.NOTHING``, each input's
        :func:`shape_only` stand-in (a VJP that reads only ``dy`` and the shapes). An op
        whose kernel needs this rank's place or one of its own collectives overrides it and
        asks ``collectives`` (the runtime hands its own; alone, one device)."""
        y = self.kernel(*xs)
        tape = self.tape
        if tape is Tape.INPUTS:
            return y, (xs, None)
        if tape is Tape.NOTHING:
            return y, (tuple(shape_only(x.shape, x.dtype) for x in xs), None)
        return y, (xs, y)

    def keeps_input(self, k: int) -> bool:
        """Whether the tape :meth:`local_forward` returns holds input ``k`` itself (the array
        it was given): what the cost model counts among the activations, and what
        optimizer-parallel level3 gathers again for the backward when it drops a weight.
        By :attr:`tape`: every input for ``INPUTS``/``INPUTS_AND_OUTPUT``, input 0 for
        ``INPUT_AND_NEW``, the indices (input 1) for ``INDICES``; an op whose own tape keeps
        an input otherwise says so (LayerNorm's gamma)."""
        tape = self.tape
        if tape in (Tape.INPUTS_AND_OUTPUT, Tape.INPUTS):
            return True
        return (tape is Tape.INPUT_AND_NEW and k == 0) or (tape is Tape.INDICES and k == 1)

    def local_backward(self, sh: OpSharding, saved: Any, dy: Any,
                       collectives: Collectives = ONE_DEVICE) -> tuple[np.ndarray | None, ...]:
        """Gradient contributions of every input from the tape and the raw output's
        cotangent ``dy`` (a tuple for a multi-output op); ``collectives`` as in
        :meth:`local_forward`."""
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
    dm = dm or (1,)   # an op of 0-d tensors on one device: one axis of one device
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
