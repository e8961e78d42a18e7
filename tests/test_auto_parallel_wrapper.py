"""``AutoParallel`` (MindSpore 2.x's per-network parallel settings), in one process: how its
modes map onto simpar's planners, its bad arguments, the features it refuses, and that its
settings reach its own network's compilation only (the global context is the same afterwards,
also after an error).

    python -m pytest tests/test_auto_parallel_wrapper.py -q
"""

from __future__ import annotations

import doctest
import os
import pathlib
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import simpar
import simpar.nn.auto_parallel as ap_module
from simpar import context, graph, nn
from simpar.auto_parallel import AutoParallel, OperatorStrategyPathError
from simpar.comm_fusion import AllReduceFusion
from simpar.layout import Layout
from simpar.nn import presets
from simpar.search import registered_searches

BATCH, SIZES = 8, (16, 32, 8)


@pytest.fixture(autouse=True)
def _fresh_context() -> Iterator[None]:
    simpar.reset_auto_parallel_context()
    yield
    simpar.reset_auto_parallel_context()


def _net(mode: str = "semi_auto") -> AutoParallel:
    mlp = nn.MLP(*SIZES, n_hidden=1, dtype=np.float64)
    return AutoParallel(nn.WithLossCell(mlp, nn.SoftmaxCrossEntropyWithLogits()), mode)


def _train(parallel_net: AutoParallel, **kw: Any) -> nn.TrainOneStepCell:
    return nn.TrainOneStepCell(parallel_net, nn.SGD(parallel_net.trainable_params(), 0.1),
                               seed=5, **kw)


def _batch(k: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(k)
    return rng.standard_normal((BATCH, SIZES[0])), rng.integers(0, SIZES[2], BATCH)


# ------------------------------------------------------------------ where users find it
def test_it_is_exported_where_a_mindspore_user_looks() -> None:
    assert AutoParallel is nn.AutoParallel is ap_module.AutoParallel
    assert not hasattr(simpar, "AutoParallel")  # import simpar stays light, as MindSpore's
    assert issubclass(AutoParallel, nn.Cell)


def test_the_module_docstring_examples_run() -> None:
    failures, tests = doctest.testmod(ap_module)
    assert tests >= 5 and failures == 0


# ------------------------------------------------------------------ modes
@pytest.mark.parametrize(("mode", "planned", "search"), [
    ("semi_auto", "semi_auto_parallel", None),
    ("sharding_propagation", "auto_parallel", "sharding_propagation"),
    ("recursive_programming", "auto_parallel", "recursive_programming"),
    ("exact", "auto_parallel", "exact"),  # simpar-only: a registered search
])
def test_modes_map_onto_simpars_planners(mode: str, planned: str, search: str | None) -> None:
    parallel_net = _net(mode)
    settings = parallel_net.parallel_settings()
    assert parallel_net.parallel_mode == mode
    assert settings["parallel_mode"] == planned
    assert settings.get("search_mode") == search
    assert _train(parallel_net).mode == planned
    # MindSpore's AutoParallel defaults, not the global context's.
    assert {k: settings[k] for k in ("dataset_strategy", "gradients_mean", "gradient_fp32_sync",
                                     "loss_repeated_mean", "enable_alltoall", "pipeline_stages")
            } == {"dataset_strategy": "data_parallel", "gradients_mean": False,
                  "gradient_fp32_sync": True, "loss_repeated_mean": True,
                  "enable_alltoall": True, "pipeline_stages": 1}


def test_every_registered_search_is_accepted_as_a_simpar_only_mode() -> None:
    for name in registered_searches():
        settings = _net(name).parallel_settings()
        assert (settings["parallel_mode"], settings["search_mode"]) == ("auto_parallel", name)


def test_semi_auto_trains_like_the_global_context_path_on_one_device() -> None:
    """On one process the wrapper's semi_auto program is the same as the one the global
    context builds with the same settings, and trains to the same numbers."""
    parallel_net = _net()
    parallel_net.dataset_strategy("full_batch")
    wrapped = _train(parallel_net)
    simpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                     dataset_strategy="full_batch", enable_alltoall=True)
    plain_net = nn.WithLossCell(nn.MLP(*SIZES, n_hidden=1, dtype=np.float64),
                                nn.SoftmaxCrossEntropyWithLogits())
    plain = nn.TrainOneStepCell(plain_net, nn.SGD(plain_net.trainable_params(), 0.1), seed=5)
    for k in range(3):  # the first call compiles each: the wrapped one under its own settings
        assert wrapped(*_batch(k)) == plain(*_batch(k))
    assert wrapped.program is not None and plain.program is not None
    assert [str(s) for s in wrapped.program.schedule(0)] == \
        [str(s) for s in plain.program.schedule(0)]
    for name, value in plain.params.items():
        assert np.array_equal(wrapped.params[name], value), name


# ------------------------------------------------------------------ the settings stay scoped
def _non_default_global_context() -> context.ParallelContext:
    simpar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                     dataset_strategy=((1, 1), (1,)), loss_repeated_mean=False)
    return context.auto_parallel_context()


def test_training_uses_the_wrappers_settings_and_leaves_the_global_context_alone() -> None:
    before = _non_default_global_context()
    parallel_net = _net()
    parallel_net.dataset_strategy("full_batch")
    train = _train(parallel_net)
    assert train.mode == "semi_auto_parallel"  # not the global data_parallel
    train(*_batch())
    assert context.auto_parallel_context() == before
    assert not before.device_num_is_set and not context.auto_parallel_context().device_num_is_set
    # The program was built under the wrapper's values, not the global ones.
    assert train.gradients_mean is False and train.loss_repeated_mean is True
    assert train.program is not None and train.program.mode == "semi_auto_parallel"
    train(*_batch(1))  # later steps do not compile again
    assert context.auto_parallel_context() == before


def test_the_global_context_is_restored_after_an_error_in_compilation() -> None:
    before = _non_default_global_context()
    train = _train(_net())
    data, label = _batch()
    with pytest.raises(ValueError, match="MatMul: contraction sizes differ"):
        train(data[:, :5], label)  # fails while tracing, inside the wrapper's settings
    assert context.auto_parallel_context() == before
    assert train.program is None
    train(data, label)  # and the cell still compiles afterwards
    assert context.auto_parallel_context() == before


def test_parallel_context_applies_and_restores_even_on_error() -> None:
    before = _non_default_global_context()
    parallel_net = _net()
    parallel_net.enable_gradients_mean()
    parallel_net.disable_loss_repeated_mean()
    parallel_net.dataset_strategy(((1, 1), (1,)))
    with pytest.raises(RuntimeError, match="inside"), parallel_net.parallel_context() as ctx:
        assert ctx == context.auto_parallel_context()
        assert (ctx.parallel_mode, ctx.gradients_mean, ctx.loss_repeated_mean,
                ctx.enable_alltoall, ctx.dataset_strategy) == (
            "semi_auto_parallel", True, False, True, ((1, 1), (1,)))
        simpar.set_auto_parallel_context(enable_alltoall=False)  # undone on leaving too
        raise RuntimeError("inside")
    assert context.auto_parallel_context() == before


def test_tracing_outside_the_settings_raises_instead_of_ignoring_them() -> None:
    parallel_net = _net()
    specs = [((BATCH, SIZES[0]), np.float64), ((BATCH,), np.int64)]
    with pytest.raises(ValueError, match="traced outside its parallel settings"):
        graph.trace(parallel_net, specs)
    with parallel_net.parallel_context():
        graph.trace(parallel_net, specs)
    other = _net()
    with other.parallel_context(), pytest.raises(ValueError, match="outside its parallel"):
        graph.trace(parallel_net, specs)


def test_the_wrapper_is_transparent_to_names() -> None:
    """Parameters and ops are named as without the wrapper (MindSpore's auto_prefix=False),
    at the top and nested inside the loss cell (MindSpore's Model(parallel_net, loss_fn=))."""
    specs = [((BATCH, SIZES[0]), np.float64), ((BATCH,), np.int64)]

    def names(cell: nn.Cell) -> tuple[list[str], list[str]]:
        g = graph.trace(cell, specs)
        return [n.name for n in g.nodes], sorted(v.name for v in g.params)

    def loss_net(backbone: nn.Cell) -> nn.Cell:
        return nn.WithLossCell(backbone, nn.SoftmaxCrossEntropyWithLogits())

    plain = names(loss_net(nn.MLP(*SIZES, dtype=np.float64)))
    assert plain[0][0] == "Default/network-WithLossCell/_backbone-MLP/fc1-Dense/MatMul-op0"
    top = AutoParallel(loss_net(nn.MLP(*SIZES, dtype=np.float64)))
    with top.parallel_context():
        assert names(top) == plain
    inner = AutoParallel(nn.MLP(*SIZES, dtype=np.float64))
    with inner.parallel_context():
        assert names(loss_net(inner)) == plain
    train = nn.TrainOneStepCell(loss_net(inner), nn.SGD(inner.trainable_params(), 0.1))
    assert train.auto_parallel is inner and train.mode == "semi_auto_parallel"


def test_one_wrapper_per_training_cell() -> None:
    inner = AutoParallel(nn.MLP(*SIZES, dtype=np.float64))
    outer = AutoParallel(nn.WithLossCell(inner, nn.SoftmaxCrossEntropyWithLogits()))
    with pytest.raises(ValueError, match="holds 2 AutoParallel wrappers .*wrap only the "
                       "top-level network, once"):
        _train(outer)


def test_training_cell_mode_must_agree_with_the_wrapper() -> None:
    with pytest.raises(ValueError, match=r"parallel_mode='data_parallel' contradicts the "
                       r"network's AutoParallel\(.*parallel_mode='semi_auto'\) \(which plans "
                       r"as 'semi_auto_parallel'\); pass None, 'semi_auto_parallel' or "
                       r"'stand_alone'"):
        _train(_net(), parallel_mode="data_parallel")
    assert _train(_net(), parallel_mode="semi_auto_parallel").mode == "semi_auto_parallel"
    twin = _train(_net(), parallel_mode="stand_alone")
    assert twin.mode == "stand_alone"
    twin(*_batch())


def test_disable_gradient_fp32_sync_warns_when_compiled(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(context, "_warned", set())
    parallel_net = _net()
    parallel_net.dataset_strategy("full_batch")
    parallel_net.disable_gradient_fp32_sync()
    assert parallel_net.parallel_settings()["gradient_fp32_sync"] is False
    with pytest.warns(context.NotHonouredWarning, match="gradient_fp32_sync=False .*no "
                      "float16 gradients"):
        _train(parallel_net)(*_batch())
    with warnings.catch_warnings():  # never from the global context afterwards
        warnings.simplefilter("error", context.NotHonouredWarning)
        simpar.set_auto_parallel_context(gradients_mean=True)


# ------------------------------------------------------------------ settings it honours
def test_settings_simpar_honours() -> None:
    parallel_net = _net()
    parallel_net.dataset_strategy(((np.int64(1), 1), (1,)))
    parallel_net.enable_gradients_mean()
    parallel_net.disable_loss_repeated_mean()
    parallel_net.pipeline(4, output_broadcast=True, interleave=True, scheduler="gpipe")
    parallel_net.enable_fp32_communication()
    parallel_net.comm_fusion(None)
    parallel_net.comm_fusion({})
    parallel_net.comm_fusion({"openstate": True, "allreduce": {"mode": "size", "config": 32}})
    parallel_net.transformer_opt(None)
    parallel_net.transformer_opt("")
    settings = parallel_net.parallel_settings()
    assert settings["dataset_strategy"] == ((1, 1), (1,))
    assert type(settings["dataset_strategy"][0][0]) is int
    assert settings["gradients_mean"] is True and settings["loss_repeated_mean"] is False
    assert parallel_net.get_pipeline_stages() == 4
    assert settings["pipeline_config"] == {"pipeline_interleave": True,
                                           "pipeline_scheduler": "gpipe"}
    assert settings["comm_fusion"] == {"openstate": True,
                                       "allreduce": {"mode": "size", "config": 32}}
    with parallel_net.parallel_context() as ctx:   # what the compilation plans with
        assert ctx.comm_fusion == AllReduceFusion("size", 32)
    for config in ("full_batch", "data_parallel"):
        parallel_net.dataset_strategy(config)
        assert parallel_net.parallel_settings()["dataset_strategy"] == config


# ------------------------------------------------------------------ bad arguments
def test_bad_parallel_mode_and_network() -> None:
    net = nn.MLP(*SIZES)
    with pytest.raises(ValueError, match=r"AutoParallel: the argument 'parallel_mode' must be "
                       r"one of \['semi_auto', 'sharding_propagation', 'recursive_programming'\] "
                       r"\(MindSpore's\), or a search simpar has registered \[.*'exact'.*\] "
                       r"\(simpar-only\), but got the value : 'auto_parallel'"):
        AutoParallel(net, "auto_parallel")
    with pytest.raises(TypeError, match="'parallel_mode' must be a str.*but got 1 of type int"):
        AutoParallel(net, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'network' must be a simpar Cell .*but got "
                       "TrainOneStepCell. MindSpore's functional form, AutoParallel"
                       r"\(train_step\), has no simpar equivalent"):
        AutoParallel(_train(_net()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'network' must be a simpar Cell .*but got int"):
        AutoParallel(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the wrapper has no strategy of its own"):
        AutoParallel(net).shard(((1, 1),))


@pytest.mark.parametrize(("config", "error", "match"), [
    (None, ValueError, "the argument 'config' must be 'full_batch', 'data_parallel' or a "
                       "tuple of tuples of positive ints, but got None"),
    ("half", ValueError, "AutoParallel.dataset_strategy: config must be 'full_batch', "
                         "'data_parallel' or a tuple .* but got 'half'"),
    ([(1, 1)], TypeError, r"config must be .* but got \[\(1, 1\)\] of type list"),
    (((1, 1.0),), TypeError, r"but got \(\(1, 1.0\),\) of type tuple"),
    (((2, 0),), ValueError, r"cut 0 is not positive"),
    ((), TypeError, r"but got \(\) of type tuple"),
])
def test_bad_dataset_strategy(config: Any, error: type[Exception], match: str) -> None:
    parallel_net = _net()
    with pytest.raises(error, match=match):
        parallel_net.dataset_strategy(config)
    assert parallel_net.parallel_settings()["dataset_strategy"] == "data_parallel"


def test_a_dataset_strategy_of_layouts_is_refused() -> None:
    layout = Layout((2, 2), ("dp", "mp"))
    with pytest.raises(NotImplementedError, match="a tuple of Layout is not supported by "
                       "simpar, whose dataset strategies are cuts per dimension"):
        _net().dataset_strategy((layout("dp", "None"), layout("dp")))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"stages": 1.0}, TypeError, "'stages' must be int type, but got the type : float"),
    ({"stages": True}, TypeError, "'stages' must be int type, but got the type : bool"),
    ({"stages": 0}, ValueError, "'stages' must be larger than zero, but got value: 0"),
    ({"output_broadcast": 1}, TypeError, "'output_broadcast' must be bool type"),
    ({"interleave": "yes"}, TypeError, "'interleave' must be bool type"),
    ({"scheduler": 1}, TypeError, "'scheduler' must be str, but got the type : int"),
    ({"scheduler": "zb"}, ValueError, r"'scheduler' must be one of \['1f1b', 'gpipe', "
                                      r"'seqpipe', 'seqvpp', 'seqsmartvpp', 'zero_bubble_v'\], "
                                      r"but got the value : 'zb'"),
])
def test_bad_pipeline_arguments(kwargs: dict[str, Any], error: type[Exception],
                                match: str) -> None:
    with pytest.raises(error, match=r"For 'AutoParallel.pipeline', the argument " + match):
        _net().pipeline(**kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"shard_size": 0}, "'shard_size' must be a positive integer or -1, but got 0"),
    ({"shard_size": 2.0}, "'shard_size' must be a positive integer or -1, but got 2.0"),
    ({"threshold": -1}, "'threshold' must be a positive integer or 0, but got -1"),
    ({"optimizer_level": "level4"}, r"'optimizer_level' must be one of \['level1', 'level2', "
                                    r"'level3'\], but got 'level4'"),
])
def test_bad_hsdp_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=r"For 'AutoParallel.hsdp', the argument " + match):
        _net().hsdp(**kwargs)


@pytest.mark.parametrize("method", ["save_operator_strategy_file",
                                    "load_operator_strategy_file"])
def test_operator_strategy_paths_are_checked_as_mindspore_checks_them(method: str) -> None:
    call = getattr(_net(), method)
    with pytest.raises(TypeError, match=f"For 'AutoParallel.{method}', the argument "
                       "'file_path' must be str, but got the type : int"):
        call(7)
    with pytest.raises(OperatorStrategyPathError, match="must be an absolute path, but got "
                       "'strategy.json'") as relative:
        call("strategy.json")
    assert isinstance(relative.value, KeyError) and isinstance(relative.value, ValueError)
    with pytest.raises(KeyError, match=r"must end in .json \(File type must be .json\)"):
        call(os.path.abspath("strategy.ckpt"))
    with pytest.raises(NotImplementedError, match=f"AutoParallel.{method}: operator strategy "
                       "files .*not supported; save_param_strategy_file"):
        call(os.path.abspath("strategy.json"))


def test_param_strategy_files_are_the_wrapper_s_strategy_ckpt_config() -> None:
    parallel_net = _net("recursive_programming")
    assert parallel_net.parallel_settings()["strategy_ckpt_config"] == {
        "load_file": "", "save_file": "", "only_trainable_params": True}
    parallel_net.save_param_strategy_file("/tmp/out/strategy.json")
    parallel_net.load_param_strategy_file("/tmp/in/strategy.json")
    parallel_net.disable_strategy_file_only_for_trainable_params()
    assert parallel_net.parallel_settings()["strategy_ckpt_config"] == {
        "load_file": "/tmp/in/strategy.json", "save_file": "/tmp/out/strategy.json",
        "only_trainable_params": False}
    with parallel_net.parallel_context() as ctx:
        assert ctx.strategy_ckpt_config.load_file == "/tmp/in/strategy.json"
    assert context.auto_parallel_context().strategy_ckpt_config.load_file == ""


@pytest.mark.parametrize("method", ["load_param_strategy_file", "save_param_strategy_file",
                                    "set_group_ckpt_save_file", "dump_local_norm"])
def test_file_paths_must_be_str(method: str) -> None:
    with pytest.raises(TypeError, match=f"For 'AutoParallel.{method}', the argument "
                       "'file_path' must be str, but got the type : PosixPath|WindowsPath"):
        getattr(_net(), method)(pathlib.Path("/tmp/x"))


def test_bad_comm_fusion_and_transformer_opt() -> None:
    with pytest.raises(TypeError, match="'config' must be dict, but got the type : list"):
        _net().comm_fusion([("allreduce", {})])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"AutoParallel.comm_fusion: config\['allreduce'\]"
                                         r"\['config'\] must be an int > 0 \(MB\) in 'size' "
                                         "mode, but got 0"):
        _net().comm_fusion({"allreduce": {"mode": "size", "config": 0}})
    with pytest.raises(TypeError, match="'file_path' must be str or None, but got the type : "
                       "int"):
        _net().transformer_opt(3)  # type: ignore[arg-type]


# ------------------------------------------------------------------ features simpar lacks
@pytest.mark.parametrize(("call", "match"), [
    (lambda n: n.pipeline(2, scheduler="seqpipe"), "AutoParallel.pipeline: "
                                                   "scheduler='seqpipe' is MindSpore's, but "
                                                   "simpar runs '1f1b' and 'gpipe' only"),
    (lambda n: n.no_init_parameters_in_compile(),
     "AutoParallel.no_init_parameters_in_compile: simpar initialises each rank's parameter "
     "blocks"),
    (lambda n: n.set_group_ckpt_save_file("/tmp/g.ckpt"),
     "AutoParallel.set_group_ckpt_save_file: simpar writes no communication-group file"),
    (lambda n: n.print_local_norm(), "AutoParallel.print_local_norm: simpar does not compute "
                                     "local norms"),
    (lambda n: n.dump_local_norm("/tmp/norms"), "AutoParallel.dump_local_norm"),
    (lambda n: n.enable_device_local_norm(), "AutoParallel.enable_device_local_norm"),
    (lambda n: n.comm_fusion({"allgather": {"mode": "auto", "config": None}}),
     r"AutoParallel.comm_fusion: config\['allgather'\]: simpar fuses only the gradient "
     "AllReduces"),
    (lambda n: n.transformer_opt("./parallel_speed_up.json"),
     "AutoParallel.transformer_opt: simpar runs each collective when its step comes"),
])
def test_features_simpar_lacks_raise_naming_the_method(call: Any, match: str) -> None:
    parallel_net = _net()
    before = parallel_net.parallel_settings()
    with pytest.raises(NotImplementedError, match=match):
        call(parallel_net)
    assert parallel_net.parallel_settings() == before


def test_presets_work_through_the_wrapper() -> None:
    """A Megatron preset's .shard() strategies are kept under semi_auto (on one device the
    cuts are 1: what matters here is that the annotated ops stay annotated)."""
    mlp = nn.MLP(*SIZES, n_hidden=1, dtype=np.float64)
    presets.megatron_mlp(mlp, 1, 1)
    parallel_net = AutoParallel(nn.WithLossCell(mlp, nn.SoftmaxCrossEntropyWithLogits()))
    parallel_net.dataset_strategy("full_batch")
    train = _train(parallel_net)
    train(*_batch())
    assert train.program is not None
    matmuls = [str(s.chosen) for s in train.program.steps if "/MatMul-" in s.node.name]
    assert matmuls == ["annotated", "annotated"]
