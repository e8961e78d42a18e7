"""Plan a model of any size for any number of devices, in one process: no MPI, no data.

    python -m simpar.plan --model gpt --layers 24 --hidden 1024 --heads 16 --seq 1024 \\
        --batch 512 --device-num 64 --search-mode dynamic_programming --profile ascend910b
    python -m simpar.plan --preset 175B --batch 1024 --device-num 1024 --out plan.json
    python -m simpar.plan --model mlp --hidden 8192 --layers 2 --batch 1024 --device-num 8
    python -m simpar.plan --preset 350M --device-num 64 --search-mode exact --time-limit 60

The model is built from shapes alone (its Parameters stay unmaterialised initializers), traced
with its loss for a global batch, and every op's strategy is searched by a registered
auto_parallel search (``simpar.search.registered_searches()``) minimising simpar's cost model
on ``--profile`` or MindSpore's (``--cost-model``). The plan is then lowered to the per-rank
program and priced by simpar's cost model on the profile. It prints the strategy table, the
predicted step time (compute, op collectives, redistribution, gradient sync), each rank's peak
memory against the device's capacity, and how long planning took; the searches' progress (the
``simpar.search`` logger) goes to stderr unless ``--quiet``. ``--out`` saves it all as JSON,
with the strategy map that ``simpar.search.StrategyMap.from_dict`` reads back. ``--search-mode
exact --time-limit S`` stops the ILP after S seconds with the best plan it has: the output
then gives the optimality gap (how far from proven optimal the plan may be).

Exit codes: 0 planned; 1 no plan (the search or the lowering refused, with its reason);
2 options refused before any work (one line naming the option, the value and what is allowed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import pathlib
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from simpar import _env, context, graph, nn
from simpar._checks import positive_float_arg, positive_int_arg
from simpar.comm_fusion import AllReduceFusion
from simpar.cost import (
    CostModel,
    CostReport,
    DeviceProfile,
    MindSporeCostModel,
    SimparCostModel,
    evaluate,
    load_profile,
    profile_names,
)
from simpar.optimizer_parallel import OptimizerLevel, OptimizerParallel
from simpar.pipeline.search import GPTShape, StageChoice, price_choice, search_pipeline
from simpar.runtime import NothingParallelWarning, ParallelProgram, lower
from simpar.search import StrategyMap, plan_request, registered_searches, request_from_context
from simpar.search.dimensions import DimensionSearch, graph_of
from simpar.search.exact import TimeLimitWarning, describe_gap
from simpar.search.planner import planning_gc
from simpar.strategy_table import strategy_table

__all__ = ["GPT_PRESETS", "GPTSize", "ModelPlan", "PlanOptions", "build_network", "main",
           "make_plan", "parse_args", "search_model", "summary", "to_json", "write_json"]

PROG = "python -m simpar.plan"
log = logging.getLogger("simpar.plan")


@dataclass(frozen=True, slots=True)
class GPTSize:
    """A GPT's sizes: hidden width, layers, attention heads, sequence length, vocabulary."""

    hidden: int
    layers: int
    heads: int
    seq: int = 1024
    vocab: int = 51200


#: Alpa's GPT benchmark suite (alpa-projects/alpa, benchmark/alpa/paper_auto_gpt_suite.py:
#: sequence 1024, vocabulary 51200), and GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers,
#: d_model 12288, 96 heads, context 2048).
GPT_PRESETS: Mapping[str, GPTSize] = {
    "125M": GPTSize(768, 12, 12),
    "350M": GPTSize(1024, 24, 16),
    "760M": GPTSize(1536, 24, 16),
    "1.3B": GPTSize(2048, 24, 32),
    "2.6B": GPTSize(2560, 32, 32),
    "6.7B": GPTSize(4096, 32, 32),
    "15B": GPTSize(5120, 48, 40),
    "39B": GPTSize(8192, 48, 64),
    "76B": GPTSize(10240, 60, 80),
    "175B": GPTSize(12288, 96, 96, seq=2048),
}
_DEFAULT_PRESET = "125M"
#: The MLP's sizes when not given: input features, hidden width, classes, hidden layers.
_MLP_DEFAULTS = {"in_features": 1024, "hidden": 4096, "classes": 1024, "layers": 1}
#: ResNet-50's and -18's when not given: ImageNet's classes and image size.
_RESNET_DEFAULTS = {"classes": 1000, "image_size": 224}
#: What each model takes of the size options (the others are refused by name).
_TAKES = {"gpt": ("preset", "layers", "hidden", "heads", "seq", "vocab"),
          "mlp": ("layers", "hidden", "in_features", "classes"),
          "resnet18": ("classes", "image_size"), "resnet50": ("classes", "image_size")}
_MAX_DEVICES = 4096
_OPTIMIZERS = {"sgd": "sgd", "momentum": "momentum", "adam": "adam", "adamw": "adam"}


@dataclass(frozen=True)
class PlanOptions:
    """What to plan: the model and its sizes, the batch, the devices and how to search."""

    model: str
    hidden: int
    layers: int
    batch: int
    device_num: int
    search_mode: str
    profile: DeviceProfile
    heads: int = 0                      # GPT
    seq: int = 0
    vocab: int = 0
    in_features: int = 0                # MLP
    classes: int = 0                    # MLP, ResNet
    image_size: int = 0                 # ResNet
    dtype: str = "float32"
    cost_model: str = "simpar"
    optimizer: str = "adam"
    dataset_strategy: str = "full_batch"
    enable_alltoall: bool = False
    preset: str | None = None
    time_limit: float | None = None     # search_mode exact: seconds (None: no limit)
    optimizer_shard: str = "off"        # the memory dimensions: optimizer parallel level,
    optimizer_shard_threshold: int = 64  # its threshold (KB),
    recompute: bool = False             # every block (MLP layer but the last) recomputed,
    micro_batches: int = 1              # and micro-batches per step;
    memory_dimensions: str = "fixed"    # whether the search chooses them (set_algo_parameters)
    comm_fusion: AllReduceFusion = AllReduceFusion()   # the gradient AllReduces' buckets
    device_memory_capacity: float | None = None   # the search's cap (None: the profile's)

    def describe(self) -> str:
        if self.model == "gpt":
            preset = f"preset {self.preset}: " if self.preset else ""
            return (f"GPT ({preset}{self.layers} layers, hidden {self.hidden}, {self.heads} "
                    f"heads, seq {self.seq}, vocab {self.vocab}, {self.dtype})")
        if self.model.startswith("resnet"):
            return (f"ResNet-{self.model[6:]} ({self.classes} classes, {self.image_size}x"
                    f"{self.image_size} images, {self.dtype})")
        return (f"MLP ({self.in_features} -> {self.layers} x {self.hidden} -> {self.classes}, "
                f"{self.dtype})")


@dataclass(frozen=True)
class ModelPlan:
    """A planned model: its strategy map, the lowered program, the cost report, its
    parameter count, the seconds each stage took (trace, search, lower, cost) and notes
    (e.g. that the search found nothing worth splitting)."""

    options: PlanOptions
    strategy_map: StrategyMap
    program: ParallelProgram
    report: CostReport
    parameters: int
    parameter_bytes: int
    seconds: Mapping[str, float]
    notes: tuple[str, ...] = ()


# ------------------------------------------------------------------ options
def _device_num(text: str) -> int:
    value = positive_int_arg(text)
    if value > _MAX_DEVICES:
        raise argparse.ArgumentTypeError(f"must be an int in [1, {_MAX_DEVICES}] (MindSpore's "
                                         f"device_num range), got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}"
                                         ) from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def _stages(text: str) -> int | None:
    if text == "auto":
        return None
    return positive_int_arg(text)


def _preset(text: str) -> str:
    return text.upper()


def _fusion(text: str) -> AllReduceFusion:
    """``--comm-fusion``: one, auto, off, or a bucket size in MB."""
    if text in ("one", "auto", "off"):
        return {"one": AllReduceFusion(), "auto": AllReduceFusion("auto", None),
                "off": AllReduceFusion(openstate=False)}[text]
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be one, auto, off or a bucket size in MB "
                                         f"(an int >= 1), got {text!r}")
    return AllReduceFusion("size", int(text))


def _default_search() -> str:
    searches = registered_searches()
    return "dynamic_programming" if "dynamic_programming" in searches else searches[0]


def _parser() -> argparse.ArgumentParser:
    p = _env.RankZeroParser(prog=PROG, description=__doc__, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", choices=("gpt", "mlp", "resnet18", "resnet50"))
    p.add_argument("--preset", type=_preset, default=None, choices=list(GPT_PRESETS),
                   help=f"GPT sizes (default {_DEFAULT_PRESET}); --layers, --hidden, --heads, "
                   "--seq and --vocab override it")
    p.add_argument("--layers", type=positive_int_arg, default=None,
                   help="GPT: transformer blocks; MLP: hidden layers "
                   f"(default {_MLP_DEFAULTS['layers']})")
    p.add_argument("--hidden", type=positive_int_arg, default=None,
                   help=f"GPT: d_model; MLP: hidden width (default {_MLP_DEFAULTS['hidden']})")
    p.add_argument("--heads", type=positive_int_arg, default=None,
                   help="GPT: attention heads; must divide --hidden")
    p.add_argument("--seq", type=positive_int_arg, default=None, help="GPT: sequence length")
    p.add_argument("--vocab", type=positive_int_arg, default=None, help="GPT: vocabulary size")
    p.add_argument("--in-features", type=positive_int_arg, default=None,
                   help=f"MLP: input features (default {_MLP_DEFAULTS['in_features']})")
    p.add_argument("--classes", type=positive_int_arg, default=None,
                   help=f"MLP, ResNet: output classes (default {_MLP_DEFAULTS['classes']}; "
                   f"ResNet {_RESNET_DEFAULTS['classes']})")
    p.add_argument("--image-size", type=positive_int_arg, default=None,
                   help=f"ResNet: image height and width (default "
                   f"{_RESNET_DEFAULTS['image_size']})")
    p.add_argument("--batch", type=positive_int_arg, default=1024, help="global batch (default "
                   "1024, Alpa's)")
    p.add_argument("--dtype", default="float32", choices=("float16", "float32", "float64"),
                   help="parameters and activations (default float32; float16 as "
                   "benchmarks/search.py plans)")
    p.add_argument("--device-num", type=_device_num, default=8,
                   help="devices to plan for (default 8); no MPI is started")
    p.add_argument("--search-mode", default=None, choices=registered_searches(),
                   help=f"a registered auto_parallel search (default {_default_search()})")
    p.add_argument("--time-limit", type=_seconds, default=None, metavar="SECONDS",
                   help="--search-mode exact only: stop after this many seconds with the best "
                   "plan found and its optimality gap (default: no limit, the proven optimum; "
                   "the algo parameter exact_time_limit)")
    p.add_argument("--cost-model", default="simpar", choices=("simpar", "mindspore"),
                   help="what the search minimises: simpar's step time on --profile "
                   "(default), or MindSpore's cost model; the plan is priced by simpar's")
    p.add_argument("--profile", default="ascend910b",
                   help=f"device profile: a shipped name ({', '.join(profile_names())}; "
                   "default ascend910b) or a .json path (python -m simpar.calibrate writes one)")
    p.add_argument("--optimizer", default="adam", choices=tuple(_OPTIMIZERS),
                   help="whose state the memory counts (default adam; adamw as adam)")
    p.add_argument("--dataset-strategy", default="full_batch",
                   choices=("full_batch", "data_parallel"),
                   help="how the batch arrives: whole on every device (default), or split "
                   "over all devices (--batch must then divide among them)")
    p.add_argument("--enable-alltoall", action=argparse.BooleanOptionalAction, default=False,
                   help="redistribute with AllToAll (default off, MindSpore's default and "
                   "benchmarks/search.py's: moves are then priced in bulk, several times "
                   "faster on large plans)")
    p.add_argument("--optimizer-shard", default="off",
                   choices=("off", "level1", "level2", "level3"),
                   help="optimizer parallel: slice each weight ranks hold alike, with its "
                        "gradient and optimizer state (MindSpore's optimizer_level)")
    p.add_argument("--optimizer-shard-threshold", type=int, default=64, metavar="KB",
                   help="parameters under this many KB stay whole (default 64)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute every block (every MLP layer but the last) in the backward")
    p.add_argument("--micro-batches", type=positive_int_arg, default=1, metavar="M",
                   help="micro-batches per step (gradient accumulation); --batch is the "
                        "whole step's")
    p.add_argument("--memory-dimensions", default="fixed",
                   choices=("fixed", "when_needed", "search"),
                   help="let the search choose the optimizer level, the recomputed blocks and "
                        f"the micro-batches ({', '.join(map(str, PLAN_MICRO_BATCHES))}) with "
                        "the cuts, always or when nothing fits; --optimizer-shard LEVEL and "
                        "--micro-batches M > 1 fix theirs")
    p.add_argument("--pipeline-stages", type=_stages, default=1, metavar="S|auto",
                   help="GPT: plan S pipeline stages (searching their layer ranges, layouts, "
                        "memory dimensions and micro-batches), or 'auto' to search S too "
                        "(MindSpore's auto_pipeline); printed next to Megatron-LM's "
                        "configuration for GPT-3 (default 1: no pipeline)")
    p.add_argument("--comm-fusion", type=_fusion, default=AllReduceFusion(),
                   metavar="one|auto|off|MB",
                   help="how the gradient AllReduces are bucketed (MindSpore's comm_fusion): "
                        "one per group of ranks (default), auto (64 MB buckets), off (one "
                        "per parameter), or buckets of at most MB megabytes")
    p.add_argument("--device-memory-capacity", type=positive_float_arg, default=None,
                   metavar="BYTES", help="the memory cap per rank the search plans under "
                   "(MindSpore's device_memory_capacity; default: the profile's); the plan "
                   "is still judged against the profile's memory")
    p.add_argument("--out", default=None, help="write the plan as JSON to this file")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (the plan still prints)")
    return p


def parse_args(argv: Sequence[str] | None) -> tuple[PlanOptions, argparse.Namespace]:
    """The checked options; a bad one prints one line and exits 2 (``SystemExit``)."""
    p = _parser()
    args = p.parse_args(argv)
    sized = sorted({k for ks in _TAKES.values() for k in ks})
    wrong = [k for k in sized if getattr(args, k) is not None and k not in _TAKES[args.model]]
    if wrong:
        takes = ", ".join("--" + k.replace("_", "-") for k in _TAKES[args.model])
        p.error(f"argument --{wrong[0].replace('_', '-')}: not an option of --model "
                f"{args.model}, which takes {takes}")
    try:
        profile = load_profile(args.profile)
    except (ValueError, TypeError) as error:
        p.error(f"argument --profile: {str(error).removeprefix('load_profile: ')}")
    search = args.search_mode or _default_search()
    if args.time_limit is not None and search != "exact":
        p.error(f"argument --time-limit: only --search-mode exact has a time limit, not "
                f"{search!r}")
    common: dict[str, Any] = dict(
        batch=args.batch, device_num=args.device_num, search_mode=search, profile=profile,
        dtype=args.dtype, cost_model=args.cost_model, optimizer=args.optimizer,
        dataset_strategy=args.dataset_strategy, enable_alltoall=args.enable_alltoall,
        time_limit=args.time_limit, optimizer_shard=args.optimizer_shard,
        optimizer_shard_threshold=args.optimizer_shard_threshold, recompute=args.recompute,
        micro_batches=args.micro_batches, memory_dimensions=args.memory_dimensions,
        comm_fusion=args.comm_fusion, device_memory_capacity=args.device_memory_capacity)
    if args.optimizer_shard_threshold < 0:
        p.error(f"argument --optimizer-shard-threshold: must be >= 0 KB, got "
                f"{args.optimizer_shard_threshold}")
    if args.batch % args.micro_batches:
        p.error(f"argument --micro-batches: {args.micro_batches} does not divide --batch "
                f"{args.batch}")
    if args.model == "gpt":
        base = GPT_PRESETS[args.preset or _DEFAULT_PRESET]
        sizes = {k: getattr(args, k) if getattr(args, k) is not None else getattr(base, k)
                 for k in ("hidden", "layers", "heads", "seq", "vocab")}
        if sizes["hidden"] % sizes["heads"]:
            divisors = [h for h in range(1, min(sizes["hidden"], 128) + 1)
                        if sizes["hidden"] % h == 0]
            p.error(f"argument --heads: {sizes['heads']} heads do not divide --hidden "
                    f"{sizes['hidden']} (each head gets hidden / heads features); up to 128, "
                    f"heads can be {', '.join(map(str, divisors))}")
        opts = PlanOptions("gpt", preset=args.preset, **sizes, **common)
    elif args.model.startswith("resnet"):
        sizes = {k: getattr(args, k) if getattr(args, k) is not None else _RESNET_DEFAULTS[k]
                 for k in ("classes", "image_size")}
        opts = PlanOptions(args.model, hidden=64, layers=int(args.model[6:]), **sizes,
                           **common)
    else:
        sizes = {k: getattr(args, k) if getattr(args, k) is not None else _MLP_DEFAULTS[k]
                 for k in ("in_features", "hidden", "classes", "layers")}
        opts = PlanOptions("mlp", **sizes, **common)
    if args.dataset_strategy == "data_parallel" and (args.batch // args.micro_batches) % \
            args.device_num:
        micro = f" in {args.micro_batches} micro-batches" if args.micro_batches > 1 else ""
        p.error(f"argument --batch: {args.batch} does not split over --device-num "
                f"{args.device_num}{micro} under --dataset-strategy data_parallel; use a "
                f"multiple of {args.device_num * args.micro_batches}, or --dataset-strategy "
                "full_batch")
    if args.out is not None:
        problem = _env.unwritable_file(pathlib.Path(args.out))
        if problem:
            p.error(f"argument --out: {args.out!r}: {problem}")
    return opts, args


# ------------------------------------------------------------------ planning
_Spec = tuple[tuple[int, ...], np.dtype]


#: The micro-batch counts simpar.plan offers the search of the memory dimensions.
PLAN_MICRO_BATCHES = (1, 2, 4, 8, 16)


def build_network(opts: PlanOptions, micro_batches: int | None = None
                  ) -> tuple[nn.Cell, list[_Spec]]:
    """The model with its loss (``WithLossCell``, as the main job trains it) and the global
    input specs ``(data, label)``. Nothing of the model's size is allocated: the Parameters
    hold initializers, drawn only when a rank takes its shard."""
    dtype = np.dtype(opts.dtype)
    model: nn.Cell
    specs: list[_Spec]
    # The graph is one micro-batch's (of ``micro_batches``, default the options').
    batch = opts.batch // (micro_batches or opts.micro_batches)
    if opts.model == "gpt":
        model = nn.GPT(opts.vocab, opts.seq, opts.hidden, opts.layers, opts.heads, dtype=dtype)
        ids: _Spec = ((batch, opts.seq), np.dtype(np.int32))
        specs = [ids, ids]
        blocks: list[nn.Cell] = list(model.blocks)
    elif opts.model.startswith("resnet"):
        resnet = nn.resnet(opts.layers, opts.classes, opts.hidden, dtype=dtype)
        model = resnet
        size = opts.image_size
        specs = [((batch, 3, size, size), dtype), ((batch,), np.dtype(np.int32))]
        blocks = [block for stage in resnet.stages for block in stage]
    else:
        model = nn.MLP(opts.in_features, opts.hidden, opts.classes, n_hidden=opts.layers,
                       dtype=dtype)
        specs = [((batch, opts.in_features), dtype), ((batch,), np.dtype(np.int32))]
        blocks = list(model.layers[:-1])
    if opts.recompute or opts.memory_dimensions != "fixed":   # (a candidate when searched)
        for block in blocks:
            block.recompute()
    return nn.WithLossCell(model, nn.SoftmaxCrossEntropyWithLogits()).set_train(), specs


def search_model(opts: PlanOptions) -> CostModel:
    """The cost model the search minimises."""
    if opts.cost_model == "mindspore":
        return MindSporeCostModel()
    return SimparCostModel(opts.profile, _OPTIMIZERS[opts.optimizer])


def make_plan(opts: PlanOptions) -> ModelPlan:
    """Trace, search, lower and price (pure: no MPI, no data). The plan request takes the
    options' devices, search, cost model and time limit, and the context's other settings."""
    with planning_gc():
        return _make_plan(opts)


def _make_plan(opts: PlanOptions) -> ModelPlan:
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    net, specs = build_network(opts)
    g = graph.trace(net, specs, ["data", "label"])
    graphs = {opts.micro_batches: g}
    if opts.memory_dimensions != "fixed" and opts.micro_batches == 1:  # one per count on offer
        for m in PLAN_MICRO_BATCHES[1:]:
            if opts.batch % m == 0:
                graphs[m] = graph.trace(*build_network(opts, m), ["data", "label"])
    parameters = sum(math.prod(v.shape) for v in g.params)
    parameter_bytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in g.params)
    seconds["trace"] = time.perf_counter() - t
    log.info("traced %d ops, %d parameters (%s elements, %s) in %.1f s", len(g.nodes),
             len(g.params), _count(parameters), _bytes(parameter_bytes), seconds["trace"])
    log.info("searching (%s, minimising %s's cost model) for %d devices", opts.search_mode,
             opts.cost_model, opts.device_num)
    t = time.perf_counter()
    request = request_from_context(
        g, cell=net, device_num=opts.device_num, mode="auto_parallel",
        dataset_strategy=opts.dataset_strategy, enable_alltoall=opts.enable_alltoall,
        search_mode=opts.search_mode, cost_model=search_model(opts),
        algo={"exact_time_limit": opts.time_limit,
              "memory_dimensions": opts.memory_dimensions},
        micro_batches=opts.micro_batches, micro_graphs=graphs,
        optimizer=OptimizerParallel(None if opts.optimizer_shard == "off"
                                    else OptimizerLevel(opts.optimizer_shard), -1,
                                    opts.optimizer_shard_threshold))
    request = dataclasses.replace(request, comm_fusion=opts.comm_fusion,
                                  memory_capacity=opts.device_memory_capacity)
    if opts.memory_dimensions != "fixed" and opts.optimizer_shard == "off":
        request = dataclasses.replace(request, searched=request.searched | {"optimizer"})
    with warnings.catch_warnings():  # the summary gives the gap
        warnings.simplefilter("ignore", TimeLimitWarning)
        smap = plan_request(request)
    g = graph_of(request, smap)
    seconds["search"] = time.perf_counter() - t
    log.info("searched in %.1f s; lowering", seconds["search"])
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NothingParallelWarning)
        program = lower(g, smap, opts.enable_alltoall)
    notes = tuple(str(w.message).split(". ")[0] for w in caught
                  if issubclass(w.category, NothingParallelWarning))
    seconds["lower"] = time.perf_counter() - t
    log.info("lowered in %.1f s; pricing on %s", seconds["lower"], opts.profile.name)
    t = time.perf_counter()
    report = evaluate(program, opts.profile, _OPTIMIZERS[opts.optimizer])
    seconds["cost"] = time.perf_counter() - t
    log.info("priced in %.1f s", seconds["cost"])
    return ModelPlan(opts, smap, program, report, parameters, parameter_bytes, seconds, notes)


# ------------------------------------------------------------------ output
def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def summary(plan: ModelPlan) -> str:
    """The cost breakdown, memory per rank and planning time, as printed."""
    r, o = plan.report, plan.options
    parts = [("compute", r.compute), ("op collectives", r.op_comm),
             ("redistribution", r.redistribution), ("gradient sync", r.grad_sync),
             *([("gradient accumulation", r.accumulation)] if r.accumulation else []),
             ("optimizer", r.optimizer), ("fixed", r.overhead)]
    priced = (f"all {r.device_num} ranks priced" if len(r.memory) == r.device_num else
              f"{len(r.memory)} of {r.device_num} ranks priced")
    priced += (f", {r.rank_classes} class{'es' if r.rank_classes > 1 else ''} of ranks "
               "alike")
    lines = [f"\npredicted step {_time(r.step_seconds)} on {r.profile} x {r.device_num} "
             f"(rank {r.slowest_rank} slowest; {priced}; optimizer {o.optimizer}):"]
    width = max(len(name) for name, _ in parts)
    lines += [f"  {name.ljust(width)}  {_time(value):>12}  "
              f"{100 * value / r.step_seconds if r.step_seconds else 0.0:5.1f}%"
              for name, value in parts]
    worst = max(r.memory, key=lambda m: (m.peak, -m.rank))
    least = min(m.peak for m in r.memory)
    spread = "" if least == worst.peak else f" (least {_bytes(least)})"
    verdict = "fits" if r.fits else (
        f"OVER by {_bytes(worst.over)}; {sum(1 for m in r.memory if m.over)} of "
        f"{len(r.memory)} priced ranks do not fit")
    lines += [f"memory per rank: peak {_bytes(worst.peak)} on rank {worst.rank}{spread}, "
              f"capacity {_bytes(worst.capacity)}: {verdict}",
              f"  parameters {_bytes(worst.parameters)} + gradients {_bytes(worst.gradients)} "
              f"+ optimizer state {_bytes(worst.optimizer)}"]
    m = worst
    if m.activations + max(m.comm_buffer, m.backward) >= m.update:
        (big, b), (small, c) = sorted([("backward transient", m.backward),
                                       ("communication buffer", m.comm_buffer)],
                                      key=lambda x: -x[1])
        lines.append(f"  + activations {_bytes(m.activations)} + {big} {_bytes(b)} (the larger "
                     f"of it and the {small}, {_bytes(c)})")
    else:
        lines.append(f"  + optimizer update {_bytes(m.update)} (after the backward: more than "
                     f"the activations with the backward's transient or communication buffer, "
                     f"{_bytes(m.activations + max(m.comm_buffer, m.backward))})")
    if not r.fits and o.cost_model == "simpar":
        lines.append("  (the search fits the arrays, the gradient buckets and the largest "
                     "transient together when a plan of these cuts can; none it found does. "
                     "--memory-dimensions when_needed adds recomputation, optimizer parallel and "
                     "micro-batches)")
    s = plan.seconds
    lines.append(f"planned in {sum(s.values()):.1f} s (trace {s['trace']:.1f} s, search "
                 f"{s['search']:.1f} s, lower {s['lower']:.1f} s, cost {s['cost']:.1f} s)")
    gap = plan.strategy_map.optimality_gap
    if gap:
        lines.append(f"NOT PROVEN OPTIMAL: search_mode exact stopped at its time limit of "
                     f"{o.time_limit:g} s with its best plan ({describe_gap(gap)}); raise "
                     "--time-limit, or drop it, for the proven optimum")
    elif gap == 0.0:
        lines.append("the search's objective is the proven optimum (optimality gap 0)")
    return "\n".join(lines)


def to_json(plan: ModelPlan, command: str = "") -> dict[str, Any]:
    """The plan as JSON-ready data: options, the strategy map (every op's strategy by its
    MindSpore-style name, every parameter's and input's layout), the cost breakdown, every
    priced rank's memory, and the planning seconds."""
    o, r = plan.options, plan.report
    model: dict[str, Any] = {"model": o.model, "dtype": o.dtype, "layers": o.layers,
                             "hidden": o.hidden, "parameters": plan.parameters,
                             "parameter_bytes": plan.parameter_bytes}
    if o.model == "gpt":
        model.update(preset=o.preset, heads=o.heads, seq=o.seq, vocab=o.vocab)
    else:
        model.update(in_features=o.in_features, classes=o.classes)
    return {
        "command": command, "model": model, "batch": o.batch, "device_num": o.device_num,
        "search_mode": o.search_mode, "cost_model": o.cost_model, "profile": o.profile.name,
        "optimizer": o.optimizer, "dataset_strategy": o.dataset_strategy,
        "enable_alltoall": o.enable_alltoall, "time_limit": o.time_limit,
        "optimality_gap": plan.strategy_map.optimality_gap,
        "strategy_map": plan.strategy_map.to_dict(),
        "cost": {"unit": "s", "step_seconds": r.step_seconds, "slowest_rank": r.slowest_rank,
                 "compute": r.compute, "op_comm": r.op_comm,
                 "redistribution": r.redistribution, "grad_sync": r.grad_sync,
                 "accumulation": r.accumulation, "optimizer": r.optimizer,
                 "overhead": r.overhead,
                 "ops": [{**asdict(row), "strategy": [list(c) for c in row.strategy]}
                         for row in r.ops]},
        "memory": {"peak": r.peak_memory, "fits": r.fits, "capacity": r.memory[0].capacity,
                   "ranks": [{**asdict(m), "peak": m.peak, "over": m.over}
                             for m in r.memory]},
        "seconds": dict(plan.seconds),
    }


def write_json(path: str | pathlib.Path, data: Any) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it: a failure leaves
    no half-written file (and no temporary one)."""
    target = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _progress(shown: bool) -> Iterator[None]:
    """INFO messages of the ``simpar.search`` and ``simpar.plan`` loggers on stderr (those
    two loggers only; restored after)."""
    if not shown:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in ("simpar.search", "simpar.plan")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, (level, propagate) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def dimensions_report(found: DimensionSearch) -> str:
    """The combinations of the memory dimensions planned, the chosen one (or the least
    memory reachable) and which dimensions bind."""
    least = found.least_memory
    if found.chosen is not None:
        head = f"memory dimensions: chose {found.chosen.describe()}"
    elif least is not None and least.memory is not None:
        head = (f"memory dimensions: nothing fits; the least memory per rank reachable is "
                f"{_bytes(least.memory)}, with {least.describe()}")
    else:
        head = "memory dimensions: nothing fits"
    if found.chosen is not None and least is not None and least.memory is not None:
        head += (f"; the least memory per rank reachable is {_bytes(least.memory)}, with "
                 f"{least.describe()}")
    return "\n".join([f"{head} (search objective: the whole step; cap {found.capacity:.0f} "
                      "bytes per rank; memory: the search's estimate)", found.table(),
                      *(f"  {line}" for line in found.binding())])


def _dimensions(opts: PlanOptions) -> str:
    """The memory dimensions asked for, as the first line names them ("" for none)."""
    parts = []
    if opts.optimizer_shard != "off":
        parts.append(f"optimizer parallel {opts.optimizer_shard} (threshold "
                     f"{opts.optimizer_shard_threshold} KB)")
    if opts.recompute:
        parts.append("every block recomputed")
    if opts.micro_batches > 1:
        parts.append(f"{opts.micro_batches} micro-batches")
    if opts.memory_dimensions != "fixed":
        parts.append(f"memory dimensions searched ({opts.memory_dimensions})")
    return "; " + ", ".join(parts) if parts else ""


def pipeline_main(opts: PlanOptions, stages: int | None) -> int:
    """``--pipeline-stages``: the pipeline search (:mod:`simpar.pipeline.search`), its best
    candidates, and Megatron-LM's configuration priced alike (tp 8, the stages the GPT-3
    paper gives for the size, data parallel over the rest, micro-batch 1, every block
    recomputed, no optimizer sharding)."""
    shape = GPTShape(opts.vocab, opts.seq, opts.hidden, opts.layers, opts.heads, opts.batch,
                     opts.dtype)
    what = "searched" if stages is None else f"{stages} given"
    print(f"simpar plan: {opts.describe()}, batch {opts.batch}, {opts.device_num} devices, "
          f"pipeline stages {what}, on {opts.profile.name} "
          f"({opts.profile.memory_capacity / 2**30:.0f} GiB per device)", flush=True)
    # The stages' plan requests read the gradient buckets from the context.
    with context.scoped_auto_parallel_context(comm_fusion=opts.comm_fusion.as_dict()):
        found = search_pipeline(shape, opts.device_num, opts.profile,
                                _OPTIMIZERS[opts.optimizer], stages)
        mega = megatron_choice(opts)
        if mega is not None:
            s, choice = mega
            ref = price_choice(shape, opts.device_num, s, choice, opts.profile,
                               _OPTIMIZERS[opts.optimizer])
    print(f"searched {len(found.candidates)} candidates in {found.seconds:.1f} s ("
          f"{found.skipped} layouts left out: their weights alone exceed the cap); the best:")
    print(found.table())
    if mega is not None:
        print(f"Megatron-LM's configuration: {ref.describe()}: predicted step "
              f"{ref.step_seconds:.3f} s, peak {ref.peak_memory / 2**30:.2f} GiB "
              f"({'fits' if ref.fits else 'does not fit'})")
    if found.best is None:
        print(f"{PROG}: error: no plan: no candidate fits {found.capacity / 2**30:.0f} GiB per "
              "device", file=sys.stderr)
        return 1
    best = found.best
    print(f"plan: {best.describe()}: predicted step {best.step_seconds:.3f} s, bubble "
          f"{best.bubble:.1%}, peak {best.peak_memory / 2**30:.2f} GiB per device"
          + (f"; {ref.step_seconds / best.step_seconds:.2f}x as fast as Megatron-LM's"
             if mega is not None else ""))
    return 0


#: Megatron-LM's configurations (Narayanan et al. 2021): (hidden, layers) -> (tensor-parallel
#: size, pipeline stages). GPT-3 175B on 1024 GPUs: t 8 x p 8 x d 16 at batch 1536, with full
#: activation recomputation; the 1-trillion-parameter GPT on 3072 GPUs: t 8 x p 64.
MEGATRON = {(12288, 96): (8, 8), (25600, 128): (8, 64)}


def megatron_choice(opts: PlanOptions) -> tuple[int, StageChoice] | None:
    """(stages, choice) of Megatron-LM's configuration for this GPT on these devices: the
    paper's tensor and pipeline sizes, data parallel over the rest, micro-batch 1, every
    block recomputed; None for another GPT, or when they do not divide the devices or the
    batch."""
    found = MEGATRON.get((opts.hidden, opts.layers))
    if found is None:
        return None
    tp, pp = found
    if opts.device_num % (tp * pp) or opts.batch % (opts.device_num // (tp * pp)):
        return None
    return pp, StageChoice(tp, opts.device_num // (tp * pp), 1, None, True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, args = parse_args(argv)
    if args.pipeline_stages != 1:
        if opts.model != "gpt":
            print(f"{PROG}: error: argument --pipeline-stages: plans a GPT only",
                  file=sys.stderr)
            return 2
        return pipeline_main(opts, args.pipeline_stages)
    limit = f" within {opts.time_limit:g} s" if opts.time_limit is not None else ""
    print(f"simpar plan: {opts.describe()}, batch {opts.batch}, {opts.device_num} devices, "
          f"search {opts.search_mode}{limit} minimising {opts.cost_model}'s cost model"
          + (f" on {opts.profile.name}" if opts.cost_model == "simpar" else "")
          + f", dataset {opts.dataset_strategy}" + _dimensions(opts), flush=True)
    with _progress(not args.quiet):
        try:
            plan = make_plan(opts)
        except (ValueError, ImportError, TimeoutError) as error:
            found = getattr(error, "search", None)
            if found is not None:
                print(dimensions_report(found))
            print(f"{PROG}: error: no plan: {error}", file=sys.stderr)
            return 1
    print(f"model: {_count(plan.parameters)} parameters ({_bytes(plan.parameter_bytes)} in "
          f"{opts.dtype}), none of them allocated")
    print(strategy_table(plan.program, fold_blocks=True))
    for note in plan.notes:
        print(f"  note: {note}: the search found no split worth its communication")
    print(summary(plan))
    if plan.strategy_map.dimensions is not None:
        print(dimensions_report(plan.strategy_map.dimensions))
    if args.out is not None:
        try:
            write_json(args.out, to_json(plan, shlex.join([*PROG.split(), *argv])))
        except OSError as error:
            print(f"{PROG}: error: --out {args.out}: {error.strerror or error}", file=sys.stderr)
            return 1
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
