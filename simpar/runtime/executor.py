"""The executor: a :class:`~simpar.runtime.ParallelProgram`'s forward and backward, compiled
once per rank (and, for the backward, per set of seeded outputs) into flat lists of calls.

Lowering and backward planning decide everything a step does; what is left per step is to
call kernels and collectives on arrays. Compiling resolves, once, what the interpreted
program looked up on every call: each value's slot in a list (not a dict keyed by value id),
each op's kernel bound to its sharding, the planned actions of every cotangent, the zeros an
unused output or a skipped gradient stands for, the Mirror buckets. A step of the compiled
forward is one call per op (its local kernel, or the op's own forward when it moves values
itself); the backward is one kernel call per op plus the actions its plan lists, in the
order :func:`simpar.runtime.program._schedule` lists their collectives (the schedule guard
checks that, call by call). ``benchmarks/executor_overhead.py`` measures what the executor
costs against the kernels it calls (README, "Performance, measured").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from simpar import comm, schedule
from simpar.cotangent import Action
from simpar.redistribution import RedistributionPlan, execute, execute_step

if TYPE_CHECKING:
    from simpar.runtime.program import BackwardPlan, MemoryWatch, ParallelProgram

__all__ = ["Executor", "mirror_announcement"]

Actions = tuple[Action, ...]

# The compiled records are NamedTuples rather than frozen dataclasses (STYLE.md's default for
# values): they are as immutable, and the loops below unpack each one per op per step, which
# a tuple does in one bytecode.


class _Forward(NamedTuple):
    run: Callable[..., Any]       # the op's inputs -> (output or outputs, tape); a view's: y
    ins: tuple[int, ...]          # slots read
    out: int                      # the output's slot (-1: several, see outs)
    outs: tuple[int, ...]         # every output's slot
    keep: int                     # tape slot (-1: the backward needs nothing)
    view: bool                    # run is the op's local_view: one input, no tape


class _Input(NamedTuple):
    """One input of an op that gets a gradient, and how its contribution is summed there."""

    k: int
    slot: int
    shape: tuple[int, ...]      # this rank's shard in the op's input layout (zeros for None)
    dtype: np.dtype
    edge: Actions               # back to the producer's layout
    align_sum: Actions          # on the running sum before adding
    align_new: Actions          # on this contribution before adding


class _Backward(NamedTuple):
    outs: tuple[tuple[int, Actions, tuple[int, ...], np.dtype], ...]  # last output first
    kernel: Callable[..., Any] | None   # None: nothing flows through
    multi: bool                 # the kernel takes a tuple of cotangents
    view: bool                  # the kernel is the op's local_view backward: dy -> dx
    keep: int
    inner: Actions
    inputs: tuple[_Input, ...]


class _Mirror(NamedTuple):
    group: tuple[int, ...]
    announce: tuple[str, tuple[int, ...], tuple[str, ...]]   # what the schedule guard expects
    names: tuple[str, ...]
    sizes: tuple[int, ...]


def mirror_announcement(group: tuple[int, ...], names: Sequence[str]
                        ) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    """What a Mirror announces to the schedule guard (compared by value): its group and its
    parameters, so a bucket the executor forms differently from the schedule is caught."""
    return ("Mirror", group, tuple(names))


def _run(actions: Actions, x: np.ndarray) -> np.ndarray:
    for act in actions:
        x = execute_step(act.step, x, act.adjoint)
    return x


def _arrive(d: np.ndarray | None, acts: Actions, shape: tuple[int, ...], dtype: np.dtype
            ) -> np.ndarray:
    """An output's cotangent as the kernel takes it: zeros for an unused output, else after
    its planned actions (the adjoints of the op's output collectives)."""
    if d is None:
        return np.zeros(shape, dtype)
    return _run(acts, d) if acts else d


def _moving(sh: Any, plans: tuple[RedistributionPlan | None, ...]
            ) -> Callable[..., tuple[Any, Any]]:
    """The forward of an op whose inputs are redistributed first."""
    def run(*xs: np.ndarray) -> tuple[Any, Any]:
        return sh.forward(*[x if p is None else execute(p, x) for p, x in zip(plans, xs)])
    return run


class Executor:
    """The compiled program of one rank. ``forward`` and ``backward`` run it; they assume
    what :meth:`ParallelProgram.forward` / ``backward`` set up around them (the schedule
    guard, validation off, the training step)."""

    def __init__(self, program: ParallelProgram, rank: int) -> None:
        self.program, self.rank = program, rank
        g = program.graph
        slot: dict[int, int] = {}

        def at(vid: int) -> int:
            return slot.setdefault(vid, len(slot))

        self.inputs = tuple(at(v.id) for v in g.inputs)
        self.params = tuple((at(v.id), v.name) for v in g.params)
        self.consts = tuple((at(v.id), v.const) for v in g.consts)
        fwd: list[_Forward] = []
        self._tape_of: dict[int, int] = {}
        for s in program.steps:
            node, sh = s.node, s.sharding
            plans = tuple(p if p.steps else None for p in s.in_plans)
            moves = (any(p is not None for p in plans) or sh.inner_plan is not None
                     or bool(sh.more_outs) or bool(sh.out_plan.steps))
            view = None if moves else sh.op.local_view(sh)
            run: Callable[..., Any]
            if view is not None:
                run = view[0]
            else:
                run = _moving(sh, plans) if moves else functools.partial(sh.op.local_forward, sh)
            keep = -1
            if node.id in program.grad_nodes:
                keep = self._tape_of[node.id] = len(self._tape_of)
            outs = tuple(at(v.id) for v in node.outputs)
            fwd.append(_Forward(run, tuple(at(v.id) for v in node.inputs),
                                outs[0] if len(outs) == 1 else -1, outs, keep,
                                view is not None))
        self.fwd = tuple(fwd)
        self.outputs = tuple(slot[v.id] for v in g.outputs)
        self.slot = slot
        #: The compiled backward per set of seeded outputs (built on first use): its steps,
        #: last op first, and its Mirror buckets.
        self.backwards: dict[tuple[bool, ...], tuple[tuple[_Backward, ...],
                                                     tuple[_Mirror, ...]]] = {}

    # ------------------------------------------------------------ forward
    def forward(self, local_inputs: Sequence[np.ndarray], local_params: dict[str, np.ndarray],
                watch: MemoryWatch | None) -> tuple[list[np.ndarray], list[Any]]:
        vals: list[Any] = [None] * len(self.slot)
        for s, x in zip(self.inputs, local_inputs):
            vals[s] = x
        for s, name in self.params:
            vals[s] = local_params[name]
        for s, c in self.consts:
            vals[s] = c
        tape: list[Any] = [None] * len(self._tape_of)
        get = vals.__getitem__
        for run, ins, out, outs, keep, view in self.fwd:
            if view:
                vals[out] = run(vals[ins[0]])
                if watch is not None:
                    watch.params = local_params
                    watch.sample(vals, tape)
                continue
            y, saved = run(*map(get, ins))
            if out >= 0:
                vals[out] = y
            else:
                for s, o in zip(outs, y):
                    vals[s] = o
            if keep >= 0:
                tape[keep] = saved
            if watch is not None:
                watch.params = local_params
                watch.sample(vals, tape)
        return [vals[s] for s in self.outputs], tape

    # ------------------------------------------------------------ backward
    def _compile_backward(self, bplan: BackwardPlan
                          ) -> tuple[tuple[_Backward, ...], tuple[_Mirror, ...]]:
        program = self.program
        bwd: list[_Backward] = []
        for s in reversed(program.steps):
            node, sh = s.node, s.sharding
            nb = bplan.nodes.get(node.id)
            if nb is None:   # no gradient flows through: its outputs' cotangents are dropped
                bwd.append(_Backward(tuple((self.slot[v.id], (), (), v.dtype)
                                           for v in node.outputs), None, False, False, -1, (),
                                     ()))
                continue
            outs = tuple((self.slot[node.outputs[k].id], nb.op.out_actions[k],
                          raw.local_shape(), node.outputs[k].dtype)
                         for k, (raw, _, _) in reversed(list(enumerate(sh.outputs))))
            inputs = tuple(
                _Input(k, self.slot[v.id], sh.in_layouts[k].local_shape(), v.dtype,
                       nb.edges[k], nb.align_sum.get(k, ()), nb.align_new.get(k, ()))
                for k, v in enumerate(node.inputs) if nb.needs[k])
            view = sh.op.local_view(sh) if all(nb.needs) else None
            bwd.append(_Backward(outs, view[1] if view else sh.backward_kernel(nb.needs),
                                 bool(sh.more_outs), view is not None, self._tape_of[node.id],
                                 nb.op.inner_actions, inputs))
        mirrors = tuple(
            _Mirror(group, mirror_announcement(group, names), names,
                    tuple(program.param_layouts[n].local_size() for n in names))
            for group, _, names in bplan.mirror_buckets(program, self.rank))
        return tuple(bwd), mirrors

    def backward(self, bplan: BackwardPlan, tape: list[Any],
                 output_grads: Sequence[np.ndarray | None], watch: MemoryWatch | None
                 ) -> dict[str, np.ndarray]:
        seeded = tuple(g is not None for g in output_grads)
        compiled = self.backwards.get(seeded)
        if compiled is None:
            compiled = self.backwards[seeded] = self._compile_backward(bplan)
        bwd, mirrors = compiled
        grads: list[Any] = [None] * len(self.slot)
        # A value's cotangent has the value's dtype, whatever numpy's promotion made of the
        # contributions, so every collective moves the bytes the schedule lists. Seeds are
        # whole: every rank holds the output's whole cotangent.
        for v, s, g in zip(self.program.graph.outputs, self.outputs, output_grads):
            if g is not None:
                grads[s] = np.asarray(g).astype(v.dtype, copy=False)
        for outs, kernel, multi, view, keep, inner, inputs in bwd:
            if kernel is None:
                for o in outs:
                    grads[o[0]] = None
                continue
            if multi:
                draws = []
                for s, acts, shape, dtype in outs:
                    d, grads[s] = grads[s], None
                    draws.append(_arrive(d, acts, shape, dtype))
                draws.reverse()
                contribs = kernel(tape[keep], tuple(draws))
            else:
                (s, acts, shape, dtype), = outs
                d, grads[s] = grads[s], None
                if d is None or acts:
                    d = _arrive(d, acts, shape, dtype)
                contribs = (kernel(d),) if view else kernel(tape[keep], d)
            if inner and contribs[0] is not None:
                contribs = (_run(inner, contribs[0]), *contribs[1:])
            for k, slot, shape, dtype, edge, align_sum, align_new in inputs:
                c = contribs[k]
                if c is None:
                    c = np.zeros(shape, dtype)
                elif c.dtype != dtype:
                    c = c.astype(dtype)
                if edge:
                    c = _run(edge, c)
                before = grads[slot]
                if before is None:
                    grads[slot] = c
                elif align_sum or align_new:
                    grads[slot] = _run(align_sum, before) + _run(align_new, c)
                else:
                    grads[slot] = before + c
            if watch is not None:
                watch.sample(tape, grads)
        program = self.program
        out: dict[str, np.ndarray] = {}
        for name, v in program.param_values.items():
            if v.param is None or not v.param.requires_grad:
                continue
            g = grads[self.slot[v.id]]
            if g is None:
                g = np.zeros(program.param_layouts[name].local_shape(), dtype=v.dtype)
            elif not g.flags.writeable:   # a broadcast view (ReduceMean's): the caller's own
                g = g.copy()
            out[name] = g
        # Mirror: one AllReduce per group of ranks and dtype, on all its parameters' gradients
        # at once (MindSpore fuses these AllReduces too); the sum completes every pending one.
        for group, announce, names, sizes in mirrors:
            flat = np.concatenate([out[n].ravel() for n in names])
            with schedule.issue(announce):
                flat = comm.all_reduce(flat, group=group)
            offset = 0
            for n, size in zip(names, sizes):
                out[n] = flat[offset:offset + size].reshape(out[n].shape)
                offset += size
        return out
