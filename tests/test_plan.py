"""``python -m simpar.plan``: plan a model for any device count in one process, from shapes.

    python -m pytest tests/test_plan.py -q

Small models and the ``exact`` search, so every test runs in seconds: the CLI end to end
(its table, cost breakdown and JSON, whose strategies are those of
``simpar.parallel.search_strategies`` for the same inputs), the memory check (planning a GPT
of several GB of parameters allocates none of them), progress on stderr, and bad options.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simpar import graph, nn, plan
from simpar.cost import MindSporeCostModel, SimparCostModel
from simpar.nn import presets
from simpar.parallel import search_strategies
from simpar.runtime import build_program
from simpar.search import StrategyMap, set_search_cost_model
from simpar.strategy_table import strategy_table

SMALL_GPT = ["--model", "gpt", "--layers", "1", "--hidden", "32", "--heads", "4", "--seq", "8",
             "--vocab", "64", "--batch", "8", "--device-num", "2", "--search-mode", "exact"]
SMALL_MLP = ["--model", "mlp", "--in-features", "16", "--hidden", "64", "--classes", "8",
             "--batch", "16", "--device-num", "4", "--search-mode", "exact"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = plan.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _searched(net: nn.Cell, specs: list[Any], device_num: int, model: Any,
              dataset_strategy: str, search: str = "exact") -> StrategyMap:
    set_search_cost_model(model)
    try:
        return search_strategies(net, specs, device_num, search, dataset_strategy, False,
                                 ["data", "label"])
    finally:
        set_search_cost_model(None)


def _check_cost(d: dict[str, Any], device_num: int) -> None:
    cost = d["cost"]
    parts = ("compute", "op_comm", "redistribution", "grad_sync", "accumulation", "optimizer",
             "overhead")
    assert all(cost[k] >= 0 for k in parts)
    assert sum(cost[k] for k in parts) == pytest.approx(cost["step_seconds"], rel=1e-9)
    assert [m["rank"] for m in d["memory"]["ranks"]] == list(range(device_num))
    for m in d["memory"]["ranks"]:
        assert m["peak"] == (m["parameters"] + m["gradients"] + m["optimizer"]
                             + max(m["activations"] + max(m["comm_buffer"], m["backward"]),
                                   m["update"]))
        assert m["capacity"] == d["memory"]["capacity"] and m["over"] == 0
    assert d["memory"]["fits"] is True
    assert set(d["seconds"]) == {"trace", "search", "lower", "cost"}


def test_a_small_gpt_plans_end_to_end_and_its_json_holds_the_searched_strategies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "plan.json"
    code, out, err = _run([*SMALL_GPT, "--quiet", "--out", str(out_path)], capsys)
    assert code == 0, err
    assert err == ""  # --quiet: no progress
    assert "strategies (" in out and "parameter gradients:" in out
    assert "predicted step" in out and "gradient sync" in out and "redistribution" in out
    assert "memory per rank: peak" in out and "capacity 64.00 GiB: fits" in out
    assert "planned in" in out and f"wrote {out_path}" in out
    d = json.loads(out_path.read_text())
    assert d["device_num"] == 2 and d["search_mode"] == "exact" and d["profile"] == "ascend910b"
    _check_cost(d, 2)
    net = nn.WithLossCell(nn.GPT(64, 8, 32, 1, 4), nn.SoftmaxCrossEntropyWithLogits())
    assert d["model"]["parameters"] == sum(math.prod(p.shape) for p in net.get_parameters())
    ids = ((8, 8), np.dtype(np.int32))
    want = _searched(net, [ids, ids], 2, SimparCostModel("ascend910b", "adam"), "full_batch")
    got = StrategyMap.from_dict(d["strategy_map"])
    assert got == want
    assert {s["type"] for s in d["strategy_map"]["ops"].values()} >= {"MatMul", "Gather"}
    assert list(d["strategy_map"]["ops"])[0].startswith(
        "Default/network-WithLossCell/_backbone-GPT/embedding-Embedding/Gather-op")
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed


def test_comm_fusion_buckets_the_plans_gradient_allreduces() -> None:
    """--comm-fusion: the plan's Mirrors, as its program schedules them, one per group of
    ranks (the default), one per gradient (off), or buckets of at most 1 MB (with the 64-wide
    MLP's 16-64 KB gradients, one)."""
    mirrors = {}
    for fusion in ("one", "off", "1"):
        opts, _ = plan.parse_args([*SMALL_MLP, "--dataset-strategy", "data_parallel",
                                   "--search-mode", "recursive_programming", "--comm-fusion",
                                   fusion])
        made = plan.make_plan(opts)
        mirrors[fusion] = [s.label for s in made.program.schedule(0) if s.role == "mirror"]
    assert len(mirrors["one"]) == 1 and mirrors["one"][0].startswith("Mirror:4 params")
    assert len(mirrors["off"]) == 4 and mirrors["1"] == mirrors["one"]


def test_the_search_plans_under_device_memory_capacity_and_the_verdict_is_the_device_s(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--device-memory-capacity is the cap the search plans under (MindSpore's
    device_memory_capacity); the plan is judged against the profile's memory still. Under a
    cap the cuts cannot meet, the search's refusal is the exit; a plan over the device's
    memory says what else may make it fit."""
    opts, _ = plan.parse_args([*SMALL_GPT, "--device-memory-capacity", "123456"])
    assert opts.device_memory_capacity == 123456.0
    code, _, err = _run([*SMALL_GPT, "--quiet", "--device-memory-capacity", "1",
                         "--search-mode", "dynamic_programming"], capsys)
    assert code == 1 and "No available cost" in err and "capacity of 1 bytes" in err
    made = plan.make_plan(plan.parse_args([*SMALL_GPT, "--profile", "cpu-local"])[0])
    tight = dataclasses.replace(made.options.profile, memory_capacity=made.report.peak_memory - 1)
    over = dataclasses.replace(made, report=dataclasses.replace(
        made.report, memory=tuple(dataclasses.replace(m, capacity=tight.memory_capacity)
                                  for m in made.report.memory)))
    assert not over.report.fits
    assert "none it found does. --memory-dimensions when_needed" in plan.summary(over)
    assert "--memory-dimensions" not in plan.summary(made)


@pytest.mark.parametrize("search", ["recursive_programming", "sharding_propagation"])
def test_mindspore_s_fast_searches_plan_end_to_end(
        search: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "plan.json"
    argv = [*SMALL_GPT[:-1], search, "--quiet", "--out", str(out_path)]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    d = json.loads(out_path.read_text())
    assert d["search_mode"] == search
    _check_cost(d, 2)
    net = nn.WithLossCell(nn.GPT(64, 8, 32, 1, 4), nn.SoftmaxCrossEntropyWithLogits())
    ids = ((8, 8), np.dtype(np.int32))
    want = _searched(net, [ids, ids], 2, SimparCostModel("ascend910b", "adam"), "full_batch",
                     search)
    assert StrategyMap.from_dict(d["strategy_map"]) == want


def test_an_mlp_plans_under_mindspore_s_cost_model_with_the_batch_split(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "mlp.json"
    code, out, _ = _run([*SMALL_MLP, "--cost-model", "mindspore", "--dataset-strategy",
                         "data_parallel", "--profile", "ascend910a", "--optimizer", "momentum",
                         "--quiet", "--out", str(out_path)], capsys)
    assert code == 0
    assert "minimising mindspore's cost model" in out and "on ascend910a x 4" in out
    d = json.loads(out_path.read_text())
    _check_cost(d, 4)
    assert d["cost_model"] == "mindspore" and d["optimizer"] == "momentum"
    assert d["strategy_map"]["inputs"]["data"]["tensor_map"] == [0, -1]  # batch over 4
    net = nn.WithLossCell(nn.MLP(16, 64, 8, n_hidden=1), nn.SoftmaxCrossEntropyWithLogits())
    specs = [((16, 16), np.dtype(np.float32)), ((16,), np.dtype(np.int32))]
    want = _searched(net, specs, 4, MindSporeCostModel(), "data_parallel")
    assert StrategyMap.from_dict(d["strategy_map"]) == want


def test_progress_goes_to_stderr_through_the_search_logger_unless_quiet(
        capsys: pytest.CaptureFixture[str]) -> None:
    search_log = logging.getLogger("simpar.search")
    before = (list(search_log.handlers), search_log.level, search_log.propagate)
    code, _, err = _run(SMALL_MLP, capsys)
    assert code == 0
    lines = err.splitlines()
    assert any(line.startswith("simpar.plan: traced ") for line in lines), err
    assert any(line.startswith("simpar.search: cost graph: ") for line in lines), err
    assert "Traceback" not in err
    assert (list(search_log.handlers), search_log.level, search_log.propagate) == before
    code, _, err = _run([*SMALL_MLP, "--quiet"], capsys)
    assert code == 0 and err == ""


def test_planning_a_gpt_of_several_gib_allocates_none_of_its_parameters() -> None:
    """9.3 GiB of float32 parameters (a 51200-word vocabulary, hidden 8192, two layers) and
    sequences of 2048: constructing, tracing, searching, lowering and pricing it stays under
    32 MiB in all (numpy's allocations are traced by tracemalloc too; a materialised causal
    mask alone would be 16 MiB per layer)."""
    small, _ = plan.parse_args(SMALL_GPT)
    plan.make_plan(small)  # imports and caches first, so that only the plan itself is counted
    opts, _ = plan.parse_args(["--model", "gpt", "--layers", "2", "--hidden", "8192", "--heads",
                               "8", "--seq", "2048", "--vocab", "51200", "--batch", "2",
                               "--device-num", "2", "--search-mode", "exact"])
    tracemalloc.start()
    try:
        result = plan.make_plan(opts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.parameter_bytes > 9 * 2**30
    assert peak < 32 * 2**20, f"planning allocated {peak / 2**20:.1f} MiB"
    assert result.report.peak_memory > result.parameter_bytes / 2  # priced, not held


def test_the_causal_mask_is_a_view_of_one_row_and_equals_the_materialised_one() -> None:
    for seq in (1, 2, 7):
        attn = nn.MultiHeadAttention(8, 2, seq)
        want = np.triu(np.full((seq, seq), -1e9), k=1).astype(np.float32)
        assert attn._mask.dtype == want.dtype and np.array_equal(attn._mask, want)
        # rows step back one element, columns forward one: a view of 2 seq - 1 elements
        assert attn._mask.strides == (-4, 4) and not attn._mask.flags.writeable


def test_the_strategy_table_folds_blocks_that_read_alike() -> None:
    gpt, loss = nn.GPT(64, 8, 32, 3, 4), nn.SoftmaxCrossEntropyWithLogits()
    presets.megatron_gpt(gpt, 1, 4, loss)
    net = nn.WithLossCell(gpt, loss)
    ids = ((4, 8), np.dtype(np.int32))
    g = graph.trace(net, [ids, ids], ["data", "label"])
    program = build_program(g, 4, "semi_auto_parallel", "full_batch", True, cell=net)
    full, folded = strategy_table(program), strategy_table(program, fold_blocks=True)
    rows = [r for r in full.splitlines() if r.startswith("  block")]
    assert {r.split("/")[0].strip() for r in rows} == {"block0", "block1", "block2"}
    folded_rows = [r for r in folded.splitlines() if r.startswith("  block")]
    assert {r.split("/")[0].strip() for r in folded_rows} == {"block0..2"}
    assert len(folded_rows) * 3 == len(rows)
    assert [r.split(None, 1)[1] for r in folded_rows] == [
        r.split(None, 1)[1] for r in rows if r.startswith("  block0/")]
    assert full.splitlines()[-1] == folded.splitlines()[-1]  # the gradient sync line


def test_presets_are_alpa_s_and_flags_override_them() -> None:
    assert plan.GPT_PRESETS["1.3B"] == plan.GPTSize(2048, 24, 32, 1024, 51200)
    assert plan.GPT_PRESETS["39B"] == plan.GPTSize(8192, 48, 64)
    assert plan.GPT_PRESETS["175B"] == plan.GPTSize(12288, 96, 96, 2048)
    for size in plan.GPT_PRESETS.values():
        assert size.hidden % size.heads == 0
    opts, _ = plan.parse_args(["--preset", "350m", "--layers", "2", "--seq", "128"])
    assert (opts.hidden, opts.heads, opts.layers, opts.seq, opts.vocab) == (
        1024, 16, 2, 128, 51200)
    opts, _ = plan.parse_args(["--model", "mlp"])
    assert (opts.in_features, opts.hidden, opts.classes, opts.layers) == (1024, 4096, 1024, 1)


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "cnn"], "argument --model: invalid choice: 'cnn' (choose from 'gpt', 'mlp', "
     "'resnet18', 'resnet50')"),
    (["--preset", "3B"], "argument --preset: invalid choice: '3B' (choose from '125M'"),
    (["--profile", "tpu9"], "argument --profile: unknown profile 'tpu9'; shipped profiles are"),
    (["--profile", "/nonexistent/p.json"], "argument --profile: cannot read "
     "'/nonexistent/p.json'"),
    (["--search-mode", "greedy"], "argument --search-mode: invalid choice: 'greedy' (choose "
     "from"),
    (["--layers", "0"], "argument --layers: must be an int >= 1, got 0"),
    (["--batch", "-4"], "argument --batch: must be an int >= 1, got -4"),
    (["--device-num", "many"], "argument --device-num: must be an int >= 1, got 'many'"),
    (["--device-num", "8192"], "argument --device-num: must be an int in [1, 4096] "
     "(MindSpore's device_num range), got 8192"),
    (["--hidden", "100", "--heads", "16"], "argument --heads: 16 heads do not divide --hidden "
     "100"),
    (["--dataset-strategy", "data_parallel", "--batch", "100", "--device-num", "64"],
     "argument --batch: 100 does not split over --device-num 64 under --dataset-strategy "
     "data_parallel; use a multiple of 64"),
    (["--model", "mlp", "--heads", "4"], "argument --heads: not an option of --model mlp"),
    (["--classes", "10"], "argument --classes: not an option of --model gpt"),
    (["--out", "{tmp}/missing/plan.json"], "argument --out: '{tmp}/missing/plan.json': "
     "directory '{tmp}/missing' does not exist"),
    (["--out", "{tmp}"], "argument --out: '{tmp}': is a directory"),
    (["--comm-fusion", "0"], "argument --comm-fusion: must be one, auto, off or a bucket size "
     "in MB (an int >= 1), got '0'"),
    (["--device-memory-capacity", "-1"], "argument --device-memory-capacity: must be a finite "
     "number > 0, got -1"),
])
def test_bad_options_exit_2_with_one_line_naming_the_option(
        argv: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as stop:
        plan.main(argv)
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m simpar.plan: error: "), err
    assert message.replace("{tmp}", str(tmp_path)) in lines[0]


def test_a_search_that_finds_no_plan_exits_1_with_its_reason(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("No available cost: every plan needs 80 GiB per rank")

    monkeypatch.setattr(plan, "plan_request", refuse)
    code, _, err = _run([*SMALL_MLP, "--quiet"], capsys)
    assert code == 1
    assert err == ("python -m simpar.plan: error: no plan: No available cost: every plan needs "
                   "80 GiB per rank\n")


def test_the_json_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text('{"old": true}\n')
    with pytest.raises(ValueError, match="Out of range float values"):
        plan.write_json(target, {"a": list(range(10000)), "b": math.nan})
    assert json.loads(target.read_text()) == {"old": True}  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary left
    plan.write_json(target, {"new": [1, 2]})
    assert json.loads(target.read_text()) == {"new": [1, 2]}
