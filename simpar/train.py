"""The main job: train a small GPT in parallel on simulated Ascend devices, then check it.

    mpirun -n 8 python -m simpar.train                       # auto_parallel, searched strategies
    mpirun -n 8 python -m simpar.train --search-mode exact   # the ILP's proven optimum
    mpirun -n 8 python -m simpar.train --strategy hybrid     # preset: dp x mp = 2 x 4
    mpirun -n 8 python -m simpar.train --strategy mp         # Megatron over all 8 ranks
    mpirun -n 8 python -m simpar.train --parallel-mode data_parallel
    mpirun -n 4 python -m simpar.train --model mlp --steps 30 --out out/
    simrun -n 8 --log-dir logs -- python -m simpar.train     # per-rank logs + rank table

Every rank holds only its shards; the collectives are real MPI collectives. At the end the
same steps run on one device (rank 0) and every rank compares its shards with the matching
slice of that run (simpar.check): max |Δloss|, max |Δparam|, max |Δgrad| at identical
parameters, and the verdict. In auto_parallel (the default) a search over the cost model
(dynamic programming on the ``--profile``, cpu-local unless told) picks every op's strategy; the
job prints why it won: its predicted cost next to the hand-written presets' and pure data
parallelism's. Exit codes: 0 PASS; 1 FAIL; 2 options refused before any work,
or INCONCLUSIVE (the single-device run diverged, so nothing can be judged).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import Any

import numpy as np

import simpar
from simpar import _env, checkpoint, comm, graph, nn, viz
from simpar import report as simpar_report
from simpar._checks import positive_float_arg
from simpar.check import CheckReport, check_against_single_device
from simpar.context import ContextError
from simpar.cost import CostReport, SimparCostModel, load_profile, profile_names
from simpar.cost.model import predicted_timeline
from simpar.cost_model_context import set_cost_model_context, set_search_cost_model
from simpar.nn import presets
from simpar.pipeline import plan_pipeline, price_pipeline
from simpar.runtime.lowering import build_program
from simpar.search import registered_searches
from simpar.strategy_table import columns as strategy_table_columns
from simpar.strategy_table import display_names as display_names  # re-exported
from simpar.strategy_table import strategy_table
from simpar.trace_events import pipelined, sequential, write_trace
from simpar.train_models import (
    MODELS,
    add_model_arguments,
    batch_shapes,
    batches,
    make_loss,
    make_model,
    mesh_problem,
    recompute_cells,
    samples_unit,
    shard_preset,
)
from simpar.train_pipeline import (
    SCHEDULES,
    assign_stages,
    measured_peak,
    pipeline_config,
    stage_lines,
)

MODES = ("stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel")


class UsageError(ValueError):
    """A contradictory or unusable combination of options; the job prints it and exits 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _env.RankZeroParser(prog="python -m simpar.train", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parallel-mode", default=None, choices=MODES,
                   help="default auto_parallel (semi_auto_parallel with --strategy); "
                   "stand_alone runs on one rank only")
    p.add_argument("--search-mode", default="dynamic_programming",
                   choices=registered_searches(),
                   help="auto_parallel's search (default dynamic_programming, MindSpore's "
                   "elimination search; recursive_programming and sharding_propagation, "
                   "MindSpore's fast ones; exact: the ILP optimum, needs scipy)")
    p.add_argument("--device-num", type=int, default=None,
                   help="must equal the number of MPI ranks (default: the world size)")
    p.add_argument("--strategy", default=None, choices=presets.PRESETS,
                   help="semi_auto_parallel preset (implies --parallel-mode "
                   "semi_auto_parallel): dp, mp (Megatron over every rank), hybrid "
                   "(dp=2 x mp=N/2, N even); in semi_auto_parallel the default is hybrid on an "
                   "even number of ranks, mp otherwise")
    p.add_argument("--model", default="gpt", choices=MODELS)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8,
                   help="global batch; must divide among the data-parallel ranks")
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=8,
                   help="must divide --d-model, and be divisible by the model-parallel cut")
    p.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    add_model_arguments(p)
    p.add_argument("--lr", type=positive_float_arg, default=None,
                   help="default 3e-3 (Adam, AdamW) / 0.1 (Momentum, SGD)")
    p.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "momentum", "sgd"))
    p.add_argument("--dtype", default="float64", choices=("float32", "float64"),
                   help="the check's tolerance follows the dtype and optimizer "
                   "(docs/check.md#tolerances)")
    p.add_argument("--gradients-mean", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--optimizer-shard", default="off",
                   choices=("off", "level1", "level2", "level3"),
                   help="optimizer parallel (MindSpore's enable_parallel_optimizer): slice "
                        "each weight ranks hold alike, its optimizer state and gradient, and "
                        "at level3 drop the gathered weight after the forward")
    p.add_argument("--recompute", action="store_true",
                   help="recompute every GPT block (every MLP layer but the last) in the "
                        "backward: MindSpore's Cell.recompute()")
    p.add_argument("--micro-batches", type=int, default=1, metavar="N",
                   help="gradient accumulation (MindSpore's GradAccumulation): each step runs "
                        "N micro-batches of --batch-size / N and sums their gradients")
    p.add_argument("--pipeline-stages", type=int, default=1, metavar="S",
                   help="cut the model into S pipeline stages, each on N/S ranks with its own "
                        "strategies (MindSpore's pipeline_stages); --micro-batches flow through "
                        "them")
    p.add_argument("--pipeline-schedule", default="1f1b", choices=SCHEDULES,
                   help="the order of the micro-batches over the stages (interleaved: 1F1B "
                        "with two chunks per stage, micro-batches a multiple of S)")
    p.add_argument("--memory-dimensions", default="fixed",
                   choices=("fixed", "when_needed", "search"),
                   help="auto_parallel: let the search choose the optimizer level, which "
                        "blocks recompute and the micro-batches (1, 2, 4, 8) with the cuts, "
                        "always ('search') or when the plan does not fit ('when_needed'); "
                        "--optimizer-shard LEVEL and --micro-batches N > 1 fix theirs")
    p.add_argument("--device-memory-capacity", type=float, default=None, metavar="BYTES",
                   help="the memory cap per rank the search plans under (MindSpore's "
                        "device_memory_capacity; default: the profile's)")
    p.add_argument("--optimizer-shard-threshold", type=int, default=64, metavar="KB",
                   help="parameters under this many KB stay whole (MindSpore's "
                        "parallel_optimizer_threshold; default 64)")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save a distributed checkpoint every N steps into --ckpt-dir "
                   "(D/step_000010, ...; 0: never)")
    p.add_argument("--ckpt-dir", default=None, help="directory for --save-every's checkpoints")
    p.add_argument("--resume", default=None, metavar="D",
                   help="resume from checkpoint D, or from the latest complete checkpoint under "
                   "D; another strategy or rank count than the one that saved is fine")
    p.add_argument("--stop-on-nonfinite", action=argparse.BooleanOptionalAction, default=True,
                   help="stop with an error naming the step when the loss is NaN or Inf "
                   "(default on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the single-device check")
    p.add_argument("--out", default=None, help="directory for summary.json")
    p.add_argument("--save-strategy", default=None, metavar="FILE",
                   help="save the plan as MindSpore's JSON strategy file (strategy_ckpt_config's "
                   "save_file; semi_auto_parallel and auto_parallel)")
    p.add_argument("--load-strategy", default=None, metavar="FILE",
                   help="take the plan from a strategy file instead of searching or "
                   "propagating (strategy_ckpt_config's load_file)")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="write DIR/report.html (the strategies, why they won, the loss curve, "
                   "predicted against measured, the cost and memory per rank, the cuts drawn, "
                   "the check) with its pictures and report.json; python -m simpar.report DIR "
                   "builds it again")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write every rank's steps, collectives and kernels, and the cost "
                   "model's predicted step, as a Chrome trace-event JSON file (Perfetto, "
                   "chrome://tracing)")
    p.add_argument("--profile", default="cpu-local",
                   help="device profile the cost model predicts the step on: a shipped name "
                   f"({', '.join(profile_names())}), a .json path (python -m simpar.calibrate "
                   "writes one), or 'none'")
    args = p.parse_args(argv)
    if args.parallel_mode is None:
        args.parallel_mode = "semi_auto_parallel" if args.strategy else "auto_parallel"
    if args.profile != "none":
        try:
            args.profile = load_profile(args.profile)
        except (ValueError, TypeError) as error:
            p.error(f"--profile {args.profile}: {error}")
    for name in ("steps", "batch_size", "seq_length", "d_model", "n_layers", "n_heads",
                 "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.micro_batches < 1:
        p.error(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.pipeline_stages < 1:
        p.error(f"--pipeline-stages must be >= 1, got {args.pipeline_stages}")
    if args.pipeline_stages > 1 and args.parallel_mode == "stand_alone":
        p.error("--pipeline-stages needs several ranks: --parallel-mode semi_auto_parallel, "
                "data_parallel or auto_parallel")
    if args.batch_size % args.micro_batches:
        p.error(f"--micro-batches {args.micro_batches} must divide --batch-size "
                f"{args.batch_size} (each step splits the batch into micro-batches)")
    if 1 < args.pipeline_stages > args.micro_batches and args.pipeline_schedule != "gpipe":
        p.error(f"--pipeline-schedule {args.pipeline_schedule} needs --micro-batches >= "
                f"--pipeline-stages (MindSpore's micro_size >= pipeline_stages), got "
                f"{args.micro_batches} for {args.pipeline_stages} stages; gpipe takes fewer")
    if args.device_memory_capacity is not None and not args.device_memory_capacity > 0:
        p.error(f"--device-memory-capacity must be > 0 bytes, got "
                f"{args.device_memory_capacity}")
    if args.memory_dimensions != "fixed" and args.parallel_mode != "auto_parallel":
        p.error(f"--memory-dimensions {args.memory_dimensions} lets auto_parallel's search "
                f"choose them; --parallel-mode is {args.parallel_mode}")
    if args.optimizer_shard_threshold < 0:
        p.error(f"--optimizer-shard-threshold must be >= 0 KB, got "
                f"{args.optimizer_shard_threshold}")
    if args.model == "gpt" and args.d_model % args.n_heads:
        p.error(f"--n-heads {args.n_heads} must divide --d-model {args.d_model} (each head "
                f"gets d_model / n_heads features)")
    if args.strategy is not None and args.parallel_mode != "semi_auto_parallel":
        p.error(f"--strategy {args.strategy} sets semi_auto_parallel strategies, but "
                f"--parallel-mode is {args.parallel_mode}; drop --strategy or use "
                "--parallel-mode semi_auto_parallel")
    if args.save_every < 0:
        p.error(f"--save-every must be >= 0, got {args.save_every}")
    if args.save_every and not args.ckpt_dir:
        p.error(f"--save-every {args.save_every} needs --ckpt-dir, the directory to save into")
    if args.ckpt_dir is not None:
        problem = _unwritable_dir(args.ckpt_dir)
        if problem:
            p.error(f"--ckpt-dir {args.ckpt_dir}: {problem}")
    start = 0
    if args.resume is not None:
        try:
            found = _resume_point(args.resume)
            manifest = checkpoint.read_manifest(found) if found is not None else None
        except ValueError as e:
            p.error(f"--resume {args.resume}: {e}")
        if found is None or manifest is None:
            p.error(f"--resume {args.resume}: no complete checkpoint there (a directory with "
                    "manifest.json, or one holding such directories)")
        args.resume, start = found, manifest.step
        if start > args.steps:
            p.error(f"--resume {found} is after step {start}, beyond --steps {args.steps}")
        saved = manifest.extra.get("job")
        if not isinstance(saved, dict):
            p.error(f"--resume {found}: the checkpoint does not record the job's settings (it "
                    "was not saved by python -m simpar.train --save-every)")
        for key, value in job_settings(args).items():
            if saved.get(key) != value:
                p.error(f"--resume {found}: the checkpoint was saved with --"
                        f"{key.replace('_', '-')} {saved.get(key)}, this job has {value}; a "
                        "resumed job keeps the model, data and training settings (strategy, "
                        "parallel mode and rank count may change)")
    if args.save_every:
        taken = [f"step_{k:06d}" for k in range(start + 1, args.steps + 1)
                 if k % args.save_every == 0
                 and os.path.exists(os.path.join(args.ckpt_dir, f"step_{k:06d}"))]
        if taken:
            p.error(f"--ckpt-dir {args.ckpt_dir} already holds {taken[0]}, which this job "
                    "would save; use another --ckpt-dir, or remove it")
    if args.device_num is not None and args.device_num < 1:
        p.error(f"--device-num must be >= 1 (the number of ranks), got {args.device_num}")
    if args.out is not None:
        problem = _unwritable_dir(args.out)
        if problem:
            p.error(f"--out {args.out}: {problem}")
    for flag, value in (("--save-strategy", args.save_strategy),
                        ("--load-strategy", args.load_strategy)):
        if value is not None and args.parallel_mode not in ("semi_auto_parallel",
                                                            "auto_parallel"):
            p.error(f"{flag} applies to semi_auto_parallel and auto_parallel (as MindSpore's "
                    f"strategy_ckpt_config), but --parallel-mode is {args.parallel_mode}")
    if args.save_strategy is not None:
        problem = _env.unwritable_file(pathlib.Path(args.save_strategy))
        if problem:
            p.error(f"--save-strategy {args.save_strategy}: {problem}")
    if args.load_strategy is not None and not os.path.isfile(args.load_strategy):
        p.error(f"--load-strategy {args.load_strategy}: no such file")
    if args.report is not None:
        problem = _unwritable_dir(args.report)
        if problem:
            p.error(f"--report {args.report}: {problem}")
    if args.trace is not None:
        problem = _env.unwritable_file(pathlib.Path(args.trace))
        if problem:
            p.error(f"--trace {args.trace}: {problem}")
    return args


def _unwritable_dir(path: str) -> str | None:
    """Why ``path`` cannot become a directory we write into, or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a directory"
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, so no directory can be made below it"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def dimensions_table(train: nn.TrainOneStepCell) -> str:
    """What the search chose for the memory dimensions, every combination it planned (the
    step objective it minimised, the memory per rank), and which dimensions bind."""
    found = train.program_dimensions
    chosen = found.chosen
    head = (f"\nmemory dimensions: the user's settings fit ({chosen.describe()})"
            if not found.searched else
            f"\nmemory dimensions searched ({', '.join(sorted(found.searched))}) under "
            f"{found.capacity:.0f} bytes per rank: chose {chosen.describe()}")
    if train.pipeline is not None:
        head += (f" (pipeline stage {train.pipeline.stage}'s; each stage searches its own, "
                 "for the micro-batches it holds at once)")
    return "\n".join([head, found.table(), *("  " + line for line in found.binding())])


def optimizer_shard_line(train: nn.TrainOneStepCell) -> str:
    """One line on what optimizer parallel slices: how many parameters (and of how many
    trainable), over how many ranks, and the bytes they keep whole."""
    prog = train.program
    assert prog is not None
    trainable = [n for n, v in prog.param_values.items()
                 if v.param is not None and v.param.requires_grad]
    sliced = [n for n in trainable if n in prog.param_shards]
    sizes = sorted({prog.param_shards[n].size for n in sliced})
    whole = sum(prog.param_layouts[n].local_size() * prog.param_values[n].dtype.itemsize
                for n in trainable if n not in prog.param_shards)
    level = next((str(prog.param_shards[n].level) for n in sliced), "off")
    return (f"optimizer parallel {level}: {len(sliced)} of {len(trainable)} trainable "
            f"parameters sliced over {'/'.join(map(str, sizes)) or '-'} ranks; "
            f"{whole} bytes per rank stay whole")


def _optimizer_config(args: argparse.Namespace) -> dict[str, Any]:
    """``parallel_optimizer_config`` for ``--optimizer-shard`` (its level; "off" keeps
    MindSpore's default level, unused)."""
    level = "level1" if args.optimizer_shard == "off" else args.optimizer_shard
    return {"optimizer_level": level,
            "parallel_optimizer_threshold": args.optimizer_shard_threshold}


def mesh(args: argparse.Namespace, world: int) -> tuple[int, int]:
    """(dp, mp) for these options on ``world`` ranks; :class:`UsageError` when they cannot
    run there. Pure: the job calls it for its own world and for the -n values it suggests."""
    mode = args.parallel_mode
    stages = args.pipeline_stages
    if stages > 1:   # the strategies below are each stage's, on its world / stages ranks
        if world % stages:
            raise UsageError(f"--pipeline-stages {stages} does not divide the {world} ranks")
        world //= stages
    if mode == "auto_parallel":  # the search decides; each rank loads its batch slice if it can
        return (world, 1) if args.batch_size % world == 0 else (1, 1)
    if mode == "stand_alone":
        if world != 1:
            raise UsageError(f"--parallel-mode stand_alone runs on one device, but this job "
                             f"has {world} ranks; run it on one (mpirun -n 1, or plain python "
                             "-m simpar.train)")
        return 1, 1
    if mode == "data_parallel":
        dp, mp, where = world, 1, f"data_parallel on {world} ranks"
    else:
        strategy = strategy_name(args, world) or "hybrid"
        default = "" if args.strategy else (
            ", the default on an odd number of ranks" if strategy == "mp" else ", the default")
        if strategy == "hybrid" and world % 2:
            raise UsageError(f"--strategy hybrid is dp=2 x mp=N/2, which needs an even number "
                             f"of ranks; this job has {world}")
        dp, mp = {"dp": (world, 1), "mp": (1, world), "hybrid": (2, world // 2)}[strategy]
        where = f"strategy {strategy}{default}, on {world} ranks is dp={dp} x mp={mp}"
    if args.batch_size % dp:
        raise UsageError(f"--batch-size {args.batch_size} does not split among {dp} "
                         f"data-parallel ranks ({where}); use a multiple of {dp}")
    problem = mesh_problem(args, mp, where)
    if problem is not None:
        raise UsageError(problem)
    return dp, mp


def dataset_strategy(args: argparse.Namespace, dp: int, mp: int, device_num: int) -> Any:
    """Each rank loads only its batch slice where the strategy cuts the batch."""
    if args.parallel_mode == "semi_auto_parallel" and args.model == "gpt" and dp > 1:
        return ((dp, 1), (dp, 1))
    if args.parallel_mode == "semi_auto_parallel" and args.model == "resnet" and dp > 1:
        return ((dp, 1, 1, 1), (dp,))
    if args.parallel_mode == "auto_parallel" and dp > 1:
        return "data_parallel"  # MindSpore's default in auto_parallel (full_batch=False)
    return "full_batch"


def plan_only(args: argparse.Namespace, world: int) -> None:
    """Check, without MPI or data, that these options plan on ``world`` ranks (raises
    :class:`UsageError` or the planner's ``ValueError``)."""
    dp, mp = mesh(args, world)
    train = build(args, args.parallel_mode, world)
    shapes = batch_shapes(args)
    if args.pipeline_stages > 1:
        m = args.micro_batches
        plan_pipeline(train.network, [((x[0] // m, *x[1:]), d) for x, d in shapes],
                      args.pipeline_stages, world, args.parallel_mode,
                      dataset_strategy(args, dp, mp, world), m,
                      args.pipeline_schedule == "interleaved")
        return
    g = graph.trace(train.network, shapes, ["data", "label"])
    build_program(g, world, args.parallel_mode, dataset_strategy(args, dp, mp, world), True,
          cell=train.network)


def working_world_sizes(args: argparse.Namespace, up_to: int = 16) -> list[int]:
    """The ``mpirun -n`` values up to ``up_to`` on which these options plan."""
    ok = []
    for n in range(1, up_to + 1):
        try:
            plan_only(args, n)
        except ValueError:
            continue
        ok.append(n)
    return ok


def build(args: argparse.Namespace, mode: str, device_num: int, reference: bool = False
          ) -> nn.TrainOneStepCell:
    """The training cell for these options; in semi_auto_parallel its ops carry the preset's
    strategies for ``device_num`` ranks (:func:`mesh` says which). ``reference`` leaves out
    ``--micro-batches`` and ``--recompute`` (the single-device check's reference: one whole
    batch, every activation kept)."""
    dtype = np.dtype(args.dtype)
    loss = make_loss(args)
    model = make_model(args, dtype)
    if mode == "semi_auto_parallel":
        dp, mp = mesh(args, device_num)
        shard_preset(model, loss, dp, mp, strategy_name(args, device_num) == "dp", device_num)
    if args.pipeline_stages > 1 and not reference:
        assign_stages(model, args.pipeline_stages, 2 if args.pipeline_schedule ==
                      "interleaved" else 1)
    # Under --memory-dimensions every block is a candidate; the search picks which recompute.
    if (args.recompute or args.memory_dimensions != "fixed") and not reference:
        for cell in recompute_cells(model):
            cell.recompute()
    net: nn.Cell = nn.WithLossCell(model, loss)
    params = net.trainable_params()
    if not reference and args.pipeline_stages > 1:
        net = nn.PipelineCell(net, args.micro_batches)
    elif not reference and args.micro_batches > 1:
        net = nn.GradAccumulation(net, args.micro_batches)
    lr = learning_rate(args)
    opt: nn.Optimizer = {"adam": lambda: nn.Adam(params, lr),
                         "adamw": lambda: nn.AdamW(params, lr),
                         "momentum": lambda: nn.Momentum(params, lr, 0.9),
                         "sgd": lambda: nn.SGD(params, lr)}[args.optimizer]()
    return nn.TrainOneStepCell(net, opt, parallel_mode=mode, seed=args.seed)


def learning_rate(args: argparse.Namespace) -> float:
    """--lr, or the optimizer's default: 3e-3 for Adam and AdamW, 0.1 for Momentum and SGD."""
    return args.lr if args.lr is not None else (
        3e-3 if args.optimizer.startswith("adam") else 0.1)


def my_rows(train: nn.TrainOneStepCell, rank: int) -> tuple[int, int] | None:
    """The batch rows this rank holds when the dataset strategy cuts only the batch
    dimension (then it loads just those), else None (it loads the global batch)."""
    if train.pipeline is not None:   # a pipeline's ranks take the global batch
        return None
    lays = train.batch_layouts()
    if any(c != 1 for lay in lays for c in lay.cuts[1:]):
        return None
    rows = {lay.slice_of(rank)[0] for lay in lays if lay.ndim}
    return rows.pop() if len(rows) == 1 else None


# ------------------------------------------------------------------ the strategy table
def print_strategy_table(train: nn.TrainOneStepCell) -> None:
    assert train.program is not None
    print(strategy_table(train.program))


# ------------------------------------------------------------------ the job
def job_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options a resumed job must share with the job that saved: model, data, optimizer
    and seed (the strategy, the parallel mode and the rank count may change)."""
    keys = ("model", "dtype", "seed", "optimizer", "lr", "batch_size", "seq_length", "d_model",
            "n_layers", "n_heads", "hidden", "gradients_mean")
    return {key: getattr(args, key) for key in keys}


def _resume_point(path: str) -> str | None:
    """``path`` if it is a complete checkpoint, else the latest complete one under it."""
    if os.path.isfile(os.path.join(path, checkpoint.MANIFEST)):
        return path
    return checkpoint.latest_checkpoint(path) if os.path.isdir(path) else None


#: Fault injection for the tests of the failure path: "RANK:STEP" makes that rank raise before
#: that step (1-based); the job must then end on every rank, with this rank's message.
INJECT_FAILURE = "SIMPAR_INJECT_FAILURE"


def _injected_failure(rank: int, step: int) -> None:
    value = os.environ.get(INJECT_FAILURE, "")
    if value and value == f"{rank}:{step}":
        raise RuntimeError(f"{INJECT_FAILURE}={value}: injected failure on rank {rank} before "
                           f"step {step}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = comm.get_rank(), comm.get_group_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    device_num = args.device_num if args.device_num is not None else world
    simpar.set_seed(args.seed)
    get_batch = batches(args)
    try:  # every rank reaches the same verdict, so every rank stops here alike
        simpar.set_auto_parallel_context(parallel_mode=args.parallel_mode,
                                         device_num=device_num,
                                         gradients_mean=args.gradients_mean,
                                         enable_alltoall=True, search_mode=args.search_mode,
                                         parallel_optimizer_config=_optimizer_config(args))
        if args.memory_dimensions == "fixed" or args.optimizer_shard != "off":
            # (left unset under --memory-dimensions: the search chooses the level)
            simpar.set_auto_parallel_context(
                enable_parallel_optimizer=args.optimizer_shard != "off")
        simpar.set_algo_parameters(memory_dimensions=args.memory_dimensions)
        simpar.set_auto_parallel_context(pipeline_stages=args.pipeline_stages,
                                         pipeline_config=pipeline_config(args.pipeline_schedule))
        simpar.set_auto_parallel_context(strategy_ckpt_config={
            "load_file": args.load_strategy or "", "save_file": args.save_strategy or ""})
        if args.device_memory_capacity is not None:
            set_cost_model_context(device_memory_capacity=args.device_memory_capacity)
        set_search_cost_model(SimparCostModel(
            args.profile if args.profile != "none" else "cpu-local", optimizer(args)))
        comm.check_context()
        dp, mp = mesh(args, world)
        train = build(args, args.parallel_mode, world)
        simpar.set_auto_parallel_context(dataset_strategy=dataset_strategy(args, dp, mp, world))
        t_build = time.perf_counter()
        data0, label0 = get_batch(0)
        train.build(data0, label0)
        t_build = time.perf_counter() - t_build
    except ValueError as e:
        if rank == 0:
            hint = ""
            if not isinstance(e, ContextError) and args.parallel_mode != "auto_parallel":
                sizes = working_world_sizes(args)
                hint = (f"; with these options -n can be {', '.join(map(str, sizes))}"
                        if sizes else "")
            print(f"python -m simpar.train: error: {e}{hint}", file=sys.stderr)
        return 2
    env = _env.SETTINGS
    say(f"simpar {simpar.__version__}: {world} ranks, mode {args.parallel_mode}, model "
        f"{args.model}, dtype {args.dtype}; BLAS threads/rank {env.get('blas_threads')}, MPI "
        f"wait policy {env.get('wait_policy')}")
    if args.parallel_mode == "semi_auto_parallel":
        say(f"mesh: dp x mp = {dp} x {mp}, strategy preset {strategy_name(args, world)!r}"
            + (f" in each of {args.pipeline_stages} pipeline stages (stage 0's table below)"
               if args.pipeline_stages > 1 else ""))
    if args.load_strategy:
        say(f"strategies loaded from {args.load_strategy} (strategy_ckpt_config's load_file): "
            "nothing searched")
    elif args.parallel_mode == "auto_parallel":
        say(f"strategies searched by {args.search_mode} on the "
            f"{args.profile.name if args.profile != 'none' else 'cpu-local'} profile, "
            f"dataset {dataset_strategy(args, dp, mp, world)}")
    if args.save_strategy:
        say(f"saved the plan to {args.save_strategy} (MindSpore's strategy file)")
    print_strategy_table(train) if rank == 0 else None
    if train.program is not None and train.program.param_shards:
        say(optimizer_shard_line(train))
    if train.program_dimensions is not None and rank == 0:
        print(dimensions_table(train))
    why = ""
    if args.parallel_mode == "auto_parallel" and args.profile != "none" and rank == 0 \
            and train.pipeline is None:
        why = why_it_won(args, train, world)
        print(why)
    per_row, unit = samples_unit(args)   # (tokens, images or samples) per batch row
    say(f"\nplanned in {t_build:.2f} s; training {args.steps} steps of {args.batch_size} x "
        f"{per_row} {unit}")
    losses: list[float] = []
    step_times: list[float] = []
    start = 0
    if args.resume is not None:
        try:
            start = checkpoint.load_training(train, args.resume)
        except ValueError as e:  # every rank raises alike (agreed in load_training)
            if rank == 0:
                print(f"python -m simpar.train: error: --resume {args.resume}: {e}",
                      file=sys.stderr)
            return 2
        # parse_args accepted only a checkpoint the job saved, which keeps its losses.
        losses = [float(x) for x in checkpoint.read_manifest(args.resume).extra["losses"]]
        say(f"resumed from {args.resume} after step {start}")
        if start >= args.steps:
            say(f"the checkpoint is after step {start}: nothing left of --steps {args.steps}")
    tokens = args.batch_size * per_row
    rows = my_rows(train, rank)
    spans: list[tuple[int, float, float, float]] = []   # (step, barrier, start, end)
    with comm.CommTrace() as trace:
        for k in range(start, args.steps):
            data, label = (data0, label0) if k == 0 else get_batch(k, rows)  # only its rows
            waited = time.perf_counter()
            comm.world().Barrier()  # untraced: only to time steps fairly
            t0 = time.perf_counter()
            _injected_failure(rank, k + 1)
            loss = train(data, label)
            step_times.append(time.perf_counter() - t0)
            spans.append((k + 1, waited, t0, t0 + step_times[-1]))
            losses.append(loss)
            if args.stop_on_nonfinite and not math.isfinite(loss):
                # Every rank computed the same global loss, so every rank stops here alike.
                if rank == 0:
                    print(f"python -m simpar.train: error: the loss is {loss} at step {k + 1}; "
                          "training stopped (--no-stop-on-nonfinite goes on)", file=sys.stderr)
                return 1
            bar = "#" * int(20 * (k + 1) / args.steps)
            say(f"  step {k + 1:>3}/{args.steps} [{bar:<20}] loss {loss:.4f}  "
                f"{tokens / step_times[-1]:>8.0f} {unit}/s", flush=True)
            if args.save_every and (k + 1) % args.save_every == 0:
                saved = checkpoint.save_training(
                    train, os.path.join(args.ckpt_dir, f"step_{k + 1:06d}"),
                    extra={"losses": [_json_float(x) for x in losses],
                           "job": job_settings(args)})
                say(f"  saved {saved}")
    steady = step_times[1:] or step_times or [math.inf]  # (a resume with no step left)
    tok_s = tokens / float(np.median(steady))
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {tok_s:.0f} {unit}/s (median step "
        f"{1e3 * float(np.median(steady)):.1f} ms)")
    say("collectives per rank 0 over the run:\n" + "\n".join(
        "  " + line for line in trace.summary().splitlines()))
    predicted: Any = None
    if train.pipeline is not None:   # the last timed step's times, then one traced step
        busy, idle = train.pipeline.busy, train.pipeline.span - train.pipeline.busy
        peak = measured_peak(train, data0, label0)
        if args.profile != "none":
            predicted = price_pipeline(train.pipeline.stages, train.pipeline.programs,
                                       args.pipeline_stages, train.pipeline_scheduler,
                                       args.micro_batches, args.profile, optimizer(args))
        say(stage_lines(train, predicted, busy, idle, peak))
    elif args.profile != "none" and train.program is not None:
        predicted = train.program.cost(args.profile, optimizer(args))
        say(f"cost model ({predicted.profile}): predicted step {predicted.step_seconds * 1e3:.1f}"
            f" ms (measured median {1e3 * float(np.median(steady)):.1f} ms), peak memory "
            f"{predicted.peak_memory / 2**20:.2f} MiB per rank (program.cost(profile) has "
            "the table)")
    if args.trace is not None:
        priced = None
        if isinstance(predicted, CostReport) and train.program is not None:
            priced = (sequential(predicted_timeline(train.program, args.profile,
                                                    predicted.slowest_rank)),
                      f"predicted (cost model on {predicted.profile}, rank "
                      f"{predicted.slowest_rank})")
        elif predicted is not None:   # a pipelined step's tasks, stage by stage
            priced = (pipelined(predicted.tasks, predicted.chunks),
                      f"predicted (cost model on {predicted.profile}, {predicted.scheduler}, "
                      f"{predicted.micro_batches} micro-batches)")
        write_trace(args.trace, spans, trace.events, priced)
        say(f"wrote the timeline to {args.trace} (Perfetto or chrome://tracing opens it)")
    summary: dict[str, Any] = {
        "mode": args.parallel_mode, "strategy": strategy_name(args, world), "dp": dp,
        "search_mode": args.search_mode if args.parallel_mode == "auto_parallel" else None,
        "mp": mp, "model": args.model, "dtype": args.dtype, "steps": args.steps,
        "losses": [_json_float(x) for x in losses], "tokens_per_s": tok_s,
        "plan_seconds": t_build, "step_seconds": step_times, "comm": trace.by_kind(),
        "strategies": train.program.strategies() if train.program else {}, "passed": None,
        "predicted_step_seconds": predicted.step_seconds if predicted else None,
        "predicted_peak_memory": predicted.peak_memory if predicted else None}
    report = None
    if not args.no_check:
        report = check_against_single_device(
            train, lambda: build(args, "stand_alone", 1, reference=True),
            [get_batch(k) for k in range(args.steps)], losses=losses)
        summary.update(_check_fields(report))
    if args.out and rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "summary.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1, default=float, allow_nan=False)
        os.replace(tmp, path)
        say(f"wrote {path}")
    if args.report and rank == 0:
        say(f"wrote {write_report(args, train, summary, why, trace, predicted, report)}")
    if report is None:
        return 0
    say("\n" + (report.summary() if report.passed else str(report)))  # the verdict, last
    if report.verdict == "INCONCLUSIVE" and rank == 0:
        print(f"python -m simpar.train: error: the single-device run diverged (first batch's "
              f"loss {report.reference_loss[0]:.4g} -> {report.reference_loss[1]:.4g}), so "
              f"the check cannot judge this run; train stably (--lr {learning_rate(args):g} "
              "is too large here) to check it", file=sys.stderr)
    return {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 2}[report.verdict]


def write_report(args: argparse.Namespace, train: nn.TrainOneStepCell,
                 summary: dict[str, Any], why: str, trace: comm.CommTrace, predicted: Any,
                 check: CheckReport | None) -> Any:
    """``--report DIR``: the run's data as ``report.json``, then its page
    (:mod:`simpar.report`); returns the page's path. Rank 0 only."""
    prog = train.program
    trainable = [] if prog is None else [
        n for n in prog.param_layouts
        if getattr(prog.param_values[n].param, "requires_grad", False)]
    data = {**summary, "title": f"{args.model}, {args.parallel_mode}, {comm.get_group_size()} "
                                f"ranks",
            "settings": json.dumps(job_settings(args) | {
                "parallel_mode": args.parallel_mode, "ranks": comm.get_group_size(),
                "search_mode": summary["search_mode"]}, indent=1),
            "strategy_table": strategy_table(prog) if prog is not None else "",
            "why_it_won": why, "collectives": trace.summary(),
            "cost": predicted.to_dict() if isinstance(predicted, CostReport) else None,
            "pipeline_cost": (dataclasses.asdict(predicted) if predicted is not None
                              and not isinstance(predicted, CostReport) else None),
            "layouts": [{"name": n, "layout": prog.storage_layout(n).to_dict()}
                        for n in trainable[:3]] if prog is not None else [],
            "check": "" if check is None else (check.summary() if check.passed else str(check))}
    simpar_report.write_data(args.report, data)
    if prog is not None:
        viz.program_png(prog, pathlib.Path(args.report) / simpar_report.GRAPH)
    return simpar_report.build(args.report)


def optimizer(args: argparse.Namespace) -> str:
    """The cost model's name for the optimizer (AdamW keeps Adam's state)."""
    return {"adamw": "adam"}.get(args.optimizer, args.optimizer)


def why_it_won(args: argparse.Namespace, train: nn.TrainOneStepCell, world: int) -> str:
    """The searched plan's predicted cost next to every hand-written preset that runs on
    ``world`` ranks and pure data parallelism (planned from shapes, nothing run)."""
    assert train.program is not None
    rows: list[tuple[str, CostReport | str]] = [
        (f"loaded ({args.load_strategy})" if args.load_strategy else
         f"searched ({args.search_mode})", train.program.cost(args.profile, optimizer(args)))]
    for name in presets.PRESETS:
        alt = argparse.Namespace(**{**vars(args), "parallel_mode": "semi_auto_parallel",
                                    "strategy": name})
        label = f"preset {name}" + (" (pure data parallel)" if name == "dp" else "")
        try:
            dp, mp = mesh(alt, world)
            cell = build(alt, "semi_auto_parallel", world)
            g = graph.trace(cell.network, batch_shapes(alt), ["data", "label"])
            program = build_program(g, world, "semi_auto_parallel",
                                    dataset_strategy(alt, dp, mp, world), True,
                                    cell=cell.network)
        except ValueError as error:
            rows.append((label, f"does not run here: {error}"))
            continue
        rows.append((label, program.cost(args.profile, optimizer(args))))
    table = [["plan", "step ms", "compute", "op comm", "redistr.", "grad sync", "other",
              "peak MiB"]]
    for label, r in rows:
        if isinstance(r, str):
            table.append([label, r[:70], "", "", "", "", "", ""])
            continue
        table.append([label] + [f"{x * 1e3:.2f}" for x in (
            r.step_seconds, r.compute, r.op_comm, r.redistribution, r.grad_sync,
            r.accumulation + r.optimizer + r.overhead)] + [f"{r.peak_memory / 2**20:.2f}"])
    best = min((r.step_seconds for _, r in rows[1:] if not isinstance(r, str)), default=None)
    searched = rows[0][1]
    assert not isinstance(searched, str)
    verdict = ("" if best is None else
               f"; the searched plan is predicted {best / searched.step_seconds:.2f}x as fast "
               "as the best preset")
    return "\n".join([f"\nwhy it won (predicted per step on {searched.profile}, ms{verdict}):",
                      *strategy_table_columns(table)])


def strategy_name(args: argparse.Namespace, world: int) -> str | None:
    """The semi_auto_parallel preset these options use on ``world`` ranks (None otherwise)."""
    if args.parallel_mode != "semi_auto_parallel":
        return None
    return args.strategy or ("hybrid" if world % 2 == 0 else "mp")


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _check_fields(report: CheckReport) -> dict[str, Any]:
    d = report.to_dict()
    return {"passed": d["passed"], "verdict": d["verdict"], "max_dloss": d["max_dloss"],
            "max_dparam": d["max_dparam"], "max_dgrad": d["max_dgrad"],
            "tolerance": d["tolerance"], "param_errors": d["param_errors"]}


if __name__ == "__main__":
    sys.exit(main())
