"""The per-rank program of a traced graph: :class:`ParallelProgram`, what
:func:`~simpar.runtime.lowering.lower` makes of a graph and its strategy map.

It is a frozen value: every op's sharding and the redistributions feeding it, every value's
and parameter's layout (:class:`~simpar.runtime.lowered.LoweredGraph`), the backward plans
for the seeds lowering chose (:mod:`simpar.runtime.backward_plan`: each planned when first
read, a function of the lowered graph and its seeds), the strategy map it came from.
Execution is the per-rank program: forward runs each op's local kernel and collectives on
this rank's shards; backward runs every op's VJP in reverse with the actions the backward plan
lists for each cotangent (whole or pending, :mod:`simpar.cotangent`), then the Mirrors. What
running derives and keeps (compiled executors, schedules) lives in the program's
:class:`~simpar.runtime.runner.ProgramRunner`, not in the program.

:meth:`ParallelProgram.schedule` is the flat list of what a rank runs
(:mod:`simpar.runtime.program_schedule`); execution is checked against it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpar.cost.model import CostReport, evaluate
from simpar.cost.profile import DeviceProfile
from simpar.cotangent import Action
from simpar.layout import TensorLayout
from simpar.ops._base import Primitive
from simpar.redistribution import LOCAL_KINDS, StepKind
from simpar.runtime.backward_plan import BackwardPlan
from simpar.runtime.executor import Executor
from simpar.runtime.lowered import LoweredGraph
from simpar.runtime.program_schedule import ProgramStep
from simpar.runtime.runner import ProgramRunner, Seeds, StepTape
from simpar.search import StrategyMap

__all__ = ["IndexLimits", "ParallelProgram"]

#: Per graph input, the ops that read it as indices: ``(op, position, limit)``.
IndexLimits = tuple[tuple[tuple[Primitive, int, int], ...], ...]


@dataclass(frozen=True, kw_only=True)
class ParallelProgram(LoweredGraph):
    """The per-rank program for one traced graph on ``device_num`` devices, lowered from
    ``strategy_map`` in ``mode``. ``backward_plans`` holds, per set of seeded outputs, the
    backward lowering chose; ``index_limits``, per graph input, the ops reading it as
    indices (``(op, position, limit)``, through ops that only move values). Nothing
    reassigns or fills its fields once lowered; ``runner`` runs it and keeps what running
    derives."""

    mode: str
    strategy_map: StrategyMap | None = None
    backward_plans: Mapping[Seeds, BackwardPlan]
    index_limits: IndexLimits = ()
    runner: ProgramRunner = field(compare=False, repr=False)

    def backward_plan(self, seeded: Sequence[bool] | None = None) -> BackwardPlan:
        """Where every cotangent is pending and what the backward runs for it
        (:mod:`simpar.cotangent`), for the outputs ``seeded`` says get a cotangent
        (default: all), each seeded whole: the plan lowering chose."""
        return self.runner.backward_plan(seeded)

    # ------------------------------------------------------------ the flat per-rank program
    def schedule(self, rank: int, seeded: Sequence[bool] | None = None
                 ) -> tuple[ProgramStep, ...]:
        """Every step ``rank`` runs for one forward and backward, in order: kernels,
        redistribution collectives, ops' own collectives, Mirrors. ``seeded`` says which
        outputs get a cotangent (default: all); the backward skips what they do not reach."""
        return self.runner.schedule(rank, seeded)

    def rank_classes(self, ranks: Sequence[int], link: Callable[[tuple[int, ...]], Hashable]
                     ) -> tuple[tuple[int, ...], ...]:
        """``ranks`` in classes whose schedules price alike: the same steps, every group the
        same size on the same ``link`` (:meth:`DeviceProfile.link`), the same bytes moved. A
        cost model prices one rank per class."""
        return self.runner.rank_classes(ranks, link)

    def cost(self, profile: str | DeviceProfile = "cpu-local", optimizer: str = "momentum"
             ) -> CostReport:
        """Predicted step time and per-rank peak memory on ``profile``
        (:func:`simpar.cost.evaluate`)."""
        return evaluate(self, profile, optimizer)

    def schedule_text(self, rank: int = 0) -> str:
        """The schedule of ``rank``, one step per line."""
        steps = self.schedule(rank)
        comm_steps = [s for s in steps if s.collective is not None]
        head = (f"rank {rank}: {len(steps)} steps, {len(comm_steps)} collectives, "
                f"{sum(s.recv_bytes for s in comm_steps)} bytes received")
        return "\n".join([head, *(str(s) for s in steps)])

    def repeated(self) -> dict[str, int]:
        """{op name: how many ranks compute each of its shards}, for every op computed on more
        than one rank alike (MindSpore's repeated calculation)."""
        return {s.node.name: s.repeat for s in self.steps if s.repeat > 1}

    # ------------------------------------------------------------ description
    def input_layouts(self) -> list[TensorLayout]:
        return [self.layouts[v.id] for v in self.graph.inputs]

    def output_layouts(self) -> list[TensorLayout]:
        return [self.layouts[v.id] for v in self.graph.outputs]

    def refused_input(self, local_inputs: Sequence[np.ndarray]) -> ValueError | None:
        """The error for the first index in this rank's input shards outside the range an
        op reading it allows (:attr:`index_limits`), else None."""
        for x, limits in zip(local_inputs, self.index_limits):
            if not limits or not x.size or x.dtype.kind not in "iu":
                continue
            lo, hi = int(x.min()), int(x.max())
            for op, k, limit in limits:
                if lo < 0 or hi >= limit:
                    return ValueError(op.index_error(k, lo if lo < 0 else hi, limit))
        return None

    def mirror_group(self, name: str, rank: int) -> tuple[int, ...]:
        """The ranks whose gradients of parameter ``name`` are summed (size 1: no Mirror):
        its replicas over which the gradient is pending. Replicas that computed the same
        gradient (a bias after a row-parallel MatMul, over the model-parallel ranks) are not
        among them."""
        return self.backward_plan().mirror_group(self, name, rank)

    def loss_batch_cut(self) -> int:
        """How many ways the batch (dim 0 of its first input) is cut at the op producing the
        first output: the data-parallel degree ``D`` that summed gradients scale with."""
        out = self.graph.outputs[0]
        step = next(s for s in self.steps if s.node is out.producer)
        first = step.sharding.in_layouts[0]
        return first.cuts[0] if first.ndim else 1

    def strategies(self) -> dict[str, list[list[int]]]:
        """{op name: strategy} for every node (what a strategy file records)."""
        return {s.node.name: [list(c) for c in s.sharding.strategy] for s in self.steps}

    def __str__(self) -> str:
        lines = [f"ParallelProgram: {self.mode}, {self.device_num} devices, "
                 f"{len(self.steps)} ops, {len(self.param_layouts)} parameters"]
        for v in self.graph.inputs:
            lines.append(f"  input {v.name}{list(v.shape)}: {self.layouts[v.id]}")
        for name, lay in self.param_layouts.items():
            g = self.mirror_group(name, 0)
            mirror = f"  Mirror AllReduce over {len(g)} ranks" if len(g) > 1 else ""
            lines.append(f"  param {name}{list(lay.shape)}: {lay}{mirror}")
        for s in self.steps:
            sh = s.sharding
            repeat = f", computed alike on {s.repeat} ranks" if s.repeat > 1 else ""
            lines.append(f"  [{s.node.id}] {s.node.op.name} {[list(c) for c in sh.strategy]}"
                         f" ({s.chosen}{repeat}) dev{list(sh.device_matrix)}  {s.node.name}")
            for k, p in enumerate(s.in_plans):
                if p.steps:
                    kinds = ", ".join(st.kind + (f"{list(st.device_axes)}" if st.device_axes
                                                 else "") for st in p.steps)
                    lines.append(f"      redistribute input {k}: {p.src} -> {p.dst}: {kinds}")
            fwd = [c.kind for c in sh.forward_comm]
            if fwd:
                lines.append(f"      forward comm: {', '.join(fwd)}")
            lines.append(f"      out: {sh.out}")
        return "\n".join(lines)

    def comm_table(self, rank: int = 0) -> list[dict[str, Any]]:
        """One row per op: name, strategy, collectives forward and backward (for printing)."""
        rows = []
        bplan = self.backward_plan()
        for s in self.steps:
            redis = [st.kind for p in s.in_plans for st in p.steps if st.kind not in LOCAL_KINDS]
            # The planned backward: the outputs' adjoints, the op's own, its inner move's.
            nb = bplan.nodes.get(s.node.id)
            backward: list[StepKind] = []
            if nb is not None:
                outs = [a for acts in nb.op.out_actions for a in acts]
                backward = [*_kinds(outs), *(c.kind for c in s.sharding.internal_backward),
                            *_kinds(nb.op.inner_actions)]
            rows.append({"op": s.node.name, "type": s.node.op.name,
                         "strategy": [list(c) for c in s.sharding.strategy],
                         "chosen": s.chosen, "repeat": s.repeat,
                         "out_tensor_map": [list(e) if isinstance(e, tuple) else e
                                            for e in s.sharding.out.tensor_map],
                         "redistribution": redis,
                         "forward": [c.kind for c in s.sharding.forward_comm],
                         "backward": backward})
        return rows

    # ------------------------------------------------------------ execution
    def forward(self, local_inputs: Sequence[np.ndarray], local_params: dict[str, np.ndarray],
                step: int = 0) -> tuple[list[np.ndarray], StepTape]:
        """Run the forward on this rank's shards; returns output shards and the tape (what
        :meth:`backward` takes) (:meth:`ProgramRunner.forward`)."""
        return self.runner.forward(local_inputs, local_params, step)

    def executor(self, rank: int) -> Executor:
        """``rank``'s compiled program (:mod:`simpar.runtime.executor`), built once."""
        return self.runner.executor(rank)

    def backward(self, tape: list[Any], output_grads: Sequence[np.ndarray | None]
                 ) -> dict[str, np.ndarray]:
        """Reverse pass from the outputs' cotangents; returns each trainable parameter's
        gradient shard, completed by its Mirror AllReduce."""
        return self.runner.backward(tape, output_grads)

    def write_states(self, params: dict[str, np.ndarray], states: Sequence[np.ndarray]
                     ) -> None:
        """After a training forward: fold the values it wrote into parameters (a
        BatchNorm's moving statistics; ``tape.states``) into ``params``
        (:meth:`ProgramRunner.write_states`)."""
        self.runner.write_states(params, states)

    def sync(self, grads: dict[str, np.ndarray], seeded: Sequence[bool] | None = None
             ) -> dict[str, np.ndarray]:
        """With micro-batches: the step's one synchronisation of the gradients summed over
        them (:meth:`ProgramRunner.sync`)."""
        return self.runner.sync(grads, seeded)


def _kinds(actions: Sequence[Action]) -> list[StepKind]:
    """The collectives planned backward actions run."""
    return [a.kind for a in actions if not a.local]
