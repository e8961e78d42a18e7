"""Strategy files of pipelined training (mpirun -n 2, 4 or 8), as MindSpore keeps them: each
rank saves its stage's plan (every op item with its ``"stage"``), the stages' files merge into
one (``merge_pipeline_strategys``), and a pipelined job that loads the merged file plans
nothing: every stage runs the strategies it was saved with, and trains as one device does.

    mpirun -n 8 python -m pytest tests/test_pipeline_strategy_mpi.py -q --with-mpi -m mpi
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import nn
from simpar.check import relative_error
from simpar.pipeline.strategy_files import merge_pipeline_strategys
from simpar.search import Source
from tests.mpi_guard import abort_job_on_error, raised_everywhere, shared_dir
from tests.test_pipeline_mpi import LR, SEED, STEPS, _batch, _gpt, _reference

pytestmark = pytest.mark.mpi(min_size=2)


def _searched(save_file: str = "", load_file: str = "", interleave: bool = False
              ) -> nn.TrainOneStepCell:
    """A GPT in 2 pipeline stages (2 chunks each with ``interleave``), each stage's
    strategies searched by dynamic programming (or read from ``load_file``)."""
    simpar.reset_auto_parallel_context()
    simpar.set_auto_parallel_context(
        parallel_mode="auto_parallel", search_mode="dynamic_programming", gradients_mean=True,
        dataset_strategy="data_parallel", pipeline_stages=2,
        pipeline_config={"pipeline_interleave": interleave, "pipeline_scheduler": "1f1b"},
        strategy_ckpt_config={"save_file": save_file, "load_file": load_file})
    cell = nn.WithLossCell(_gpt(2, 2 if interleave else 1), nn.SoftmaxCrossEntropyWithLogits())
    return nn.TrainOneStepCell(nn.PipelineCell(cell, 4), nn.Adam(cell.trainable_params(), LR),
                               seed=SEED)


@pytest.mark.parametrize("interleave", [False, True], ids=["1f1b", "interleaved"])
def test_each_stage_saves_its_plan_the_files_merge_and_the_merged_file_plans_again(
        interleave: bool, tmp_path: Path) -> None:
    rank = comm.get_rank()
    root = shared_dir(tmp_path)
    stages_dir, merged = root / "stages", root / "merged.json"
    with abort_job_on_error("pipeline strategy files"):
        if rank == 0:
            stages_dir.mkdir()
        comm.world().Barrier()
        first = _searched(save_file=str(stages_dir / f"strategy_{rank}.json"),
                          interleave=interleave)
        first(*_batch(0))
        comm.world().Barrier()
        if rank == 0:
            merge_pipeline_strategys(stages_dir, merged)
        comm.world().Barrier()
        again = _searched(load_file=str(merged), interleave=interleave)
        losses = [again(*_batch(k)) for k in range(STEPS)]
        simpar.reset_auto_parallel_context()
        ref_losses, _ = _reference()
    a, b = first.pipeline, again.pipeline
    assert a is not None and b is not None
    problems = []
    mine = json.loads((stages_dir / f"strategy_{rank}.json").read_text())
    stage_items = {item["stage"] for item in mine["parallel_strategy_item"].values()}
    ops = {n.name for vs in a.chunks for n in a.stages[vs].graph.nodes}
    if stage_items != {a.stage} or set(mine["parallel_strategy_item"]) != ops:
        problems.append(f"rank {rank}: its file holds stages {stage_items}, "
                        f"{len(mine['parallel_strategy_item'])} ops; its stage {a.stage} has "
                        f"{len(ops)}")
    whole = json.loads(merged.read_text())
    every = {n.name: vs % 2 for vs, st in enumerate(a.stages) for n in st.graph.nodes}
    if {k: v["stage"] for k, v in whole["parallel_strategy_item"].items()} != every:
        problems.append(f"rank {rank}: the merged file does not file every op under its stage")
    for vs, (p, q) in enumerate(zip(a.programs, b.programs)):
        assert p.strategy_map is not None and q.strategy_map is not None
        if any(s.source is not Source.FILE for s in q.strategy_map.ops.values()):
            problems.append(f"rank {rank}: virtual stage {vs} searched instead of loading")
        if {k: s.in_strategy for k, s in p.strategy_map.ops.items()} != \
                {k: s.in_strategy for k, s in q.strategy_map.ops.items()} or \
                dict(p.param_layouts) != dict(q.param_layouts) or \
                [p.layouts[v.id] for v in p.graph.inputs] != \
                [q.layouts[v.id] for v in q.graph.inputs]:
            problems.append(f"rank {rank}: virtual stage {vs} planned otherwise from the file")
    err = float(np.max([relative_error(np.float64(x), y) for x, y in zip(losses, ref_losses)]))
    if not err <= 1e-10:
        problems.append(f"rank {rank}: losses {losses} differ from one device's by {err:.2e}")
    count = comm.all_reduce(np.array([len(problems)], dtype=np.int64), op="max")[0]
    assert not problems and not count, "\n".join(problems) or "another rank failed"


def test_bad_pipeline_strategy_files_are_refused_on_every_rank(tmp_path: Path) -> None:
    rank = comm.get_rank()
    root = shared_dir(tmp_path)
    one = root / "one.json"

    def run(**files: str) -> None:
        try:
            _searched(**files)(*_batch(0))
        finally:
            simpar.reset_auto_parallel_context()

    # One file for every rank: the two stages would overwrite each other's plan.
    raised_everywhere(lambda: run(save_file=str(one)), ValueError,
                      "save_file names one file for pipeline stages [0, 1]")
    # A stage's own file lacks the other stage's strategies.
    with abort_job_on_error("save per rank"):
        run(save_file=str(root / f"s_{rank}.json"))
    raised_everywhere(lambda: run(load_file=str(root / "s_0.json")), ValueError,
                      "holds no strategy of pipeline stage 1")
    # An op filed under another stage than the network runs it on.
    with abort_job_on_error("merge"):
        if rank == 0:
            (root / "all").mkdir()
            for r in range(comm.get_group_size()):
                (root / "all" / f"s_{r}.json").write_text((root / f"s_{r}.json").read_text())
            merge_pipeline_strategys(root / "all", root / "merged.json")
            doc = json.loads((root / "merged.json").read_text())
            first = next(iter(doc["parallel_strategy_item"]))
            doc["parallel_strategy_item"][first]["stage"] = 1
            (root / "moved.json").write_text(json.dumps(doc))
        comm.world().Barrier()
    raised_everywhere(lambda: run(load_file=str(root / "moved.json")), ValueError,
                      "under pipeline stage 1, but the network runs it on stage 0")
    if rank == 0:
        with pytest.raises(ValueError, match=r"no file in .* holds pipeline stage\(s\) \[1\]"):
            (root / "half").mkdir()
            (root / "half" / "s_0.json").write_text((root / "s_0.json").read_text())
            merge_pipeline_strategys(root / "half", root / "half.json")
        with pytest.raises(NotADirectoryError, match="is not a directory"):
            merge_pipeline_strategys(root / "merged.json", root / "x.json")
