"""Pipeline stages in one process: which stage runs each op, each stage's graph, the
schedules, and the settings (no MPI; the runs are in tests/test_pipeline_mpi.py).

    python -m pytest tests/test_pipeline.py -q
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import simpar
from simpar import comm, graph, nn
from simpar.cost import load_profile
from simpar.cost.model import accumulation_seconds
from simpar.pipeline import (
    PipelineCost,
    bubble_fraction,
    in_flight,
    plan_pipeline,
    price_pipeline,
    schedule,
    split_stages,
    stages_of,
    timeline,
)


def _mlp(stages: tuple[int, ...] = ()) -> nn.WithLossCell:
    mlp = nn.MLP(8, 16, 4, n_hidden=2, dtype=np.float64)
    for layer, stage in zip(mlp.layers, stages):
        layer.pipeline_stage = stage
    return nn.WithLossCell(mlp, nn.SoftmaxCrossEntropyWithLogits())


def _trace(cell: nn.Cell) -> graph.Graph:
    return graph.trace(cell, [((4, 8), np.float64), ((4,), np.int32)], ["data", "label"])


def test_a_cells_stage_holds_its_ops_and_the_loss_follows_the_last() -> None:
    g = _trace(_mlp((0, 0, 1)))
    of = stages_of(g, 2)
    by_layer = {n.name.split("/")[3]: s for n, s in zip(g.nodes, of) if "fc" in n.name}
    assert by_layer == {"fc1-Dense": 0, "fc2-Dense": 0, "fc3-Dense": 1}
    loss = [s for n, s in zip(g.nodes, of) if "_loss_fn" in n.name]
    assert loss and set(loss) == {1}           # recorded outside any stage: its input's


def test_stages_are_checked() -> None:
    with pytest.raises(ValueError, match=r"pipeline_stage 2, but pipeline_stages is 2"):
        stages_of(_trace(_mlp((0, 1, 2))), 2)
    with pytest.raises(ValueError, match=r"reads .*, which stage 1 computes; a value may only "
                       "flow to its own or a later stage"):
        stages_of(_trace(_mlp((0, 1, 0))), 2)
    with pytest.raises(ValueError, match=r"no op runs on stage\(s\) \[1\] of the 3 stages"):
        stages_of(_trace(_mlp((0, 0, 2))), 3)


def test_each_stage_is_a_graph_of_its_own_ops_with_its_boundaries() -> None:
    g = _trace(_mlp((0, 1, 1)))
    st = split_stages(g, 2)
    assert sum(len(s.graph.nodes) for s in st) == len(g.nodes)
    first, last = st
    assert [v.name for v in first.graph.inputs] == ["data"] and first.batch == (0,)
    assert [v.name for v in last.graph.inputs][0] == "label" and last.batch[0] == 1
    (b,) = [x for x in last.received if x is not None]
    assert (b.producer, b.consumers) == (0, (1,))
    assert first.sent == (b,) and first.loss == (None,)
    assert last.loss == (0,) and last.sent == (None,)      # the loss, on the last stage
    assert last.graph.grad_inputs == (last.graph.inputs[1].id,)
    assert first.graph.grad_inputs == ()
    assert [n.id for n in last.graph.nodes] == list(range(len(last.graph.nodes)))
    params = {v.name for s in st for v in s.graph.params}
    assert params == {v.name for v in g.params}
    assert all(v.producer is n for s in st for n in s.graph.nodes for v in n.outputs)


def test_a_recomputed_cell_keeps_its_ops_on_its_stage() -> None:
    cell = _mlp((0, 1, 1))
    cell._backbone.fc2.recompute()      # type: ignore[attr-defined]
    first, last = split_stages(_trace(cell), 2)
    assert first.graph.segments == []
    (seg,) = last.graph.segments
    assert "fc2" in seg.name and all(last.graph.nodes[i].segment == 0 for i in seg.nodes)


def test_the_loss_must_be_on_the_last_stage() -> None:
    class Early(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Dense(8, 4, dtype=np.float64)
            self.second = nn.Dense(8, 4, dtype=np.float64)
            self.first.pipeline_stage, self.second.pipeline_stage = 0, 1
            self.loss = nn.SoftmaxCrossEntropyWithLogits()

        def construct(self, x: Any, y: Any) -> Any:
            self.second(x)                       # on stage 1, but the loss is on stage 0
            return self.loss(self.first(x), y)

    with pytest.raises(ValueError, match=r"output .* \(the loss\) must be computed on the "
                       r"last stage \(1\)"):
        split_stages(_trace(Early()), 2)


@pytest.mark.parametrize(("stages", "micro"), [(2, 1), (2, 4), (4, 4), (4, 8), (8, 2)])
def test_schedules_run_every_micro_batch_once_each_way_in_order(stages: int, micro: int
                                                                 ) -> None:
    for sched in ("gpipe", "1f1b"):
        for s in range(stages):
            tasks = schedule(sched, s, stages, micro)
            assert [k for kind, _, k in tasks if kind == "F"] == list(range(micro))
            assert [k for kind, _, k in tasks if kind == "B"] == list(range(micro))
            assert all(tasks.index(("F", 0, k)) < tasks.index(("B", 0, k))
                       for k in range(micro))
            assert in_flight(tasks) == (micro if sched == "gpipe" else min(stages - s, micro))


def test_schedules_are_checked_and_the_bubble_is_the_papers() -> None:
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match=r"scheduler must be one of \['1f1b', 'gpipe'\]"):
        schedule("zero_bubble_v", 0, 2, 2)
    with pytest.raises(ValueError, match="stage must be in 0..1"):
        schedule("1f1b", 2, 2, 2)


def test_the_settings_are_mindsporess() -> None:
    simpar.reset_auto_parallel_context()
    assert simpar.get_auto_parallel_context("pipeline_stages") == 1
    assert simpar.get_auto_parallel_context("pipeline_config") == {
        "pipeline_interleave": False, "pipeline_scheduler": "1f1b"}
    simpar.set_auto_parallel_context(pipeline_stages=4, pipeline_config={
        "pipeline_scheduler": "gpipe"})
    assert simpar.get_auto_parallel_context("pipeline_config")["pipeline_scheduler"] == "gpipe"
    with pytest.raises(simpar.context.ContextError, match="pipeline_stages must be an int"):
        simpar.set_auto_parallel_context(pipeline_stages=0)
    with pytest.raises(simpar.context.ContextError, match="pipeline_scheduler"):
        simpar.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "zb"})
    simpar.reset_auto_parallel_context()
    cell = nn.Dense(2, 2)
    with pytest.raises(TypeError, match="'pipeline_stage' must be int type"):
        cell.pipeline_stage = 1.0       # type: ignore[assignment]
    with pytest.raises(ValueError, match="can not be less than 0, but got -2"):
        cell.pipeline_stage = -2
    with pytest.raises(KeyError, match=r"stage_config names \['nope'\]"):
        nn.PipelineCell(_mlp(), 2, stage_config={"nope": 1})
    cell = _mlp()
    nn.Pipeline(cell, 2, segment_config={"_backbone.fc3": 1})
    assert cell._backbone.fc3.pipeline_segment == 1     # type: ignore[attr-defined]
    assert nn.Pipeline(_mlp(), 2).micro_size == 2


def test_a_stage_world_of_one_rank() -> None:
    with comm.stage_world([0]) as group:
        assert (comm.get_rank(), comm.get_group_size(), group.ranks) == (0, 1, (0,))
    with pytest.raises(ValueError, match="is not among the ranks"), comm.stage_world([1]):
        pass


# ------------------------------------------------------------------ the timeline and prices
def _equal(stages: int, micro: int, chunks: int, sched: str, f: float = 1.0, b: float = 2.0
           ) -> dict[tuple[int, str, int, int], tuple[float, float]]:
    """Every stage's tasks on a timeline, each chunk taking f / chunks forward and
    b / chunks backward, messages free: virtual stage v feeds v + 1."""
    tasks = [schedule(sched, s, stages, micro, chunks) for s in range(stages)]
    last = stages * chunks - 1

    def needs(s: int, task: tuple[str, int, int]) -> list[tuple[int, Any, float]]:
        kind, c, k = task
        v = c * stages + s
        if kind == "F":
            return [] if v == 0 else [((v - 1) % stages, ("F", (v - 1) // stages, k), 0.0)]
        out = [(s, ("F", c, k), 0.0)]
        return out if v == last else [*out, ((v + 1) % stages, ("B", (v + 1) // stages, k),
                                             0.0)]

    return timeline(tasks, lambda s, t: (f if t[0] == "F" else b) / chunks, needs)


@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (2, 8), (4, 4), (4, 8), (8, 8),
                                                (8, 16)])
def test_every_schedule_runs_without_deadlock_and_the_bubble_is_the_papers(
        stages: int, micro: int) -> None:
    """Equal stages: GPipe and 1F1B take (M + S - 1)(F + B); interleaved with V chunks
    (M + (S - 1) / V)(F + B) (Narayanan et al. 2021, section 2.2.1)."""
    for sched, chunks in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("1f1b", 4),
                          ("gpipe", 2)):
        spans = _equal(stages, micro, chunks, sched)
        assert len(spans) == 2 * micro * chunks * stages   # every task ran: no deadlock
        end = max(e for _, e in spans.values())
        if chunks == 1 or sched == "1f1b":
            assert end == pytest.approx((micro + (stages - 1) / chunks) * 3.0), (sched, chunks)
            assert (end - 3.0 * micro) / end == pytest.approx(
                bubble_fraction(stages, micro, chunks))


def test_a_deadlocking_order_raises() -> None:
    tasks = [(("F", 0, 0), ("B", 0, 0)), (("B", 0, 0), ("F", 0, 0))]   # stage 1 backward first

    def needs(s: int, task: tuple[str, int, int]) -> list[tuple[int, Any, float]]:
        kind, c, k = task
        if s == 1 and kind == "F":
            return [(0, ("F", 0, k), 0.0)]
        if s == 1:
            return [(1, ("F", 0, k), 0.0)]
        return [] if kind == "F" else [(1, ("B", 0, k), 0.0)]

    with pytest.raises(ValueError, match="the schedule deadlocks"):
        timeline(tasks, lambda s, t: 1.0, needs)


def test_a_pipelines_price_counts_its_bubble_messages_and_micro_batches_in_flight() -> None:
    """A GPT cut into 4 stages on 8 devices (2 per stage), priced purely: every stage's
    busy time is its micro-batches' forwards and backwards, and the three later ones'
    gradients added into the first's; GPipe holds every micro-batch in flight and 1F1B at
    most S - s, and the messages cost something."""
    summing: list[float] = []

    def plan(sched: str) -> PipelineCost:
        net = nn.GPT(32, 8, 16, 6, 2, dtype=np.float64)
        parts = [net.embedding, *net.blocks, net.head]
        for k, unit in enumerate(parts):
            unit.pipeline_stage = k * 4 // len(parts)
        net.ln_f.pipeline_stage = 3
        cell = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits())
        stages, programs = plan_pipeline(cell, [((4, 8), np.int32), ((4, 8), np.int32)], 4, 8,
                                         "data_parallel", "data_parallel", 4)
        assert [p.device_num for p in programs] == [2] * 4
        summing[:] = [accumulation_seconds(p, load_profile("cpu-local")) for p in programs]
        return price_pipeline(stages, programs, 4, sched, 4, "cpu-local", "adam")

    gpipe, one = plan("gpipe"), plan("1f1b")
    assert all(a > 0 for a in summing)
    for cost in (gpipe, one):
        for s in cost.stages:
            assert s.busy == pytest.approx(4 * (s.forward + s.backward) + 3 * summing[s.stage])
            assert s.idle >= 0 and s.end >= s.busy
        assert cost.step_seconds >= max(s.end for s in cost.stages)
        assert cost.p2p_seconds > 0 and 0 < cost.bubble < 1
    assert [s.in_flight for s in gpipe.stages] == [4, 4, 4, 4]
    assert [s.in_flight for s in one.stages] == [4, 3, 2, 1]
    assert gpipe.stages[3].peak_memory > one.stages[3].peak_memory > 0   # 4 against 1
    assert "stage 3:" in one.table()


def test_a_pipeline_that_does_not_divide_the_ranks_or_the_units_is_refused() -> None:
    from simpar import train
    from simpar.train_pipeline import assign_stages
    args = train.parse_args(["--strategy", "dp", "--pipeline-stages", "3",
                             "--pipeline-schedule", "gpipe"])
    with pytest.raises(train.UsageError, match="--pipeline-stages 3 does not divide the 8 ranks"):
        train.mesh(args, 8)
    with pytest.raises(ValueError, match=r"--pipeline-stages 4 with 2 interleaved chunks needs "
                       r"at least 8 units to cut between, but the GPT has 4"):
        assign_stages(nn.GPT(32, 8, 16, 2, 2), 4, 2)


def _gpt_stages(capacity: float | None = None, scheduler: str = "1f1b") -> list[Any]:
    """The per-stage plans of a 4-block GPT in 2 stages, 4 micro-batches, with the memory
    dimensions searched (every block a recomputation candidate) under ``capacity``."""
    from simpar.cost_model_context import reset_cost_model_context, set_cost_model_context
    from simpar.pipeline import plan_pipeline
    net = nn.GPT(32, 8, 16, 4, 2, dtype=np.float64)
    for k, unit in enumerate([net.embedding, *net.blocks, net.head, net.ln_f]):
        unit.pipeline_stage = 0 if k < 3 else 1
    for block in net.blocks:
        block.recompute()
    cell = nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits())
    simpar.set_auto_parallel_context(parallel_mode="auto_parallel", pipeline_stages=2,
                                     search_mode="dynamic_programming")
    simpar.set_algo_parameters(memory_dimensions="search")
    if capacity is not None:
        set_cost_model_context(device_memory_capacity=capacity)
    try:
        _, programs = plan_pipeline(cell, [((4, 8), np.int32), ((4, 8), np.int32)], 2, 4,
                                    "auto_parallel", "data_parallel", 4, scheduler=scheduler)
    finally:
        simpar.reset_auto_parallel_context()
        simpar.reset_algo_parameters()
        reset_cost_model_context()
    return [p.strategy_map.dimensions for p in programs]


def test_each_stage_searches_its_memory_dimensions_for_the_micro_batches_it_holds() -> None:
    """Under 1F1B stage 0 holds 2 of the 4 micro-batches' activations at once, stage 1 one;
    each stage's search counts that many, so a cap between the two stages' needs makes the
    first stage recompute and leaves the second alone. Under GPipe both hold all 4."""
    free = _gpt_stages()
    none = [next(a for a in found.alternatives if a.key == (4, None, ())) for found in free]
    assert all(found.chosen.key == (4, None, ()) for found in free)   # nothing binds
    lean = [found.least_memory for found in free]
    assert lean[0].memory < none[0].memory and none[1].memory < none[0].memory
    cap = max(none[1].memory, lean[0].memory) + 1.0
    assert cap < none[0].memory
    first, second = _gpt_stages(cap)
    assert first.chosen.recompute or first.chosen.level is not None
    assert second.chosen.key == (4, None, ())
    assert first.chosen.memory <= cap and second.chosen.memory <= cap
    # GPipe keeps every micro-batch's activations: stage 0's need grows by 4 / 2.
    gpipe = _gpt_stages(scheduler="gpipe")
    held = next(a for a in gpipe[0].alternatives if a.key == (4, None, ()))
    assert held.memory > none[0].memory


def _cell_of(name: str) -> str:
    """The GPT's top Cell an op runs in: "block1", "embedding", "head", ..."""
    return name.split("_backbone-GPT/")[1].split("-")[0] if "_backbone-GPT/" in name else name


def test_auto_pipeline_cuts_a_gpt_between_its_blocks_with_even_flops() -> None:
    """balance_stages: contiguous, every stage non-empty, each cut where one value (the
    residual stream) crosses, and the stages' FLOPs as even as the blocks allow."""
    from simpar.pipeline.stages import balance_stages
    net = nn.GPT(32, 8, 16, 4, 2, dtype=np.float64)
    g = graph.trace(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits()),
                    [((4, 8), np.int32), ((4, 8), np.int32)], ["data", "label"])
    for stages in (1, 2, 4):
        of = balance_stages(g, stages)
        assert of == sorted(of) and set(of) == set(range(stages))
        for k in range(len(of) - 1):
            if of[k] != of[k + 1]:   # a cut after node k: only the residual stream crosses
                made = {v.id for n in g.nodes[:k + 1] for v in n.outputs}
                later = {v.id for n in g.nodes[k + 1:] for v in n.inputs}
                assert len(made & later) == 1, g.nodes[k].name
                assert _cell_of(g.nodes[k].name) != _cell_of(g.nodes[k + 1].name)
    blocks = [{_cell_of(n.name) for n, s in zip(g.nodes, of) if s == stage
               and _cell_of(n.name).startswith("block")} for stage in range(4)]
    assert all(len(b) == 1 for b in blocks[1:3])   # 4 blocks over 4 stages: one each inside
    with pytest.raises(ValueError, match="cannot cut"):
        balance_stages(g, len(g.nodes) + 1)


def test_auto_pipeline_prices_every_stage_count_and_keeps_the_fastest_that_fits() -> None:
    from simpar.cost_model_context import reset_cost_model_context, set_cost_model_context
    from simpar.pipeline.auto import choose_stages
    from simpar.runtime import lower
    from simpar.search import plan_request, request_from_context
    from simpar.search.dimensions import graph_of

    def run(capacity: float | None) -> tuple[int, list[Any]]:
        net = nn.WithLossCell(nn.GPT(32, 8, 16, 4, 2, dtype=np.float64),
                              nn.SoftmaxCrossEntropyWithLogits())
        specs = [((4, 8), np.dtype(np.int32)), ((4, 8), np.dtype(np.int32))]
        # Sharding propagation keeps the cuts the dataset gives whatever the cap (the searches
        # of the cuts would trade them for memory): the stages are the only way under it.
        simpar.set_auto_parallel_context(parallel_mode="auto_parallel",
                                         dataset_strategy="data_parallel",
                                         search_mode="sharding_propagation")
        if capacity is not None:
            set_cost_model_context(device_memory_capacity=capacity)
        try:
            g = graph.trace(net, specs, ["data", "label"])
            request = request_from_context(g, cell=net, mode="auto_parallel", device_num=4,
                                           micro_batches=4)

            def plan_one() -> Any:
                smap = plan_request(request)
                return lower(graph_of(request, smap), smap, request.enable_alltoall)

            return choose_stages(net, specs, 4, 4, "data_parallel", 4, "1f1b", request,
                                 plan_one)
        finally:
            simpar.reset_auto_parallel_context()
            reset_cost_model_context()

    chosen, priced = run(None)
    assert [p.stages for p in priced] == [1, 2, 4] and all(p.fits for p in priced)
    assert chosen == min(priced, key=lambda p: (p.step_seconds, p.stages)).stages
    one = priced[0]
    least = min(p.peak_memory for p in priced[1:])
    assert least < one.peak_memory                     # stages hold less per rank
    squeezed, again = run((least + one.peak_memory) / 2)
    assert squeezed > 1 and not again[0].fits
    assert again[[p.stages for p in again].index(squeezed)].fits


def test_a_stage_holds_the_most_activations_its_schedule_keeps_at_once() -> None:
    """Interleaved 1F1B, 4 stages, 8 micro-batches, 2 chunks: on stage 1 each chunk's most in
    flight (8 and 4) never coincide; at most 9 micro-batches' activations are held at once,
    which is what the stage's memory counts (not 12)."""
    from simpar.pipeline.schedules import chunk_in_flight, in_flight, most_held
    tasks = schedule("1f1b", 1, 4, 8, 2)
    assert chunk_in_flight(tasks, 2) == [8, 4] and in_flight(tasks) == 9
    assert most_held(tasks, [100.0, 100.0]) == 900.0
    assert most_held(tasks, [100.0, 0.0]) == 800.0                 # chunk 0 alone: its 8
    assert most_held(tasks, [100.0, 100.0], [5.0, 50.0]) == 950.0  # chunk 1's transient
    assert most_held(schedule("gpipe", 0, 4, 8), [1.0]) == 8.0      # GPipe: all of them
