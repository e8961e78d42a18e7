"""One interface for both cost models, so a search can use either and a report can show both.

A :class:`CostModel` prices the three things a strategy search compares:

* ``op(sharding, parameters, itemsize)``: one op under one strategy (its kernels forward and
  backward, its own collectives, the gradient sync of the parameters it reads);
* ``edge(plan, itemsize)``: one redistribution between two ops (forward and backward);
* ``program(program)``: a whole lowered program;
* ``memory(sharding, parameters, itemsize, kept_elsewhere, ...)``: the bytes per rank one op
  adds to a step's peak (its parameters with their gradients and optimizer state, the
  activations its backward keeps), which a search adds up and holds under
  ``memory_capacity``; ``keeps_output(op, ...)`` says whether an op's output is among them,
  so that its consumers do not count it again.

:class:`SimparCostModel` answers in seconds on a :class:`~simpar.cost.profile.DeviceProfile`
(the model of :mod:`simpar.cost.model`); :class:`MindSporeCostModel` answers in MindSpore's
units with MindSpore's objective (:mod:`simpar.cost.mindspore`). :func:`compare` prints a
program's ops under several models side by side.

>>> models = [SimparCostModel("ascend910a"), MindSporeCostModel()]   # doctest: +SKIP
>>> print(compare(program, models))                                   # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from simpar.collective_kinds import traffic
from simpar.cost import mindspore as ms
from simpar.cost.model import OPTIMIZER_STATE, evaluate
from simpar.cost.profile import DeviceProfile, load_profile
from simpar.cost.step_price import step_op_seconds
from simpar.cost_model_context import CostModelContext, cost_model_context
from simpar.mesh import DeviceMesh
from simpar.ops._base import OpSharding
from simpar.ops.comm_spec import CommSpec
from simpar.redistribution import RedistributionPlan

if TYPE_CHECKING:  # simpar.search imports this package: a run-time import would be a cycle
    from simpar.search.moves import MoveSteps

__all__ = ["CostModel", "MindSporeCostModel", "SimparCostModel", "compare"]


@runtime_checkable
class CostModel(Protocol):
    """What a strategy search needs of a cost model (lower is better, in ``unit``)."""

    @property
    def name(self) -> str: ...

    @property
    def unit(self) -> str: ...

    def op(self, sharding: OpSharding, parameters: Collection[int], itemsize: int,
           input_itemsizes: Sequence[int] | None = ...) -> float: ...

    def edge(self, plan: RedistributionPlan, itemsize: int) -> float: ...

    def program(self, program: Any) -> float: ...

    def memory(self, sharding: OpSharding, parameters: Collection[int], itemsize: int,
               kept_elsewhere: Collection[int] = ...,
               input_itemsizes: Sequence[int] | None = ...,
               involved: Collection[int] | None = ..., frozen: Collection[int] = ...,
               *args: Any) -> float: ...

    def keeps_output(self, op: Any, n_inputs: int, parameters: Collection[int],
                     involved: Collection[int], kept_elsewhere: Collection[int]) -> bool: ...

    @property
    def memory_capacity(self) -> float: ...


@dataclass(frozen=True)
class SimparCostModel:
    """simpar's model: seconds on ``profile``, seen from ``rank`` (groups are per rank)."""

    profile: DeviceProfile | str = "cpu-local"
    optimizer: str = "momentum"
    rank: int = 0
    #: How many micro-batches' activations are alive at once: a pipeline stage's in flight
    #: (its schedule's forwards ahead of their backwards); 1 otherwise.
    activation_copies: int = 1
    name: str = field(default="simpar", init=False)
    unit: str = field(default="s", init=False)
    #: :meth:`edge` depends on the fields alone: the searches' pricers of one model share
    #: the moves they price.
    fixed_edge_prices: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", load_profile(self.profile))

    @property
    def _profile(self) -> DeviceProfile:
        assert isinstance(self.profile, DeviceProfile)
        return self.profile

    def _spec_seconds(self, spec: CommSpec, itemsize: int) -> float:
        rank = self.rank % math.prod(spec.device_matrix)
        return self._profile.step_collective_seconds(
            str(spec.kind), spec.group(rank), spec.elements * itemsize,
            spec.recv_bytes(rank, itemsize))

    def op(self, sharding: OpSharding, parameters: Collection[int], itemsize: int,
           input_itemsizes: Sequence[int] | None = None) -> float:
        """Kernels forward and backward (twice the FLOPs and bytes), the op's own collectives
        both ways, and the AllReduce of every replicated parameter's gradient. ``itemsize``
        is the outputs' bytes per element, and the inputs' unless ``input_itemsizes``."""
        sh = sharding
        forward, backward = self.kernel_seconds(sh, itemsize, input_itemsizes)
        seconds = forward + backward
        # The backward as simpar.cotangent plans the op by itself (OpSharding.solo_backward):
        # its moves, then each parameter's gradient sum over its replicas (its Mirror).
        for spec in [*sh.forward_comm, *sh.backward_moves]:
            seconds += self._spec_seconds(spec, itemsize)
        for i in parameters:
            mirror = sh.input_grad_spec(i)
            if mirror is not None:  # the Mirror of a replicated parameter
                seconds += self._mirror_seconds(mirror, itemsize)
        return seconds

    def mirror_call_seconds(self, spec: CommSpec) -> float:
        """One Mirror call's fixed cost over ``spec``'s group, its bytes aside: the ring's
        rounds of latency and the wait for the slowest rank (at least 0). What a gradient's
        share of its bucket's calls costs (the Pricer, under a ``comm_fusion`` that makes
        the calls many)."""
        rank = self.rank % math.prod(spec.device_matrix)
        return max(0.0, self._profile.step_collective_seconds("AllReduce", spec.group(rank),
                                                              0, 0))

    def kernel_seconds(self, sharding: OpSharding, itemsize: int,
                       input_itemsizes: Sequence[int] | None = None) -> tuple[float, float]:
        """The op's forward kernel and its backward (twice the FLOPs and bytes)."""
        sh, prof = sharding, self._profile
        sizes = input_itemsizes or (itemsize,) * len(sh.in_layouts)
        nbytes = (sum(lay.local_size() * b for lay, b in zip(sh.in_layouts, sizes))
                  + itemsize * sum(raw.local_size() for raw, _, _ in sh.outputs))
        dtype = {2: "float16", 4: "float32", 8: "float64"}.get(itemsize, "float32")
        flops = sh.local_flops()
        return (prof.compute_seconds(flops, nbytes, dtype),
                prof.compute_seconds(2 * flops, 2 * nbytes, dtype))

    def step_op(self, sharding: OpSharding, parameters: Collection[int], itemsize: int,
                input_itemsizes: Sequence[int] | None = None, **dimensions: Any) -> float:
        """The op's share of a whole step with the memory dimensions (``shards``,
        ``micro_batches``, ``recomputed``): :func:`~simpar.cost.step_price.step_op_seconds`."""
        return step_op_seconds(self, sharding, parameters, itemsize, input_itemsizes,
                               **dimensions)

    def _mirror_seconds(self, spec: CommSpec, itemsize: int) -> float:
        """A parameter's share of the fused gradient AllReduce: its bytes at the link's
        bandwidth. The program fuses every Mirror of a group into one call, so the call's
        fixed costs belong to no single op."""
        rank = self.rank % math.prod(spec.device_matrix)
        group = spec.group(rank)
        if len(group) < 2:
            return 0.0
        link = self._profile.link(group)
        return traffic("AllReduce", len(group), spec.elements * itemsize) / link.bandwidth

    def edge(self, plan: RedistributionPlan, itemsize: int) -> float:
        """Every collective of ``plan`` forward, and its adjoint backward."""
        seconds = 0.0
        for step in plan.steps:
            if step.kind.local:
                continue
            rank = self.rank % step.src.device_num
            group = (step.src.mesh.group_of(rank, step.device_axes) if step.device_axes
                     else tuple(range(step.src.device_num)))  # a direct exchange: everyone
            # An AllToAllV's adjoint receives what the forward sends; for the even shards
            # simpar plans that is what it receives, and far cheaper to count.
            recv = step.recv_bytes(rank, itemsize) if step.kind.facts.by_pieces else 0
            prof = self._profile
            seconds += (prof.step_collective_seconds(str(step.kind), group,
                                                     step.src.local_size() * itemsize, recv)
                        + prof.step_collective_seconds(str(step.kind.adjoint), group,
                                                       step.dst.local_size() * itemsize, recv))
        return seconds

    def edge_prices(self, mesh: DeviceMesh, steps: Sequence[MoveSteps], itemsize: int
                    ) -> np.ndarray:
        """:meth:`edge` of many plans at once, bit for bit: ``steps`` are their steps in plan
        order over the device axes of ``mesh``
        (:func:`~simpar.search.moves.move_steps`)."""
        seconds = np.zeros(len(steps[0].present) if steps else 0)
        prof = self._profile
        rank = self.rank % mesh.size
        for step in steps:
            if step.kind.local:
                continue
            at = np.flatnonzero(step.present)
            if not at.size:
                continue
            masks, which = np.unique(step.axes[at], return_inverse=True)
            groups = [_group_of_mask(mesh, rank, int(m)) for m in masks]
            seconds[at] += (
                prof.step_collectives_seconds(str(step.kind), groups, which,
                                              step.src_elements[at] * itemsize)
                + prof.step_collectives_seconds(str(step.kind.adjoint), groups, which,
                                                step.dst_elements[at] * itemsize))
        return seconds

    def program(self, program: Any) -> float:
        return evaluate(program, self._profile, self.optimizer).step_seconds

    @property
    def memory_capacity(self) -> float:
        """The profile's device memory."""
        return float(self._profile.memory_capacity)

    #: :meth:`memory` prices optimizer slices and recomputation (``sliced``, ``recomputed``).
    prices_memory_dimensions = True

    def memory(self, sharding: OpSharding, parameters: Collection[int], itemsize: int,
               kept_elsewhere: Collection[int] = frozenset(),
               input_itemsizes: Sequence[int] | None = None,
               involved: Collection[int] | None = None, frozen: Collection[int] = (),
               sliced: Mapping[int, tuple[int, bool]] | None = None,
               recomputed: tuple[bool, bool] = (False, False)) -> float:
        """Bytes per rank: each trainable parameter's shard (positions ``parameters``) with
        its gradient and the optimizer's state, each ``frozen`` one's shard alone, and what the
        op's tape keeps for the backward (:class:`~simpar.ops.kernels.Tape`), once per
        micro-batch in flight (``activation_copies``). Inputs in
        ``kept_elsewhere`` (a producer's tape holds the same array, or a parameter another op
        counts) and parameters are not counted as activations. (``involved`` is MindSpore's.)
        ``sliced`` maps a parameter position optimizer parallel slices to (the ranks its
        slices spread over, whether the tape keeps the gathered copy: the op keeps that input
        and the level is not 3); ``recomputed`` is (the op is recomputed: its tape is not
        kept, whether it opens the recomputed Cell: its input 0 is what the Cell keeps).
        An estimate per op: :func:`~simpar.cost.model.evaluate` counts a whole program's
        arrays once each and adds the transient buffers."""
        sh = sharding
        sizes = input_itemsizes or (itemsize,) * len(sh.in_layouts)
        ins = [lay.local_size() * b for lay, b in zip(sh.in_layouts, sizes)]
        outs = sum(raw.local_size() * itemsize for raw, _, _ in sh.outputs)
        copies = 2 + OPTIMIZER_STATE[self.optimizer]
        total = float(sum(ins[i] for i in frozen))
        for i in parameters:
            ranks, gathered = (sliced or {}).get(i, (1, False))
            total += copies * ins[i] / ranks + (ins[i] if gathered else 0)
        if recomputed[0]:
            kept = ins[0] if recomputed[1] and sh.in_layouts else 0
            return total + self.activation_copies * kept
        skip = {*parameters, *frozen, *kept_elsewhere}
        tape = str(sh.op.tape)
        kept = sum(ins[k] for k in _tape_inputs(tape, [k for k in range(len(ins))
                                                       if k not in skip]))
        if tape in ("inputs+output", "output"):
            kept += outs
        elif tape in ("new-like-input", "input+new"):
            kept += ins[0]
        elif tape == "mask":
            kept += sh.in_layouts[0].local_size()
        return total + self.activation_copies * kept

    def transient(self, sharding: OpSharding, gradients: Mapping[int, float], itemsize: int,
                  input_itemsizes: Sequence[int] | None = None,
                  gathered: Mapping[int, tuple[int, bool]] | None = None) -> float:
        """Bytes per rank the op holds for a while beside every array :meth:`memory` counts,
        as :func:`~simpar.cost.model.evaluate` adds the largest such of a program: while
        its backward runs, its outputs' cotangents, the gradients of the inputs in
        ``gradients`` (position: the share of that gradient already counted, a sliced
        parameter's slice; 0 for an activation's), the weights level3 gathers again for it,
        and its kernels' workspace; while one of its own collectives runs, the collective's
        buffer and its result, and so while optimizer parallel gathers a weight it reads
        (``gathered``: position -> the ranks its slices spread over, whether it is gathered
        again for the backward)."""
        sh = sharding
        sizes = input_itemsizes or (itemsize,) * len(sh.in_layouts)
        ins = [lay.local_size() * b for lay, b in zip(sh.in_layouts, sizes)]
        backward = float(sum(raw.local_size() * itemsize for raw, _, _ in sh.outputs))
        backward += sum(ins[k] * (1.0 - stored) for k, stored in gradients.items())
        backward += sh.op.workspace(tuple(lay.local_shape() for lay in sh.in_layouts),
                                    sh.raw_out.local_shape()) * itemsize
        held = 0.0
        for k, (ranks, again) in (gathered or {}).items():
            held = max(held, ins[k] * (1.0 + 1.0 / ranks))   # the slice and the whole
            backward += ins[k] if again else 0.0
        for spec in [*sh.forward_comm, *sh.internal_backward]:
            result = spec.elements if spec.step is None else (
                spec.step.src if spec.adjoint else spec.step.dst).local_size()
            held = max(held, (spec.elements + result)
                       * (itemsize if spec.on_output or not sizes else sizes[0]))
        return float(max(backward, held))

    def keeps_output(self, op: Any, n_inputs: int, parameters: Collection[int],
                     involved: Collection[int], kept_elsewhere: Collection[int]) -> bool:
        """Whether ``op``'s tape holds its output (its consumers then share that array)."""
        return str(op.tape) in ("inputs+output", "output")

    #: Arrays are shared, as :func:`~simpar.cost.model.evaluate` counts them: an input one
    #: op's tape keeps is not counted again by later readers, nor through views (Reshape).
    shares_arrays = True

    @staticmethod
    def kept_inputs(op: Any, roles: Sequence[tuple[str, bool]]) -> list[int]:
        """The input positions ``op``'s tape keeps as they are (not parameters)."""
        return _tape_inputs(str(op.tape), [k for k, (role, _) in enumerate(roles)
                                           if role == "free"])


@lru_cache(maxsize=1 << 16)
def _group_of_mask(mesh: DeviceMesh, rank: int, mask: int) -> tuple[int, ...]:
    """``rank``'s group over the device axes of ``mesh`` whose bits ``mask`` sets."""
    return mesh.group_of(rank, tuple(a for a in range(mesh.ndim) if mask >> a & 1))


def _tape_inputs(tape: str, free: list[int]) -> list[int]:
    """Which of the ``free`` input positions a tape of kind ``tape`` keeps as they are."""
    if tape in ("inputs+output", "inputs"):
        return free
    if tape == "input+new":
        return [0] if 0 in free else []
    return [1] if tape == "indices" and 1 in free else []


@dataclass(frozen=True)
class MindSporeCostModel:
    """MindSpore's model: its objective in its units (bytes of slices), under ``ctx`` (None:
    the process's ``set_cost_model_context`` when priced; a plan request fixes it when built).
    """

    ctx: CostModelContext | None = None
    name: str = field(default="mindspore", init=False)
    unit: str = field(default="MindSpore cost (bytes of slices)", init=False)

    @property
    def fixed_edge_prices(self) -> bool:
        """Whether :meth:`edge` depends on the fields alone: with its own context, not the
        process's read when priced."""
        return self.ctx is not None

    def op(self, sharding: OpSharding, parameters: Collection[int], itemsize: int,
           input_itemsizes: Sequence[int] | None = None) -> float:
        cost = ms.op_cost(sharding, parameters, itemsize, input_itemsizes=input_itemsizes)
        return ms.objective(cost, sharding.strategy, math.prod(sharding.device_matrix), self.ctx)

    def edge(self, plan: RedistributionPlan, itemsize: int) -> float:
        return ms.edge_objective(ms.redistribution_cost(plan, itemsize), self.ctx)

    def program(self, program: Any) -> float:
        return sum(_op_total(self, s) for s in program.steps)

    @property
    def memory_capacity(self) -> float:
        """``device_memory_capacity`` of the cost-model context."""
        return float(self._context.device_memory_capacity)

    def memory(self, sharding: OpSharding, parameters: Collection[int], itemsize: int,
               kept_elsewhere: Collection[int] = frozenset(),
               input_itemsizes: Sequence[int] | None = None,
               involved: Collection[int] | None = None, frozen: Collection[int] = ()
               ) -> float:
        """MindSpore's memory of the op (training or inference per ``run_phase``):
        ``parameters`` and ``frozen`` are its Parameters, ``involved`` the inputs computed
        from one, ``kept_elsewhere`` its ``prev_in_memory``."""
        params = {*parameters, *frozen}
        cost = ms.op_cost(sharding, params, itemsize,
                          involved=None if involved is None else {*involved, *params},
                          prev_in_memory=kept_elsewhere, input_itemsizes=input_itemsizes)
        return cost.memory if self._context.training else cost.inference_memory

    @property
    def _context(self) -> CostModelContext:
        return self.ctx if self.ctx is not None else cost_model_context()

    def keeps_output(self, op: Any, n_inputs: int, parameters: Collection[int],
                     involved: Collection[int], kept_elsewhere: Collection[int]) -> bool:
        """MindSpore's ``is_output_in_memory`` of the op's cost class."""
        return ms.keeps_output(op, n_inputs, parameters, involved, kept_elsewhere)


def _op_total(model: CostModel, step: Any) -> float:
    """An op step's own cost plus the redistributions of its inputs."""
    node, sh = step.node, step.sharding
    itemsize = node.outputs[0].dtype.itemsize
    params = {k for k, v in enumerate(node.inputs) if v.kind == "param"}
    return model.op(sh, params, itemsize, [v.dtype.itemsize for v in node.inputs]) + sum(
        model.edge(p, v.dtype.itemsize) for v, p in zip(node.inputs, step.in_plans) if p.steps)


def compare(program: Any, models: Sequence[CostModel]) -> str:
    """A table: every op of ``program`` (its own cost plus its inputs' redistributions) under
    each model, then each model's whole-program figure."""
    header = ["op", "strategy"] + [f"{m.name} ({m.unit})" for m in models]
    rows = [header]
    for s in program.steps:
        name = "/".join(s.node.name.rsplit("/", 2)[-2:])
        rows.append([name, str([list(c) for c in s.sharding.strategy]).replace(" ", "")]
                    + [f"{_op_total(m, s):.6g}" for m in models])
    rows.append(["whole program", ""] + [f"{m.program(program):.6g}" for m in models])
    widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if k < 2 else c.rjust(w)
                               for k, (c, w) in enumerate(zip(r, widths))) for r in rows)
