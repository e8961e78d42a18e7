"""Running a lowered program on this process's rank, and what running derives once.

A :class:`ProgramRunner` holds everything execution builds from the frozen program and
reuses: per rank its compiled :class:`~simpar.runtime.executor.Executor`, per (rank, seeded
outputs) its schedule (:mod:`simpar.runtime.program_schedule`) and the collectives the
schedule guard expects of each direction. Lowering makes one per program, with the backward
plans it chose (:mod:`simpar.runtime.backward_plan`); nothing here decides.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from simpar import comm, schedule
from simpar.runtime.backward_plan import BackwardPlan
from simpar.runtime.executor import Executor
from simpar.runtime.lowered import LoweredGraph
from simpar.runtime.memory import current_watch
from simpar.runtime.program_schedule import ProgramStep, rank_classes
from simpar.runtime.program_schedule import schedule as schedule_of
from simpar.seed import training_step

__all__ = ["ProgramRunner", "Seeds", "StepTape", "seeds_of"]

#: Which outputs get a cotangent, one flag per graph output.
Seeds = tuple[bool, ...]


class StepTape(list[Any]):
    """A forward's tape (a list, as the executor made it) and the step number the forward
    ran under, for a backward that runs a recomputed Cell's forward again; ``states``, this
    rank's shards of the values the forward writes into parameters (``graph.updates``)."""

    def __init__(self, tape: list[Any], step: int, states: Sequence[np.ndarray] = ()) -> None:
        super().__init__(tape)
        self.step = step
        self.states = tuple(states)


def seeds_of(seeded: Sequence[bool] | None, n_outputs: int) -> Seeds:
    """``seeded`` as a key of the backward plans (None: every output seeded)."""
    return tuple(bool(b) for b in seeded) if seeded is not None else (True,) * n_outputs


class ProgramRunner:
    """Runs ``lowered`` forward and backward on this process's rank, the backward as
    ``backward_plans`` (one per set of seeded outputs, planned when first read) says."""

    def __init__(self, lowered: LoweredGraph, backward_plans: Mapping[Seeds, BackwardPlan]
                 ) -> None:
        self.lowered = lowered
        self.backward_plans = backward_plans
        self._executors: dict[int, Executor] = {}
        self._schedules: dict[tuple[int, Seeds], tuple[ProgramStep, ...]] = {}
        self._guarded: dict[tuple[int, Seeds, str], tuple[ProgramStep, ...]] = {}

    def backward_plan(self, seeded: Sequence[bool] | None = None) -> BackwardPlan:
        """The backward lowering planned for the outputs ``seeded`` says get a cotangent
        (default: all)."""
        key = seeds_of(seeded, len(self.lowered.graph.outputs))
        found = self.backward_plans.get(key)
        if found is None:
            raise ValueError(f"backward: seeded {list(key)} has no backward plan; the program "
                             f"planned {sorted(list(k) for k in self.backward_plans)}. Lower "
                             "it with simpar.runtime.lower(..., seeds=[...]) naming it")
        return found

    def schedule(self, rank: int, seeded: Sequence[bool] | None = None
                 ) -> tuple[ProgramStep, ...]:
        """``rank``'s schedule (:func:`~simpar.runtime.program_schedule.schedule`), built
        once per (rank, seeded outputs)."""
        n = self.lowered.device_num
        if not 0 <= rank < n:
            raise ValueError(f"schedule: rank must be in 0..{n - 1}, got {rank}")
        key = (rank, seeds_of(seeded, len(self.lowered.graph.outputs)))
        found = self._schedules.get(key)
        if found is None:
            found = self._schedules[key] = schedule_of(self.lowered,
                                                       self.backward_plan(key[1]), rank)
        return found

    def rank_classes(self, ranks: Sequence[int], link: Callable[[tuple[int, ...]], Hashable],
                     seeded: Sequence[bool] | None = None) -> tuple[tuple[int, ...], ...]:
        """``ranks`` in classes whose schedules price alike
        (:func:`~simpar.runtime.program_schedule.rank_classes`)."""
        return rank_classes(self.lowered, self.backward_plan(seeded),
                            self.schedule(ranks[0], seeded), ranks, link)

    def collectives(self, rank: int, seeded: Sequence[bool] | None, phase: str
                    ) -> tuple[ProgramStep, ...]:
        """The schedule's collectives of one phase (what the guard checks): ``"forward"``,
        ``"backward"`` (without the ``deferred`` steps when micro-batches accumulate) or
        ``"sync"`` (those), built once per (rank, seeds, phase): every step reuses them."""
        key = (rank, seeds_of(seeded, len(self.lowered.graph.outputs)), phase)
        found = self._guarded.get(key)
        if found is None:
            steps = [s for s in self.schedule(rank, key[1]) if s.collective is not None]
            if phase == "forward":
                found = tuple(s for s in steps if not s.backward)
            elif phase == "backward":
                found = tuple(s for s in steps if s.backward and not s.deferred)
            else:
                found = tuple(s for s in steps if s.deferred)
            self._guarded[key] = found
        return found

    def executor(self, rank: int) -> Executor:
        """``rank``'s compiled program (:mod:`simpar.runtime.executor`), built once."""
        found = self._executors.get(rank)
        if found is None:
            found = self._executors[rank] = Executor(self.lowered, rank)
        return found

    def use_executor(self, rank: int, executor: Executor) -> None:
        """Run ``executor`` for ``rank`` from now on (a benchmark swaps kernels this way)."""
        self._executors[rank] = executor

    def _rank(self) -> int:
        return comm.get_rank() if self.lowered.device_num > 1 else 0

    def forward(self, local_inputs: Sequence[np.ndarray], local_params: dict[str, np.ndarray],
                step: int = 0) -> tuple[list[np.ndarray], StepTape]:
        """The forward on this rank's shards: output shards and the tape.

        Collectives run without simpar.comm's cross-rank agreement check: every rank runs
        the same plan, so shapes agree by construction (and the check would double the
        number of collectives)."""
        rank = self._rank()
        expected = self.collectives(rank, None, "forward")
        with comm.validation_disabled(), training_step(step), \
                schedule.following(expected, "forward"):
            outs, tape = self.executor(rank).forward(local_inputs, local_params,
                                                     current_watch())
        n = len(self.lowered.graph.outputs)
        return outs[:n], StepTape(tape, step, outs[n:])

    def backward(self, tape: list[Any], output_grads: Sequence[np.ndarray | None]
                 ) -> dict[str, np.ndarray]:
        """The reverse pass from the outputs' cotangents: each trainable parameter's
        gradient shard, completed by its Mirror AllReduce (or reduce-scattered into its
        optimizer slice). With micro-batches (``micro_batches > 1``) the gradients that sync
        once per step come back pending: sum them over the step's micro-batches and pass the
        sum to :meth:`sync`."""
        rank = self._rank()
        seeded = [g is not None for g in output_grads]
        expected = self.collectives(rank, seeded, "backward")
        accumulating = self.lowered.micro_batches > 1
        # A recomputed Cell draws the forward's dropout masks: the forward's step number.
        with comm.validation_disabled(), training_step(getattr(tape, "step", 0)), \
                schedule.following(expected, "backward"):
            return self.executor(rank).backward(self.backward_plan(seeded), tape,
                                                output_grads, current_watch(),
                                                sync=not accumulating)

    def write_states(self, params: dict[str, np.ndarray], states: Sequence[np.ndarray]
                     ) -> None:
        """Fold what a forward wrote (``graph.updates``: a BatchNorm's batch statistics;
        ``states``, this rank's shards of them, from the forward's tape) into ``params``:
        ``param = (1 - weight) * param + weight * value``, shard by shard (lowering checked
        that each value is laid out as its parameter is stored)."""
        for update, local in zip(self.lowered.graph.updates, states):
            p = params[update.param]
            p *= 1.0 - update.weight
            p += update.weight * local

    def sync(self, grads: dict[str, np.ndarray], seeded: Sequence[bool] | None = None
             ) -> dict[str, np.ndarray]:
        """The step's one synchronisation of gradients summed over its micro-batches (from
        :meth:`backward`): the Mirrors, and level1's slicing."""
        rank = self._rank()
        key = seeds_of(seeded, len(self.lowered.graph.outputs))
        expected = self.collectives(rank, key, "sync")
        with comm.validation_disabled(), schedule.following(expected, "sync"):
            return self.executor(rank).sync(key, grads)
