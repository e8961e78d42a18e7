"""The pipeline search and its pricing in one process (pure: shapes only, nothing runs).

    python -m pytest tests/test_pipeline_search.py -q
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from simpar import plan as plan_cli
from simpar.cost import load_profile
from simpar.pipeline.search import (
    LADDER,
    GPTShape,
    PipelinePlan,
    StageChoice,
    _split,
    _split_apart,
    _step,
    _units,
    price_choice,
    price_interleaved,
    search_pipeline,
)

SMALL = GPTShape(vocab=512, seq=64, hidden=128, layers=8, heads=8, batch=64, dtype="float32")


def test_the_split_fills_stages_evenly_under_the_slowest_stage_and_the_cap() -> None:
    """Blocks of 1 s each, the first stage 2 s more (the embedding), 3 stages, 10 blocks:
    the slowest stage takes 4 s ([2, 4, 4]); a cap of 3 blocks per stage leaves [2, 3, 3]
    for 8 blocks and nothing for 10."""
    def seconds(s: int, k: int) -> float:
        return k + (2.0 if s == 0 else 0.0)

    assert _split(10, 3, seconds, lambda s, k: 0, 1) == [2, 4, 4]
    assert _split(8, 3, seconds, lambda s, k: k, 3) == [2, 3, 3]
    assert _split(10, 3, seconds, lambda s, k: k, 3) is None


def test_each_stage_chooses_its_option_with_the_split() -> None:
    """Two options for a block: 1 s holding 2 bytes a micro-batch in flight, or 1.5 s (its
    forward again) holding 1. Two stages holding 2 and 1 micro-batches in flight under 1F1B,
    a cap of 12 bytes, 10 blocks. Plain, stage 0 fits 3 blocks and stage 1 6: no split.
    Every block recomputed: 5 and 5, the slowest stage 7.5 s. Each stage choosing: stage 0
    recomputes 4 blocks (6 s, 8 bytes), stage 1 runs 6 plain (6 s, 12 bytes), what a brute
    force over every split and option finds least."""
    flight = [2, 1]

    def seconds(s: int, k: int, o: int) -> float:
        return k * (1.0, 1.5)[o]

    def memory(s: int, k: int, o: int) -> int:
        return k * flight[s] * (2, 1)[o]

    assert _split_apart(10, 2, seconds, memory, 12, 1) is None
    uniform = _split_apart(10, 2, lambda s, k, o: seconds(s, k, 1),
                           lambda s, k, o: memory(s, k, 1), 12, 1)
    assert uniform == ([5, 5], [0, 0])
    found = _split_apart(10, 2, seconds, memory, 12, 2)
    assert found == ([4, 6], [1, 0])
    best = min(max(seconds(s, k, o) for s, (k, o) in enumerate(zip(ks, os)))
               for ks in itertools.product(range(1, 10), repeat=2) if sum(ks) == 10
               for os in itertools.product((0, 1), repeat=2)
               if all(memory(s, k, o) <= 12 for s, (k, o) in enumerate(zip(ks, os))))
    assert best == 6.0 == max(seconds(s, k, o) for s, (k, o) in enumerate(zip(*found)))


def test_a_searched_plan_recomputes_only_the_stages_that_need_it() -> None:
    """Under a cap that the blocks' activations, held as 1F1B holds them (more micro-batches
    in flight on the first stages), overflow on the first stages only, the ``"stages"`` rung
    recomputes those and not the last, and its step is faster than every block
    recomputed."""
    prof = load_profile("ascend910b")
    choice = StageChoice(2, 2, 2, None, False)
    plain = price_choice(SMALL, 16, 4, choice, prof)
    cap = (plain.stage_memory[-1] + plain.peak_memory) // 2   # the first stages over it
    assert not price_choice(SMALL, 16, 4, choice, prof, capacity=cap).fits
    apart = price_choice(SMALL, 16, 4, choice, prof, capacity=cap, apart=True)
    everyone = price_choice(SMALL, 16, 4, replace(choice, recompute=True), prof, capacity=cap)
    assert apart.fits and everyone.fits and apart.peak_memory <= cap
    assert 0 in apart.recomputed and 3 not in apart.recomputed and apart.rung == (None, "stages")
    assert apart.step_seconds < everyone.step_seconds
    assert apart.recomputed == (0, 1) and "recomputation on stages 0-1 of 4" in apart.describe()


def test_a_priced_choice_is_its_stages_timeline() -> None:
    prof = load_profile("ascend910b")
    plan = price_choice(SMALL, 16, 4, StageChoice(2, 2, 2, None, False), prof)
    assert plan.devices_per_stage == 4 and plan.micro_batches == 64 // 4
    assert sum(plan.blocks) == 8 and all(k >= 1 for k in plan.blocks)
    assert plan.fits and 0 < plan.bubble < 1 and plan.step_seconds > 0
    # A recomputed block costs its forward again and keeps only its input; level1 keeps
    # a slice of the optimizer state.
    _, block, _, _ = _units(SMALL, 4, StageChoice(2, 2, 2, None, False), prof, "adam")
    _, again, _, _ = _units(SMALL, 4, StageChoice(2, 2, 2, None, True), prof, "adam")
    _, sliced, _, _ = _units(SMALL, 4, StageChoice(2, 2, 2, "level1", False), prof, "adam")
    assert again.backward > block.backward and again.forward == pytest.approx(block.forward)
    assert again.activations < block.activations
    assert sliced.static < block.static
    # Every backward but the first adds its gradients into the step's sum: the timeline
    # is longer by at most all the stages' summing.
    emb, _, head, sent = _units(SMALL, 4, StageChoice(2, 2, 2, None, False), prof, "adam")
    m, blocks = plan.micro_batches, plan.blocks
    without, _ = _step(4, m, blocks, *(replace(u, summing=0.0) for u in (emb, block, head)),
                       sent, 4, prof)
    extra = (m - 1) * (sum(blocks) * block.summing + emb.summing + head.summing)
    assert block.summing > 0 and without < plan.step_seconds <= without + extra + 1e-15


def test_the_search_keeps_the_fastest_plan_that_fits_and_each_layout_climbs_the_ladder(
        ) -> None:
    cap = 24 * 2**20
    found = search_pipeline(SMALL, 16, "ascend910b", capacity=cap)
    assert found.best is not None and found.best.fits
    assert found.best.peak_memory <= cap
    fitting = [p for p in found.candidates if p.fits]
    assert found.best.step_seconds == min(p.step_seconds for p in fitting)
    # A layout stops at its first rung that fits, in the ladder's order.
    by_layout: dict[tuple[int, int, int, str | None], list[PipelinePlan]] = {}
    for p in found.candidates:
        if p.chunks == 1:
            by_layout.setdefault((p.stages, p.choice.tp, p.choice.mbs, p.choice.search),
                                 []).append(p)
    # Each Megatron layout's micro-batch is also planned with every op's cuts searched.
    assert {k[:3] for k in by_layout if k[3] == "recursive_programming"} == \
        {k[:3] for k in by_layout if k[3] is None}
    # A layout that fits is priced interleaved too (2 and 4 chunks per stage) where it can
    # run: the micro-batches a multiple of the stages, a block at least per virtual stage.
    woven = [p for p in found.candidates if p.chunks > 1]
    assert {p.chunks for p in woven} == {2, 4}
    assert all(p.micro_batches % p.stages == 0 and len(p.blocks) == p.chunks * p.stages
               <= SMALL.layers for p in woven)
    assert all(any(q.chunks == 1 and q.fits and q.stages == p.stages and q.choice == p.choice
                   for q in found.candidates) for p in woven)
    for tried in by_layout.values():
        rungs = [p.rung for p in tried]
        assert rungs == list(LADDER[:len(rungs)])
        assert all(not p.fits for p in tried[:-1])
    assert {p.stages for p in found.candidates} >= {2, 4, 8}
    fixed = search_pipeline(SMALL, 16, "ascend910b", stages=4, capacity=cap)
    assert {p.stages for p in fixed.candidates} == {4}
    tiny = search_pipeline(SMALL, 16, "ascend910b", capacity=2**16)
    assert tiny.best is None and all(not p.fits for p in tiny.candidates)
    assert "fits" in found.table()


def test_simpar_plan_searches_pipelines_and_prices_megatrons_configuration(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--pipeline-stages auto`` on a GPT Megatron-LM has a configuration for (its
    (hidden, layers) as GPT-3's, scaled down: the table is keyed by them)."""
    monkeypatch.setitem(plan_cli.MEGATRON, (128, 8), (2, 2))
    code = plan_cli.main(["--hidden", "128", "--layers", "8", "--heads", "8", "--seq", "64",
                          "--vocab", "512", "--batch", "64", "--device-num", "16",
                          "--pipeline-stages", "auto", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Megatron-LM's configuration: pp 2 x (tp 2 x dp 4" in out
    assert "plan: pp " in out and "as fast as Megatron-LM's" in out
    searched = float(out.split("plan: ")[1].split("predicted step ")[1].split(" s")[0])
    megatron = float(out.split("Megatron-LM's configuration: ")[1].split(
        "predicted step ")[1].split(" s")[0])
    assert searched <= megatron
    assert plan_cli.main(["--model", "mlp", "--pipeline-stages", "2"]) == 2
    assert np.isfinite(searched)


def test_interleaving_shrinks_the_bubble_and_holds_more_in_flight() -> None:
    """Equal choice, 4 stages: the interleaved step's bubble is smaller (Narayanan et al.
    2021: 1 / V of the plain schedule's), and its first stage holds more activations."""
    choice = StageChoice(2, 2, 2, None, False)
    plain = price_choice(SMALL, 16, 4, choice, "ascend910b")
    woven = price_interleaved(SMALL, 16, 4, choice, "ascend910b")
    assert woven is not None and woven.chunks == 2 and sum(woven.blocks) == 8
    assert woven.bubble < plain.bubble
    assert price_interleaved(SMALL, 16, 8, choice, "ascend910b") is None   # 8 x 2 > 8 blocks


def test_a_searched_stage_is_planned_by_the_operator_level_search() -> None:
    """A stage whose cuts the search chooses: its units' strategies come from the search (not
    Megatron's presets), for a micro-batch of the same rows, and it is priced like any."""
    from simpar.search import Source
    prof = load_profile("ascend910b")
    plans: dict[Any, Any] = {}
    choice = StageChoice(2, 2, 2, None, False, "recursive_programming")
    emb, block, head, sent = _units(SMALL, 4, choice, prof, "adam", plans)
    (parts, programs), = plans.values()
    for prog in programs:
        assert all(s.source is Source.SEARCHED for s in prog.strategy_map.ops.values())
        assert prog.device_num == 4
    assert parts[0].graph.inputs[0].shape[0] == choice.rows == 4
    assert block.forward > 0 and block.static > 0 and sent > 0
    plan = price_choice(SMALL, 16, 4, choice, prof)
    assert plan.micro_batches == SMALL.batch // 4 and "cuts searched by recursive_programming" \
        in plan.describe()
    megatron = search_pipeline(SMALL, 16, "ascend910b", stages=4, intra=None)
    assert all(p.choice.search is None for p in megatron.candidates)


def test_simpar_plan_s_pipeline_search_buckets_gradients_as_comm_fusion_says(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--comm-fusion`` reaches every stage's plan request in the pipeline search (they
    read the context), and the context is as it was afterwards."""
    import simpar.pipeline.search as search_module
    from simpar import context
    from simpar.comm_fusion import AllReduceFusion
    real = search_module.request_from_context
    seen: set[AllReduceFusion] = set()

    def spying(*args: Any, **kwargs: Any) -> Any:
        request = real(*args, **kwargs)
        seen.add(request.comm_fusion)
        return request

    monkeypatch.setattr(search_module, "request_from_context", spying)
    code = plan_cli.main(["--hidden", "128", "--layers", "4", "--heads", "8", "--seq", "64",
                          "--vocab", "512", "--batch", "32", "--device-num", "8",
                          "--pipeline-stages", "2", "--comm-fusion", "off", "--quiet"])
    assert code == 0, capsys.readouterr()
    assert seen == {AllReduceFusion(openstate=False)}
    assert context.auto_parallel_context().comm_fusion == AllReduceFusion()
