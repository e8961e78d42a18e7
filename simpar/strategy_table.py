"""The strategy table that the main job (``simpar.train``) and the planner (``simpar.plan``)
print: one row per op that communicates, is annotated or is computed alike on several ranks,
with its strategy, output tensor map and collectives and where its strategy came from (the
user's ``.shard()``, the search, propagation), then how the parameter gradients sync.

Pure: it reads a lowered :class:`~simpar.runtime.ParallelProgram` (rank 0's view) and returns
text. With ``fold_blocks`` the rows of consecutive numbered cells that read alike (a GPT's
``block0`` .. ``block23``) print once, as ``block0..23/attn/q/MatMul``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from simpar.runtime import ParallelProgram

__all__ = ["columns", "display_names", "strategy_table"]

#: Where a row's strategy came from, as the table says it (the ``chosen`` of comm_table).
_SET_BY = {"annotated": "user .shard()", "searched": "search", "propagated": "propagation",
           "data_parallel": "data parallel", "file": "strategy file"}
_NUMBERED = re.compile(r"^([A-Za-z_]+?)(\d+)/(.+)$")
_OP_NUMBER = re.compile(r"-op\d+$")


def display_names(names: list[str]) -> dict[str, str]:
    """Short, unique, readable op names: the cell path below the network without class
    names ("block1/attn/q/MatMul"), with MindSpore's ``-opN`` kept only where two ops of one
    cell would read alike ("block1/attn/BatchMatMul-op20")."""
    short = {}
    for name in names:
        parts = name.split("/")
        parts = parts[2:] if len(parts) > 2 and parts[0] == "Default" else parts
        cells = [p.split("-")[0].lstrip("_") for p in parts[:-1]]
        cells = [c for c in cells if c != "backbone"]
        short[name] = "/".join([*cells, parts[-1].rsplit("-op", 1)[0]])
    seen: dict[str, int] = {}
    for s in short.values():
        seen[s] = seen.get(s, 0) + 1
    return {n: s if seen[s] == 1 else f"{s}-op{n.rsplit('-op', 1)[-1]}"
            for n, s in short.items()}


def columns(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Rows of cells as left-aligned columns two spaces apart."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
            for r in rows]


def strategy_table(program: ParallelProgram, fold_blocks: bool = False) -> str:
    """The table, headed by a blank line and a title, ending with the gradient sync line."""
    rows = program.comm_table()
    shown = [r for r in rows if r["chosen"] == "annotated" or r["forward"] or r["redistribution"]
             or r["repeat"] > 1]
    names = display_names([r["op"] for r in rows])
    table = [[names[r["op"]], str(r["strategy"]).replace(" ", ""),
              str(r["out_tensor_map"]).replace(" ", ""),
              ", ".join(r["redistribution"] + r["forward"]) or "-",
              ", ".join(r["backward"]) or "-",
              f"x{r['repeat']}" if r["repeat"] > 1 else "-",
              _SET_BY.get(str(r["chosen"]), str(r["chosen"]))] for r in shown]
    rest = ("searched" if program.mode == "auto_parallel" and any(
        str(r["chosen"]) == "searched" for r in rows) else "propagated")
    rest += ", need no communication and are computed once"
    title = (f"\nstrategies ({len(shown)} of {len(rows)} ops shown: annotated, communicating or "
             f"computed alike on several ranks; the rest {rest})")
    if fold_blocks:
        folded = _fold(table)
        if len(folded) < len(table):
            title += ("; numbered cells that read alike are folded (block0..23: every block "
                      "from 0 to 23; -opN numbers are the first block's)")
        table = folded
    mirrors: dict[int, int] = {}
    scattered: dict[int, int] = {}   # optimizer parallel: reduce-scattered into slices
    for name in program.param_layouts:
        shard = program.param_shards.get(name)
        if shard is not None:
            scattered[shard.size] = scattered.get(shard.size, 0) + 1
            continue
        g = len(program.mirror_group(name, 0))
        mirrors[g] = mirrors.get(g, 0) + 1
    sync = "  parameter gradients: " + ", ".join(
        [f"{n} synced over {g} ranks" if g > 1 else f"{n} sharded (no Mirror)"
         for g, n in sorted(mirrors.items())]
        + [f"{n} reduce-scattered into optimizer slices over {g} ranks"
           for g, n in sorted(scattered.items())])
    header = ["op", "strategy", "out map", "forward", "backward", "repeated", "set by"]
    return "\n".join([title, *columns([header, *table]), sync])


@dataclass
class _Run:
    """The shown rows of numbered cells ``cell<first>`` .. ``cell<last>``, which read alike."""

    cell: str
    first: int
    last: int
    signature: list[tuple[str, ...]]
    rows: list[list[str]]


def _fold(table: list[list[str]]) -> list[list[str]]:
    """Runs of consecutive numbered cells (``block3/...``) whose rows read alike, once each."""
    items: list[list[str] | _Run] = []
    for row in table:
        found = _NUMBERED.match(row[0])
        if found is None:
            items.append(row)
            continue
        cell, k = found.group(1), int(found.group(2))
        key = (_OP_NUMBER.sub("", found.group(3)), *row[1:])
        last = items[-1] if items else None
        if isinstance(last, _Run) and (last.cell, last.first) == (cell, k):
            last.signature.append(key)
            last.rows.append(row)
        else:
            items.append(_Run(cell, k, k, [key], [row]))
    merged: list[list[str] | _Run] = []
    for item in items:
        prev = merged[-1] if merged else None
        if (isinstance(item, _Run) and isinstance(prev, _Run) and prev.cell == item.cell
                and item.first == prev.last + 1 and item.signature == prev.signature):
            prev.last = item.last
        else:
            merged.append(item)
    out: list[list[str]] = []
    for item in merged:
        if not isinstance(item, _Run):
            out.append(item)
            continue
        prefix = f"{item.cell}{item.first}"
        label = prefix if item.first == item.last else f"{prefix}..{item.last}"
        out += [[label + r[0][len(prefix):], *r[1:]] for r in item.rows]
    return out
