"""The main job, ``simpar.train.main``: short runs on real ranks, and its argument checks.

    mpirun -n 8 python -m pytest tests/test_train_main.py -q --with-mpi -m mpi
    python -m pytest tests/test_train_main.py -q            # the argument checks

Each multi-rank run trains 2-3 steps (the default 20-step job is too slow for the suite) and
runs the job's own check against the single-device run. Rank 0 writes ``summary.json`` into
rank 0's ``tmp_path``, whose name is broadcast so that every rank reads the same summary and
passes or fails together.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.comm as comm
from simpar import train
from simpar.search import set_search_cost_model
from tests.mpi_guard import shared_dir


@pytest.fixture(autouse=True)
def _clean_context() -> Any:
    yield
    simpar.reset_auto_parallel_context()
    simpar.set_seed(0)
    set_search_cost_model(None)  # the job sets its --profile's model for the searches




def _main(argv: list[str], tmp_path: Path) -> tuple[int, dict[str, Any]]:
    """Run the job on every rank; its exit code and the summary rank 0 wrote."""
    out = shared_dir(tmp_path) / "out"
    code = train.main([*argv, "--out", str(out)])
    comm.barrier()  # rank 0 writes the summary after the others may have returned
    return code, json.loads((out / "summary.json").read_text())


def _check_summary(summary: dict[str, Any], steps: int, dtype: str = "float64") -> None:
    tol = 1e-5 if dtype == "float32" else 1e-10
    assert summary["passed"] is True
    assert summary["max_dloss"] <= tol and summary["max_dparam"] <= tol
    assert summary["steps"] == steps and len(summary["losses"]) == steps
    assert all(math.isfinite(x) and x > 0 for x in summary["losses"])
    assert len(summary["step_seconds"]) == steps and summary["tokens_per_s"] > 0
    assert summary["comm"], "the run recorded no collectives"
    for kind, row in summary["comm"].items():
        # Every step runs the same program, so the same collectives.
        assert row["count"] > 0 and row["count"] % steps == 0, (kind, row)
        assert row["bytes_sent"] > 0 and row["bytes_recv"] > 0 and row["seconds"] >= 0


@pytest.mark.mpi(min_size=2)
def test_gpt_auto_parallel_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default job: auto_parallel, strategies searched by dynamic programming, each rank
    loading its batch slice; it trains like one device. Rank 0 prints, in this order, the
    searched strategy table, why it won, the predicted and the measured step time, and last
    the check against one device."""
    n = comm.get_group_size()
    code, summary = _main(["--steps", "2"], tmp_path)
    assert code == 0
    _check_summary(summary, 2)
    assert (summary["model"], summary["mode"], summary["search_mode"]) == (
        "gpt", "auto_parallel", "dynamic_programming")
    assert summary["strategy"] is None and summary["predicted_step_seconds"] > 0
    assert len(summary["strategies"]) > 50
    assert all(math.prod(c) <= n for s in summary["strategies"].values() for c in s)
    out = capsys.readouterr().out.splitlines()
    if comm.get_rank() > 0:
        assert out == []
        return
    _check_default_job_printout(out, summary)


def _check_default_job_printout(out: list[str], summary: dict[str, Any]) -> None:
    """Every line the issue asks of the default job, checked against its summary."""
    def find(prefix: str) -> int:
        found = [k for k, line in enumerate(out) if line.startswith(prefix)]
        assert len(found) == 1, (prefix, out)
        return found[0]

    find("strategies searched by dynamic_programming on the cpu-local profile")
    title = find("strategies (")
    strategies = summary["strategies"]
    assert re.match(rf"strategies \(\d+ of {len(strategies)} ops shown: .*; the rest searched",
                    out[title]), out[title]
    assert out[title + 1].split() == ["op", "strategy", "out", "map", "forward", "backward",
                                      "repeated", "set", "by"]
    sync = find("  parameter gradients: ")
    full = {short: name for name, short in train.display_names(list(strategies)).items()}
    for row in out[title + 2:sync]:  # each row: the searched strategy of that op
        op, strategy = row.split()[:2]
        assert strategy == str(strategies[full[op]]).replace(" ", ""), row
        assert row.endswith("  search"), row
    won = find("why it won (predicted per step on cpu-local, ms")
    header = out[won + 1].split()
    assert header[:3] == ["plan", "step", "ms"] and header[-2:] == ["peak", "MiB"]
    plans: dict[str, list[str]] = {}
    for row in out[won + 2:]:
        if not row.startswith("  "):
            break
        label, cells = re.split(r"\s{2,}", row.strip(), maxsplit=1)
        plans[label] = cells.split()
    assert list(plans) == ["searched (dynamic_programming)", "preset dp (pure data parallel)",
                           "preset mp", "preset hybrid"]
    searched = float(plans.pop("searched (dynamic_programming)")[0])
    runs = {k: c for k, c in plans.items() if c[:4] != ["does", "not", "run", "here:"]}
    assert "preset dp (pure data parallel)" in runs
    assert all(len(c) == 7 for c in runs.values()), runs  # step, 5 parts, peak memory
    assert f"{searched:.2f}" == f"{summary['predicted_step_seconds'] * 1e3:.2f}"
    best = min(float(c[0]) for c in runs.values())
    ratio = re.search(r"the searched plan is predicted ([\d.]+)x as fast as the best preset",
                      out[won])
    assert ratio and float(ratio[1]) == pytest.approx(best / searched, abs=0.01), out[won]
    assert searched <= best + 0.01, "the search lost to a hand-written preset"
    predicted = find("cost model (cpu-local): predicted step ")
    median = float(np.median(summary["step_seconds"][1:]))
    assert (f"predicted step {summary['predicted_step_seconds'] * 1e3:.1f} ms (measured median "
            f"{median * 1e3:.1f} ms)") in out[predicted]
    check = find("check against one device (2 steps, every rank's shards): ")
    assert out[check].endswith(": PASS") and check == len(out) - 1
    assert title < won < predicted < check


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("search", ["recursive_programming", "sharding_propagation"])
def test_mindspore_s_fast_searches_run_the_job(search: str, tmp_path: Path) -> None:
    """``--search-mode recursive_programming`` and ``sharding_propagation``: the job plans
    with them and trains like one device."""
    code, summary = _main(["--model", "mlp", "--search-mode", search, "--steps", "2"],
                          tmp_path)
    assert code == 0
    _check_summary(summary, 2)
    assert (summary["mode"], summary["search_mode"]) == ("auto_parallel", search)
    assert summary["predicted_step_seconds"] > 0


@pytest.mark.mpi(min_size=2)
def test_a_resumed_job_is_bit_identical_and_passes_its_check(tmp_path: Path) -> None:
    """``--save-every 2 --ckpt-dir D``, then ``--resume D`` of the same job: the resumed
    steps' losses equal the uninterrupted run's bit for bit, and its single-device check
    (from step 0: the checkpoint keeps the earlier losses) passes. Resuming under the
    Megatron preset (another strategy) passes the check too."""
    ckpt = shared_dir(tmp_path) / "ckpt"
    argv = ["--model", "mlp", "--steps", "4", "--optimizer", "adam"]
    code, whole = _main([*argv, "--save-every", "2", "--ckpt-dir", str(ckpt)], tmp_path)
    assert code == 0 and whole["passed"] is True
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002", "step_000004"]
    code, resumed = _main([*argv, "--resume", str(ckpt / "step_000002")], tmp_path / "r")
    assert code == 0 and resumed["passed"] is True
    assert resumed["losses"] == whole["losses"]
    code, other = _main([*argv, "--strategy", "mp", "--resume", str(ckpt / "step_000002")],
                        tmp_path / "o")
    assert code == 0 and other["passed"] is True
    np.testing.assert_allclose(other["losses"], whole["losses"], rtol=1e-10)


@pytest.mark.mpi(min_size=2)
def test_gpt_hybrid_preset(tmp_path: Path) -> None:
    n = comm.get_group_size()
    code, summary = _main(["--strategy", "hybrid", "--steps", "3"], tmp_path)
    assert code == 0
    _check_summary(summary, 3)
    assert (summary["model"], summary["mode"], summary["strategy"]) == (
        "gpt", "semi_auto_parallel", "hybrid")
    assert (summary["dp"], summary["mp"]) == (2, n // 2)
    head = [v for k, v in summary["strategies"].items() if "head-Dense/MatMul" in k]
    assert head == [[[2, 1], [n // 2, 1]]]
    # Tensor parallel: the row-parallel layers' AllReduces plus the Mirrors.
    assert set(summary["comm"]) == {"AllReduce"}
    if n > 2:
        assert summary["comm"]["AllReduce"]["count"] >= 3 * (2 + 4 * 2)


@pytest.mark.mpi
def test_trace_is_chrome_trace_events_with_every_rank_and_the_prediction(tmp_path: Path
                                                                         ) -> None:
    """``--trace FILE`` on 1, 2, 4 and 8 ranks: a trace-event file in which every event has
    name, ph, ts, pid and tid and every complete event a dur; one process per rank (its
    steps, collectives and kernels, the collectives being exactly those the job traced) and
    the cost model's predicted timeline as a process of its own."""
    n = comm.get_group_size()
    path = shared_dir(tmp_path) / "trace.json"
    code, summary = _main(["--model", "mlp", "--steps", "2", "--trace", str(path)], tmp_path)
    assert code == 0
    comm.barrier()
    events = json.loads(path.read_text())["traceEvents"]
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert [names[r] for r in range(n)] == [f"rank {r}" for r in range(n)]
    assert names[n].startswith("predicted (cost model on cpu-local")
    assert set(names) == set(range(n + 1))
    for r in range(n):
        mine = [e for e in events if e["pid"] == r and e["ph"] == "X"]
        assert [e["name"] for e in mine if e.get("cat") == "step"] == ["step 1", "step 2"]
        kinds = sorted(e["name"] for e in mine if e.get("cat") == "collective")
        traced = sum(int(row["count"]) for row in summary["comm"].values())
        assert len(kinds) == traced or r != 0   # the summary counts rank 0's, the whole run
    predicted = [e for e in events if e["pid"] == n and e["ph"] == "X"]
    assert {e["cat"] for e in predicted} >= {"compute"}


@pytest.mark.mpi
def test_report_on_every_world_size(tmp_path: Path) -> None:
    """``--report DIR`` on 1, 2, 4 and 8 ranks: rank 0 writes the page, its data and its
    pictures; the page holds the check's verdict and every picture inlined."""
    out = shared_dir(tmp_path) / "report"
    code, _ = _main(["--model", "mlp", "--steps", "2", "--report", str(out)], tmp_path)
    assert code == 0
    comm.barrier()
    data = json.loads((out / "report.json").read_text())
    assert f"{comm.get_group_size()} ranks" in data["title"]
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 4 and ": PASS</pre>" in page


@pytest.mark.mpi(min_size=2)
def test_the_job_saves_its_plan_and_runs_a_saved_one(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """``--save-strategy FILE`` writes MindSpore's strategy file of the searched plan;
    ``--load-strategy FILE`` runs that plan with nothing searched, says so, and passes."""
    path = shared_dir(tmp_path) / "plan.json"
    code, saved = _main(["--model", "mlp", "--steps", "2", "--save-strategy", str(path)],
                        tmp_path / "a")
    assert code == 0 and "parallel_strategy_item" in json.loads(path.read_text())
    capsys.readouterr()
    code, loaded = _main(["--model", "mlp", "--steps", "2", "--load-strategy", str(path)],
                         tmp_path / "b")
    assert code == 0 and loaded["passed"] is True
    assert loaded["strategies"] == saved["strategies"]
    if comm.get_rank() == 0:
        out = capsys.readouterr().out
        assert f"strategies loaded from {path} (strategy_ckpt_config's load_file)" in out
        assert "searched by" not in out


@pytest.mark.mpi(min_size=2)
def test_a_pipelined_trace_predicts_every_stage_s_tasks(tmp_path: Path) -> None:
    """``--trace`` of a pipelined run: the predicted process has a thread per stage with its
    forward and backward tasks (``F0``, ``B1``, ...), every micro-batch's, each step."""
    path = shared_dir(tmp_path) / "trace.json"
    code, _ = _main(["--model", "mlp", "--steps", "2", "--pipeline-stages", "2",
                     "--micro-batches", "2", "--trace", str(path)], tmp_path)
    assert code == 0
    comm.barrier()
    events = json.loads(path.read_text())["traceEvents"]
    n = comm.get_group_size()
    threads = {e["tid"]: e["args"]["name"] for e in events
               if e["name"] == "thread_name" and e["pid"] == n}
    assert sorted(threads.values()) == ["stage 0", "stage 1"]
    tasks = [e["name"] for e in events if e["pid"] == n and e["ph"] == "X"]
    assert sorted(tasks) == sorted(["F0", "F1", "B0", "B1"] * 2 * 2)   # 2 stages, 2 steps


@pytest.mark.mpi(min_size=2)
def test_a_pipelined_report_draws_each_stage(tmp_path: Path) -> None:
    out = shared_dir(tmp_path) / "report"
    code, _ = _main(["--model", "mlp", "--steps", "2", "--pipeline-stages", "2",
                     "--micro-batches", "2", "--report", str(out)], tmp_path)
    assert code == 0
    comm.barrier()
    data = json.loads((out / "report.json").read_text())
    assert len(data["pipeline_cost"]["stages"]) == 2 and data["cost"] is None
    assert "predicted pipelined step per stage" in (out / "report.html").read_text()


@pytest.mark.mpi(min_size=2)
def test_resnet_with_its_classes_cut(tmp_path: Path) -> None:
    """``--model resnet --strategy mp``: the classifier's classes cut over every rank (its
    weight rows, the one-hot labels and the dense cross entropy), the rest data parallel
    over none; the job trains like one device."""
    n = comm.get_group_size()
    code, summary = _main(["--model", "resnet", "--strategy", "mp", "--steps", "2"], tmp_path)
    assert code == 0
    _check_summary(summary, 2)
    assert (summary["model"], summary["dp"], summary["mp"]) == ("resnet", 1, n)
    head = [v for k, v in summary["strategies"].items() if "end_point-Dense/MatMul" in k]
    assert head == [[[1, 1], [n, 1]]]
    onehot = [v for k, v in summary["strategies"].items() if "/OneHot" in k]
    assert onehot == [[[1, n], [], []]]


@pytest.mark.mpi(min_size=2)
def test_gpt_data_parallel_momentum(tmp_path: Path) -> None:
    code, summary = _main(["--steps", "2", "--parallel-mode", "data_parallel", "--optimizer",
                           "momentum"], tmp_path)
    assert code == 0
    _check_summary(summary, 2)
    assert (summary["mode"], summary["dp"], summary["mp"]) == (
        "data_parallel", comm.get_group_size(), 1)
    assert set(summary["comm"]) == {"AllReduce"}


@pytest.mark.mpi(min_size=2)
def test_mlp_megatron_float32(tmp_path: Path) -> None:
    code, summary = _main(["--model", "mlp", "--strategy", "mp", "--steps", "3", "--dtype",
                           "float32", "--optimizer", "momentum"], tmp_path)
    assert code == 0
    _check_summary(summary, 3, "float32")
    assert (summary["dp"], summary["mp"], summary["dtype"]) == (1, comm.get_group_size(),
                                                                "float32")
    fc1 = [v for k, v in summary["strategies"].items() if "fc1-Dense/MatMul" in k]
    assert fc1 == [[[1, 1], [comm.get_group_size(), 1]]]


@pytest.mark.mpi(min_size=2)
def test_mlp_summed_gradients_match_the_scaled_single_device_run(tmp_path: Path) -> None:
    """``--no-gradients-mean``: the job's check compares with D times the single-device
    gradient (D = the batch cut at the loss op), and passes."""
    code, summary = _main(["--model", "mlp", "--strategy", "dp", "--steps", "3",
                           "--no-gradients-mean", "--optimizer", "sgd"], tmp_path)
    assert code == 0
    _check_summary(summary, 3)
    assert (summary["dp"], summary["mp"]) == (comm.get_group_size(), 1)


# ------------------------------------------------------------------ one process
def test_one_process_run_writes_a_passing_summary(tmp_path: Path) -> None:
    if comm.get_group_size() != 1:
        pytest.skip("the one-process run")
    code = train.main(["--model", "mlp", "--steps", "2", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0
    assert summary["passed"] is True and len(summary["losses"]) == 2
    assert not (tmp_path / "summary.json.tmp").exists()


def test_checkpoint_options_are_checked_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Resuming beyond --steps, with other settings, or into a --ckpt-dir that holds a step
    the job would save, exits 2 with one line before anything is planned."""
    if comm.get_group_size() != 1:
        pytest.skip("the one-process run")
    ckpt = tmp_path / "ckpt"
    job = ["--model", "mlp", "--no-check", "--profile", "none"]
    assert train.main([*job, "--steps", "2", "--save-every", "2", "--ckpt-dir", str(ckpt)]) == 0
    capsys.readouterr()
    for argv, message in [
            (["--steps", "1", "--resume", str(ckpt)],
             "is after step 2, beyond --steps 1"),
            (["--steps", "4", "--seed", "3", "--resume", str(ckpt)],
             "was saved with --seed 0, this job has 3"),
            (["--steps", "4", "--save-every", "2", "--ckpt-dir", str(ckpt)],
             f"--ckpt-dir {ckpt} already holds step_000002, which this job would save"),
            (["--steps", "4", "--resume", str(tmp_path / "nothing")],
             "no complete checkpoint there"),
            (["--steps", "4", "--save-every", "2"], "--save-every 2 needs --ckpt-dir")]:
        with pytest.raises(SystemExit) as exc:
            train.main([*job, *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err, argv


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
    (["--n-heads", "0"], "--n-heads must be >= 1, got 0"),
    (["--steps", "three"], "argument --steps: invalid int value: 'three'"),
    (["--model", "vgg"], "argument --model: invalid choice: 'vgg'"),
    (["--strategy", "pipeline"], "argument --strategy: invalid choice: 'pipeline'"),
    (["--parallel-mode", "data_parallel", "--save-strategy", "plan.json"],
     "--save-strategy applies to semi_auto_parallel and auto_parallel"),
    (["--load-strategy", "/no/such/plan.json"], "--load-strategy /no/such/plan.json: no such file"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["--pipeline-stages", "0"], "--pipeline-stages must be >= 1, got 0"),
    (["--pipeline-stages", "2", "--parallel-mode", "stand_alone"],
     "--pipeline-stages needs several ranks"),
    (["--pipeline-schedule", "zb"], "argument --pipeline-schedule: invalid choice: 'zb'"),
    (["--pipeline-stages", "4", "--micro-batches", "2"],
     "--pipeline-schedule 1f1b needs --micro-batches >= --pipeline-stages"),
], ids=["steps-0", "batch-negative", "heads-0", "steps-not-int", "model", "strategy",
        "save-strategy-dp", "load-strategy-missing", "dtype",
        "pipeline-stages-0", "pipeline-stand-alone", "pipeline-schedule",
        "pipeline-fewer-micro-batches"])
def test_bad_arguments_exit_with_a_usage_message(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_device_num_must_match_the_world(capsys: pytest.CaptureFixture[str]) -> None:
    n = comm.get_group_size()
    assert train.main(["--device-num", str(n + 3), "--steps", "1"]) == 2
    if comm.get_rank() == 0:
        assert (f"device_num is {n + 3} on rank 0, but the MPI world has {n} ranks"
                in capsys.readouterr().err)


def test_auto_parallel_is_the_default_and_presets_imply_semi_auto() -> None:
    assert (train.parse_args([]).parallel_mode, train.parse_args([]).search_mode) == (
        "auto_parallel", "dynamic_programming")
    assert train.parse_args(["--strategy", "mp"]).parallel_mode == "semi_auto_parallel"
    auto = train.parse_args([])
    assert train.mesh(auto, 8) == (8, 1) and train.dataset_strategy(auto, 8, 1, 8) == \
        "data_parallel"
    assert train.mesh(auto, 3) == (1, 1) and train.dataset_strategy(auto, 1, 1, 3) == \
        "full_batch"  # 8 rows do not split among 3 ranks: every rank loads the batch


# ------------------------------------------------------------------ user errors, every rank
def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the job with options it must refuse: exit code 2 on every rank, one line without
    a traceback on rank 0's stderr, nothing from the other ranks. Returns rank 0's line."""
    try:
        code = train.main(argv)
    except SystemExit as e:  # argparse
        code = e.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert code == 2
    codes = comm.all_gather(np.array([code], dtype=np.int64))
    assert (codes == 2).all(), codes
    if comm.get_rank() > 0:
        assert out == "" and err == ""
        return ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("python -m simpar.train: error: ")
    return lines[0]


@pytest.mark.mpi
@pytest.mark.parametrize(("argv", "message"), [
    (["--lr", "-1"], "argument --lr: must be a finite number > 0, got -1"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    (["--n-heads", "3"], "--n-heads 3 must divide --d-model 64"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--parallel-mode", "pipeline"], "argument --parallel-mode: invalid choice: 'pipeline'"),
    (["--parallel-mode", "data_parallel", "--strategy", "mp"],
     "--strategy mp sets semi_auto_parallel strategies, but --parallel-mode is data_parallel"),
    (["--search-mode", "greedy"], "argument --search-mode: invalid choice: 'greedy'"),
    (["--profile", "tpu9"], "--profile tpu9: load_profile: unknown profile 'tpu9'; shipped "
     "profiles are ['ascend910a', 'ascend910b', 'cpu-local']"),
], ids=["lr-negative", "lr-nan", "lr-inf", "heads-not-dividing", "steps-0", "seed", "mode",
        "strategy-with-dp", "search-mode", "profile"])
def test_user_errors_print_one_line_on_rank_0(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused([*argv, "--steps", "1"] if "--steps" not in argv else argv, capsys)
    if comm.get_rank() == 0:
        assert message in line


@pytest.mark.mpi(min_size=2)
def test_stand_alone_on_several_ranks_is_refused_before_any_work(
        capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(["--parallel-mode", "stand_alone", "--steps", "1"], capsys)
    if comm.get_rank() == 0:
        n = comm.get_group_size()
        assert f"stand_alone runs on one device, but this job has {n} ranks" in line
        assert line.endswith("with these options -n can be 1")


@pytest.mark.mpi(min_size=2)
def test_a_batch_that_does_not_split_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(["--parallel-mode", "semi_auto_parallel", "--batch-size", "3", "--steps",
                     "1"], capsys)
    if comm.get_rank() == 0:
        assert "--batch-size 3 does not split among 2 data-parallel ranks (strategy hybrid, " \
            "the default" in line


@pytest.mark.mpi(min_size=4)
def test_heads_that_do_not_split_among_mp_are_refused(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    n = comm.get_group_size()
    heads = 6 if n == 8 else 3  # the issue's --d-model 66 --n-heads 6 on 8 ranks: mp=4
    line = _refused(["--parallel-mode", "semi_auto_parallel", "--d-model", "66", "--n-heads",
                     str(heads), "--steps", "1"], capsys)
    if comm.get_rank() == 0:
        assert f"--n-heads {heads} does not split among {n // 2} model-parallel ranks" in line
        assert "with these options -n can be 1, 2" in line


def test_which_world_sizes_work_is_computed_by_planning() -> None:
    args = train.parse_args(["--strategy", "hybrid"])
    assert train.working_world_sizes(args) == [2, 4, 8, 16]
    with pytest.raises(train.UsageError, match="--strategy hybrid is dp=2 x mp=N/2, which "
                       "needs an even number of ranks; this job has 3"):
        train.mesh(args, 3)
    default = train.parse_args(["--parallel-mode", "semi_auto_parallel"])
    with pytest.raises(train.UsageError, match=r"the GPT's vocabulary of 128 characters does "
                       r"not split among 3 model-parallel ranks \(strategy mp, the default on an "
                       r"odd number of ranks, on 3 ranks is dp=1 x mp=3"):
        train.mesh(default, 3)
    with pytest.raises(train.UsageError, match=r"--n-heads 6 does not split among 4 "):
        train.mesh(train.parse_args(["--parallel-mode", "semi_auto_parallel", "--d-model",
                                     "66", "--n-heads", "6"]), 8)
    assert train.mesh(default, 8) == (2, 4) and train.mesh(default, 1) == (1, 1)


def test_strategy_table_names_are_unique_and_readable() -> None:
    names = ["Default/network-WithLossCell/_backbone-GPT/block0-TransformerBlock/"
             "attn-MultiHeadAttention/q-Dense/MatMul-op4",
             "Default/network-WithLossCell/_backbone-GPT/block1-TransformerBlock/"
             "attn-MultiHeadAttention/q-Dense/MatMul-op45",
             "Default/network-WithLossCell/_backbone-GPT/block1-TransformerBlock/"
             "attn-MultiHeadAttention/BatchMatMul-op61",
             "Default/network-WithLossCell/_backbone-GPT/block1-TransformerBlock/"
             "attn-MultiHeadAttention/BatchMatMul-op65",
             "Default/network-WithLossCell/_loss_fn-SoftmaxCrossEntropyWithLogits/"
             "SparseSoftmaxCrossEntropyWithLogits-op90"]
    short = train.display_names(names)
    assert list(short.values()) == [
        "block0/attn/q/MatMul", "block1/attn/q/MatMul", "block1/attn/BatchMatMul-op61",
        "block1/attn/BatchMatMul-op65", "loss_fn/SparseSoftmaxCrossEntropyWithLogits"]


def test_strategy_table_columns_are_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    if comm.get_group_size() != 1:
        pytest.skip("one process")
    args = train.parse_args(["--steps", "1"])
    cell = train.build(args, "semi_auto_parallel", 1)
    data, label = train.batches(args)(0)
    cell.build(data, label)
    train.print_strategy_table(cell)
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("  ") and
            "parameter gradients" not in r]
    header = rows[0]
    starts = [header.index(c) for c in ("strategy", "out map", "forward", "backward")]
    for row in rows[1:]:
        for s in starts:  # every column starts after a gap of at least two spaces
            assert row[s - 2:s] == "  " and row[s] != " ", (row, s)
    assert len({r.split()[0] for r in rows[1:]}) == len(rows) - 1  # unique names


@pytest.mark.mpi
def test_out_below_a_regular_file_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = _refused(["--steps", "1", "--out", str(afile / "sub")], capsys)
    if comm.get_rank() == 0:
        assert f"--out {afile}/sub: {afile} is a file, so no directory can be made below it" \
            in line


@pytest.mark.mpi(min_size=4)
def test_an_mlp_hidden_width_that_does_not_split_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    mp = comm.get_group_size() // 2
    line = _refused(["--parallel-mode", "semi_auto_parallel", "--model", "mlp", "--hidden", "3",
                     "--steps", "1"], capsys)
    if comm.get_rank() == 0:
        assert f"--hidden 3 does not split among {mp} model-parallel ranks" in line


@pytest.mark.mpi(min_size=4)
def test_a_diverged_run_is_inconclusive_not_a_fail(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """SGD at lr 1000 blows the loss up to ~1e9: round-off then grows without bound, so
    the job says it cannot judge the run (exit 2) instead of blaming the parallel math."""
    code, summary = _main(["--strategy", "hybrid", "--steps", "2", "--optimizer", "sgd",
                           "--lr", "1000"], tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and summary["verdict"] == "INCONCLUSIVE" and summary["passed"] is False
    if comm.get_rank() == 0:
        assert re.search(r"error: the single-device run diverged \(first batch's loss "
                         r"[\d.]+ -> [\d.e+]+\)", err), err
        assert "--lr 1000 is too large here" in err


def test_the_job_reports_the_cost_models_prediction(tmp_path: Path) -> None:
    """The summary holds the cost model's predicted step and peak memory on the chosen
    profile next to the measured steps; --profile none leaves them out."""
    out = shared_dir(tmp_path) / "out"
    assert train.main(["--steps", "1", "--no-check", "--profile", "ascend910a",
                       "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["predicted_step_seconds"] > 0 and summary["predicted_peak_memory"] > 0
    comm.barrier()  # every rank has read it before rank 0 writes the next one
    assert train.main(["--steps", "1", "--no-check", "--profile", "none",
                       "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["predicted_step_seconds"] is None
