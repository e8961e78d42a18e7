"""Running one op's sharding on this rank: the runtime side of :class:`simpar.ops.OpSharding`.

An :class:`OpRunner` runs what the pure sharding rule describes, through :mod:`simpar.comm`:
the redistribution before the kernel (Reshape's ``inner_plan``), the kernel, the output
plans, and, backward, the actions its planned backward lists
(:attr:`OpSharding.solo_backward <simpar.ops.OpSharding.solo_backward>`, from
:mod:`simpar.cotangent`). It is also the :class:`~simpar.ops.Collectives` the op's kernels
call mid-kernel: this rank's place among the op's devices and the op's own collectives,
each prepared once (:func:`simpar.comm.prepare`) and announced to the schedule guard.
``run_op`` runs an op by itself with one; the executor gives one to every op it calls
through ``local_forward``/``local_backward``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from simpar import comm, schedule
from simpar.cotangent import Action
from simpar.layout import distribute
from simpar.ops._base import OpSharding
from simpar.ops.comm_spec import CommSpec
from simpar.ops.kernels import needing
from simpar.redistribution import execute, execute_step

__all__ = ["OpRunner"]


class OpRunner:
    """``sharding`` run on ``rank`` (default: this process's, or 0 when the op runs on one
    device, a stand-alone reference inside a multi-rank job). On rank 5 of a LayerNorm
    whose normalised axis is split 4 ways on 8 devices, its kernel's
    ``collectives.all_reduce`` sums the statistics over ranks 4..7."""

    def __init__(self, sharding: OpSharding, rank: int | None = None) -> None:
        self.sharding = sharding
        self.rank = (rank if rank is not None else
                     0 if math.prod(sharding.device_matrix) == 1 else comm.get_rank())
        # The op's own collectives, prepared: by (id of the spec, which the sharding keeps
        # alive; shape; dtype).
        self._prepared: dict[tuple[int, tuple[int, ...], np.dtype], comm.Prepared] = {}

    # ------------------------------------------------------------ Collectives
    def all_reduce(self, spec: CommSpec, x: np.ndarray, what: str) -> np.ndarray:
        """Run one of the op's own collectives (an entry of ``internal_forward`` or
        ``internal_backward``) on this rank's partial ``x``: ``what`` tags the trace. The
        collective is prepared the first time a spec runs on an array of a given shape and
        dtype, and reused after."""
        key = (id(spec), x.shape, x.dtype)
        run = self._prepared.get(key)
        if run is None:
            run = self._prepared[key] = comm.prepare("all_reduce", x.shape, x.dtype,
                                                     spec.group(self.rank), op=spec.how)
        at = schedule.announce(spec)
        if at is None:
            with comm.label(f"{self.sharding.op.name}:{what}"):
                y = run(x)
        else:
            y = run(x, at)
        return y.reshape(np.shape(x))  # all_reduce hands a 0-d array back as shape (1,)

    # ------------------------------------------------------------ forward
    def forward(self, *local_inputs: np.ndarray) -> tuple[Any, Any]:
        """This rank's output shard (a tuple for multi-output ops) and what backward needs."""
        sh = self.sharding
        name = sh.op.name
        if sh.inner_plan is not None:
            with comm.label(f"{name}:redistribute"):
                local_inputs = (execute(sh.inner_plan, local_inputs[0]), *local_inputs[1:])
        raw, saved = sh.op.local_forward(sh, *local_inputs, collectives=self)
        if not sh.more_outs and not sh.out_plan.steps:   # most ops: nothing to move
            return raw, saved
        raws = raw if sh.more_outs else (raw,)
        outs = []
        for k, (r, (_, _, p)) in enumerate(zip(raws, sh.outputs)):
            if not p.steps:
                outs.append(r)
                continue
            with comm.label(f"{name}:output" + (f"{k}" if k else "")):
                outs.append(execute(p, r))
        return (tuple(outs) if sh.more_outs else outs[0]), saved

    # ------------------------------------------------------------ backward
    def seed(self, k: int, grad_output: np.ndarray) -> np.ndarray:
        """This rank's share of output ``k``'s whole cotangent ``grad_output``, as
        :attr:`OpSharding.solo_backward` seeds it: its shard, divided among the replicas it
        is pending over (the replicas share an output's cotangent, except where they
        computed it from different input pieces)."""
        sh = self.sharding
        lay = sh.outputs[k][1]
        reps = math.prod(lay.device_matrix[a] for a in sh.solo_backward.seeds[k])
        return np.asarray(distribute(grad_output, lay, self.rank) / reps,
                          dtype=grad_output.dtype)

    def backward(self, saved: Any, local_dout: Any, needs: Sequence[bool] | None = None
                 ) -> tuple[np.ndarray | None, ...]:
        """This rank's gradient *contributions* for every input, in the input layouts, from
        its shares of the outputs' cotangents (:meth:`seed`), as
        :attr:`OpSharding.solo_backward` plans it (sum over an input's replica axes to
        complete them, :meth:`complete_grad`). For a multi-output op, ``local_dout`` is a
        tuple (None for an unused output: zeros). ``needs[k]`` False says input k's
        gradient is not used: the kernels may skip it and give None."""
        sh = self.sharding
        name = sh.op.name
        planned = sh.solo_backward.op
        douts = local_dout if sh.more_outs else (local_dout,)
        draws: list[np.ndarray] = []
        for k, (d, (_, out, _)) in reversed(list(enumerate(zip(douts, sh.outputs)))):
            if d is None:
                d = np.zeros(out.local_shape(), dtype=_float_of(saved))
            with comm.label(f"{name}:output-adjoint" + (f"{k}" if k else "")):
                draws.append(_run(planned.out_actions[k], d))
        draws.reverse()
        grads = self.kernel_backward(saved, draws, needs)
        if sh.inner_plan is None or grads[0] is None:
            return grads
        with comm.label(f"{name}:redistribute-adjoint"):
            return (_run(planned.inner_actions, grads[0]), *grads[1:])

    def kernel_backward(self, saved: Any, draws: Sequence[np.ndarray],
                        needs: Sequence[bool] | None = None) -> tuple[np.ndarray | None, ...]:
        """The local kernel's gradients (with its own collectives, ``internal_backward``) from
        the raw outputs' cotangents ``draws``, one per output; before the inner plan's
        adjoint. ``needs`` as in :meth:`backward`."""
        sh = self.sharding
        run = self.backward_kernel((True,) * len(sh.in_layouts) if needs is None else needs)
        return run(saved, tuple(draws) if sh.more_outs else draws[0])

    def backward_kernel(self, needs: Sequence[bool]
                        ) -> Callable[[Any, Any], tuple[np.ndarray | None, ...]]:
        """:meth:`kernel_backward` bound once for a compiled program: ``f(saved, dout)`` with
        ``dout`` the raw output's cotangent (a tuple of them for a multi-output op). When
        every input's gradient is needed it is the op's own ``local_backward``, with nothing
        in between."""
        sh = self.sharding
        needs = tuple(bool(n) for n in needs)
        if all(needs):
            return functools.partial(sh.op.local_backward, sh, collectives=self)

        def run(saved: Any, dout: Any) -> tuple[np.ndarray | None, ...]:
            with needing(needs):
                return sh.op.local_backward(sh, saved, dout, collectives=self)
        return run

    def complete_grad(self, i: int, contribution: np.ndarray) -> np.ndarray:
        """Sum input ``i``'s gradient contributions over the axes the planned backward
        leaves it pending on, its replicas (one AllReduce,
        :meth:`OpSharding.input_grad_spec <simpar.ops.OpSharding.input_grad_spec>`)."""
        spec = self.sharding.input_grad_spec(i)
        if spec is None:
            return contribution
        with comm.label(f"{self.sharding.op.name}:input{i}-grad"):
            return comm.all_reduce(contribution, group=spec.group(self.rank))


def _run(actions: Sequence[Action], x: np.ndarray) -> np.ndarray:
    """Planned backward actions on this rank's array, in order."""
    for a in actions:
        x = execute_step(a.step, x, a.adjoint)
    return x


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
