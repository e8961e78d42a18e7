"""A run report: ``python -m simpar.train --report DIR`` writes ``DIR/report.json`` (what the
run planned, measured and predicted), its pictures and ``DIR/report.html``, a page that holds
everything itself (the pictures inlined) and opens in any browser. ``python -m simpar.report
DIR`` builds the pictures and the page again from ``report.json`` (no MPI).

The page: the run's settings; the strategy table and why the plan won; the loss curve; each
step's measured time against the cost model's prediction; the predicted step by part and the
peak memory per rank by part (:func:`simpar.viz.cost_png`); the strategy graph
(:func:`simpar.viz.program_png`, drawn by the job); the cut of the first parameters, drawn
(:func:`simpar.viz.layout_png`); the collectives; the single-device check.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from simpar import viz
from simpar.cost.model import CostReport, MemoryRow, OpCostRow
from simpar.layout import TensorLayout
from simpar.pipeline.price import PipelineCost, StageCost

__all__ = ["build", "main", "write_data"]

DATA = "report.json"
PAGE = "report.html"
#: The program's strategy graph, which the job draws (report.json does not hold the program).
GRAPH = "graph.png"


def write_data(directory: str | Path, data: Mapping[str, Any]) -> Path:
    """``data`` (JSON-serialisable) as ``directory/report.json`` (made whole, then renamed)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / DATA
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    tmp.replace(path)
    return path


def _cost_report(d: Mapping[str, Any]) -> CostReport:
    """A :class:`CostReport` back from its ``to_dict``."""
    fields = set(CostReport.__dataclass_fields__)
    plain = {k: v for k, v in d.items() if k in fields and k not in ("ops", "memory")}
    ops = tuple(OpCostRow(**{**o, "strategy": tuple(tuple(s) for s in o["strategy"])})
                for o in d.get("ops", ()))
    memory = tuple(MemoryRow(**m) for m in d.get("memory", ()))
    return CostReport(**plain, ops=ops, memory=memory)


def _pictures(data: Mapping[str, Any], out: Path) -> list[tuple[str, Path]]:
    """(caption, PNG) of every picture the data allows, in page order."""
    pics = [("Loss per step", viz.lines_png({"loss": data["losses"]}, "step", "loss",
                                          out / "loss.png"))]
    steps = {"measured": [s * 1e3 for s in data["step_seconds"]]}
    if data.get("predicted_step_seconds"):
        steps["predicted"] = [data["predicted_step_seconds"] * 1e3] * len(data["step_seconds"])
    pics.append(("Step time, measured against the cost model's prediction",
                 viz.lines_png(steps, "step", "ms", out / "steps.png")))
    if data.get("cost"):
        pics.append(("The predicted step by part, and the peak memory of each rank",
                     viz.cost_png(_cost_report(data["cost"]), out / "cost.png")))
    if data.get("pipeline_cost"):
        pics.append(("The predicted pipelined step per stage: busy, the bubble, sync; and "
                     "each stage's peak memory",
                     viz.pipeline_png(_pipeline_cost(data["pipeline_cost"]),
                                      out / "pipeline.png")))
    if (out / GRAPH).is_file():   # drawn from the program by the job (not from the data)
        pics.append(("The strategy graph: each op's strategy, and the collectives on each "
                     "edge", out / GRAPH))
    for k, lay in enumerate(data.get("layouts", ())):
        layout = TensorLayout.from_dict(lay["layout"])
        pics.append((f"How {lay['name']} is cut",
                     viz.layout_png(layout, out / f"layout{k}.png", lay["name"])))
    return pics


def _pipeline_cost(d: Mapping[str, Any]) -> PipelineCost:
    """A :class:`PipelineCost` back from ``dataclasses.asdict``."""
    return PipelineCost(**{**d, "stages": tuple(StageCost(**s) for s in d["stages"])})


def _inline(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def build(directory: str | Path) -> Path:
    """The pictures and ``report.html`` of ``directory/report.json``; returns the page."""
    out = Path(directory)
    path = out / DATA
    if not path.is_file():
        raise ValueError(f"report: {str(out)!r} holds no {DATA}; python -m simpar.train "
                         "--report DIR writes one")
    try:
        data = json.loads(path.read_text())
        pics = _pictures(data, out)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"report: {path} is not a report this version reads: "
                         f"{error!r}") from None
    esc = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>simpar run: "
             f"{esc(str(data.get('title', '')))}</title><style>body{{font-family:sans-serif;"
             "margin:2em;max-width:70em}pre{background:#f4f4f4;padding:.8em;overflow-x:auto;"
             "font-size:12px}img{max-width:100%;border:1px solid #ddd}</style></head><body>",
             f"<h1>simpar run: {esc(str(data.get('title', '')))}</h1>"]
    for heading, key in (("Settings", "settings"), ("Strategies", "strategy_table"),
                         ("Why this plan", "why_it_won"), ("Collectives", "collectives")):
        if data.get(key):
            parts.append(f"<h2>{heading}</h2><pre>{esc(str(data[key]))}</pre>")
    for caption, png in pics:
        parts.append(f"<h2>{esc(caption)}</h2><img alt='{esc(caption)}' "
                     f"src='{_inline(png)}'>")
    if data.get("check"):
        parts.append(f"<h2>Against one device</h2><pre>{esc(str(data['check']))}</pre>")
    parts.append("</body></html>")
    page = out / PAGE
    tmp = page.with_name(page.name + f".tmp{os.getpid()}")
    tmp.write_text("\n".join(parts))
    tmp.replace(page)
    return page


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simpar.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="the directory python -m simpar.train --report wrote")
    args = p.parse_args(argv)
    try:
        page = build(args.directory)
    except (ValueError, ImportError) as error:
        print(f"python -m simpar.report: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
