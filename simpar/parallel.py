"""The user's helpers: run one operator in parallel, and describe its parallel plan.

``run_op(op, *global_inputs)`` runs ``op`` under its strategy on the current MPI world, where
every rank holds only its shards, and returns the assembled global result;
``get_parallel_info(op, input_shapes)`` says, without running anything, what it would do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from simpar import _checks as checks
from simpar import comm, context, graph
from simpar.cake import cake
from simpar.compare import relative_error
from simpar.layout import TensorLayout, distribute
from simpar.ops._base import OpSharding, Primitive
from simpar.redistribution import execute, plan
from simpar.runtime.op_runner import OpRunner
from simpar.search import StrategyMap, plan_request, request_from_context
from simpar.strategy_file import load_strategy, save_strategy

__all__ = ["OpCheckError", "OpRun", "describe_sharding", "export_strategy", "get_parallel_info",
           "import_strategy", "run_op", "search_strategies"]


class OpCheckError(AssertionError):
    """``run_op(check=True)`` found the parallel result differs from the single-device one."""


@dataclass(frozen=True)
class OpRun:
    """What ``run_op(..., full=True)`` returns: global results and this rank's shards."""

    output: Any
    grads: tuple[np.ndarray | None, ...] | None
    sharding: OpSharding
    local_inputs: tuple[np.ndarray, ...]
    local_output: Any
    local_grads: tuple[np.ndarray | None, ...] | None


def _gather_global(local: np.ndarray, layout: TensorLayout) -> np.ndarray:
    """Every rank gets the global array (for returning results; not part of the op)."""
    with comm.label("run_op:assemble"):
        return execute(plan(layout, layout.replicated()), local)


def _tolerance(dtype: np.dtype) -> float:
    return 1e-5 if dtype == np.float32 else 1e-12


def _check(what: str, got: np.ndarray, want: np.ndarray, local: np.ndarray | None,
           op: Primitive) -> None:
    """Raise :class:`OpCheckError` on every rank unless ``got`` (assembled, the same on every
    rank) matches ``want``; a non-finite value fails and names the ranks whose shard holds it
    (``local`` is this rank's shard; collective)."""
    if got.shape != want.shape:
        raise OpCheckError(f"{op.name}: parallel {what} has shape {got.shape}, single device "
                           f"{want.shape}")
    err = relative_error(got, want)
    if err <= (_tolerance(want.dtype) if want.dtype.kind == "f" else 0.0):
        return
    where = ""
    if local is not None and got.dtype.kind in "fc" and not np.isfinite(got).all():
        bad = np.array([0 if np.isfinite(local).all() else 1], dtype=np.int32)
        flags = comm.all_gather(bad) if comm.get_group_size() > 1 else bad
        where = f" (non-finite values in the shards of ranks {np.flatnonzero(flags).tolist()})"
    elif want.dtype.kind == "f" and not np.isfinite(want).all():
        where = " (the single-device result itself is non-finite)"
    amount = "non-finite" if err == float("inf") else f"{err:.3e} (relative to max |value|)"
    tol = f", more than {_tolerance(want.dtype):.0e}" if err != float("inf") else ""
    raise OpCheckError(f"{op.name}: parallel {what} differs from single device: {amount}"
                       f"{tol}{where}; strategy {op.in_strategy}")


def run_op(op: Primitive, *global_inputs: np.ndarray, grad_output: np.ndarray | None = None,
           check: bool = False, full: bool = False, verbose: bool = False) -> Any:
    """Run ``op`` on the MPI world under its strategy and return the global result.

    Each rank takes its shard of every input, runs the op's per-rank program (local kernel and
    collectives) and the output is assembled afterwards. With ``grad_output`` it also runs the
    backward and returns ``(output, input_grads)``. ``check=True`` compares with the
    single-device kernel/VJP and raises :class:`OpCheckError` on every rank if they differ.
    ``verbose=True``: rank 0 prints the plan first, each input's and output's cut drawn as the
    grid of its blocks and the ranks holding each (:func:`simpar.cake.cake`), and the
    collectives forward and backward.

    >>> out = run_op(MatMul().shard(((2, 1), (1, 4))), a, b)   # doctest: +SKIP
    """
    if not isinstance(op, Primitive):
        raise TypeError(f"run_op: op must be a simpar.ops primitive, got {type(op).__name__}")
    if len(global_inputs) != op.n_inputs:
        raise ValueError(f"run_op: {op.name} takes {op.n_inputs} inputs, got "
                         f"{len(global_inputs)}")
    xs = [np.asarray(x) for x in global_inputs]
    rank, size = comm.get_rank(), comm.get_group_size()
    if size > 1:
        given: tuple[Any, ...] = () if grad_output is None else (
            tuple(grad_output) if isinstance(grad_output, (tuple, list)) else (grad_output,))
        comm.check_same_arrays(f"run_op({op.name})", [
            *((f"input {i}", x) for i, x in enumerate(xs)),
            *((f"grad_output {k}", np.asarray(d)) for k, d in enumerate(given))])
    op.check_values(*xs)
    sh = _planned(op, xs)
    if verbose and rank == 0:
        print(describe_sharding(sh, [x.dtype.name for x in xs][0]), flush=True)
    runner = OpRunner(sh)
    local_in = tuple(distribute(x, lay, rank) for x, lay in zip(xs, sh.in_layouts))
    with comm.label("run_op:forward"):
        local_out, saved = runner.forward(*local_in)
    multi = bool(sh.more_outs)
    local_outs = local_out if multi else (local_out,)
    outs = tuple(_gather_global(o, lay) for o, (_, lay, _) in zip(local_outs, sh.outputs))
    out: Any = outs if multi else outs[0]
    if check:
        want = op.kernel(*xs)
        for k, (o, w, lo) in enumerate(zip(outs, want if multi else (want,), local_outs)):
            _check(f"output {k}" if multi else "output", o, np.asarray(w), lo, op)
    grads: tuple[np.ndarray | None, ...] | None = None
    local_grads: tuple[np.ndarray | None, ...] | None = None
    if grad_output is not None:
        dys = tuple(grad_output) if multi else (grad_output,)
        if len(dys) != len(outs):
            raise ValueError(f"run_op: {op.name} has {len(outs)} outputs; give one "
                             f"grad_output per output, got {len(dys)}")
        dys = tuple(np.asarray(d, dtype=o.dtype) for d, o in zip(dys, outs))
        for k, (dy, o) in enumerate(zip(dys, outs)):
            if dy.shape != o.shape:
                raise ValueError(f"run_op: grad_output {k} has shape {dy.shape}, output {k} of "
                                 f"{op.name} has shape {o.shape}")
        # The backward as simpar.cotangent plans it (OpSharding.solo_backward): each rank
        # its share of every cotangent, each input's gradient summed over its replicas.
        local_dys = [runner.seed(k, dy) for k, dy in enumerate(dys)]
        with comm.label("run_op:backward"):
            contribs = runner.backward(saved, tuple(local_dys) if multi else local_dys[0])
            local_grads = tuple(None if c is None else runner.complete_grad(i, c)
                                for i, c in enumerate(contribs))
        grads = tuple(None if g is None else _gather_global(g, lay)
                      for g, lay in zip(local_grads, sh.in_layouts))
        if check:
            ys = op.kernel(*xs)
            want_g = op.vjp(xs, ys, dys if multi else dys[0])
            for i, (g, w) in enumerate(zip(grads, want_g)):
                if (g is None) != (w is None):
                    raise OpCheckError(f"{op.name}: gradient {i} presence differs")
                if g is not None and w is not None:
                    _check(f"gradient of input {i}", g, np.asarray(w),
                           None if local_grads is None else local_grads[i], op)
    if full:
        return OpRun(out, grads, sh, local_in, local_out, local_grads)
    return out if grads is None else (out, grads)


def _planned(op: Primitive, xs: Sequence[np.ndarray]) -> OpSharding:
    """run_op's plan: the op's strategy (or its default) on the request's devices, as a
    semi_auto_parallel one-op network with the global inputs plans it."""
    request = request_from_context(graph.trace(op, [(x.shape, x.dtype) for x in xs]),
                                   mode="semi_auto_parallel", dataset_strategy="full_batch")
    return op.sharding([x.shape for x in xs], request.device_num,
                       enable_alltoall=request.enable_alltoall)


def _cakes(sh: OpSharding) -> tuple[list[str], list[str]]:
    """Each input's and output's cut, drawn (:func:`simpar.cake.cake`)."""
    ins = [cake(lay, f"input {i}") for i, lay in enumerate(sh.in_layouts)]
    outs = []
    for k, (raw, out, _) in enumerate(sh.outputs):
        name = f"output {k}" if len(sh.outputs) > 1 else "output"
        if raw != out:   # the kernel's partial (or other) layout, then the op's collectives'
            outs.append(cake(raw, f"{name} as the kernel leaves it"))
        outs.append(cake(out, name))
    return ins, outs


def describe_sharding(sh: OpSharding, dtype: str = "float32", rank: int = 0) -> str:
    """``sh`` as ``run_op(verbose=True)`` prints it: the strategy and device matrix, every
    input's and output's cut drawn, and ``rank``'s collectives forward and backward."""
    itemsize = np.dtype(dtype).itemsize
    out_size = sh.op.output_dtype(np.dtype(dtype)).itemsize
    ins, outs = _cakes(sh)

    def comms(specs: Sequence[Any]) -> str:
        listed = [c.describe(rank, itemsize, out_size) for c in specs]
        return ", ".join(f"{c['op']} over {c['group']}" for c in listed) or "none"

    return "\n".join([f"{sh.op.name}: strategy {[list(s) for s in sh.strategy]}, device "
                      f"matrix {list(sh.device_matrix)}", *ins, *outs,
                      f"rank {rank}: forward {comms(sh.forward_comm)}; backward "
                      f"{comms(sh.backward_comm)}"])


def get_parallel_info(op: Primitive, input_shapes: Sequence[Sequence[int]],
                      device_num: int | None = None, rank: int | None = None,
                      dtype: str = "float32") -> dict[str, Any]:
    """What ``op`` does in parallel, as a JSON-serialisable dict, without running it.

    ``forward_comm``/``backward_comm`` list ``{"op", "group", "groups", "bytes", "reason"}``:
    ``group`` is ``rank``'s group, ``bytes`` what it receives. ``inputs_cake`` and
    ``outputs_cake`` draw each cut as the grid of its blocks, each cell the ranks holding it
    (:func:`simpar.cake.cake`; ``print(info["inputs_cake"][0])``). For
    ``MatMul().shard(((2, 4), (4, 1)))`` on 8 devices the forward is one AllReduce, over
    [0, 1, 2, 3] for ranks 0..3 and [4, 5, 6, 7] for the others.
    """
    if not isinstance(op, Primitive):
        raise TypeError(f"get_parallel_info: op must be a simpar.ops primitive, got "
                        f"{checks.shown(op)}")
    input_shapes = checks.shapes(input_shapes, "get_parallel_info: input_shapes")
    _planning_args("get_parallel_info", device_num)
    if rank is not None:
        checks.integer(rank, "get_parallel_info: rank", 0, expected="an int or None")
    if device_num is None:
        device_num = int(context.get_auto_parallel_context("device_num"))
    if rank is None:
        rank = int(context.get_auto_parallel_context("global_rank")) \
            if context.get_auto_parallel_context("global_rank") < device_num else 0
    in_size = np.dtype(dtype).itemsize
    out_size = op.output_dtype(np.dtype(dtype)).itemsize
    sh = op.sharding(input_shapes, device_num,
                     enable_alltoall=bool(context.get_auto_parallel_context("enable_alltoall")))
    in_cakes, out_cakes = _cakes(sh)
    return {
        "op": op.name,
        "strategy": [list(s) for s in sh.strategy],
        "device_matrix": list(sh.device_matrix),
        "inputs_tensor_map": [lay.to_dict()["tensor_map"] for lay in sh.in_layouts],
        "outputs_tensor_map": [o.to_dict()["tensor_map"] for _, o, _ in sh.outputs],
        "inputs_slice_shape": [list(lay.local_shape()) for lay in sh.in_layouts],
        "outputs_slice_shape": [list(o.local_shape()) for _, o, _ in sh.outputs],
        "inputs_cake": in_cakes,
        "outputs_cake": out_cakes,
        "forward_comm": [c.describe(rank, in_size, out_size) for c in sh.forward_comm],
        "backward_comm": [c.describe(rank, in_size, out_size) for c in sh.backward_comm],
        "flops": int(sh.local_flops()),
        "memory_bytes": int(sh.memory_bytes(in_size, out_size)),
    }


def search_strategies(cell: Any, input_specs: Sequence[tuple[Sequence[int], Any]],
                      device_num: int | None = None, search_mode: str | None = None,
                      dataset_strategy: Any = None, enable_alltoall: bool | None = None,
                      input_names: Sequence[str] | None = None) -> StrategyMap:
    """Search every op's strategy of ``cell`` for inputs of the given ``(shape, dtype)`` on
    ``device_num`` devices, without running anything: no MPI, no data, nothing of the
    model's size allocated. Returns the :class:`~simpar.search.StrategyMap`, keyed by
    MindSpore-style op names (``.ops[name].in_strategy``), that ``lower`` and
    ``TrainOneStepCell`` would run. ``search_mode`` names a registered search
    ("dynamic_programming", MindSpore's; "exact", the ILP optimum). An argument left None is
    the context's ``device_num``, ``search_mode``, ``dataset_strategy`` or
    ``enable_alltoall`` where the user set it, else ``"dynamic_programming"``,
    ``"full_batch"`` and False; the algo parameters and the cost model are the context's.
    The training step is planned: a Cell is traced in training mode (its modes are kept)."""
    _planning_args("search_strategies", device_num, search_mode, dataset_strategy,
                   enable_alltoall)
    g = graph.trace(cell, input_specs, input_names, training=True)
    return plan_request(request_from_context(
        g, cell=cell, device_num=device_num, mode="auto_parallel", search_mode=search_mode,
        dataset_strategy=dataset_strategy, enable_alltoall=enable_alltoall,
        unset={"search_mode": "dynamic_programming", "dataset_strategy": "full_batch",
               "enable_alltoall": False}))


def export_strategy(path: str, cell: Any, input_specs: Sequence[tuple[Sequence[int], Any]],
                    device_num: int, mode: str = "auto_parallel",
                    search_mode: str = "dynamic_programming",
                    dataset_strategy: Any = "full_batch", enable_alltoall: bool = False,
                    input_names: Sequence[str] | None = None) -> StrategyMap:
    """Plan ``cell`` for these inputs on ``device_num`` devices (a search in auto_parallel,
    the ``.shard()`` strategies and propagation in semi_auto_parallel) and save the plan to
    ``path`` as MindSpore's JSON strategy file (:func:`simpar.strategy_file.save_strategy`),
    without running anything. Returns the saved map."""
    checks.path(path, "export_strategy: path")
    checks.positive_int(device_num, "export_strategy: device_num")
    _planning_args("export_strategy", device_num, search_mode, dataset_strategy,
                   enable_alltoall)
    g = graph.trace(cell, input_specs, input_names, training=True)
    smap = plan_request(request_from_context(
        g, cell=cell, device_num=device_num, mode=mode, dataset_strategy=dataset_strategy,
        enable_alltoall=enable_alltoall, search_mode=search_mode))
    save_strategy(path, smap, g, search_mode=search_mode if mode == "auto_parallel" else None)
    return smap


def import_strategy(path: str, cell: Any, input_specs: Sequence[tuple[Sequence[int], Any]],
                    device_num: int, dataset_strategy: Any = "full_batch",
                    input_names: Sequence[str] | None = None) -> StrategyMap:
    """The strategy map of a strategy file, checked against ``cell`` traced for these inputs
    on ``device_num`` devices (:func:`simpar.strategy_file.load_strategy`: what differs is
    named). A plain MindSpore file has no input layouts: they come from
    ``dataset_strategy``. ``simpar.runtime.lower(graph, map)`` runs it, no search."""
    checks.path(path, "import_strategy: path")
    checks.positive_int(device_num, "import_strategy: device_num")
    _planning_args("import_strategy", device_num, None, dataset_strategy, None)
    g = graph.trace(cell, input_specs, input_names, training=True)
    return load_strategy(path, g, device_num, dataset_strategy=dataset_strategy)


def _planning_args(func: str, device_num: object, search_mode: object = None,
                   dataset_strategy: object = None, enable_alltoall: object = None) -> None:
    """The planning helpers' optional arguments: None (the context's), or a valid value."""
    if device_num is not None:
        checks.positive_int(device_num, f"{func}: device_num")
    if search_mode is not None and not isinstance(search_mode, str):
        raise TypeError(f"{func}: search_mode must be None (the context's) or a search's name "
                        f"such as 'dynamic_programming', got {checks.shown(search_mode)}")
    if dataset_strategy is not None:
        context.check_dataset_strategy(func, "dataset_strategy", dataset_strategy)
    if enable_alltoall is not None and not isinstance(enable_alltoall, bool):
        raise TypeError(f"{func}: enable_alltoall must be None (the context's) or a bool, got "
                        f"{checks.shown(enable_alltoall)}")
