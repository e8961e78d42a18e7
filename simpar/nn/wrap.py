"""``WithLossCell`` and ``TrainOneStepCell``: one call trains one step on the MPI world.

The first call traces the network for the inputs' shapes, lowers it under the parallel
context to a :class:`~simpar.runtime.ParallelProgram`, and gives every rank its shards of the
global initial parameters. Each call then runs forward, backward and the optimizer on this
rank's shards and returns the global loss.

Gradient seeding (docs/design.md#gradient-semantics-the-backward-is-planned-with-layouts):
the loss is replicated on ``r`` ranks, and every replica seeds the whole cotangent (the
backward keeps it whole where the replicas compute alike, :mod:`simpar.cotangent`). With
``loss_repeated_mean`` the gradients, once each parameter's Mirror sums its pending parts,
equal the single-device gradient of the global loss exactly; without it they are ``r`` times
that (MindSpore sums the repeated losses' gradients then). With ``gradients_mean=False`` they
are instead the sum over the ``D`` data-parallel shards (``D`` = the cut of the batch dimension
at the loss op), as data parallel training sums them.

A network wrapped in :class:`~simpar.nn.auto_parallel.AutoParallel` (anywhere in the cell's
network, at most once) brings its own settings: the cell takes its mode from the wrapper, and
compiles inside ``AutoParallel.parallel_context()``, so the global context is neither read
for the settings the wrapper gives nor changed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from simpar import _checks as checks
from simpar import comm, context, graph
from simpar.layout import TensorLayout, shard_index, take_shard
from simpar.nn.auto_parallel import AutoParallel
from simpar.nn.cell import Cell
from simpar.nn.grad_accumulation import GradAccumulation
from simpar.nn.optim import Optimizer
from simpar.pipeline import PipelineRunner, plan_pipeline
from simpar.pipeline.auto import choose_stages
from simpar.pipeline.strategy_files import save_pipeline_strategy
from simpar.redistribution import execute, plan
from simpar.runtime.lowering import lower
from simpar.runtime.program import ParallelProgram
from simpar.search import (
    PlanRequest,
    global_input_shapes,
    plan_once,
    request_from_context,
)
from simpar.search.dimensions import MICRO_BATCH_CHOICES, graph_of
from simpar.seed import get_seed
from simpar.strategy_file import save_strategy
from simpar.strategy_import import plan_with_file

__all__ = ["TrainOneStepCell", "WithLossCell"]


class WithLossCell(Cell):
    """``loss_fn(backbone(data), label)``."""

    def __init__(self, backbone: Cell, loss_fn: Cell) -> None:
        super().__init__()
        self._backbone = backbone
        self._loss_fn = loss_fn

    def construct(self, data: Any, label: Any) -> Any:
        return self._loss_fn(self._backbone(data), label)


class TrainOneStepCell:
    """Calling it on ``(data, label)`` runs one training step and returns the global loss.

    The first call must pass the global batch: its shapes are the graph's. Later calls may
    pass the global batch (each rank takes its slice per the dataset strategy) or this rank's
    slice. ``parallel_mode`` overrides the context's mode (tests build a stand-alone reference
    in the same process this way).

    ``per_device=True`` is MindSpore's ``full_batch=False`` feeding, which
    :class:`simpar.mindspore.train.Model` uses: every call, the first too, passes this rank's
    own slice, laid out by the dataset strategy (``"data_parallel"``: rank r holds block r of
    the batch); the global shapes are the slices' times the strategy's cuts. Ranks whose
    slices are copies of one block must pass the same data, as MindSpore's sharded datasets
    give them (not checked: only the shapes are).

    With an :class:`~simpar.nn.auto_parallel.AutoParallel` in ``network``, the mode and the
    other parallel settings are the wrapper's; ``parallel_mode`` may then only repeat the
    wrapper's mode or be ``"stand_alone"`` (the single-device twin, whose program the
    wrapper's settings do not change). ``auto_parallel`` is that wrapper, or None.
    """

    #: Whether the constructor puts the network in training mode (simpar's; MindSpore's
    #: TrainOneStepCell leaves the mode to ``set_train()``, as simpar.mindspore's does).
    sets_train_mode = True

    def __init__(self, network: Cell, optimizer: Optimizer, sens: float = 1.0,
                 parallel_mode: str | None = None, seed: int | None = None,
                 per_device: bool = False) -> None:
        checks.instance(network, Cell, "TrainOneStepCell: network", "a Cell")
        checks.instance(optimizer, Optimizer, "TrainOneStepCell: optimizer",
                        "a simpar.nn Optimizer")
        if isinstance(sens, bool) or not isinstance(sens, (int, float)):
            raise TypeError(f"TrainOneStepCell: sens must be a number, got {sens!r}")
        if parallel_mode is not None and parallel_mode not in context.ParallelMode.MODES:
            raise ValueError(f"TrainOneStepCell: parallel_mode must be None (the context's) or "
                             f"one of {list(context.ParallelMode.MODES)}, got {parallel_mode!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or seed < 0):
            raise ValueError(f"TrainOneStepCell: seed must be None (the global seed) or an int "
                             f">= 0, got {seed!r}")
        checks.instance(per_device, bool, "TrainOneStepCell: per_device", "a bool")
        if self.sets_train_mode:
            network.set_train(True)
        self.network = network
        self.optimizer = optimizer
        #: Whether every call passes this rank's own slice (MindSpore's full_batch=False).
        self.per_device = per_device
        self.sens = float(sens)
        self.auto_parallel = _auto_parallel_of(network)
        if self.auto_parallel is None:
            self.mode = parallel_mode or str(context.get_auto_parallel_context("parallel_mode"))
        else:
            own = str(self.auto_parallel.parallel_settings()["parallel_mode"])
            if parallel_mode not in (None, own, "stand_alone"):
                raise ValueError(f"TrainOneStepCell: parallel_mode={parallel_mode!r} contradicts "
                                 f"the network's {self.auto_parallel!r} (which plans as {own!r}); "
                                 f"pass None, {own!r} or 'stand_alone' (the single-device twin)")
            self.mode = parallel_mode or own
        self.seed = get_seed() if seed is None else seed
        accumulation = _grad_accumulation_of(network)
        #: Micro-batches per step (a GradAccumulation in ``network``; 1 without).
        self.micro_batches = accumulation.micro_size if accumulation is not None else 1
        #: Whether auto_parallel may choose the micro-batches (no GradAccumulation fixes them).
        self._choose_micro = accumulation is None
        self.program: ParallelProgram | None = None
        #: With ``pipeline_stages`` > 1: this rank's part of the pipeline
        #: (:class:`~simpar.pipeline.PipelineRunner`), else None.
        self.pipeline: PipelineRunner | None = None
        self.pipeline_scheduler = "1f1b"
        #: How auto_parallel chose the memory dimensions (memory_dimensions not "fixed"):
        #: a :class:`~simpar.search.dimensions.DimensionSearch`, else None.
        self.program_dimensions: Any = None
        #: With ``auto_pipeline``: every stage count it priced (``StageCount``), else ().
        self.stage_counts: list[Any] = []
        self._ctx: context.ParallelContext | None = None
        self._seed = 1.0
        self.params: dict[str, np.ndarray] = {}
        # Per graph input, this rank's (layout, where its shard sits, whether it holds zeros).
        self._feed: tuple[tuple[TensorLayout, tuple[slice, ...], bool], ...] = ()
        self.step_count = 0
        self.last_grads: dict[str, np.ndarray] = {}
        network.name_parameters()

    # ------------------------------------------------------------ build
    def build(self, data: np.ndarray, label: np.ndarray) -> ParallelProgram:
        """Trace and lower for these global input shapes, and lay out the parameters."""
        with self.settings() as ctx:
            self.per_device = self.feeds_per_device(ctx)
            if self.per_device:
                return self._build_per_device(ctx, data, label)
            return self._build(ctx, data, label)

    def feeds_per_device(self, ctx: context.ParallelContext) -> bool:
        """Whether each rank passes its own slice under ``ctx``: the ``per_device`` given
        (simpar.mindspore's cell decides it from ``full_batch``, as MindSpore does). The build
        records it in :attr:`per_device`."""
        return self.per_device

    def global_shapes(self, ctx: context.ParallelContext, data: np.ndarray,
                      label: np.ndarray) -> list[tuple[int, ...]]:
        """The global shapes of a batch of which this rank passed ``data`` and ``label``: theirs
        without ``per_device``, else theirs times the dataset strategy's cuts under ``ctx``."""
        shapes = [tuple(int(d) for d in data.shape), tuple(int(d) for d in label.shape)]
        world = 1 if self.mode == "stand_alone" else comm.get_group_size()
        if not self.feeds_per_device(ctx) or world == 1:
            return shapes
        dataset = "data_parallel" if self.mode == "data_parallel" else ctx.dataset_strategy
        return global_input_shapes(shapes, world, dataset)

    def _build_per_device(self, ctx: context.ParallelContext, data: np.ndarray,
                          label: np.ndarray) -> ParallelProgram:
        """Build from this rank's slices: the global shapes are theirs times the dataset
        strategy's cuts (the ranks must agree on the slices' shapes, not their bytes)."""
        world = 1 if self.mode == "stand_alone" else comm.get_group_size()
        if world > 1:
            comm.check_context()   # device_num against the world: the shapes multiply by it
            comm.check_same_arrays("TrainOneStepCell.build", [
                (f"{what} (this rank's slice; shape)", np.asarray(x.shape, dtype=np.int64))
                for what, x in (("data", data), ("label", label))])
            if ctx.pipeline_stages > 1 or ctx.auto_pipeline:
                raise ValueError("TrainOneStepCell: per_device=True (MindSpore's "
                                 "full_batch=False) with pipeline stages is not supported: "
                                 "pass the global batch on every rank (full_batch=True)")
        shapes = self.global_shapes(ctx, data, label)
        # Stand-ins of the global shapes that hold no memory: only shapes and dtypes are read.
        stand_ins = [np.broadcast_to(np.zeros((), x.dtype), shape)
                     for x, shape in zip((data, label), shapes)]
        return self._build(ctx, stand_ins[0], stand_ins[1], agreed=True)

    def settings(self) -> contextlib.AbstractContextManager[context.ParallelContext]:
        """The parallel context to compile under: the network's AutoParallel's, scoped to the
        compilation (a stand-alone twin's too: one device's program does not depend on them),
        or else the global one."""
        if self.auto_parallel is None:
            return contextlib.nullcontext(context.auto_parallel_context())
        return self.auto_parallel.parallel_context()

    def _plan(self, ctx: context.ParallelContext, request: PlanRequest) -> ParallelProgram:
        """Plan ``request`` (or load the strategy file's plan: no search) and lower; save the
        plan when ``strategy_ckpt_config`` names a save_file. A search (auto_parallel) or a
        propagation (the strategies data_parallel and semi_auto_parallel leave unset) runs
        once for every rank (:func:`~simpar.search.plan_once`). Strategy files apply to
        semi_auto_parallel and auto_parallel, as in MindSpore; every rank reads (and writes,
        atomically, the same bytes) the same file, so every rank fails alike."""
        g = request.graph
        files = ctx.strategy_ckpt_config if self.mode in (
            "semi_auto_parallel", "auto_parallel") else context.StrategyCkptConfig()
        if files.load_file:   # simpar's file, or MindSpore's (simpar.strategy_import)
            smap = plan_with_file(files.load_file, request, ctx.dataset_strategy)
        else:   # a search, or propagation: once for every rank (stand_alone: each its own)
            smap = plan_once(request)
        g = graph_of(request, smap)
        if files.save_file:
            save_strategy(files.save_file, smap, g, search_mode=request.search_mode if
                          self.mode == "auto_parallel" else None,
                          cost_model=request.cost_model.name,
                          only_trainable_params=files.only_trainable_params)
        self.micro_batches = smap.micro_batches
        self.program_dimensions = smap.dimensions
        return lower(graph_of(request, smap), smap, request.enable_alltoall)

    def _build(self, ctx: context.ParallelContext, data: np.ndarray, label: np.ndarray,
               agreed: bool = False) -> ParallelProgram:
        self._ctx = ctx
        world = 1 if self.mode == "stand_alone" else comm.get_group_size()
        if world > 1 and not agreed:  # shapes decide the program: every rank traces the same
            comm.check_context()  # device_num against the world, once: the request has it
            comm.check_same_arrays("TrainOneStepCell.build", [("data", data), ("label", label)])
        m = self.micro_batches
        for what, x in (("data", data), ("label", label)):
            if x.ndim == 0 or x.shape[0] % m:
                raise ValueError(f"For micro batch initialization, the 0th dimension shape of "
                                 f"input({x.shape[0] if x.ndim else 'a scalar'}) must be divided "
                                 f"by micro size({m}): GradAccumulation splits the {what} of "
                                 f"shape {x.shape} into {m} micro-batches")
        if ctx.auto_pipeline and self.mode != "stand_alone":
            stages = self._auto_stages(ctx, data, label)
            if stages > 1:
                return self._build_pipeline(ctx, data, label, stages)
        elif ctx.pipeline_stages > 1 and self.mode != "stand_alone":
            return self._build_pipeline(ctx, data, label)
        # The program is one micro-batch's (the whole batch's without accumulation); when
        # auto_parallel chooses the micro-batches, one graph per count on offer.
        counts = [m]
        if self.mode == "auto_parallel" and self._choose_micro and \
                context.algo_parameters().memory_dimensions != "fixed":
            counts = [c for c in MICRO_BATCH_CHOICES if data.shape[0] % c == 0]
        graphs = {c: graph.trace(self.network, [((x.shape[0] // c, *x.shape[1:]), x.dtype)
                                                for x in (data, label)], ["data", "label"])
                  for c in counts}
        try:
            request = request_from_context(graphs[m], cell=self.network, mode=self.mode,
                                           micro_batches=m, micro_graphs=graphs)
        except ValueError as e:
            if m == 1:
                raise
            raise ValueError(f"{e} (GradAccumulation: each of the {m} micro-batches has "
                             f"{data.shape[0] // m} of the batch's {data.shape[0]} rows)"
                             ) from None
        self.program = self._plan(ctx, request)
        m = self.micro_batches   # the plan's (auto_parallel may have chosen it)
        rank = comm.get_rank() if request.device_num > 1 else 0
        trainable = {p.name for p in self.optimizer.parameters}
        for name in self.program.param_layouts:
            v = self.program.param_values[name]
            assert v.param is not None
            # This rank draws its own block only (its optimizer slice, when the optimizer is
            # parallel): never the whole parameter.
            lay = self.program.storage_layout(name)
            self.params[name] = v.param.initial_value(self.seed, lay.slice_of(rank))
            if name not in trainable and v.param.requires_grad:
                raise ValueError(f"TrainOneStepCell: parameter {name} is trainable but not "
                                 "in the optimizer's params")
        self.optimizer.init_state({n: self.params[n] for n in self.optimizer.names()})
        # Where this rank's part of the whole batch sits: the micro-batch's layout over m times
        # the rows (each rank then splits its part into m, as MindSpore's _MicroBatch does).
        self._feed = tuple((full, *shard_index(full, rank)) for full in (
            lay.with_shape((lay.shape[0] * m, *lay.shape[1:])) if lay.ndim else lay
            for lay in self.program.input_layouts()))
        self._seed = self.loss_seed()
        return self.program

    def _auto_stages(self, ctx: context.ParallelContext, data: np.ndarray, label: np.ndarray
                     ) -> int:
        """``auto_pipeline``: the stage count :func:`~simpar.pipeline.auto.choose_stages`
        prices fastest, up to ``pipeline_stages`` (kept in :attr:`stage_counts`)."""
        if self.mode != "auto_parallel" or ctx.search_mode != "recursive_programming":
            raise ValueError(f"auto_pipeline needs parallel_mode 'auto_parallel' and "
                             f"search_mode 'recursive_programming', as MindSpore's does; got "
                             f"{self.mode!r} and {ctx.search_mode!r}")
        m = self.micro_batches
        specs = [((x.shape[0] // m, *x.shape[1:]), x.dtype) for x in (data, label)]
        g = graph.trace(self.network, specs, ["data", "label"])
        plan_one: Callable[[], ParallelProgram] | None = None
        try:
            request = request_from_context(g, cell=self.network, mode=self.mode,
                                           micro_batches=m)

            def plan_one() -> ParallelProgram:
                smap = plan_once(request)
                return lower(graph_of(request, smap), smap, request.enable_alltoall)
        except ValueError:   # no plan without stages (the batch does not split, say)
            request = request_from_context(g, cell=self.network, mode=self.mode,
                                           micro_batches=m, dataset_strategy="full_batch")
        stages, self.stage_counts = choose_stages(
            self.network, specs, comm.get_group_size(), ctx.pipeline_stages,
            ctx.dataset_strategy, m, ctx.pipeline_config.pipeline_scheduler, request, plan_one,
            functools.partial(plan_once, together=True))
        return stages

    def _build_pipeline(self, ctx: context.ParallelContext, data: np.ndarray,
                        label: np.ndarray, auto: int | None = None) -> ParallelProgram:
        """The stages' programs (:mod:`simpar.pipeline`); this rank's stage's is
        ``program``, and it holds that stage's parameters only. ``auto``: the stage count
        ``auto_pipeline`` chose (the network cut where it says), else ``pipeline_stages``
        and the Cells' ``pipeline_stage``. Every stage is planned once for every rank, in
        turn (:func:`~simpar.search.plan_once`: by rank 0, or the memory dimensions'
        combinations shared among the ranks)."""
        stages, world = auto or ctx.pipeline_stages, comm.get_group_size()
        m = self.micro_batches
        _check_pipeline(ctx, self.mode, world, m, stages)
        files = ctx.strategy_ckpt_config if self.mode in (
            "semi_auto_parallel", "auto_parallel") else context.StrategyCkptConfig()
        chosen = next((p.plan for p in self.stage_counts if p.stages == auto), None)
        # The counts' plans are let go: only the chosen one is kept, as the program.
        self.stage_counts = [dataclasses.replace(p, plan=None) for p in self.stage_counts]
        if chosen is not None and not files.load_file:   # auto_pipeline planned it already
            parts, programs = chosen
        else:
            parts, programs = plan_pipeline(
                self.network, [((x.shape[0] // m, *x.shape[1:]), x.dtype) for x in (data, label)],
                stages, world, self.mode, ctx.dataset_strategy, m,
                ctx.pipeline_config.pipeline_interleave and auto is None, files.load_file or None,
                ctx.pipeline_config.pipeline_scheduler, auto_split=auto is not None,
                plan=functools.partial(plan_once, together=True))
        if files.save_file:   # this rank's stage's plan, as MindSpore saves it per rank
            stage = comm.get_rank() // (world // stages)
            _distinct_per_stage(files.save_file, stage)
            save_pipeline_strategy(
                files.save_file, programs, stages, stage,
                search_mode=ctx.search_mode if self.mode == "auto_parallel" else None,
                only_trainable_params=files.only_trainable_params)
        self._seed = self.loss_seed_of(programs[-1])
        self.pipeline_scheduler = ctx.pipeline_config.pipeline_scheduler
        self.pipeline = PipelineRunner(parts, programs, comm.get_rank(), stages,
                                       self.pipeline_scheduler, m, self._seed)
        self.program = self.pipeline.program
        assert self.program.strategy_map is not None
        self.program_dimensions = self.program.strategy_map.dimensions   # this stage's
        trainable = {p.name for p in self.optimizer.parameters}
        for name, (prog, _) in self.pipeline.params().items():
            v = prog.param_values[name]
            assert v.param is not None
            self.params[name] = v.param.initial_value(
                self.seed, prog.storage_layout(name).slice_of(self.pipeline.local))
            if name not in trainable and v.param.requires_grad:
                raise ValueError(f"TrainOneStepCell: parameter {name} is trainable but not "
                                 "in the optimizer's params")
        self.optimizer.hold_only(list(self.params))
        self.optimizer.init_state({n: self.params[n] for n in self.optimizer.names()})
        return self.program

    @staticmethod
    def _local(x: np.ndarray, feed: tuple[TensorLayout, tuple[slice, ...], bool]) -> np.ndarray:
        lay, where, zero = feed
        if x.shape == lay.shape:
            # A copy, not a view of the caller's array: the rank holds its shard as a device
            # holds its slice of the dataset, which is what the cost model's memory counts.
            return take_shard(x, where, zero)
        if x.shape == lay.local_shape():
            return x
        raise ValueError(f"TrainOneStepCell: input of shape {x.shape} is neither the global "
                         f"batch {lay.shape} nor this rank's slice {lay.local_shape()}")

    def loss_seed(self) -> float:
        """The cotangent each rank gives its copy of the loss (see module docstring), for the
        context the program was built under."""
        assert self.program is not None
        return self.loss_seed_of(self.program)

    def loss_seed_of(self, program: ParallelProgram) -> float:
        """:meth:`loss_seed` for the program that computes the loss (a pipeline's last
        stage's)."""
        assert self._ctx is not None
        ctx = self._ctx
        lay = program.output_layouts()[0]
        replicas = math.prod(lay.device_matrix[a] for a in lay.replica_axes)
        dp = program.loss_batch_cut()
        seed = self.sens * (1.0 if ctx.gradients_mean or self.mode == "stand_alone" else dp)
        return seed if ctx.loss_repeated_mean else seed * replicas

    def set_train(self, mode: bool = True) -> TrainOneStepCell:
        """The network's :meth:`~simpar.nn.Cell.set_train`, before the first step builds the
        program (the mode decides the traced graph)."""
        if self.program is not None and self.network.training != mode:
            raise ValueError("TrainOneStepCell.set_train: the program was built in "
                             f"{'training' if self.network.training else 'evaluation'} mode "
                             "on the first step; set the mode before it")
        self.network.set_train(mode)
        return self

    # ------------------------------------------------------------ one step
    def __call__(self, data: np.ndarray, label: np.ndarray) -> float:
        loss, grads = self.value_and_grad(data, label)
        self.last_grads = grads
        self.optimizer.step(self.params, grads)
        self.step_count += 1
        return loss

    def value_and_grad(self, data: np.ndarray, label: np.ndarray, step: int | None = None
                       ) -> tuple[float, dict[str, np.ndarray]]:
        """The global loss and this rank's gradient shards at the current parameters, without
        an optimizer step (``step`` numbers the dropout masks; default: the next step's)."""
        data, label = np.asarray(data), np.asarray(label)
        built_now = self.program is None
        if built_now:
            self.build(data, label)  # which checks that the ranks passed the same batch
        prog = self.program
        assert prog is not None
        if self.pipeline is not None:   # the global batch on every rank, checked alike
            if not built_now:
                comm.check_same_arrays("TrainOneStepCell", [("data", data), ("label", label)])
            return self.pipeline.step(data, label, self.params,
                                      self.step_count if step is None else step)
        feed = self._feed
        try:
            local_in = [self._local(data, feed[0]), self._local(label, feed[1])]
            refused = prog.refused_input(local_in)
        except ValueError as e:
            refused = e
        if prog.device_num == 1:
            if refused is not None:
                raise refused
            return self._step(prog, local_in, step)
        if refused is not None:  # stand-ins of the right shapes, so that the step can run
            local_in = [np.zeros(lay.local_shape(), x.dtype)
                        for x, (lay, _, _) in zip((data, label), feed)]
        # The check that the ranks passed the same batch (and that none refused its shard)
        # runs alongside the forward: its 8-byte Allreduce completes inside the forward's
        # collectives, and it is waited for right after them, while the ranks are still
        # together (waited for after the backward, it became one more synchronisation of
        # ranks that finish their backward at different times: 3-4% of the Megatron MLP's
        # step on 8 ranks sharing 2 cores). Nothing the forward computed is used before.
        pending = comm.start_check_same_arrays("TrainOneStepCell", [
            _agreed(what, x, lay) for what, x, (lay, _, _) in zip(("data", "label"),
                                                                   (data, label), feed)],
            refused=refused)
        try:
            return self._step(prog, local_in, step, pending.wait)
        except BaseException:
            pending.abandon()
            raise

    def _step(self, prog: ParallelProgram, local_in: list[np.ndarray], step: int | None,
              checked: Callable[[], None] | None = None
              ) -> tuple[float, dict[str, np.ndarray]]:
        step = self.step_count if step is None else step
        m = self.micro_batches
        if m == 1:
            outs, tape = prog.forward(local_in, self.params, step=step)
            if checked is not None:   # the batch check: it raises before anything is used
                checked()
            prog.write_states(self.params, tape.states)
            loss = outs[0]
            seed = np.full(loss.shape, self._seed, dtype=loss.dtype)
            return float(loss), prog.backward(tape, [seed])
        # Gradient accumulation: each micro-batch's gradients (seeded 1/m, MindSpore's sens),
        # summed; then the step's one synchronisation. Micro-batch k numbers its dropout
        # masks m * step + k.
        parts = [np.split(x, m, axis=0) for x in local_in]
        losses: list[float] = []
        total: dict[str, np.ndarray] = {}
        for k in range(m):
            outs, tape = prog.forward([p[k] for p in parts], self.params, step=m * step + k)
            if checked is not None and k == 0:
                checked()
            prog.write_states(self.params, tape.states)
            loss = outs[0]
            losses.append(float(loss))
            seed = np.full(loss.shape, self._seed / m, dtype=loss.dtype)
            for name, g in prog.backward(tape, [seed]).items():
                if name not in total:
                    total[name] = g if g.flags.writeable else g.copy()
                else:
                    total[name] += g
            del tape
        return float(np.mean(losses)), prog.sync(total)

    def global_batch(self, data: np.ndarray, label: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The global batch of which every rank passed its own slice (``per_device``; built
        first), on every rank: each input redistributed from its batch layout to whole
        (collective; an AllGather of the slices under "data_parallel")."""
        if self.program is None:
            self.build(data, label)
        if self.pipeline is not None or not self.per_device:
            return np.asarray(data), np.asarray(label)
        pairs = [(np.ascontiguousarray(x), lay)
                 for x, lay in zip((data, label), self.batch_layouts())]
        wrong = [f"{tuple(x.shape)} where the batch layout's slice is {lay.local_shape()}"
                 for x, lay in pairs if tuple(x.shape) != lay.local_shape()]
        if comm.get_group_size() > 1:   # decided together: no rank enters the gather alone
            anywhere = int(comm.all_reduce(np.array([len(wrong)]), op="max")[0])
            wrong = wrong or (["one on another rank"] if anywhere else [])
        if wrong:
            raise ValueError(f"TrainOneStepCell.global_batch: a slice of the wrong shape, "
                             f"{wrong[0]}")
        out = [execute(plan(lay, lay.replicated()), x) for x, lay in pairs]
        if comm.get_group_size() > 1:
            try:
                comm.check_same_arrays("TrainOneStepCell.global_batch",
                                       [("data", out[0]), ("label", out[1])])
            except comm.InputMismatchError as e:
                raise ValueError(
                    "TrainOneStepCell.global_batch: the ranks that hold copies of one block "
                    "of the batch fed different rows, so the ranks assembled different global "
                    "batches: shard the dataset by block (num_shards = the batch's cut, "
                    f"shard_id = the rank's block) ({e})") from None
        return out[0], out[1]

    # ------------------------------------------------------------ inspection
    def batch_layouts(self) -> list[TensorLayout]:
        """The layouts of the whole batch's inputs (``build`` first): the program's, over
        ``micro_batches`` times the rows with gradient accumulation (each rank's part then
        splits into the micro-batches)."""
        if self.program is None:
            raise ValueError("TrainOneStepCell.batch_layouts: the cell has not been built; "
                             "call it (or build) on a batch first")
        return [lay for lay, _, _ in self._feed]

    # ------------------------------------------------------------ inspection (context)
    def _built_context(self, what: str) -> context.ParallelContext:
        if self._ctx is None:
            raise ValueError(f"TrainOneStepCell.{what}: the cell has not been built; call it "
                             "(or build) on a batch first")
        return self._ctx

    @property
    def gradients_mean(self) -> bool:
        """The context's ``gradients_mean`` when the program was built (``build`` first)."""
        return bool(self._built_context("gradients_mean").gradients_mean)

    @property
    def loss_repeated_mean(self) -> bool:
        """The context's ``loss_repeated_mean`` when the program was built (``build`` first)."""
        return bool(self._built_context("loss_repeated_mean").loss_repeated_mean)

    def global_parameters(self) -> dict[str, np.ndarray]:
        """Every parameter assembled to its global value (collective: every rank calls)."""
        assert self.program is not None
        if self.pipeline is not None:
            return self.pipeline.global_parameters(self.params)
        out = {}
        for name in self.program.param_layouts:
            lay = self.program.storage_layout(name)
            if self.program.device_num == 1 or lay.replicated() == lay:
                out[name] = self.params[name].copy()  # a snapshot, not the live shard
                continue
            with comm.label("assemble"):
                out[name] = execute(plan(lay, lay.replicated()), self.params[name])
        return out


def _check_pipeline(ctx: context.ParallelContext, mode: str, world: int, micro_batches: int,
                    stages: int) -> None:
    """What a pipelined cell needs of its settings, checked alike on every rank."""
    if mode not in ("semi_auto_parallel", "auto_parallel", "data_parallel"):
        raise ValueError(f"pipeline: pipeline_stages={stages} needs parallel_mode "
                         f"semi_auto_parallel, auto_parallel or data_parallel, got {mode!r}")
    if world % stages:
        raise ValueError(f"pipeline: pipeline_stages={stages} must divide the {world} ranks "
                         "(each stage runs on device_num / pipeline_stages of them)")
    scheduler = ctx.pipeline_config.pipeline_scheduler
    if micro_batches < stages and scheduler == "1f1b":
        raise ValueError(f"pipeline: the 1f1b scheduler needs micro_size >= pipeline_stages, "
                         f"as MindSpore's Pipeline does: got {micro_batches} micro-batches for "
                         f"{stages} stages; wrap the network in nn.PipelineCell(network, "
                         f"micro_size={stages}) or more, or use pipeline_scheduler 'gpipe'")


def _distinct_per_stage(path: str, stage: int) -> None:
    """Refuse, on every rank alike, a save_file that two stages would both write: each stage
    saves its own plan (give each rank its own file, as MindSpore's pipeline examples do,
    e.g. with the rank in its name)."""
    digest = hashlib.sha256(os.path.abspath(path).encode()).digest()
    mine = np.array([int.from_bytes(digest[:7], "big"), stage], dtype=np.int64)
    every = np.zeros((comm.get_group_size(), 2), dtype=np.int64)
    comm.world().Allgather(mine, every)   # raw MPI: settings, no training traffic
    stages_of: dict[int, set[int]] = {}
    for key, s in every.tolist():
        stages_of.setdefault(key, set()).add(s)
    shared = sorted(next((s for s in stages_of.values() if len(s) > 1), set()))
    if shared:
        raise ValueError(f"pipeline: strategy_ckpt_config's save_file names one file for "
                         f"pipeline stages {shared}, which save different plans (this rank's "
                         f"is {path!r}); give each rank its own file, e.g. with the rank in "
                         "its name, and merge them with simpar.pipeline.merge_pipeline_strategys")


def _agreed(what: str, x: np.ndarray, lay: TensorLayout) -> tuple[str, np.ndarray]:
    """What every rank must agree on for one input: a global batch, byte for byte; a rank's
    own slice (which differs between ranks by design), only its shape."""
    if tuple(x.shape) == lay.shape:
        return what, x
    return f"{what} (this rank's slice; shape)", np.asarray(x.shape, dtype=np.int64)


def _grad_accumulation_of(network: Cell) -> GradAccumulation | None:
    """The GradAccumulation wrapper inside ``network`` (itself included), if any; more than
    one would leave the number of micro-batches unclear."""
    found = [cell for _, cell in network.cells_and_names() if isinstance(cell, GradAccumulation)]
    found = [c for k, c in enumerate(found) if all(c is not d for d in found[:k])]
    if len(found) > 1:
        raise ValueError(f"TrainOneStepCell: the network holds {len(found)} GradAccumulation "
                         f"wrappers ({', '.join(map(repr, found))}); wrap the network once")
    return found[0] if found else None


def _auto_parallel_of(network: Cell) -> AutoParallel | None:
    """The AutoParallel wrapper inside ``network`` (itself included), if any; more than one
    would leave it unclear whose settings the one program follows."""
    found: list[tuple[str, AutoParallel]] = []
    for path, cell in network.cells_and_names():
        if isinstance(cell, AutoParallel) and all(cell is not c for _, c in found):
            found.append((path or "the network itself", cell))
    if len(found) > 1:
        raise ValueError(f"TrainOneStepCell: the network holds {len(found)} AutoParallel "
                         f"wrappers ({', '.join(f'{p}: {c!r}' for p, c in found)}); wrap only "
                         "the top-level network, once: one training cell compiles one program "
                         "under one set of parallel settings")
    return found[0][1] if found else None
