"""Pictures of a plan, as PNG files (matplotlib, the optional ``viz`` extra:
``pip install -e .[viz]``). Each function draws one figure, writes it to ``path`` and
returns the path; none of them needs MPI.

* :func:`layout_png`: the cake, a tensor layout's blocks coloured by the ranks that hold them
  (one colour per holder set; copies and partial sums written in the cells as
  :mod:`simpar.cake` writes them);
* :func:`program_png`: a program's strategy graph: its ops in order, each with its strategy
  and its own collectives, and every edge between them with the collectives that move the
  value (its redistribution), or none;
* :func:`cost_png`: a plan's predicted step split into compute, op communication,
  redistribution, gradient sync, the optimizer and fixed costs, and its peak memory per rank
  split into parameters, gradients, optimizer state, activations and transients;
* :func:`pipeline_png`: a pipelined step's prediction per stage: busy, idle in the bubble,
  once-per-step sync, and each stage's peak memory;
* :func:`fidelity_png`: predicted against measured step time, one point per strategy;
* :func:`lines_png`: series per step (a loss curve; measured and predicted step times);
* :func:`bars_png`: grouped bars (a measured step time per model and parallel mode);
* :func:`scaling_png`: panels of lines against the device count (a step time per parallel
  mode, measured and predicted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from simpar.cake import cake_cells
from simpar.layout import TensorLayout

__all__ = ["bars_png", "cost_png", "fidelity_png", "layout_png", "lines_png", "pipeline_png",
           "program_png", "scaling_png"]


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 (an optional extra, imported only to draw)
    except ImportError:
        raise ImportError("simpar.viz draws with matplotlib, the optional 'viz' extra: "
                          "pip install -e .[viz]") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    return plt


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    fig.clf()
    tmp.replace(out)   # never half a picture under the name
    return out


def layout_png(layout: TensorLayout, path: str | Path, name: str = "tensor") -> Path:
    """``layout`` as a grid of blocks (its last two dims; the blocks of the first of the
    dims before them only), each coloured by the set of ranks holding it."""
    plt = _pyplot()
    cells = cake_cells(layout)
    ndim = len(layout.shape)
    grid: dict[tuple[tuple[int, int], ...], str]
    if ndim == 0:
        grid = {((0, 1), (0, 1)): cells[()]}
    elif ndim == 1:
        grid = {((0, 1), block[0]): text for block, text in cells.items()}
    else:
        first = min(block[:-2] for block in cells)
        grid = {block[-2:]: text for block, text in cells.items() if block[:-2] == first}
    rows = sorted({b[0] for b in grid})
    cols = sorted({b[1] for b in grid})
    holders = sorted(set(grid.values()))
    palette = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(cols), 1.0 + 0.8 * len(rows)))
    for (r, c), text in grid.items():
        y, x = rows.index(r), cols.index(c)
        ax.add_patch(plt.Rectangle((x, -y - 1), 1, 1, facecolor=palette(
            holders.index(text) % 20), edgecolor="black"))
        ax.text(x + 0.5, -y - 0.5, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(cols))
    ax.set_ylim(-len(rows), 0)
    ax.set_xticks([k + 0.5 for k in range(len(cols))],
                  [f"{a}:{b}" for a, b in cols], fontsize=7)
    ax.set_yticks([-k - 0.5 for k in range(len(rows))],
                  [f"{a}:{b}" for a, b in rows], fontsize=7)
    partial = f", partial over device axes {list(layout.partial_axes)}" \
        if layout.partial_axes else ""
    ax.set_title(f"{name} {tuple(layout.shape)}, cut {tuple(layout.cuts)} on "
                 f"{list(layout.device_matrix)}{partial}", fontsize=8)
    return _save(fig, path)


def cost_png(report: Any, path: str | Path, title: str = "") -> Path:
    """A :class:`~simpar.cost.CostReport`: the predicted step by part (one bar) and the
    peak memory of each rank priced, by part."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    parts = [("compute", report.compute), ("op comm", report.op_comm),
             ("redistribution", report.redistribution), ("grad sync", report.grad_sync),
             ("accumulation", report.accumulation), ("optimizer", report.optimizer),
             ("fixed", report.overhead)]
    bottom = 0.0
    for label, seconds in parts:
        left.bar(0, seconds * 1e3, bottom=bottom, label=label)
        bottom += seconds * 1e3
    left.set_xticks([0], ["step"])
    left.set_ylabel("predicted ms")
    left.legend(fontsize=7)
    ranks = [m.rank for m in report.memory]
    mib = 2.0 ** 20
    stack = [("parameters", [m.parameters for m in report.memory]),
             ("gradients", [m.gradients for m in report.memory]),
             ("optimizer state", [m.optimizer for m in report.memory]),
             ("activations", [m.activations for m in report.memory]),
             ("transient", [m.peak - m.parameters - m.gradients - m.optimizer - m.activations
                            for m in report.memory])]
    base = [0.0] * len(ranks)
    for label, values in stack:
        right.bar([str(r) for r in ranks], [v / mib for v in values], bottom=base, label=label)
        base = [b + v / mib for b, v in zip(base, values)]
    right.set_xlabel("rank")
    right.set_ylabel("peak MiB")
    right.legend(fontsize=7)
    fig.suptitle(title or f"predicted on {report.profile}: {report.step_seconds * 1e3:.2f} ms "
                 f"per step, {report.device_num} devices", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def fidelity_png(names: Sequence[str], predicted: Sequence[float], measured: Sequence[float],
                 path: str | Path) -> Path:
    """Predicted against measured step time (seconds), one labelled point per strategy and
    the line where they agree."""
    if not (len(names) == len(predicted) == len(measured)) or not names:
        raise ValueError(f"fidelity_png: names, predicted and measured must be as long as "
                         f"each other and not empty, got {len(names)}, {len(predicted)} and "
                         f"{len(measured)}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    ms, ps = [m * 1e3 for m in measured], [p * 1e3 for p in predicted]
    ax.scatter(ms, ps)
    for name, m, p in zip(names, ms, ps):
        ax.annotate(name, (m, p), fontsize=6)
    top = max(ms + ps) * 1.1
    ax.plot([0, top], [0, top], linewidth=0.5)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    fig.tight_layout()
    return _save(fig, path)


def lines_png(series: Mapping[str, Sequence[float]], xlabel: str, ylabel: str,
              path: str | Path) -> Path:
    """Each named series against its step number (1, 2, ...), one line each."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for label, values in series.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


#: Ops a strategy graph draws before it says how many more there are.
MAX_OPS = 48


def _kinds(steps: Sequence[Any]) -> str:
    kinds = [str(st.kind) for st in steps if str(st.kind) not in ("Slice", "Local")]
    return ", ".join(kinds)


def program_png(program: Any, path: str | Path, title: str = "") -> Path:
    """The strategy graph of a lowered program (:class:`~simpar.runtime.ParallelProgram`):
    one box per op in trace order (its type, strategy and forward collectives; red where it
    communicates), and an arc from each producer to each consumer, red and labelled with the
    redistribution's collectives where the value must move between their layouts."""
    plt = _pyplot()
    steps = list(program.steps)[:MAX_OPS]
    index = {st.node.id: k for k, st in enumerate(steps)}
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.34 * len(steps)))
    for k, st in enumerate(steps):
        sh = st.sharding
        comm = ", ".join(dict.fromkeys(str(c.kind) for c in sh.forward_comm))
        text = f"{st.node.op.name} {[list(s) for s in sh.strategy]}" + (
            f"  [{comm}]" if comm else "")
        ax.text(0.32, -k, text, va="center", fontsize=7, family="monospace",
                bbox={"boxstyle": "round", "facecolor": "#fde0dc" if comm else "#e3f0fb",
                      "edgecolor": "#999999"})
        for v, moves in zip(st.node.inputs, st.in_plans):
            if v.producer is None or v.producer.id not in index:
                continue
            a = index[v.producer.id]
            label = _kinds(moves.steps)
            depth = 0.05 + 0.03 * min(k - a, 8)
            ax.annotate("", xy=(0.3, -k), xytext=(0.3, -a),
                        arrowprops={"arrowstyle": "->", "color": "red" if label else "#777777",
                                    "connectionstyle": f"arc3,rad={depth}", "linewidth": 0.8})
            if label:
                ax.text(0.3 - depth * (k - a) * 0.6, -(a + k) / 2, label, fontsize=6,
                        color="red", ha="right", va="center")
    if len(program.steps) > len(steps):
        ax.text(0.32, -len(steps), f"... and {len(program.steps) - len(steps)} more ops",
                fontsize=7, va="center")
    ax.set_xlim(0, 1)
    ax.set_ylim(-len(steps) - 0.5, 0.8)
    ax.axis("off")
    ax.set_title(title or f"strategy graph, {program.device_num} devices ({program.mode})",
                 fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def pipeline_png(cost: Any, path: str | Path) -> Path:
    """A :class:`~simpar.pipeline.PipelineCost`: per stage, its busy time, its idle time
    inside the step (the bubble) and its once-per-step sync (one stacked bar each), and its
    peak memory."""
    plt = _pyplot()
    stages = [f"stage {s.stage}" for s in cost.stages]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    base = [0.0] * len(stages)
    for label, values in (("busy", [s.busy for s in cost.stages]),
                          ("idle (bubble)", [s.idle for s in cost.stages]),
                          ("sync", [s.sync for s in cost.stages])):
        left.bar(stages, [v * 1e3 for v in values], bottom=base, label=label)
        base = [b + v * 1e3 for b, v in zip(base, values)]
    left.set_ylabel("predicted ms")
    left.legend(fontsize=7)
    right.bar(stages, [s.peak_memory / 2.0 ** 20 for s in cost.stages], color="tab:purple")
    right.set_ylabel("peak MiB")
    fig.suptitle(f"predicted on {cost.profile}: {cost.step_seconds * 1e3:.2f} ms per step, "
                 f"{cost.scheduler}, {cost.micro_batches} micro-batches, bubble "
                 f"{cost.bubble:.0%}", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def bars_png(groups: Mapping[str, Mapping[str, float]], path: str | Path,
             ylabel: str) -> Path:
    """Grouped bars: one group per key of ``groups`` (e.g. a model), in it one bar per key of
    its mapping (e.g. a parallel mode: one colour per such key across all groups, a key a
    group lacks left out), each labelled with its value."""
    if not groups or not any(groups.values()):
        raise ValueError("bars_png: groups must hold at least one value")
    plt = _pyplot()
    series = list(dict.fromkeys(key for bars in groups.values() for key in bars))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(2.0 + 0.35 * len(series) * len(groups), 4.0))
    for k, key in enumerate(series):
        xs = [g + (k - (len(series) - 1) / 2) * width
              for g, bars in enumerate(groups.values()) if key in bars]
        values = [bars[key] for bars in groups.values() if key in bars]
        drawn = ax.bar(xs, values, width, label=key)
        ax.bar_label(drawn, fmt="%.3g", fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(v for bars in groups.values() for v in bars.values()) * 1.2)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return _save(fig, path)


def scaling_png(panels: Mapping[str, Mapping[str, Mapping[int, float]]], path: str | Path,
                ylabel: str, columns: int = 3) -> Path:
    """One panel per key of ``panels`` (e.g. a model, measured or predicted), ``columns`` to a
    row; in each, one line per series (e.g. a parallel mode: one colour per series name across
    all panels) through its {device count: value} points, on log-2 axes."""
    if not panels or not any(points for lines in panels.values() for points in lines.values()):
        raise ValueError("scaling_png: panels must hold at least one point")
    if not isinstance(columns, int) or columns < 1:
        raise ValueError(f"scaling_png: columns must be a positive int, got {columns!r}")
    plt = _pyplot()
    names = list(dict.fromkeys(name for lines in panels.values() for name in lines))
    colour = {name: f"C{k % 10}" for k, name in enumerate(names)}
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.3 * columns, 2.8 * rows + 0.6),
                             squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        counts = sorted({n for points in lines.values() for n in points})
        for name, points in lines.items():
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", markersize=3, color=colour[name],
                    label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("devices", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=colour[name], marker="o", markersize=3)
               for name in names]
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 4), fontsize=7)
    fig.tight_layout(rect=(0, 0.1 if rows == 1 else 0.06, 1, 1))
    return _save(fig, path)
