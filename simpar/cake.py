"""The cake in the terminal: a tensor layout drawn as the grid of its blocks, each cell the
ranks that hold that block.

A 2-D tensor is its grid (rows of blocks along dim 0, columns along dim 1); a tensor of
higher rank is drawn as its last two dims, one grid per block of the dims before them (named
above it); a 1-D tensor is one row. A cell lists the ranks holding the block: ``0 4`` are
two copies; ``0+1`` marks partial sums (the block is the sum of what ranks 0 and 1 hold,
pending over the partial axes), and ``0+1 4+5`` two copies of such a sum.

>>> from simpar.layout import TensorLayout
>>> print(cake(TensorLayout.from_dim_axes((2, 4), [(0,), (1,)], (8, 16)), "x"))
x (8, 16) on device matrix [2, 4], cut (2, 4):
          cols 0:4  cols 4:8  cols 8:12  cols 12:16
rows 0:4  0         1         2          3
rows 4:8  4         5         6          7
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from simpar.layout import TensorLayout

__all__ = ["cake", "cake_cells"]

#: Grids drawn of a tensor of rank > 2 before the rest are summarised in one line.
MAX_GRIDS = 4


def _cell(layout: TensorLayout, ranks: Sequence[int]) -> str:
    """The ranks holding one block: copies apart, the partial sums of a copy joined by +."""
    if not layout.partial_axes:
        return " ".join(map(str, ranks))
    mesh = layout.mesh
    copies: dict[tuple[int, ...], list[int]] = {}
    for r in ranks:
        coord = mesh.coordinate(r)
        key = tuple(c for a, c in enumerate(coord) if a not in layout.partial_axes)
        copies.setdefault(key, []).append(r)
    return " ".join("+".join(map(str, group)) for group in copies.values())


def cake_cells(layout: TensorLayout) -> dict[tuple[tuple[int, int], ...], str]:
    """Every block of the tensor (its ``(start, stop)`` per dim) and the ranks holding it,
    as its cell reads (:func:`cake`)."""
    held: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for r in range(layout.mesh.size):
        held.setdefault(layout.slice_of(r), []).append(r)
    return {block: _cell(layout, ranks) for block, ranks in sorted(held.items())}


def _grid(cells: dict[tuple[tuple[int, int], ...], str], rows: list[tuple[int, int]],
          cols: list[tuple[int, int]], lead: tuple[tuple[int, int], ...]) -> list[str]:
    """One grid: blocks of ``rows`` (none: a 1-D tensor, one row) by ``cols``."""
    if rows:
        table = [[""] + [f"cols {a}:{b}" for a, b in cols]]
        table += [[f"rows {row[0]}:{row[1]}"] + [cells[lead + (row, col)] for col in cols]
                  for row in rows]
    else:
        table = [[f"{a}:{b}" for a, b in cols], [cells[lead + (col,)] for col in cols]]
    widths = [max(len(line[k]) for line in table) for k in range(len(table[0]))]
    return ["  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip()
            for line in table]


def cake(layout: TensorLayout, name: str = "tensor") -> str:
    """``layout`` drawn as the grid of its blocks (see the module's docstring)."""
    shape = layout.shape
    title = (f"{name} {tuple(shape)} on device matrix {list(layout.device_matrix)}, "
             f"cut {tuple(layout.cuts)}" + (f", partial over device axes "
                                            f"{list(layout.partial_axes)}"
                                            if layout.partial_axes else "") + ":")
    cells = cake_cells(layout)
    if not shape:
        return f"{title}\n{cells[()]}"
    per_dim = [sorted({block[d] for block in cells}) for d in range(len(shape))]
    if len(shape) == 1:
        return "\n".join([title, *_grid(cells, [], per_dim[0], ())])
    lines = [title]
    leads = list(itertools.product(*per_dim[:-2]))
    for k, lead in enumerate(leads):
        if k == MAX_GRIDS:
            lines.append(f"... and {len(leads) - MAX_GRIDS} more blocks of dims "
                         f"0..{len(shape) - 3}")
            break
        if lead:
            lines.append("dims 0.." + str(len(shape) - 3) + " at " + ", ".join(
                f"{a}:{b}" for a, b in lead) + ":")
        lines += _grid(cells, per_dim[-2], per_dim[-1], lead)
    return "\n".join(lines)
