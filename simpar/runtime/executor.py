"""The executor: a :class:`~simpar.runtime.ParallelProgram`'s forward and backward, compiled
once per rank (and, for the backward, per set of seeded outputs) into straight-line Python.

Lowering and backward planning decide everything a step does; what is left per step is to
call kernels and collectives on arrays. Compiling resolves, once, what an interpreter would
look up on every call: each op's kernel bound to its sharding, the planned actions of every
cotangent, the zeros an unused output or a skipped gradient stands for, which contribution to
a gradient is its first (assigned) and which are added, the Mirror buckets. The compiled
records (:class:`_Forward`, :class:`_Backward`) are then written out as the source of one
Python function per direction, as torch.fx writes a GraphModule's ``forward``: every value is
a local variable, dropped after its last use; an op whose kernel is the plain single-device
one on shards is called without the wrapper between (its tape built inline, keeping what
its ``Tape`` kind says), or written into the code as its expression where it gives one
(:meth:`Primitive.inline`), into its input 0 where nothing else can hold that array
(:meth:`Executor._updates`: ``v45 += v7``); every step of
a redistribution, an op's input moves and output plan included, is one call of the step
bound for this rank (:func:`simpar.redistribution.bind_step`, its collective prepared once by
:func:`simpar.comm.prepare`; an AllReduce sums an inline op's fresh product in place,
:func:`sums_output_in_place`). ``Executor.source()`` prints what a rank runs. The backward
runs its kernel calls and the actions its plan lists in the order
:func:`simpar.runtime.program_schedule.schedule` lists their collectives (the schedule guard checks
that, call by call).
``benchmarks/executor_overhead.py`` measures what the executor costs against the kernels it
calls (docs/performance.md#a-training-step-against-its-floor).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from simpar import comm, schedule
from simpar.cotangent import Action
from simpar.ops._base import Primitive
from simpar.ops.kernels import Inline, Tape, shape_only
from simpar.redistribution import ALL_REDUCE, RedistributionPlan, Step, bind_step, execute
from simpar.runtime.backward_plan import BackwardPlan
from simpar.runtime.lowered import LoweredGraph, Segment
from simpar.runtime.memory import MemoryWatch
from simpar.runtime.op_runner import OpRunner
from simpar.runtime.source import Source as _Source
from simpar.runtime.tapes import Dropped

__all__ = ["Executor", "input_gradient", "mirror_announcement", "sums_output_in_place"]

Actions = tuple[Action, ...]
# Redistribution steps to run: (step, adjoint, the dtype it moves).
Moves = tuple[tuple[Step, bool, np.dtype | None], ...]

# The compiled records are NamedTuples rather than frozen dataclasses (STYLE.md's default for
# values): they are as immutable, and the code generators below unpack them field by field.


class _Forward(NamedTuple):
    run: Callable[..., Any]       # inputs -> (raw output or outputs, tape); see view, plain
    ins: tuple[int, ...]          # slots read
    out: int                      # the output's slot (-1: several, see outs)
    outs: tuple[int, ...]         # every output's slot
    keep: int                     # tape slot (-1: the backward needs nothing)
    view: bool                    # run is the op's local_view: one input, no tape
    plain: bool = False           # run is the op's single-device kernel: inputs -> output,
    #                               the tape ``(inputs, output)`` (Primitive.local_forward's)
    pre: tuple[Moves, ...] = ()   # per input: the steps of its redistribution, run first
    post: tuple[Moves, ...] = ()  # per output: the steps of its output plan, run after
    inline: Inline | None = None  # plain, and the kernel is written into the code as this
    tape: Tape = Tape.INPUTS_AND_OUTPUT   # with plain: what the tape keeps (the op's kind)


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
    plain: bool = False         # the kernel is the op's vjp: (inputs, output, dy) -> grads
    inner_dtype: np.dtype | None = None   # what the inner actions move (input 0's dtype)
    inline: Inline | None = None  # the gradients are written into the code as these
    needs: tuple[bool, ...] = ()  # with inline: which inputs' gradients are used


class _Mirror(NamedTuple):
    group: tuple[int, ...]
    announce: tuple[str, tuple[int, ...], tuple[str, ...]]   # what the schedule guard expects
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    run: comm.Prepared          # the bucket's AllReduce, prepared


def input_gradient(name: str) -> str:
    """The key under which ``backward`` returns graph input ``name``'s gradient (an input of
    ``Graph.grad_inputs``): whole, in the input's layout."""
    return f"<input {name}>"


def mirror_announcement(group: tuple[int, ...], names: Sequence[str]
                        ) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    """What a Mirror announces to the schedule guard (compared by value): its group and its
    parameters, so a bucket the executor forms differently from the schedule is caught."""
    return ("Mirror", group, tuple(names))


def _moving(runner: OpRunner, plans: tuple[RedistributionPlan | None, ...]
            ) -> Callable[..., tuple[Any, Any]]:
    """The forward of an op that redistributes inside it (its ``inner_plan``): inputs moved,
    the op's own forward, outputs moved, all in one call."""
    def run(*xs: np.ndarray) -> tuple[Any, Any]:
        return runner.forward(*[x if p is None else execute(p, x) for p, x in zip(plans, xs)])
    return run


#: Tape kinds that do not hold the op's output: with them (or with no tape), an inline op's
#: product is an array nothing but the code holds.
_KEEPS_NO_OUTPUT = frozenset({Tape.INPUTS, Tape.NOTHING})


def sums_output_in_place(sh: Any, kept: bool) -> bool:
    """Whether the compiled program hands this op's raw output to the first step of its
    output plan to write into (an AllReduce sums in place, ``bind_step``'s ``consume``): the
    op is written inline (its product is a new array), has one output, and its tape (``kept``:
    it has one) does not hold that output. The schedule counts no result buffer there."""
    op = sh.op
    if sh.inner_plan is not None or sh.more_outs or not _plain(op) or (
            kept and op.tape not in _KEEPS_NO_OUTPUT):
        return False
    return op.inline(tuple(lay.local_shape() for lay in sh.in_layouts)) is not None


def backward_reads(sh: Any, k: int, needs: Sequence[bool]) -> bool:
    """Whether op ``sh``'s backward, computing the input gradients ``needs`` asks for, reads
    its input ``k``: level3 gathers a dropped weight again only for a backward that does
    (``x @ W`` reads ``W`` for ``x``'s gradient alone). Known where the op is written inline
    with an expression for every gradient needed; otherwise it is assumed to."""
    if sh.inner_plan is not None or sh.more_outs or not _plain(sh.op):
        return True
    inline = sh.op.inline(tuple(lay.local_shape() for lay in sh.in_layouts))
    if inline is None or any(need and g is None for need, g in zip(needs, inline.grads)):
        return True
    return any(need and f"{{x{k}}}" in g for need, g in zip(needs, inline.grads))


def _plain(op: Any) -> bool:
    """The op runs Primitive's own per-rank forward and backward: its kernel and VJP on the
    shards, the tape ``(inputs, output)``."""
    return (type(op).local_forward is Primitive.local_forward
            and type(op).local_backward is Primitive.local_backward)


class Executor:
    """The compiled program of one rank. ``forward`` and ``backward`` run it; they assume
    what :class:`~simpar.runtime.runner.ProgramRunner` sets up around them (the schedule
    guard, validation off, the training step)."""

    def __init__(self, program: LoweredGraph, rank: int) -> None:
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
        #: Per op, its runner on this rank: the Collectives its kernels call.
        self._runners = tuple(OpRunner(s.sharding, rank) for s in program.steps)
        for s, runner in zip(program.steps, self._runners):
            node, sh = s.node, s.sharding
            pre = tuple(tuple((st, False, v.dtype) for st in p.steps)
                        for p, v in zip(s.in_plans, node.inputs))
            post = tuple(tuple((st, False, v.dtype) for st in p.steps)
                         for (_, _, p), v in zip(sh.outputs, node.outputs))
            inner = sh.inner_plan is not None
            moves = any(pre) or any(post) or bool(sh.more_outs)
            view = None if moves or inner else sh.op.local_view(sh)
            plain = view is None and not inner and not sh.more_outs and _plain(sh.op)
            run: Callable[..., Any]
            inline = None
            if view is not None:
                run = view[0]
            elif plain:
                run = sh.op.kernel
                inline = sh.op.inline(tuple(lay.local_shape() for lay in sh.in_layouts))
            elif inner:   # the whole forward in one call, its moves included
                run = _moving(runner, tuple(p if p.steps else None for p in s.in_plans))
                pre = post = ()
            else:
                run = functools.partial(sh.op.local_forward, sh, collectives=runner)
            keep = -1
            if node.id in program.grad_nodes:
                keep = self._tape_of[node.id] = len(self._tape_of)
            outs = tuple(at(v.id) for v in node.outputs)
            fwd.append(_Forward(run, tuple(at(v.id) for v in node.inputs),
                                outs[0] if len(outs) == 1 else -1, outs, keep,
                                view is not None, plain, pre, post, inline, sh.op.tape))
        self.outputs = tuple(slot[v.id] for v in g.outputs)
        #: The values the forward writes into parameters (``graph.updates``), returned after
        #: the outputs.
        self.states = tuple(slot[u.value] for u in g.updates)
        self.slot = slot
        # Optimizer parallel: the slots of parameters stored in slices (gathered before
        # their first use), and of those level3 drops after the forward and gathers again.
        shards = program.param_shards
        self._sharded = {s: name for s, name in self.params if name in shards}
        self._regathered = {s: name for s, name in self._sharded.items()
                            if shards[name].level.regathers}
        self._dropped = {s: Dropped(name) for s, name in self._regathered.items()}
        #: Per op index in a recomputed Cell: (the segment's number, the segment).
        self._segment_at = {i: (n, seg) for n, seg in enumerate(program.segments)
                            for i in range(seg.first, seg.last + 1)}
        # Redistribution steps bound for this rank (redistribution.bind_step), made when the
        # code that calls them is first written: one per (step, direction, dtype), the step by
        # identity, as the schedule guard compares announcements (equal steps of two plans
        # are two entries of the schedule).
        self._bound: dict[tuple[int, bool, np.dtype | None, bool],
                          Callable[[np.ndarray], np.ndarray]] = {}
        self._fwd = tuple(fwd)
        self._forward_fns: dict[bool, tuple[Callable[..., Any], str]] = {}
        #: The compiled backward per set of seeded outputs (built on first use): its steps,
        #: last op first, its Mirror buckets, and the steps completing each sliced
        #: parameter's gradient into its slice.
        self.backwards: dict[tuple[bool, ...], tuple[tuple[_Backward, ...],
                                                     tuple[_Mirror, ...],
                                                     dict[str, Moves]]] = {}
        #: Per seeds, the sums that make each gradient input's cotangent whole.
        self._input_sums: dict[tuple[bool, ...], dict[str, Moves]] = {}
        # The generated backward per (seeded, watched), with the records it was written from.
        self._backward_fns: dict[tuple[tuple[bool, ...], bool, bool],
                                 tuple[tuple[_Backward, ...], Callable[..., Any], str]] = {}

    @property
    def fwd(self) -> tuple[_Forward, ...]:
        """The forward's records, one per op in program order (replacing them rewrites the
        generated forward: ``benchmarks/executor_overhead.py`` swaps kernels this way)."""
        return self._fwd

    @fwd.setter
    def fwd(self, records: tuple[_Forward, ...]) -> None:
        self._fwd = tuple(records)
        self._forward_fns = {}

    def _moved(self, src: _Source, steps: Moves, x: str, consume: bool = False) -> str:
        """The expression that runs ``steps`` (step, adjoint, dtype) on the array ``x``, one
        bound call each: ``B3(B2(x))``. ``consume``: nothing else holds ``x``, so the first
        step may write into it (an AllReduce sums in place)."""
        for step, adjoint, dtype in steps:
            x = f"{src.bind('B', self._bind(step, adjoint, dtype, consume))}({x})"
            consume = False
        return x

    def _bind(self, step: Step, adjoint: bool, dtype: np.dtype | None, consume: bool = False
              ) -> Callable[[np.ndarray], np.ndarray]:
        """``step`` bound for this rank (:func:`bind_step`), once per (step, direction,
        dtype, consume); the step by identity (the program keeps its steps alive)."""
        key = (id(step), adjoint, dtype, consume)
        run = self._bound.get(key)
        if run is None:
            run = self._bound[key] = bind_step(step, adjoint, dtype, self.rank, consume)
        return run

    def _run(self, steps: Moves, x: np.ndarray) -> np.ndarray:
        """``steps`` run on ``x`` now, each bound as the generated code binds it."""
        for step, adjoint, dtype in steps:
            x = self._bind(step, adjoint, dtype)(x)
        return x

    def _actions(self, src: _Source, actions: Actions, dtype: np.dtype | None, x: str) -> str:
        return self._moved(src, tuple((a.step, a.adjoint, dtype) for a in actions), x)

    def source(self, seeded: Sequence[bool] | None = None) -> str:
        """The Python this rank runs: the generated forward, then (once a backward with these
        seeded outputs, default all, has run or been compiled) the generated backward."""
        seeded = tuple(seeded) if seeded is not None else (True,) * len(self.outputs)
        text = self._forward_fn(False)[1]
        if seeded in self.backwards:
            text += "\n\n" + self._backward_fn(seeded, False, True)[2]
        return text

    # ------------------------------------------------------------ forward
    def _forward_fn(self, watched: bool) -> tuple[Callable[..., Any], str]:
        found = self._forward_fns.get(watched)
        if found is None:
            found = self._forward_fns[watched] = self._write_forward(watched)
        return found

    def _write_forward(self, watched: bool) -> tuple[Callable[..., Any], str]:
        src = _Source("def forward(inputs, params, watch):")
        n_tapes = len(self._tape_of)
        last: dict[int, int] = {}   # slot -> index of the last op reading it
        for i, r in enumerate(self._fwd):
            for s in r.ins:
                last[s] = i
        kept_to_end = set(self.outputs) | set(self.states)
        reads = collections.Counter(s for r in self._fwd for s in r.ins)
        producer = {s: i for i, r in enumerate(self._fwd) for s in r.outs}
        for k, s in enumerate(self.inputs):
            src.add(f"v{s} = inputs[{k}]")
        for s, name in self.params:
            if s not in self._sharded:   # a sliced one is gathered before its first use
                src.add(f"v{s} = params[{name!r}]")
        gathered: set[int] = set()
        for s, c in self.consts:
            src.add(f"v{s} = {src.bind('C', c)}")
        sample = "watch.params = params; watch.sample(locals())"
        if watched:
            src.add(sample)
        for i, r in enumerate(self._fwd):
            run = src.bind("R", r.run)
            node = self.program.steps[i].node
            src.add(f"# {node.name}: {node.op.name}")
            n, seg = self._segment_at.get(i, (-1, None))
            if seg is not None and i == seg.first:   # a recomputed Cell keeps its inputs
                src.add(f"S{n} = {{}}")
                for key, expr in self._segment_inputs(n, gathered):
                    src.add(f"S{n}[{key!r}] = {expr}")
            if seg is not None:   # its ops keep no tape: the backward runs them again
                r = r._replace(keep=-1)
            for s in r.ins:
                if s in self._sharded and s not in gathered:
                    gathered.add(s)
                    src.add(f"v{s} = " + self._moved(src, self._gather(self._sharded[s]),
                                                     f"params[{self._sharded[s]!r}]"))
                    if seg is not None and not self._regathers(seg, s):
                        src.add(f"S{n}[{('v', s)!r}] = v{s}")
            names = []   # the kernel's arguments: values, or their redistributed copies
            for k, s in enumerate(r.ins):
                if k < len(r.pre) and r.pre[k]:
                    src.add(f"m{k} = " + self._moved(src, r.pre[k], f"v{s}"))
                    names.append(f"m{k}")
                    if seg is not None and not seg.mp_comm:   # kept, not moved again
                        src.add(f"S{n}[{('m', i, k)!r}] = m{k}")
                else:
                    names.append(f"v{s}")
            args = ", ".join(names)
            moved_out = any(r.post)
            raw = "r" if moved_out or r.out < 0 else f"v{r.out}"
            if r.view:
                src.add(f"{raw} = {run}({args})")
            elif r.inline is not None:
                xs = {f"x{k}": name for k, name in enumerate(names)}
                if r.inline.update is not None and seg is None and \
                        self._updates(i, reads, producer):
                    src.add(r.inline.update.format(**xs))
                    src.add(f"{raw} = {names[0]}")
                else:
                    src.add(f"{raw} = " + r.inline.forward.format(**xs))
                if r.keep >= 0:
                    src.add(f"t{r.keep} = " + self._tape(src, i, args, raw))
            elif r.plain:
                src.add(f"{raw} = {run}({args})")
                if r.keep >= 0:
                    src.add(f"t{r.keep} = " + self._tape(src, i, args, raw))
            else:
                src.add(f"{raw}, {f't{r.keep}' if r.keep >= 0 else '_'} = {run}({args})")
            for k in self._drops(i):   # level3: the tape lets go of the gathered weight
                marker = src.bind("W", self._dropped[r.ins[k]])
                src.add(f"t{r.keep} = _unhold(t{r.keep}, {names[k]}, {marker})")
            if raw == "r":   # each output after its own plan's steps
                # An inline expression's product that its tape does not keep is the step's
                # to reduce in place (a row-parallel MatMul's, before its AllReduce).
                fresh = r.inline is not None and sums_output_in_place(
                    self.program.steps[i].sharding, r.keep >= 0)
                for k, s in enumerate(r.outs):
                    part = "r" if r.out >= 0 else f"r[{k}]"
                    steps = r.post[k] if k < len(r.post) else ()
                    src.add(f"v{s} = " + self._moved(src, steps, part, fresh))
                    if seg is not None and not seg.mp_comm and steps:
                        src.add(f"S{n}[{('o', i, k)!r}] = v{s}")
            temps = [n for n in names if n.startswith("m")] + (["r"] if raw == "r" else [])
            dead = sorted({s for s in r.ins if last.get(s) == i} - kept_to_end)
            dead += [s for s in r.outs if s not in last and s not in kept_to_end]
            if temps or dead:   # the op's temporaries, and the values it read last
                src.add("del " + ", ".join([*temps, *(f"v{s}" for s in dead)]))
            if watched:
                src.add(sample)
        untaped = {r.keep for i, r in enumerate(self._fwd) if r.view or i in self._segment_at}
        tapes = [("None" if k in untaped else f"t{k}") for k in range(n_tapes)]
        # The stored slices of the level3 weights, for the backward to gather again; what
        # each recomputed Cell keeps.
        tapes += [f"params[{name!r}]" for name in self._regathered.values()]
        tapes += [f"S{n}" for n in range(len(self.program.segments))]
        src.add(f"return [{', '.join(f'v{s}' for s in self.outputs + self.states)}], "
                f"[{', '.join(tapes)}]")
        return src.build("forward")

    def _gather(self, name: str) -> Moves:
        """The steps that make parameter ``name`` whole from its stored slice."""
        dtype = self.program.param_values[name].dtype
        return tuple((st, False, dtype) for st in self.program.weight_gathers[name].steps)

    def _recompute(self, n: int, tape: list[Any]) -> None:
        """Run recomputed Cell ``n``'s forward again from what it kept, and put its ops'
        tapes where the backward reads them. Every collective runs as the schedule lists it
        (its redistributions' only with ``mp_comm``, the sliced weights' gathers when
        :meth:`_regathers`); the values are bitwise the first forward's."""
        seg = self.program.segments[n]
        kept: dict[Any, Any] = tape[len(self._tape_of) + len(self._regathered) + n]
        vals: dict[int, Any] = {}
        last = {s: i for i in range(seg.first, seg.last + 1) for s in self._fwd[i].ins}
        for i in range(seg.first, seg.last + 1):
            r, sh = self._fwd[i], self.program.steps[i].sharding
            for s in r.ins:
                if ("p", s) in kept and s not in vals:
                    vals[s] = self._run(self._gather(self._sharded[s]), kept["p", s])
            args = []
            for k, s in enumerate(r.ins):
                x = vals[s] if s in vals else kept["v", s]
                if k < len(r.pre) and r.pre[k]:
                    x = self._run(r.pre[k], x) if seg.mp_comm else kept["m", i, k]
                args.append(x)
            if r.view:
                y, made = r.run(*args), None
            elif r.plain:   # the kernel and its tape, as Primitive.local_forward gives them
                y, made = sh.op.local_forward(sh, *args, collectives=self._runners[i])
            else:
                y, made = r.run(*args)
            ys = (y,) if r.out >= 0 else tuple(y)
            for k, s in enumerate(r.outs):
                post = r.post[k] if k < len(r.post) else ()
                if not post:
                    vals[s] = ys[k]
                else:
                    vals[s] = self._run(post, ys[k]) if seg.mp_comm else kept["o", i, k]
            if r.keep >= 0:
                tape[r.keep] = made
            # A value no later op of the Cell reads goes now: only the tapes outlive this.
            for s in {*r.ins, *r.outs}:
                if last.get(s, -1) <= i:
                    vals.pop(s, None)

    def _regathers(self, seg: Segment, s: int) -> bool:
        """Whether recomputing ``seg`` gathers sliced weight ``s`` again (level3, or the
        Cell's ``parallel_optimizer_comm_recompute``) rather than keep the gathered copy."""
        return seg.opt_comm or self.program.param_shards[self._sharded[s]].level.regathers

    def _segment_inputs(self, n: int, gathered: set[int]) -> list[tuple[tuple[Any, ...], str]]:
        """What recomputed Cell ``n`` keeps when its first op is reached: each value its ops
        read that none of them makes (``("v", slot)``), and each sliced weight's slice it
        gathers again (``("p", slot)``); a weight gathered inside it is kept when gathered."""
        seg = self.program.segments[n]
        made = {s for i in range(seg.first, seg.last + 1) for s in self._fwd[i].outs}
        out, seen = [], set()
        for i in range(seg.first, seg.last + 1):
            for s in self._fwd[i].ins:
                if s in made or s in seen:
                    continue
                seen.add(s)
                if s not in self._sharded:
                    out.append((("v", s), f"v{s}"))
                elif self._regathers(seg, s):
                    out.append((("p", s), f"params[{self._sharded[s]!r}]"))
                elif s in gathered:
                    out.append((("v", s), f"v{s}"))
        return out

    def _drops(self, i: int) -> list[int]:
        """The inputs of op ``i`` whose tape holds a level3 weight the backward gathers
        again: the op keeps a tape, keeps that input itself, and moves no input inside (and
        is not recomputed: its tape then comes from the recomputation)."""
        r, sh = self._fwd[i], self.program.steps[i].sharding
        if r.keep < 0 or r.view or sh.inner_plan is not None or i in self._segment_at:
            return []
        return [k for k, s in enumerate(r.ins) if s in self._regathered
                and sh.op.keeps_input(k)]

    def _tape(self, src: _Source, i: int, args: str, raw: str) -> str:
        """What plain op ``i``'s tape keeps, as its kind says (Primitive.local_forward's
        rule): ``(inputs, output)``, ``(inputs, None)``, or for ``Tape.NOTHING`` the inputs'
        shape-only stand-ins, made once here."""
        kind = self._fwd[i].tape
        if kind is Tape.INPUTS:
            return f"(({args},), None)"
        if kind is Tape.NOTHING:
            sh, node = self.program.steps[i].sharding, self.program.steps[i].node
            return src.bind("S", (tuple(shape_only(lay.local_shape(), v.dtype)
                                        for lay, v in zip(sh.in_layouts, node.inputs)), None))
        return f"(({args},), {raw})"

    def _updates(self, i: int, reads: collections.Counter[int], producer: dict[int, int]
                 ) -> bool:
        """Whether inline op ``i`` may write its result into its input 0 (Inline.update), as
        a hand-written step adds a bias in place: nothing else can hold that array. It is
        read by this op only (once) and is no output of the program; this op's tape does
        not keep it; it was made by an inline expression (a new array) that its own tape
        does not keep, or by an AllReduce after one; and the result has its shape and its
        dtype (so does every input: numpy's in-place and out-of-place results then agree bit
        for bit)."""
        r = self._fwd[i]
        s0 = r.ins[0]
        if (r.pre and r.pre[0]) or reads[s0] != 1 or s0 in self.outputs or (
                r.keep >= 0 and r.tape is not Tape.NOTHING) or s0 not in producer:
            return False
        p = self._fwd[producer[s0]]
        if p.inline is None:
            return False
        k = p.outs.index(s0)
        moves = p.post[k] if k < len(p.post) else ()
        if moves:
            step, adjoint, _ = moves[-1]
            if step.kind != ALL_REDUCE or adjoint:
                return False
        elif p.keep >= 0 and p.tape not in _KEEPS_NO_OUTPUT:
            return False
        sh, node = self.program.steps[i].sharding, self.program.steps[i].node
        dtype = node.outputs[0].dtype
        return (all(v.dtype == dtype for v in node.inputs)
                and sh.outputs[0][0].local_shape() == sh.in_layouts[0].local_shape())

    def forward(self, local_inputs: Sequence[np.ndarray], local_params: dict[str, np.ndarray],
                watch: MemoryWatch | None) -> tuple[list[np.ndarray], list[Any]]:
        run = self._forward_fn(watch is not None)[0]
        return run(local_inputs, local_params, watch)

    # ------------------------------------------------------------ backward
    def _compile_backward(self, bplan: BackwardPlan, seeded: tuple[bool, ...]
                          ) -> tuple[tuple[_Backward, ...], tuple[_Mirror, ...],
                                     dict[str, Moves]]:
        program = self.program
        bwd: list[_Backward] = []
        for i in reversed(range(len(program.steps))):
            node, sh = program.steps[i].node, program.steps[i].sharding
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
            plain = view is None and all(nb.needs) and self._fwd[i].plain
            kernel = (view[1] if view else sh.op.vjp if plain
                      else self._runners[i].backward_kernel(nb.needs))
            inline = self._fwd[i].inline
            if inline is not None and any(need and g is None
                                          for need, g in zip(nb.needs, inline.grads)):
                inline = None   # a gradient the backward needs has no expression: the VJP runs
            bwd.append(_Backward(outs, kernel, bool(sh.more_outs), view is not None,
                                 self._tape_of[node.id], nb.op.inner_actions, inputs, plain,
                                 node.inputs[0].dtype, inline, tuple(nb.needs)))
        mirrors = []
        for group, dtype, names in bplan.mirror_buckets(program, self.rank):
            sizes = tuple(program.param_layouts[n].local_size() for n in names)
            # The bucket is packed afresh on every step (np.concatenate): summed in place.
            mirrors.append(_Mirror(group, mirror_announcement(group, names), names, sizes,
                                   comm.prepare("all_reduce", (sum(sizes),), dtype, group,
                                                consume=True)))
        syncs: dict[str, Moves] = {
            name: tuple((st, False, program.param_values[name].dtype) for st in p.steps)
            for name, p in bplan.shard_syncs.items()}
        dtypes = {v.name: v.dtype for v in program.graph.inputs}
        self._input_sums[seeded] = {
            name: tuple((st, False, dtypes[name]) for st in p.steps)
            for name, p in bplan.input_sums.items()}
        return tuple(bwd), tuple(mirrors), syncs

    def _backward_fn(self, seeded: tuple[bool, ...], watched: bool, sync: bool
                     ) -> tuple[tuple[_Backward, ...], Callable[..., Any], str]:
        records, _, syncs = self.backwards[seeded]
        found = self._backward_fns.get((seeded, watched, sync))
        if found is None or found[0] is not records:
            # Without sync (a micro-batch before the step's last), the gradients that sync
            # once per step stay whole and pending: level1's slices are cut after the last.
            now = syncs if sync else {n: m for n, m in syncs.items()
                                      if self.program.param_shards[n].level.per_micro_batch}
            found = self._backward_fns[seeded, watched, sync] = (
                records, *self._write_backward(records, seeded, watched, now))
        return found

    def _write_backward(self, records: tuple[_Backward, ...], seeded: tuple[bool, ...],
                        watched: bool, syncs: dict[str, Moves]
                        ) -> tuple[Callable[..., Any], str]:
        src = _Source("def backward(tape, seeds, watch):")
        held: set[int] = set()   # slots holding a gradient at this point of the code
        gathered: set[int] = set()   # level3 weights gathered again (w{slot})
        taken: list[int] = []    # the slots the op being written consumes

        def take(s: int, acts: Actions, shape: tuple[int, ...], dtype: np.dtype) -> str:
            """An output's cotangent as the kernel takes it: zeros for an unused output, else
            after its planned actions (the adjoints of the op's output collectives)."""
            if s in held:
                held.discard(s)
                taken.append(s)
                expr = f"g{s}"
            else:
                expr = f"_zeros({shape!r}, {src.bind('D', dtype)})"
            return self._actions(src, acts, dtype, expr)

        for k, s in enumerate(self.outputs):
            if seeded[k]:
                src.add(f"g{s} = seeds[{k}]")
                held.add(s)
        steps = self.program.steps
        # A sliced parameter's gradient is complete after the last record adding to it: its
        # sync (ReduceScatter into its slice) runs there. Level3 weights are gathered again
        # before the first record whose tape dropped them, and let go after the last.
        last_add = {inp.slot: j for j, r in enumerate(records) for inp in r.inputs
                    if inp.slot in self._sharded and self._sharded[inp.slot] in syncs}
        drops = {j: [k for k in self._drops(len(steps) - 1 - j)
                     if backward_reads(steps[len(steps) - 1 - j].sharding, k, r.needs)]
                 for j, r in enumerate(records) if r.kernel is not None}
        last_drop = {self._fwd[len(steps) - 1 - j].ins[k]: j
                     for j, ks in drops.items() for k in ks}
        extra = {s: len(self._tape_of) + n for n, s in enumerate(self._regathered)}
        synced: set[int] = set()
        # A recomputed Cell runs its forward again before the first of its ops' VJPs, and
        # lets go of the tapes that made after the last.
        in_seg = [(j, self._segment_at[len(steps) - 1 - j][0]) for j, r in enumerate(records)
                  if r.kernel is not None and len(steps) - 1 - j in self._segment_at]
        rerun = {n: j for j, n in reversed(in_seg)}
        release = {n: j for j, n in in_seg}
        for j, r in enumerate(records):
            for n, at in rerun.items():
                if at == j:
                    src.add(f"# recompute {self.program.segments[n].name}")
                    src.add(f"{src.bind('X', functools.partial(self._recompute, n))}(tape)")
            if r.kernel is None:
                dropped = [s for s, _, _, _ in r.outs if s in held]
                held.difference_update(dropped)
                if dropped:
                    src.add("del " + ", ".join(f"g{s}" for s in dropped))
                continue
            kernel = src.bind("K", r.kernel)
            taken.clear()
            i = len(steps) - 1 - j   # the records run last op first
            node = steps[i].node
            src.add(f"# {node.name}: {node.op.name} backward")
            for k in drops.get(j, ()):
                s = self._fwd[i].ins[k]
                name = self._regathered[s]
                if s not in gathered:
                    gathered.add(s)
                    src.add(f"w{s} = " + self._moved(src, self._gather(name), f"tape[{extra[s]}]"))
                pre = self._fwd[i].pre[k] if k < len(self._fwd[i].pre) else ()
                marker = src.bind("W", self._dropped[s])
                src.add(f"tape[{r.keep}] = _rehold(tape[{r.keep}], {marker}, "
                        + self._moved(src, pre, f"w{s}") + ")")
            if r.multi:
                draws = [take(*o) for o in r.outs]
                draws.reverse()
                src.add(f"C = {kernel}(tape[{r.keep}], ({', '.join(draws)},))")
            else:
                d = take(*r.outs[0])
                if r.inline is not None:
                    src.add(f"T = tape[{r.keep}]")
                    src.add(f"d = {d}")
                    names = {f"x{k}": f"T[0][{k}]" for k in range(len(r.needs))}
                    grads = [g.format(**names, y="T[1]", dy="d") if need and g else "None"
                             for need, g in zip(r.needs, r.inline.grads)]
                    src.add(f"C = ({', '.join(grads)},)")
                    src.add("del T, d")
                elif r.view:
                    src.add(f"C = ({kernel}({d}),)")
                elif r.plain:
                    src.add(f"C = {kernel}(*tape[{r.keep}], {d})")
                else:
                    src.add(f"C = {kernel}(tape[{r.keep}], {d})")
            if taken:
                src.add("del " + ", ".join(f"g{s}" for s in taken))
            if r.inner:
                src.add("if C[0] is not None: C = ("
                        + self._actions(src, r.inner, r.inner_dtype, "C[0]") + ", *C[1:])")
            for k, s, shape, dtype, edge, align_sum, align_new in r.inputs:
                dt = src.bind("D", dtype)
                src.add(f"c = C[{k}]")
                src.add(f"if c is None: c = _zeros({shape!r}, {dt})")
                src.add(f"elif c.dtype != {dt}: c = c.astype({dt})")
                if edge:
                    src.add("c = " + self._actions(src, edge, dtype, "c"))
                if s not in held:
                    src.add(f"g{s} = c")
                    held.add(s)
                elif align_sum or align_new:
                    before = self._actions(src, align_sum, dtype, f"g{s}")
                    new = self._actions(src, align_new, dtype, "c")
                    src.add(f"g{s} = {before} + {new}")
                else:
                    src.add(f"g{s} = g{s} + c")
            if drops.get(j):
                src.add(f"tape[{r.keep}] = None")   # the gathered weight goes with it
                done = [s for s, last in last_drop.items() if last == j]
                if done:
                    src.add("del " + ", ".join(f"w{s}" for s in done))
            for n, at in release.items():
                if at == j:
                    seg = self.program.segments[n]
                    keeps = [self._fwd[i].keep for i in range(seg.first, seg.last + 1)
                             if self._fwd[i].keep >= 0]
                    where = len(self._tape_of) + len(self._regathered) + n
                    src.add("; ".join(f"tape[{k}] = None" for k in [*keeps, where]))
            for s, last in last_add.items():
                if last == j and s in held:
                    name = self._sharded[s]
                    src.add(f"s{s} = " + self._moved(src, syncs[name], f"g{s}"))
                    src.add(f"del g{s}")
                    held.discard(s)
                    synced.add(s)
            if watched:
                src.add("watch.sample(tape, locals())")
        program = self.program
        src.add("out = {}")
        for name, v in program.param_values.items():
            if v.param is None or not v.param.requires_grad:
                continue
            s = self.slot[v.id]
            if s in synced:
                src.add(f"out[{name!r}] = s{s}")
            elif s in held:
                # A broadcast view (ReduceMean's) is read-only: the caller gets its own copy.
                src.add(f"out[{name!r}] = g{s} if g{s}.flags.writeable else g{s}.copy()")
            else:   # no gradient reached it: zeros, in the layout it is returned in
                lay = (program.storage_layout(name) if name in syncs
                       else program.param_layouts[name])
                shape = lay.local_shape()
                src.add(f"out[{name!r}] = _zeros({shape!r}, {src.bind('D', v.dtype)})")
        for v in program.graph.inputs:   # a stage's input from an earlier stage: summed whole
            if v.name in self._input_sums[seeded]:
                s, key = self.slot[v.id], input_gradient(v.name)
                shape = program.layouts[v.id].local_shape()
                src.add(f"out[{key!r}] = " + (
                    self._moved(src, self._input_sums[seeded][v.name], f"g{s}") if s in held
                    else f"_zeros({shape!r}, {src.bind('D', v.dtype)})"))
        src.add("return out")
        return src.build("backward")

    def backward(self, bplan: BackwardPlan, tape: list[Any],
                 output_grads: Sequence[np.ndarray | None], watch: MemoryWatch | None,
                 sync: bool = True) -> dict[str, np.ndarray]:
        """The gradients of this rank's parameters. ``sync`` False (a micro-batch whose
        gradients are summed with the others' before the step's one synchronisation): the
        Mirrors and level1's slicing are left to :meth:`sync`."""
        seeded = tuple(g is not None for g in output_grads)
        if seeded not in self.backwards:
            self.backwards[seeded] = self._compile_backward(bplan, seeded)
        run = self._backward_fn(seeded, watch is not None, sync)[1]
        # A value's cotangent has the value's dtype, whatever numpy's promotion made of the
        # contributions, so every collective moves the bytes the schedule lists. Seeds are
        # whole: every rank holds the output's whole cotangent.
        seeds = [None if g is None else np.asarray(g).astype(v.dtype, copy=False)
                 for v, g in zip(self.program.graph.outputs, output_grads)]
        out: dict[str, np.ndarray] = run(tape, seeds, watch)
        return self._mirrors(seeded, out) if sync else out

    def sync(self, seeded: Sequence[bool], grads: dict[str, np.ndarray]
             ) -> dict[str, np.ndarray]:
        """The step's one synchronisation of gradients summed over micro-batches (each left
        pending by ``backward(..., sync=False)``): level1's slices cut, in parameter order,
        then the Mirrors. A new dict; the arrays given may be written into."""
        key = tuple(seeded)
        _, _, syncs = self.backwards[key]
        out = dict(grads)
        for name in self.program.param_values:
            moves = syncs.get(name)
            if moves is not None and not self.program.param_shards[name].level.per_micro_batch:
                out[name] = self._run(moves, out[name])
        return self._mirrors(key, out)

    def _mirrors(self, seeded: tuple[bool, ...], out: dict[str, np.ndarray]
                 ) -> dict[str, np.ndarray]:
        mirrors = self.backwards[seeded][1]
        # Mirror: one AllReduce per bucket (by default every gradient of a group of ranks and
        # dtype; comm_fusion splits them), packed at once; the sum completes every pending one.
        for _, announce, names, sizes, all_reduce in mirrors:
            flat = all_reduce(np.concatenate([out[n].ravel() for n in names]),
                              schedule.announce(announce))
            offset = 0
            for n, size in zip(names, sizes):
                out[n] = flat[offset:offset + size].reshape(out[n].shape)
                offset += size
        return out
