"""When each parallel mode wins: three models, each trained on every rank under seven plans.

    mpirun -n 8 python benchmarks/strategies.py              # RESULTS.md, the PNG, the page
    mpirun -n 8 python benchmarks/strategies.py --no-write   # print only
    mpirun -n 8 python benchmarks/strategies.py --only mlp   # some rows only (no writing)

The models, their batches and the measurements are cost_fidelity's (its ``_build``,
``_batch`` and ``measure``): the main job's GPT (float64, Adam), the Megatron MLP (float32,
Momentum) and the small ResNet-18 (float32, Momentum, 32 x 32 images). Each trains under

* pure data parallel (``parallel_mode="data_parallel"``);
* tensor parallel over all n ranks (``semi_auto_parallel``, Megatron 1 x n; for the ResNet
  the classifier's classes cut n ways, :func:`simpar.nn.resnet.shard_classifier` 1 x n);
* the hybrid 2 x n/2 (the same with the batch cut 2 ways);
* the plan of each ``auto_parallel`` search (dynamic_programming, recursive_programming,
  sharding_propagation; dataset_strategy "data_parallel"; each search minimises simpar's
  cost model on the profile, for the model's optimizer, as the main job's does);
* a naive plan: everything replicated (``semi_auto_parallel`` with no ``.shard()`` and the
  batch whole: propagation keeps every op whole, so every rank computes the whole step).

Per row: the step time (the slowest rank's median over ``--steps`` timed steps), the bytes
moved per rank per step (:class:`simpar.comm.CommTrace` over one untimed step: the largest
bytes_sent + bytes_recv over the ranks), the measured peak memory per rank (the rank with the
largest: tracemalloc over one step plus the parameters and optimizer state held before it),
the prediction of both (``program.cost(profile, optimizer)``), and the single-device check
(:func:`simpar.check.check_against_single_device`) over the two untimed steps that start every
row, against the same model built stand-alone. It writes ``## strategies`` in RESULTS.md,
``benchmarks/strategies.png`` and ``docs/strategies.md``, a page generated from the table:
every sentence in it is computed from the measured figures, so it is never edited by hand.
"""

# ruff: noqa: E402, I001  (simpar first: simpar/_env.py must run before numpy's BLAS and MPI)
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simpar.comm as comm

import numpy as np
import cost_fidelity
from _common import host_line, markdown_table, today, write_section
from cost_fidelity import (GPT, GPT_BATCH, MLP_BATCH, MLP_SIZES, RESNET, RESNET_BATCH,
                           RESNET_IMAGE, Strategy, _batch, _build, _classifier, _megatron, _none,
                           measure)

from simpar import viz
from simpar.check import check_against_single_device
from simpar.cost import SimparCostModel, load_profile
from simpar.cost_model_context import set_search_cost_model
from simpar.runtime import NothingParallelWarning

SCRIPT = "python benchmarks/strategies.py"
HERE = Path(__file__).resolve().parent
PNG = HERE / "strategies.png"
PAGE = HERE.parent / "docs" / "strategies.md"
SEARCHES = ("dynamic_programming", "recursive_programming", "sharding_propagation")
MODELS = {"gpt": ("GPT", "adam"), "mlp": ("MLP", "momentum"), "resnet": ("ResNet-18", "momentum")}
NAIVE = "replicated (naive)"
MIB = 2.0 ** 20
SAME = 1.05   # bytes within 5% of each other count as the same amount moved


def _cut(model: str, d: int) -> Any:
    """The dataset strategy that cuts the batch ``d`` ways (data and label)."""
    return {"resnet": ((d, 1, 1, 1), (d,)), "mlp": ((d, 1), (d,))}.get(model, ((d, 1), (d, 1)))


def plans(n: int) -> list[tuple[str, Strategy]]:
    """(mode, strategy) for every row: per model, the seven plans of the module docstring."""
    semi, half = "semi_auto_parallel", max(1, n // 2)
    rows: list[tuple[str, Strategy]] = []
    for model, (_, opt) in MODELS.items():
        if model == "resnet":
            tensor, hybrid = _classifier(1, n), _classifier(2, half)
        else:
            tensor, hybrid = _megatron(1, n), _megatron(2, half)
        rows += [
            ("data parallel", Strategy(f"{model} data parallel", model, "data_parallel",
                                       "data_parallel", _none, opt)),
            (f"tensor parallel 1x{n}", Strategy(f"{model} tensor parallel 1x{n}", model, semi,
                                                _cut(model, 1), tensor, opt)),
            (f"hybrid 2x{half}", Strategy(f"{model} hybrid 2x{half}", model, semi,
                                          _cut(model, 2), hybrid, opt)),
        ]
        rows += [(f"auto: {search}", Strategy(f"{model} auto {search}", model, "auto_parallel",
                                              "data_parallel", _none, opt, search=search))
                 for search in SEARCHES]
        rows.append((NAIVE, Strategy(f"{model} replicated", model, semi, _cut(model, 1),
                                     _none, opt)))
    return rows


@dataclass
class Row:
    """One model under one plan: what was measured and what was predicted."""

    model: str
    mode: str
    ms: float                 # measured step: the slowest rank's median
    pred_ms: float
    pred_compute_ms: float    # the prediction's compute part
    pred_comm_ms: float       # its op communication + redistribution + gradient sync
    moved: int                # bytes sent + received per step, the most of any rank
    calls: int                # collectives per step, the most of any rank
    comm_ms: float            # time inside them in that step, the median rank's
    outside_ms: float         # the rest of that step, the median rank's
    peak: int                 # measured peak bytes, the rank with the largest
    pred_peak: int            # predicted peak of that rank
    pred_state: int           # of it: parameters + gradients + optimizer state
    pred_activations: int     # of it: activations
    grad_bytes: int           # the trainable parameters' (= the gradients') global bytes
    whole_ops: int            # ops every rank computes whole (repeat n)
    ops: int
    strategies: dict[str, Any]
    verdict: str
    summary: str


def run(mode: str, s: Strategy, n: int, steps: int) -> Row:
    """Train ``s`` (collective): the check and the traced step first, then cost_fidelity's
    timed steps and memory step."""
    got: dict[str, Any] = {}

    def warmup(train: Any, batches: list[Any]) -> None:
        reference = replace(s, mode="stand_alone", dataset=None, annotate=_none, search=None)
        got["check"] = check_against_single_device(
            train, lambda: _build(reference, 1, context=False), batches)
        batch = _batch(s.model, 2)
        comm.barrier()
        with comm.CommTrace() as trace:
            start = time.perf_counter()
            train(*batch)
            seconds = time.perf_counter() - start
        mine = np.array([[trace.bytes_sent() + trace.bytes_recv(), trace.count(),
                          trace.seconds(), seconds - trace.seconds()]])
        every = comm.all_gather(mine, axis=0)
        got["comm"] = (int(every[:, 0].max()), int(every[:, 1].max()),
                       float(np.median(every[:, 2])) * 1e3, float(np.median(every[:, 3])) * 1e3)
        program = train.program
        got["strategies"] = program.strategies()
        got["whole"] = sum(st.repeat == n for st in program.steps), len(program.steps)
        got["grad_bytes"] = sum(
            int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
            for v in program.param_values.values()
            if v.param is not None and v.param.requires_grad)

    if s.mode == "auto_parallel":   # as the main job: simpar's model, for this optimizer
        set_search_cost_model(SimparCostModel(cost_fidelity.PROFILE, s.optimizer))
    try:
        with warnings.catch_warnings():   # the naive plan is meant to parallelise nothing
            warnings.simplefilter("ignore", NothingParallelWarning)
            seconds, predicted, peaks, report = measure(s, n, steps, warmup)
    finally:
        set_search_cost_model(None)
    worst = max(range(len(peaks)), key=lambda r: peaks[r])
    memory = {m.rank: m for m in report.memory}
    row = memory.get(worst, max(report.memory, key=lambda m: m.peak))
    check = got["check"]
    return Row(s.model, mode, seconds * 1e3, predicted * 1e3, report.compute * 1e3,
               (report.op_comm + report.redistribution + report.grad_sync) * 1e3,
               *got["comm"], peaks[worst], row.peak,
               row.parameters + row.gradients + row.optimizer, row.activations,
               got["grad_bytes"], *got["whole"], got["strategies"], check.verdict,
               check.summary())


# ------------------------------------------------------------------ what the rows say

def _mib(b: float) -> str:
    return f"{b / MIB:.2f} MiB" if b >= MIB / 100 or b == 0 else f"{b / 1024:.1f} KiB"


def _ms(x: float) -> str:
    return f"{x:.1f} ms"


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def table(rows: list[Row]) -> str:
    return markdown_table(
        ["model", "mode", "measured ms", "predicted ms", "predicted compute + comm ms",
         "moved MiB/rank/step", "collectives/step", "ms in / outside collectives",
         "measured peak MiB",
         "predicted peak MiB", "check"],
        [[MODELS[r.model][0], r.mode, f"{r.ms:.1f}", f"{r.pred_ms:.1f}",
          f"{r.pred_compute_ms:.1f} + {r.pred_comm_ms:.1f}", f"{r.moved / MIB:.3f}",
          str(r.calls), f"{r.comm_ms:.1f} / {r.outside_ms:.1f}", f"{r.peak / MIB:.2f}",
          f"{r.pred_peak / MIB:.2f}",
          r.verdict] for r in rows])


def describe(model: str, n: int) -> str:
    """The model, its batch and its 'hidden size' as this page uses them."""
    if model == "gpt":
        return (f"vocabulary {GPT['vocab_size']}, d_model {GPT['d_model']}, {GPT['n_layers']} "
                f"layers, {GPT['n_heads']} heads; batch {GPT_BATCH} x {GPT['seq_length']} "
                "tokens; float64, Adam")
    if model == "mlp":
        return (f"{' -> '.join(map(str, MLP_SIZES))}; batch {MLP_BATCH}; float32, Momentum")
    return (f"one basic block per stage, stem width {RESNET['width']}, "
            f"{RESNET['num_classes']} classes; batch {RESNET_BATCH} images of 3 x "
            f"{RESNET_IMAGE} x {RESNET_IMAGE}; float32, Momentum")


def activation(model: str) -> tuple[int, str]:
    """(bytes, how) of one activation of batch x hidden at the tensor-parallel cut: what a
    Megatron layer AllReduces (GPT, MLP) or the logits of the ResNet's cut classifier."""
    if model == "gpt":
        rows, width, size = GPT_BATCH * GPT["seq_length"], GPT["d_model"], 8
        return rows * width * size, f"{rows} tokens x d_model {width} x 8 B"
    if model == "mlp":
        rows, width = MLP_BATCH, MLP_SIZES[-1]
        return rows * width * 4, f"batch {rows} x width {width} x 4 B"
    rows, width = RESNET_BATCH, RESNET["num_classes"]
    return rows * width * 4, f"batch {rows} x {width} classes x 4 B (the logits)"


def _groups(rows: list[Row]) -> list[list[Row]]:
    """The rows grouped by plan: rows whose every op has the same strategy are one plan."""
    out: list[list[Row]] = []
    for r in rows:
        for g in out:
            if g[0].strategies == r.strategies:
                g.append(r)
                break
        else:
            out.append([r])
    return out


def _calls(k: int) -> str:
    return f"{k} collective{'' if k == 1 else 's'}"


def _traffic(r: Row) -> str:
    if r.calls == 0:
        return "no collective at all"
    return (f"{_mib(r.moved)} in {_calls(r.calls)} ({_ms(r.comm_ms)} spent in "
            f"{'it' if r.calls == 1 else 'them'})")


def _best(g: list[Row]) -> Row:
    """A plan's row: the fastest of the rows that ran it."""
    return min(g, key=lambda r: r.ms)


def _label(g: list[Row]) -> str:
    """A plan's name: its hand-written mode if one ran it, else its search's."""
    hand = [r.mode for r in g if not r.mode.startswith("auto: ")]
    return hand[0] if hand else _best(g).mode


def spread(rows: list[Row]) -> float | None:
    """The largest relative difference between rows that ran the same plan (the run's own
    noise), or None when no two rows did."""
    by_model: dict[str, list[Row]] = {}
    for r in rows:
        by_model.setdefault(r.model, []).append(r)
    gaps = [max(r.ms for r in g) / min(r.ms for r in g) - 1
            for model_rows in by_model.values() for g in _groups(model_rows) if len(g) > 1]
    return max(gaps, default=None)


def verdict_for(rows: list[Row], noise: float | None = None) -> str:
    """Which mode is fastest for one model's rows, and why, from the measured figures: a
    slower plan loses on communication when its extra time inside collectives is at least its
    extra time outside them, else on compute (everything outside the collectives)."""
    groups = _groups(rows)
    best, label = _best, _label
    groups.sort(key=lambda g: best(g).ms)
    mine, slowest = groups[0], groups[-1]
    fast, slow = best(mine), best(slowest)
    text = f"Fastest: **{label(mine)}** at {_ms(fast.ms)}"
    if len(mine) > 1:
        text += (" (" + _join([f"{r.mode} {_ms(r.ms)}" for r in mine]) + ": the same "
                 "strategies, op for op)")
    text += (f"; the slowest, {label(slowest)}, takes {slow.ms / fast.ms:.1f}x as long "
             f"({_ms(slow.ms)}). ")
    if len(groups) > 1:
        second = best(groups[1])
        gap = second.ms / fast.ms - 1
        text += (f"The next plan, {label(groups[1])}, took {_ms(second.ms)} ({gap:.0%} more"
                 + (f", within the {noise:.0%} by which rows running one same plan differed "
                    "in this run: too close to call here" if noise is not None and gap <= noise
                    else "") + "). ")
    text += (f"Per rank and step: {_traffic(fast)}"
             + (", every op whole on every rank" if fast.whole_ops == fast.ops else "")
             + f", and {_ms(fast.outside_ms)} outside collectives. ")
    others = [(label(g), best(g)) for g in groups[1:]]
    comm_bound = [(name, r) for name, r in others
                  if r.comm_ms - fast.comm_ms >= r.outside_ms - fast.outside_ms]
    compute_bound = [(name, r) for name, r in others if (name, r) not in comm_bound]
    if comm_bound:
        text += "Communication decides against " + _join(
            [f"{name} ({_ms(r.ms)}: {_traffic(r)})" for name, r in comm_bound]) + ". "
    if compute_bound:
        parts = []
        for name, r in compute_bound:
            priced = (f"; the cost model prices its compute at {_ms(r.pred_compute_ms)} "
                      f"against {_ms(fast.pred_compute_ms)}"
                      if r.pred_compute_ms > fast.pred_compute_ms * 1.1 else "")
            parts.append(f"{name} ({_ms(r.ms)}: {_ms(r.outside_ms)} outside collectives, "
                         f"{_traffic(r)}{priced})")
        text += "Compute, all that runs outside the collectives, decides against " + _join(
            parts) + ". "
    predicted = min(rows, key=lambda r: r.pred_ms)
    predicted_label = label(next(g for g in groups if predicted in g))
    text += (f"The cost model predicts {predicted_label} fastest ({_ms(predicted.pred_ms)}; "
             f"measured {_ms(predicted.ms)}"
             + (", the measured winner's plan" if predicted.strategies == fast.strategies
                else "") + "). ")
    searched = [r for r in rows if r.mode.startswith("auto: ")]
    hand = [r for r in rows if not r.mode.startswith("auto: ")]
    picks = []
    for r in searched:
        same = [h.mode for h in hand if h.strategies == r.strategies]
        picks.append(f"{r.mode.removeprefix('auto: ')} "
                     + (f"chose {same[0]}" if same else
                        f"chose a plan of its own, {r.ops - r.whole_ops} of {r.ops} ops cut")
                     + f" ({_ms(r.ms)})")
    return text + "The searches: " + "; ".join(picks) + "."


def intuition(by_model: dict[str, list[Row]], n: int) -> list[str]:
    """The batch-against-hidden-size paragraphs, with each model's figures."""
    tp_mode = f"tensor parallel 1x{n}"
    lines = [
        "Data parallel moves the gradients, once per step: an AllReduce of every "
        "parameter's gradient, so its bytes grow with the parameters (counted here as sent + "
        f"received: about 4 (n-1)/n = {4 * (n - 1) / n:.2f} x the gradients' bytes). Tensor "
        "parallel moves activations instead, in every layer, forward and backward: its bytes "
        "grow with the batch times the hidden size, and not with the parameters. Which is "
        "smaller decides which mode communicates less:",
        ""]
    ratios = []
    for model, rows in by_model.items():
        by_mode = {r.mode: r for r in rows}
        dp, tp = by_mode.get("data parallel"), by_mode.get(tp_mode)
        if dp is None or tp is None:
            continue
        act, how = activation(model)
        fewer = "tensor parallel" if tp.moved < dp.moved else "data parallel"
        faster = "tensor parallel" if tp.ms < dp.ms else "data parallel"
        ratios.append((dp.grad_bytes / act, MODELS[model][0], fewer))
        lines.append(
            f"* **{MODELS[model][0]}**: gradients {_mib(dp.grad_bytes)}; data parallel moved "
            f"{_mib(dp.moved)} per rank per step ({dp.moved / dp.grad_bytes:.2f}x the "
            f"gradients, in {_calls(dp.calls)}). One batch x hidden activation is {how} "
            f"= {_mib(act)}; tensor "
            f"parallel moved {_mib(tp.moved)} ({tp.moved / act:.1f} such activations, in "
            f"{_calls(tp.calls)}). "
            f"Gradients / activation = {dp.grad_bytes / act:.1f}: {fewer} moved fewer bytes "
            f"({_mib(min(dp.moved, tp.moved))} against {_mib(max(dp.moved, tp.moved))}), "
            f"and {faster} was faster ({_ms(min(dp.ms, tp.ms))} against "
            f"{_ms(max(dp.ms, tp.ms))}).")
    if ratios:
        ratios.sort()
        lines += ["", "Ordered by gradients per batch x hidden activation: " + "; ".join(
            f"{name} {ratio:.1f} ({fewer} moved less)" for ratio, name, fewer in ratios)
            + ". A bigger batch (or sequence) moves the balance toward data parallel; more "
            "parameters per unit of batch x hidden (wide layers, small batches) toward tensor "
            "parallel. Bytes are not the whole step: every collective also pays a latency, so many "
            "small ones cost more than their bytes say, "
            "and a plan that moves fewer bytes can still lose on compute when it leaves ops "
            "whole on every rank (which mode wins, above)."]
    return lines


def memory_lines(by_model: dict[str, list[Row]], capacity: int, profile: str) -> list[str]:
    lines = []
    for model, rows in by_model.items():
        low, high = min(rows, key=lambda r: r.peak), max(rows, key=lambda r: r.peak)
        winner = min(_groups(rows), key=lambda g: _best(g).ms)
        fast, fast_name = _best(winner), _label(winner)
        each = "; ".join(f"{r.mode} {r.peak / MIB:.2f}" for r in sorted(rows, key=lambda r: r.peak))
        split = "; ".join(
            f"{r.mode}: {_mib(r.pred_state)} parameters, gradients and optimizer state, "
            f"{_mib(r.pred_activations)} activations"
            for r in (low, high))
        lines.append(
            f"* **{MODELS[model][0]}** (measured MiB per rank, ascending): {each}. Lowest: "
            f"{low.mode}, {high.peak / low.peak:.1f}x less than {high.mode}; the fastest, "
            f"{fast_name}, peaks at {fast.peak / MIB:.2f} MiB, "
            + ("the lowest. " if fast.peak <= low.peak * SAME else
               f"{fast.peak / low.peak:.1f}x the lowest. ")
            + f"The cost model's split of the lowest and the highest: {split}.")
    top = max((r for rows in by_model.values() for r in rows), key=lambda r: r.peak)
    lines += ["", f"The largest peak of every row is {_mib(top.peak)} ({MODELS[top.model][0]}, "
              f"{top.mode}), {capacity / top.peak:.0f}x under the {profile} profile's "
              f"{capacity / 2**30:.2f} GiB per rank: memory limits none of these plans at "
              "these sizes, so it decides no winner here; it would for a model whose "
              "replicated parameters and optimizer state do not fit one device, where only "
              "the plans that cut them run at all."]
    return lines


def page(rows: list[Row], n: int, steps: int, date: str, host: str, profile: str,
         capacity: int) -> str:
    """docs/strategies.md: every sentence computed from ``rows``."""
    by_model: dict[str, list[Row]] = {}
    for r in rows:
        by_model.setdefault(r.model, []).append(r)
    command = f"mpirun -n {n} {SCRIPT}"
    bad = [r for r in rows if r.verdict != "PASS"]
    cores = len(os.sched_getaffinity(0))
    naive_rows = [r for r in rows if r.mode == NAIVE]
    naive = ("every op whole on every rank, " + _join(
        [f"{r.whole_ops} of {r.ops} for the {MODELS[r.model][0]}" for r in naive_rows])
        if naive_rows else "not run")
    crowded = (f" With {cores} cores for {n} ranks, every time is several times what {n} "
               "devices of their own would take, and every collective is a point where all "
               "its ranks must be scheduled at once: the comparisons between plans are what "
               "this page reads." if cores < n else "")
    out = [
        "# When each parallel mode wins",
        "",
        f"*Generated by `{command}` ({date}); never edited by hand: run the command again to "
        "refresh it. Every figure and sentence below is computed from that run's "
        "measurements.*",
        "",
        f"Three models trained on {n} ranks (the same models as the "
        "[cost model's fidelity benchmark](calibration.md#fidelity)):",
        "",
        *[f"* **{MODELS[m][0]}**: {describe(m, n)};" for m in by_model],
        "",
        f"each under pure data parallel, tensor parallel over all {n} ranks (Megatron; for the "
        f"ResNet, the classifier's classes cut {n} ways and every convolution whole on every "
        f"rank), the hybrid 2x{max(1, n // 2)}, the plan each `auto_parallel` search picks "
        "(dataset_strategy \"data_parallel\", simpar's cost model), and a naive plan that "
        "replicates everything: " + naive + ".",
        "",
        "## The measurements",
        "",
        f"Measured: the slowest rank's median step over {steps} timed steps; bytes moved: the "
        "most any rank sent + received in one more, traced step (CommTrace), in how many "
        "collectives, and the median rank's time inside them and outside them in that step "
        "(a collective's time includes waiting for its group's slowest rank; the rest is "
        "compute and the executor's own work); a slower plan loses on communication when its "
        "extra time in collectives is at least its extra time outside them, else on compute. "
        "Peak memory: the rank with the largest "
        "(tracemalloc plus the parameters and optimizer state held). Predicted: "
        f"`program.cost(\"{profile}\", optimizer)`. Check: the single-device check over two "
        f"steps. {host[0].upper()}{host[1:]}.{crowded}",
        "",
        table(rows),
        "",
        "![measured step time per model and mode](../benchmarks/strategies.png)",
        "",
        "## Which mode wins",
        "",
    ]
    noise = spread(rows)
    if noise is not None:
        out += [f"Rows that ran the same strategies, op for op, measured up to {noise:.0%} "
                "apart: that is this run's noise, and a smaller gap decides nothing. A plan "
                "that several rows ran is named by its hand-written mode and timed by its "
                "fastest row.", ""]
    for model, model_rows in by_model.items():
        out += [f"**{MODELS[model][0]}.** {verdict_for(model_rows, noise)}", ""]
    out += ["## Batch against hidden size", "", *intuition(by_model, n), "",
            "## Memory per rank", "", *memory_lines(by_model, capacity, profile), "",
            "## The single-device check", ""]
    if not bad:
        out.append(f"Every row passes: all {len(rows)} plans train, over two steps, like one "
                   "device (losses, every rank's parameter shards, and the gradients at "
                   "identical parameters, within the check's tolerances).")
    else:
        out.append(f"{len(rows) - len(bad)} of {len(rows)} rows pass. The others:")
        out.append("")
        out += [f"* {MODELS[r.model][0]}, {r.mode}: {r.verdict}: "
                + r.summary.replace("\n", " ") for r in bad]
    return "\n".join(out).rstrip() + "\n"


def _png(rows: list[Row]) -> str:
    groups: dict[str, dict[str, float]] = {}
    for r in rows:
        groups.setdefault(MODELS[r.model][0], {})[r.mode] = r.ms
    try:
        viz.bars_png(groups, PNG, "measured step (ms)")
    except ImportError:
        return "(No bar chart: matplotlib is not installed; `pip install -e .[viz]` adds it.)"
    return f"![measured step time per model and mode]({PNG.name})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="cpu-local", help="a shipped name or a JSON path")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="only the rows whose name contains one of these (implies "
                             "--no-write)")
    args = parser.parse_args()
    cost_fidelity.PROFILE = load_profile(args.profile)
    n, rank = comm.get_group_size(), comm.get_rank()
    host = host_line()   # the load before this run
    rows: list[Row] = []
    for mode, s in plans(n):
        if args.only and not any(text in s.name for text in args.only):
            continue
        row = run(mode, s, n, args.steps)
        rows.append(row)
        if rank == 0:
            print(f"{s.name}: {row.ms:.1f} ms (predicted {row.pred_ms:.1f}), moved "
                  f"{_mib(row.moved)}, peak {row.peak / MIB:.2f} MiB (predicted "
                  f"{row.pred_peak / MIB:.2f}), {row.whole_ops}/{row.ops} ops whole on every "
                  f"rank; {row.summary.splitlines()[0]}", flush=True)
            if row.verdict != "PASS":
                print(row.summary, flush=True)
    if rank != 0:
        return 0
    command = f"mpirun -n {n} {SCRIPT}"
    body = "\n\n".join([
        f"`{command}` ({today()}; profile {cost_fidelity.PROFILE.name}; {args.steps} timed "
        "steps per row, the slowest rank's median; moved: CommTrace over one more step, the "
        "most any rank sent + received, in how many collectives, and the median rank's time "
        "inside them (waiting included) and outside them; memory: the rank with the largest "
        "measured peak, tracemalloc over one step plus the parameters and optimizer state held "
        "before it, "
        "next to the model's figure for that rank; check: the single-device check over two "
        "steps). What the figures say: [when each mode wins](../docs/strategies.md).",
        table(rows), host])
    print(table(rows))
    if args.only or args.no_write:
        return 0
    body += "\n\n" + _png(rows)
    write_section("strategies", body)
    PAGE.write_text(page(rows, n, args.steps, today(), host, cost_fidelity.PROFILE.name,
                         cost_fidelity.PROFILE.memory_capacity))
    print(f"written to benchmarks/RESULTS.md (## strategies), {PNG.name} and "
          f"docs/{PAGE.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
