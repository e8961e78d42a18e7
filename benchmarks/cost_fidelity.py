"""How well simpar's cost model predicts measured step time and memory, over many strategies.

    mpirun -n 8 python benchmarks/cost_fidelity.py                     # writes "## cost_fidelity"
    mpirun -n 8 python benchmarks/cost_fidelity.py --profile my.json --no-write
    mpirun -n 8 python benchmarks/cost_fidelity.py --pipelines   # "## cost_fidelity_pipelines"

Every strategy trains the main job's GPT (vocabulary 128, sequence 32, d_model 64, 2 layers,
8 heads, batch 8, float64, Adam) or a Megatron MLP (batch 64, 256 -> 1024 -> 256, float32,
Momentum) on all ranks: pure data parallel, Megatron tensor parallel, hybrids 2x4 and 4x2,
split-k, vocabulary-parallel, computing everything on every rank, and strategies that
redistribute at every layer. The ResNet rows train the main job's ``--model resnet``
(:func:`simpar.nn.resnet`, MindSpore's structure with one block per stage, stem width 8,
8 classes, batch 16, float32, Momentum) on 32 x 32 images of 3 channels from
:func:`simpar.dataset.random_images` (the job's default is 16 x 16; at 32 the activations
and the convolutions' unrolled windows, not the parameters and the gradient bucket, set the
peak): ResNet-18's basic blocks data parallel over all ranks, the same with the classifier's
classes cut (``semi_auto_parallel``, :func:`simpar.nn.resnet.shard_classifier` 2 x n/2, the
batch cut 2 ways: every convolution and BatchNorm on 8 images, each BatchNorm's statistics
AllReduced over 2 ranks), and ResNet-50's bottlenecks data parallel. For each, the
prediction is ``program.cost(profile, optimizer)`` (pure; the ``cpu-local`` profile that
``python -m simpar.calibrate`` wrote) and the measurement is:

* step time: the median over ``--steps`` timed steps (after two untimed ones) of the slowest
  rank's time for one ``TrainOneStepCell`` call, each step started after a barrier, its batch
  made before it;
* memory: each rank's peak of traced numpy allocations (tracemalloc) over one more step,
  plus the bytes of its parameters and optimizer state that exist before the step, the same
  parts the model counts.

Reported: both per strategy, Spearman's rho between predicted and measured step time, the
median |predicted / measured - 1|, and how many strategies' memory is within 15%, over every
row (the ResNet rows included, to the same targets). Targets
(issue 13): rho >= 0.9, median error <= 25%, memory within 15%.
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar.comm as comm

import numpy as np
from _common import host_line, markdown_table, today, write_section

import simpar
from simpar import nn, viz
from simpar.cost import load_profile
from simpar.dataset import CharCorpus, random_classification, random_images
from simpar.nn import presets
from simpar.nn.resnet import shard_classifier
from simpar.pipeline import price_pipeline
from simpar.runtime import watching_memory
from simpar.train_pipeline import assign_stages, pipeline_config

SCRIPT = "python benchmarks/cost_fidelity.py"
GPT = {"vocab_size": 128, "seq_length": 32, "d_model": 64, "n_layers": 2, "n_heads": 8}
GPT_BATCH = 8
MLP_SIZES, MLP_BATCH = (256, 1024, 256), 64
# The main job's --model resnet (one block per stage, stem width 8, 8 classes), on images
# twice its default side, so that activations count.
RESNET = {"num_classes": 8, "width": 8, "layer_nums": (1, 1, 1, 1)}
RESNET_BATCH, RESNET_IMAGE = 16, 32


@dataclass(frozen=True)
class Strategy:
    """One row: how to build the cell, its mode and dataset strategy, and its optimizer."""

    name: str
    model: str                      # "gpt", "mlp" or "resnet"
    mode: str
    dataset: Any
    annotate: Callable[[Any, Any, int], None]
    optimizer: str
    level: str | None = None        # optimizer parallel (threshold 0), or off
    micro: int = 1                  # micro-batches (GradAccumulation, or PipelineCell)
    recompute: bool = False         # every GPT block (MLP layer but the last) recomputed
    stages: int = 1                 # pipeline stages (the main job's cut of the units)
    schedule: str = "1f1b"          # --pipeline-schedule's choices
    depth: int = 18                 # the ResNet's structure: 18 (basic blocks) or 50
    search: str | None = None       # auto_parallel's search_mode (None: the context default)


def _none(model: Any, loss: Any, n: int) -> None:
    pass


def _megatron(dp: int, mp: int) -> Callable[[Any, Any, int], None]:
    def apply(model: Any, loss: Any, n: int) -> None:
        if isinstance(model, nn.GPT):
            presets.megatron_gpt(model, dp, mp, loss)
        else:
            presets.megatron_mlp(model, dp, mp)
    return apply


def _split_k(model: Any, loss: Any, n: int) -> None:
    for layer in model.layers:        # every MatMul cuts its reduction dim over all ranks
        layer.matmul.shard(((1, n), (1, n)))


def _replicated(model: Any, loss: Any, n: int) -> None:
    for layer in model.layers:        # every op computes the whole batch on every rank
        layer.matmul.shard(((1, 1), (1, 1)))
        layer.bias_add.shard(((1, 1), (1,)))


def _redistributing(model: Any, loss: Any, n: int) -> None:
    presets.redistributing_mlp(model, n)


def _vocab_parallel(model: Any, loss: Any, n: int) -> None:
    """Only the vocabulary is split (embedding, LM head, cross entropy); the blocks follow."""
    model.embedding.gather.shard(((n, 1), (1, 1)))
    presets.column_parallel(model.head, 1, n)
    loss.ce.shard(((1, n), (1,)))


def _gpt_mix(model: Any, loss: Any, n: int) -> None:
    presets.mixed_gpt(model, loss, n)  # every block boundary changes the layout


def _classifier(dp: int, mp: int) -> Callable[[Any, Any, int], None]:
    def apply(model: Any, loss: Any, n: int) -> None:
        shard_classifier(model, dp, mp, loss)   # the batch over dp, the classes over mp
    return apply


def strategies(n: int) -> list[Strategy]:
    semi = "semi_auto_parallel"
    half = max(1, n // 2)
    rows: list[Strategy] = []
    for model, opt in (("mlp", "momentum"), ("gpt", "adam")):
        batch_dim = (lambda d: ((d, 1), (d,))) if model == "mlp" else (
            lambda d: ((d, 1), (d, 1)))
        rows += [
            Strategy(f"{model} data parallel", model, "data_parallel", "data_parallel",
                     _none, opt),
            Strategy(f"{model} Megatron 1x{n}", model, semi, batch_dim(1), _megatron(1, n), opt),
            Strategy(f"{model} hybrid 2x{half}", model, semi, batch_dim(2), _megatron(2, half),
                     opt),
            Strategy(f"{model} hybrid {half}x2", model, semi, batch_dim(half),
                     _megatron(half, 2), opt),
        ]
    # The memory dimensions (issue 30): each level, recomputation, micro-batches, and together.
    for model, opt in (("mlp", "momentum"), ("gpt", "adam")):
        dp = ("data_parallel", "data_parallel")
        for level in ("level1", "level2", "level3"):
            rows.append(Strategy(f"{model} dp {level}", model, *dp, _none, opt, level))
        rows += [
            Strategy(f"{model} dp recompute", model, *dp, _none, opt, recompute=True),
            Strategy(f"{model} hybrid 2x{half} 2 micro-batches", model, semi,
                     ((2, 1), (2,)) if model == "mlp" else ((2, 1), (2, 1)),
                     _megatron(2, half), opt, micro=2),
            Strategy(f"{model} hybrid 2x{half} level3 recompute 2 micro", model, semi,
                     ((2, 1), (2,)) if model == "mlp" else ((2, 1), (2, 1)),
                     _megatron(2, half), opt, "level3", 2, True),
        ]
    rows += [
        Strategy("mlp split-k", "mlp", semi, ((1, 1), (1,)), _split_k, "momentum"),
        Strategy("mlp replicated (poor)", "mlp", semi, ((1, 1), (1,)), _replicated, "momentum"),
        Strategy("mlp redistributing (poor)", "mlp", semi, ((n, 1), (n,)), _redistributing,
                 "momentum"),
        Strategy("gpt vocabulary-parallel", "gpt", semi, ((1, 1), (1, 1)), _vocab_parallel,
                 "adam"),
        Strategy("gpt mixed layouts (poor)", "gpt", semi, ((1, 1), (1, 1)), _gpt_mix, "adam"),
    ]
    # Convolutional networks: the main job's --model resnet (ResNet-18 and -50 structures).
    rows += [
        Strategy("resnet18 data parallel", "resnet", "data_parallel", "data_parallel", _none,
                 "momentum"),
        Strategy(f"resnet18 classes cut 2x{half}", "resnet", semi, ((2, 1, 1, 1), (2,)),
                 _classifier(2, half), "momentum"),
        Strategy("resnet50 data parallel", "resnet", "data_parallel", "data_parallel", _none,
                 "momentum", depth=50),
    ]
    return rows


def pipeline_strategies(n: int) -> list[Strategy]:
    """``--pipelines``'s rows (issue 31): pipeline stages, each program priced on the
    schedule's timeline (:func:`simpar.pipeline.price_pipeline`)."""
    half, quarter = max(1, n // 2), max(1, n // 4)
    dp = ("data_parallel", "data_parallel")
    return [
        Strategy(f"gpt pp2 x hybrid 2x{quarter} 4 micro 1f1b", "gpt", "semi_auto_parallel",
                 ((2, 1), (2, 1)), _megatron(2, quarter), "adam", micro=4, stages=2),
        Strategy(f"gpt pp4 x dp{quarter} 4 micro gpipe", "gpt", *dp, _none, "adam", micro=4,
                 stages=4, schedule="gpipe"),
        Strategy(f"gpt pp2 x dp{half} 2 micro interleaved", "gpt", *dp, _none, "adam",
                 micro=2, stages=2, schedule="interleaved"),
        Strategy(f"mlp pp2 x dp{half} 4 micro 1f1b", "mlp", *dp, _none, "momentum", micro=4,
                 stages=2),
    ]


def _batch(model: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    if model == "mlp":
        return random_classification(step, MLP_BATCH, MLP_SIZES[0], MLP_SIZES[2], 0,
                                     np.dtype(np.float32))
    if model == "resnet":
        return random_images(step, RESNET_BATCH, 3, RESNET_IMAGE, RESNET["num_classes"], 0,
                             np.dtype(np.float32))
    return CharCorpus(seed=0).batch(step, GPT_BATCH, GPT["seq_length"])


def _build(s: Strategy, n: int, context: bool = True) -> nn.TrainOneStepCell:
    """``s``'s training cell on ``n`` ranks. ``context=False`` leaves the auto-parallel
    context alone (a single-device check's reference, built on rank 0 only)."""
    if s.model == "mlp":
        net: nn.Cell = nn.MLP(*MLP_SIZES, n_hidden=1, dtype=np.dtype(np.float32))
    elif s.model == "resnet":
        net = nn.resnet(s.depth, dtype=np.dtype(np.float32), **RESNET)
    else:
        net = nn.GPT(**GPT, dtype=np.dtype(np.float64))
    loss = nn.SoftmaxCrossEntropyWithLogits()
    s.annotate(net, loss, n)
    if context:
        simpar.reset_auto_parallel_context()
        simpar.set_auto_parallel_context(parallel_mode=s.mode, gradients_mean=True,
                                         dataset_strategy=s.dataset, enable_alltoall=True)
    if context and s.search is not None:
        simpar.set_auto_parallel_context(search_mode=s.search)
    if context and s.level is not None:
        simpar.set_auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config={
            "optimizer_level": s.level, "parallel_optimizer_threshold": 0})
    if s.recompute:
        for part in (net.blocks if isinstance(net, nn.GPT) else net.layers[:-1]):
            part.recompute()
    if s.stages > 1:
        assign_stages(net, s.stages, 2 if s.schedule == "interleaved" else 1)
        simpar.set_auto_parallel_context(pipeline_stages=s.stages,
                                         pipeline_config=pipeline_config(s.schedule))
    cell: nn.Cell = nn.WithLossCell(net, loss)
    params = cell.trainable_params()
    if s.stages > 1:
        cell = nn.PipelineCell(cell, s.micro)
    elif s.micro > 1:
        cell = nn.GradAccumulation(cell, s.micro)
    opt: nn.Optimizer = (nn.Adam(params, 1e-3) if s.optimizer == "adam"
                         else nn.Momentum(params, 0.01, 0.9))
    return nn.TrainOneStepCell(cell, opt, parallel_mode=s.mode, seed=0)


def _slowest(seconds: float) -> float:
    return float(comm.all_reduce(np.array([seconds]), op="max")[0])


def measure(s: Strategy, n: int, steps: int,
            warmup: Callable[[nn.TrainOneStepCell, list[Any]], None] | None = None
            ) -> tuple[float, float, list[int], Any]:
    """(median slowest-rank step seconds, predicted seconds, per-rank measured peak bytes,
    the cost report). ``warmup(train, batches)``, if given, runs the two untimed steps on
    these two batches instead (e.g. the single-device check, and more untimed steps)."""
    train = _build(s, n)
    if warmup is not None:
        warmup(train, [_batch(s.model, k) for k in range(2)])
    for k in range(2 if warmup is None else 0):
        train(*_batch(s.model, k))
    times = []
    for k in range(steps):
        batch = _batch(s.model, 2 + k)   # made before the clock starts: not the step's time
        comm.barrier()
        start = time.perf_counter()
        train(*batch)
        times.append(_slowest(time.perf_counter() - start))
    assert train.program is not None
    report: Any = train.program.cost(PROFILE, s.optimizer)
    if train.pipeline is not None:   # the stages on their timeline; each rank its stage's
        runner = train.pipeline
        cost = price_pipeline(runner.stages, runner.programs, runner.count,
                              train.pipeline_scheduler, runner.micro_batches, PROFILE,
                              s.optimizer)
        report = _Priced(cost.step_seconds, tuple(
            _Peak(r, cost.stages[r // runner.per_stage].peak_memory) for r in range(n)))
    before = sum(a.nbytes for a in train.params.values()) + sum(
        a.nbytes for slots in train.optimizer.state.values() for a in slots.values())
    batch = _batch(s.model, 2 + steps)  # the user's global batch: not the program's memory
    with watching_memory():   # the executor writes its watched step once: not a step's memory
        train(*_batch(s.model, 1))
    tracemalloc.start()
    tracemalloc.reset_peak()
    with watching_memory() as watch:
        train(*batch)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peaks = comm.all_gather(np.array([before + peak], dtype=np.int64)).reshape(-1)
    held = comm.all_gather(np.array([watch.peak], dtype=np.int64)).reshape(-1)
    HELD[s.name] = [int(h) for h in held]
    simpar.reset_auto_parallel_context()
    return float(np.median(times)), report.step_seconds, [int(p) for p in peaks], report


@dataclass(frozen=True)
class _Peak:
    rank: int
    peak: int


@dataclass(frozen=True)
class _Priced:
    """A pipelined step's prediction in the shape of a CostReport's two fields read here."""

    step_seconds: float
    memory: tuple[_Peak, ...]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x: list[float]) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        values = np.asarray(x)
        for v in np.unique(values):
            tie = values == v
            r[tie] = r[tie].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


PROFILE: Any = None
HELD: dict[str, list[int]] = {}  # per strategy, each rank's peak bytes the executor held
PNG = Path(__file__).resolve().parent / "cost_fidelity.png"


def _scatter(names: list[str], predicted: list[float], measured: list[float]) -> str:
    """Predicted against measured step time as a PNG (:func:`simpar.viz.fidelity_png`,
    matplotlib: the optional ``viz`` extra); the line for RESULTS.md says where it is or why
    there is none."""
    try:
        viz.fidelity_png(names, predicted, measured, PNG)
    except ImportError:
        return "(No scatter plot: matplotlib is not installed; `pip install -e .[viz]` adds it.)"
    return f"![predicted against measured step time]({PNG.name})"


def main() -> int:
    global PROFILE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="cpu-local", help="a shipped name or a JSON path")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--pipelines", action="store_true",
                        help="the pipeline rows instead (written under ### pipelines)")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="only the strategies whose name contains one of these (implies "
                             "--no-write)")
    args = parser.parse_args()
    PROFILE = load_profile(args.profile)
    n, rank = comm.get_group_size(), comm.get_rank()
    rows, predicted, measured, mem_ok = [], [], [], 0
    table_rows: list[list[str]] = []
    stage_rows: list[list[str]] = []   # --pipelines: each stage's memory
    stages_ok = 0
    if args.only:
        args.no_write = True
    for s in (pipeline_strategies(n) if args.pipelines else strategies(n)):
        if args.only and not any(text in s.name for text in args.only):
            continue
        seconds, pred, peaks, report = measure(s, n, args.steps)
        mem_pred = {m.rank: m.peak for m in report.memory}
        worst = max(range(len(peaks)), key=lambda r: peaks[r])
        pred_mem = mem_pred.get(worst, max(mem_pred.values()))
        mem_ratio = pred_mem / peaks[worst]
        mem_ok += abs(mem_ratio - 1) <= 0.15
        predicted.append(pred)
        measured.append(seconds)
        rows.append(s.name)
        table_rows.append([s.name, f"{pred * 1e3:.1f}", f"{seconds * 1e3:.1f}",
                           f"{pred / seconds:.2f}", f"{pred_mem / 2**20:.2f}",
                           f"{peaks[worst] / 2**20:.2f}", f"{mem_ratio:.2f}",
                           f"{HELD[s.name][worst] / 2**20:.2f}"])
        if s.stages > 1:   # each stage: its prediction against its fullest rank's peak
            per = n // s.stages
            for stage in range(s.stages):
                ranks = range(stage * per, (stage + 1) * per)
                got = max(peaks[r] for r in ranks)
                want = mem_pred[ranks[0]]
                stages_ok += abs(want / got - 1) <= 0.15
                stage_rows.append([s.name, str(stage), f"{want / 2**20:.2f}",
                                   f"{got / 2**20:.2f}", f"{want / got:.2f}"])
        if rank == 0:
            print(f"{s.name}: predicted {pred * 1e3:.1f} ms, measured {seconds * 1e3:.1f} ms; "
                  f"memory predicted {pred_mem / 2**20:.2f} MiB, measured "
                  f"{peaks[worst] / 2**20:.2f} MiB (rank {worst})", flush=True)
    rho = spearman(predicted, measured)
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured)]
    med = float(np.median(errors))
    if rank == 0:
        table = markdown_table(["strategy", "predicted ms", "measured ms", "ratio",
                                "predicted MiB", "measured MiB", "ratio",
                                "executor-held MiB"], table_rows)
        verdict = (f"Spearman rho {rho:.3f} (target >= 0.9); median |predicted/measured - 1| "
                   f"{med:.1%} (target <= 25%); memory within 15% for {mem_ok} of "
                   f"{len(rows)} strategies (target: all).")
        if stage_rows:
            table += "\n\nEach stage's memory: its prediction (the stage's program with the " \
                "micro-batches its schedule holds in flight) against the largest measured peak " \
                "of its ranks.\n\n" + markdown_table(
                    ["strategy", "stage", "predicted MiB", "measured MiB", "ratio"], stage_rows)
            verdict += (f" Each stage's memory within 15% for {stages_ok} of "
                        f"{len(stage_rows)} stages.")
        body = "\n\n".join([
            f"`mpirun -n {n} {SCRIPT}{' --pipelines' if args.pipelines else ''}"
            f"{'' if args.profile == 'cpu-local' else ' --profile ' + args.profile}` ({today()}; "
            f"profile {PROFILE.name}; {args.steps} "
            "timed steps per strategy, the slowest rank's median; memory: the rank with the "
            "largest measured peak, tracemalloc over one step plus the parameters and "
            "optimizer state held before it; executor-held: the peak of the arrays the "
            "executor itself holds, sampled after every op (simpar.runtime.watching_memory), "
            "which misses the temporaries inside kernels and the optimizer's, so the target "
            "is judged on tracemalloc's figure).", table, verdict, host_line()])
        print(table)
        print(verdict)
        section = "cost_fidelity_pipelines" if args.pipelines else "cost_fidelity"
        if not args.pipelines and not args.no_write:   # --no-write leaves the picture too
            body += "\n\n" + _scatter(rows, predicted, measured)
        if not args.no_write:
            write_section(section, body)
            print(f"written to benchmarks/RESULTS.md (## {section})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
