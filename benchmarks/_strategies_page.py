"""The words of benchmarks/strategies.py: its rows, the store that keeps them per device count
(``benchmarks/strategies.json``, plain JSON), and the tables and the page (docs/strategies.md)
computed from them. No MPI here: the page is rebuilt from the store alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from _common import markdown_table
from cost_fidelity import GPT, GPT_BATCH, MLP_BATCH, MLP_SIZES, RESNET, RESNET_BATCH, RESNET_IMAGE

SCRIPT = "python benchmarks/strategies.py"
HERE = Path(__file__).resolve().parent
PNG = HERE / "strategies.png"
SCALING_PNG = HERE / "strategies-devices.png"
RUNS = HERE / "strategies.json"
PAGE = HERE.parent / "docs" / "strategies.md"
MODELS = {"gpt": ("GPT", "adam"), "mlp": ("MLP", "momentum"), "resnet": ("ResNet-18", "momentum")}
NAIVE = "replicated (naive)"
ONE = "one device"
MIB = 2.0 ** 20
SAME = 1.05   # bytes within 5% of each other count as the same amount moved



@dataclass
class Row:
    """One model under one plan: what was measured and what was predicted."""

    model: str
    mode: str
    ms: float                 # measured step: the slowest rank's median
    pred_ms: float            # on the run's profile (the sweep's: calibrated at this count)
    fixed_ms: float           # on the shipped cpu-local profile: one device speed at every count
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
    strategies: str           # plan_digest of {op name: strategy}: equal for equal plans
    verdict: str
    summary: str


@dataclass
class Run:
    """One device count's rows and how they were measured."""

    n: int
    date: str
    host: str
    steps: int
    profile: str
    capacity: int             # the profile's memory per rank, bytes
    calibration: str          # how the profile was measured (its sources' first line)
    rows: list[Row]


def plan_digest(strategies: dict[str, Any]) -> str:
    """A short fingerprint of a plan's {op name: strategy}: two rows ran the same plan when
    theirs are equal."""
    text = json.dumps(strategies, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_run(entry: Run, path: Path = RUNS) -> None:
    """Put ``entry`` in ``path`` under its device count (replacing that count's rows, keeping
    the others'), atomically: a crash never leaves half a file."""
    runs = load_runs(path)
    runs[entry.n] = entry
    text = json.dumps({"runs": {str(n): asdict(r) for n, r in sorted(runs.items())}},
                      indent=1, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def load_runs(path: Path = RUNS) -> dict[int, Run]:
    """{device count: its run} from ``path`` (none when it does not exist)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    names = {f.name for f in fields(Row)}
    out = {}
    for key, entry in data["runs"].items():
        rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in entry["rows"]]
        out[int(key)] = Run(**{**entry, "rows": rows})
    return out


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
    rows, width = RESNET_BATCH, int(RESNET["num_classes"])
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


def _kind(mode: str, n: int) -> str:
    """A mode's name with its device count written as n: the same mode at every count."""
    return (mode.replace(f"tensor parallel 1x{n}", "tensor parallel 1xn")
            .replace(f"hybrid 2x{max(1, n // 2)}", "hybrid 2xn/2"))


def _by_model(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.model, []).append(r)
    return out


def _fastest(rows: list[Row], n: int, key: str = "ms") -> tuple[str, Row]:
    """(the plan's name, its row) of the fastest plan among one model's ``rows`` on ``n``
    devices, measured (``key="ms"``) or predicted (``"pred_ms"``, ``"fixed_ms"``)."""
    group = min(_groups(rows), key=lambda g: min(getattr(r, key) for r in g))
    return _kind(_label(group), n), min(group, key=lambda r: getattr(r, key))


def device_table(runs: dict[int, Run], what: str) -> str:
    """One row per model and mode, one column per device count: ``what`` is "time" (measured
    / predicted on the count's profile / predicted on cpu-local, ms) or "bytes" (moved MiB /
    measured peak MiB per rank). On one device every plan is the model stand-alone: its one
    row fills that column of each of the model's modes."""
    counts = sorted(runs)

    def cell(r: Row) -> str:
        if what == "time":
            return f"{r.ms:.1f} / {r.pred_ms:.1f} / {r.fixed_ms:.1f}"
        return f"{r.moved / MIB:.3f} / {r.peak / MIB:.2f}"

    cells: dict[tuple[str, str], dict[int, str]] = {}
    for n in counts:
        for r in runs[n].rows:
            if r.mode != ONE:
                cells.setdefault((r.model, _kind(r.mode, n)), {})[n] = cell(r)
    for r in runs[1].rows if 1 in runs else []:
        for (model, _), row in cells.items():
            if model == r.model:
                row[1] = cell(r)
    return markdown_table(["model", "mode", *[f"{n} device{'s' * (n > 1)}" for n in counts]],
                          [[MODELS[m][0], mode, *[row.get(n, "") for n in counts]]
                           for (m, mode), row in cells.items()])


def _winners(rows_at: dict[int, list[Row]], key: str) -> str:
    """The fastest plan at each count of ``rows_at``, by ``key``, and whether it changes."""
    won = {n: _fastest(rows, n, key) for n, rows in rows_at.items() if n > 1}
    parts = []
    for n, (w, r) in won.items():
        part = f"at {n} devices {w} ({_ms(getattr(r, key))}"
        noise = spread(rows_at[n]) if key == "ms" else None
        groups = sorted(_groups(rows_at[n]), key=lambda g: min(getattr(x, key) for x in g))
        if noise is not None and len(groups) > 1:
            second = min(getattr(x, key) for x in groups[1])
            if second / getattr(r, key) - 1 <= noise:
                part += (f"; the next plan within {second / getattr(r, key) - 1:.1%}, inside "
                         f"this count's noise of {noise:.0%}")
        parts.append(part + ")")
    text = "; ".join(parts)
    kinds = list(dict.fromkeys(w for w, _ in won.values()))
    return text + (f": {kinds[0]} at every count" if len(kinds) == 1 else
                   ": it changes with the count")


def device_lines(runs: dict[int, Run]) -> list[str]:
    """The device-count section: the two tables and, per model, what they say."""
    counts = sorted(runs)
    cores = len(os.sched_getaffinity(0))
    shared = [n for n in counts if n > cores]
    lines = [
        "The same models, the same global batch (strong scaling: each rank's share of the "
        "batch shrinks as the count grows) and the same plans, on "
        + _join([str(n) for n in counts]) + " devices, each count by its own run: "
        + "; ".join(f"{n} device{'s' * (n > 1)} on {runs[n].date}, profile "
                    f"\"{runs[n].profile}\"" for n in counts) + ". "
        f"This machine has {cores} cores, so a rank is a different device at each count: up "
        f"to {cores} ranks each has a core of its own"
        + (f"; at {_join([str(n) for n in shared])} ranks they take turns on the cores"
           if shared else "")
        + ". Each count's prediction is therefore made on a profile calibrated at that count "
        "(`mpirun -n k python -m simpar.calibrate`, as `--sweep` does): measured against "
        "predicted at one count compares like with like. How a plan scales on devices of "
        "their own, each as fast at every count, is the third figure of each cell of the "
        "first table: the cost model on the shipped `cpu-local` profile (a device as fast as "
        "one of 8 ranks on this machine) at every count.",
        "",
        "Step time, ms: measured / predicted on the count's profile / predicted on "
        "`cpu-local` (one device speed at every count):",
        "",
        device_table(runs, "time"),
        "",
        "Per rank and step: MiB moved (the most any rank sent + received) / measured peak MiB "
        "(the rank with the largest):",
        "",
        device_table(runs, "bytes"),
        "",
        f"![step time against the device count]({os.path.relpath(SCALING_PNG, PAGE.parent)})",
        "",
    ]
    for model in MODELS:
        rows_at = {n: [r for r in runs[n].rows if r.model == model] for n in counts}
        rows_at = {n: rows for n, rows in rows_at.items() if rows}
        many = [n for n in rows_at if n > 1]
        if not many:
            continue
        text = (f"Fastest measured: {_winners(rows_at, 'ms')}. Fastest predicted on the "
                f"count's profile: {_winners(rows_at, 'pred_ms')}. Fastest on one device "
                f"speed: {_winners(rows_at, 'fixed_ms')}. ")
        one = next((r for r in rows_at.get(1, []) if r.mode == ONE), None)
        top = max(many)
        if one is not None:
            w, r = _fastest(rows_at[top], top)
            fw, fr = _fastest(rows_at[top], top, "fixed_ms")
            text += (f"Against one device, the fastest plan at {top} devices runs "
                     f"{one.ms / r.ms:.2f}x as fast measured ({w}: {_ms(r.ms)} against "
                     f"{_ms(one.ms)}, on the same {cores} cores) and "
                     f"{one.fixed_ms / fr.fixed_ms:.2f}x on one "
                     f"device speed ({fw}: {_ms(fr.fixed_ms)} against {_ms(one.fixed_ms)}). ")
        dp = {n: next(r for r in rows_at[n] if r.mode == "data parallel") for n in many}
        tp = {n: next(r for r in rows_at[n] if _kind(r.mode, n) == "tensor parallel 1xn")
              for n in many}
        lo = min(many)
        text += (
            "Data parallel moves "
            + ", ".join(f"{dp[n].moved / dp[n].grad_bytes:.2f}x" for n in many)
            + " the gradients per rank at " + _join([str(n) for n in many])
            + " devices (the ring's 4 (n-1)/n: "
            + ", ".join(f"{4 * (n - 1) / n:.2f}" for n in many)
            + "), nearly the same bytes at every count while each rank's compute shrinks; "
            "every rank keeps the whole model and its optimizer state, so its peak ("
            + ", ".join(f"{dp[n].peak / MIB:.2f}" for n in many) + " MiB) falls only by its "
            "share of the activations. "
            "Tensor parallel 1xn moves " + ", ".join(_mib(tp[n].moved) for n in many)
            + " per rank, and its peak goes " + ", ".join(f"{tp[n].peak / MIB:.2f}"
                                                          for n in many)
            + f" MiB ({tp[top].peak / tp[lo].peak:.2f}x from {lo} to {top} devices: the cut "
            "parameters and their optimizer state shrink as 1/n, the replicated ones and the "
            "activations it leaves whole do not).")
        lines += [f"**{MODELS[model][0]}.** {text}", ""]
    return lines


def page(runs: dict[int, Run]) -> str:
    """docs/strategies.md: every sentence computed from the ``runs``' rows; the sections
    before "Device count" read the largest count's."""
    n = max(runs)
    main_run = runs[n]
    rows, steps, host = main_run.rows, main_run.steps, main_run.host
    profile, capacity = main_run.profile, main_run.capacity
    by_model = _by_model(rows)
    command = (f"mpirun -n {n} {SCRIPT}" if len(runs) == 1 else
               f"python {SCRIPT.removeprefix('python ')} --sweep "
               + " ".join(map(str, sorted(runs))))
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
        f"*Generated by `{command}` ({main_run.date}); never edited by hand: run the command "
        "again to "
        "refresh it. Every figure and sentence below is computed from that run's "
        "measurements.*",
        "",
        f"Three models trained on {n} ranks, and [on fewer](#device-count) (the same models "
        "as the "
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
            "## Memory per rank", "", *memory_lines(by_model, capacity, profile), ""]
    if len(runs) > 1:
        out += ["## Device count", "", *device_lines(runs)]
    out += ["## The single-device check", ""]
    every = [(k, r) for k, run in sorted(runs.items()) for r in run.rows]
    bad = [(k, r) for k, r in every if r.verdict != "PASS"]
    if not bad:
        out.append(f"Every row passes: all {len(every)} plans"
                   + (f" (on {_join([str(k) for k in sorted(runs)])} devices)"
                      if len(runs) > 1 else "")
                   + ", over two steps, train like one device (losses, every rank's "
                   "parameter shards, and the gradients at identical parameters, within the "
                   "check's tolerances).")
    else:
        out.append(f"{len(every) - len(bad)} of {len(every)} rows pass. The others:")
        out.append("")
        out += [f"* {MODELS[r.model][0]}, {r.mode}, {k} devices: {r.verdict}: "
                + r.summary.replace("\n", " ") for k, r in bad]
    return "\n".join(out).rstrip() + "\n"


def results(runs: dict[int, Run]) -> str:
    """RESULTS.md's ``## strategies``: each count's table under its command."""
    parts = [
        "Per row: the slowest rank's median step over the timed steps; moved: CommTrace over "
        "one more step, the most any rank sent + received, in how many collectives, and the "
        "median rank's time inside them (waiting included) and outside them; memory: the rank "
        "with the largest measured peak, tracemalloc over one step plus the parameters and "
        "optimizer state held before it, next to the model's figure for that rank; check: "
        "the single-device check over two steps. What the figures say: [when each mode wins]"
        "(../docs/strategies.md)."]
    for n, entry in sorted(runs.items(), reverse=True):
        parts += [f"### {n} device{'s' * (n > 1)}",
                  f"`mpirun -n {n} {SCRIPT}` ({entry.date}; profile \"{entry.profile}\": "
                  f"{entry.calibration or 'shipped'}; {entry.steps} timed steps per row)",
                  table(entry.rows), entry.host]
    return "\n\n".join(parts)
