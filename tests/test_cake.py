"""The cake in the terminal (simpar.cake): every cell of a drawn layout names exactly the
ranks that hold that block, copies apart and partial sums joined by +; get_parallel_info and
run_op(verbose=True) carry the drawings."""

from __future__ import annotations

import numpy as np
import pytest

from simpar import ops
from simpar.cake import cake, cake_cells
from simpar.layout import TensorLayout
from simpar.parallel import get_parallel_info, run_op


def _rows(text: str) -> list[list[str]]:
    """The drawing's grid lines as cells (split on runs of two spaces or more)."""
    import re
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[1:]]


def test_a_two_by_four_cut_is_drawn_cell_by_cell() -> None:
    lay = TensorLayout.from_dim_axes((2, 4), [(0,), (1,)], (8, 16))
    assert _rows(cake(lay, "x")) == [
        ["cols 0:4", "cols 4:8", "cols 8:12", "cols 12:16"],
        ["rows 0:4", "0", "1", "2", "3"],
        ["rows 4:8", "4", "5", "6", "7"]]


def test_copies_and_partial_sums() -> None:
    sh = ops.MatMul().shard(((2, 4), (4, 1))).sharding([(8, 16), (16, 4)], 8)
    # the kernel's output: partial over the k axis (device axis 1)
    assert _rows(cake(sh.raw_out))[1:] == [["rows 0:4", "0+1+2+3"], ["rows 4:8", "4+5+6+7"]]
    # b cut on its rows 4 ways, copied over the 2 row blocks of a
    assert [r[1] for r in _rows(cake(sh.in_layouts[1]))[1:]] == ["0 4", "1 5", "2 6", "3 7"]
    # partial over one axis and copied over another: two copies of each sum
    lay = TensorLayout.from_dim_axes((2, 2), [(), ()], (4, 4), partial_axes=(1,))
    assert cake_cells(lay) == {((0, 4), (0, 4)): "0+1 2+3"}
    assert "partial over device axes [1]" in cake(lay).splitlines()[0]


def test_every_rank_is_in_exactly_one_cell_per_copy() -> None:
    """Any layout: the cells' ranks are every device once."""
    for dm, dims, shape in [((2, 2, 2), [(0,), (2,), ()], (4, 6, 2)), ((8,), [(), (0,)], (3, 8)),
                            ((4, 2), [(1, 0)], (16,))]:
        lay = TensorLayout.from_dim_axes(dm, dims, shape)
        ranks = [int(r) for cell in cake_cells(lay).values() for r in cell.split()]
        assert sorted(ranks) == list(range(int(np.prod(dm))))


def test_higher_ranks_draw_their_last_two_dims_per_leading_block() -> None:
    lay = TensorLayout.from_dim_axes((2, 2), [(0,), (), (1,)], (4, 3, 8))
    text = cake(lay, "t")
    assert "dims 0..0 at 0:2:" in text and "dims 0..0 at 2:4:" in text
    assert text.count("cols 0:4") == 2
    many = TensorLayout.from_dim_axes((8,), [(0,), (), ()], (8, 2, 2))
    assert "... and 4 more blocks of dims 0..0" in cake(many)


def test_parallel_info_and_verbose_run_op_draw_the_cut(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    info = get_parallel_info(ops.MatMul().shard(((2, 4), (4, 1))), [(8, 16), (16, 4)], 8, 5)
    assert _rows(info["inputs_cake"][0])[1] == ["rows 0:4", "0", "1", "2", "3"]
    assert "as the kernel leaves it" in info["outputs_cake"][0]
    run_op(ops.ReLU().shard(((1, 1),)), np.ones((2, 2)), verbose=True)
    printed = capsys.readouterr().out
    assert printed.startswith("ReLU: strategy [[1, 1]], device matrix [1, 1]")
    assert "rank 0: forward none; backward none" in printed
