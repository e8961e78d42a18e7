"""simpar.context: MindSpore's defaults, round trips, and every way a call can be wrong."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import inspect
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simpar import context
from simpar import search as _searches  # noqa: F401  (registers the search modes)
from simpar.context import (
    ContextError,
    ContextTypeError,
    ParallelContext,
    ParallelMode,
    StrategyCkptConfig,
    WorldMismatchError,
    algo_parameters,
    auto_parallel_context,
    get_algo_parameters,
    get_auto_parallel_context,
    register_search_mode,
    reset_algo_parameters,
    reset_auto_parallel_context,
    search_modes,
    set_algo_parameters,
    set_auto_parallel_context,
    set_world,
    validate_against_world,
)


@pytest.fixture(autouse=True)
def _fresh_context(monkeypatch: pytest.MonkeyPatch) -> None:
    reset_auto_parallel_context()
    reset_algo_parameters()
    monkeypatch.setattr(context, "_world", None)
    monkeypatch.setattr(context, "_SEARCH_MODES", list(context._SEARCH_MODES))


def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith(".") and ". " not in message, message


@contextmanager
def _raises(exc: type[Exception], *words: str) -> Iterator[None]:
    """pytest.raises that also checks the message is one sentence containing ``words``."""
    with pytest.raises(exc) as info:
        yield
    message = str(info.value)
    _one_sentence(message)
    for word in words:
        assert word in message, (word, message)


# ------------------------------------------------------------------------------------------
# Defaults: MindSpore 2.2+ (see the module docstring for where each was looked up).

AUTO_DEFAULTS: dict[str, Any] = {
    "parallel_mode": "stand_alone",
    "device_num": 1,
    "global_rank": 0,
    "gradients_mean": False,
    "gradient_fp32_sync": True,
    "loss_repeated_mean": True,
    "search_mode": "recursive_programming",
    "strategy_ckpt_config": {"load_file": "", "save_file": "", "only_trainable_params": True},
    "strategy_ckpt_load_file": "",
    "strategy_ckpt_save_file": "",
    "full_batch": False,
    "dataset_strategy": "data_parallel",
    "enable_alltoall": False,
    "pipeline_stages": 1,
    "pipeline_config": {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"},
}

ALGO_DEFAULTS: dict[str, Any] = {
    "fully_use_devices": False,  # MindSpore 2.4 and later (True up to 2.3)
    "elementwise_op_strategy_follow": False,
    "enable_algo_approxi": False,
    "algo_approxi_epsilon": 0.1,
    "tensor_slice_align_enable": False,
    "tensor_slice_align_size": 16,
    "exact_time_limit": None,  # simpar's own (search_mode "exact"), not MindSpore's
    "memory_dimensions": "fixed",  # simpar's own (simpar.search.dimensions), not MindSpore's
}


@pytest.mark.parametrize(("key", "expected"), AUTO_DEFAULTS.items())
def test_auto_defaults_match_mindspore(key: str, expected: object) -> None:
    assert get_auto_parallel_context(key) == expected


@pytest.mark.parametrize(("key", "expected"), ALGO_DEFAULTS.items())
def test_algo_defaults_match_mindspore(key: str, expected: object) -> None:
    assert get_algo_parameters(key) == expected


def test_default_snapshots() -> None:
    assert auto_parallel_context() == ParallelContext(
        parallel_mode="stand_alone", device_num=1, global_rank=0, gradients_mean=False,
        gradient_fp32_sync=True, loss_repeated_mean=True, search_mode="recursive_programming",
        strategy_ckpt_config=StrategyCkptConfig(), dataset_strategy="data_parallel",
        enable_alltoall=False, pipeline_stages=1, device_num_is_set=False,
        global_rank_is_set=False,
    )
    assert dataclasses.asdict(algo_parameters()) == ALGO_DEFAULTS


def test_search_modes_are_mindspores_three_then_simpars_exact() -> None:
    assert search_modes()[:4] == ("recursive_programming", "dynamic_programming",
                                  "sharding_propagation", "exact")


# ------------------------------------------------------------------------------------------
# Round trips.

AUTO_VALUES = [
    ("parallel_mode", "semi_auto_parallel"),
    ("parallel_mode", ParallelMode.AUTO_PARALLEL),
    ("parallel_mode", "data_parallel"),
    ("device_num", 8),
    ("device_num", 4096),
    ("global_rank", 4095),
    ("gradients_mean", True),
    ("gradient_fp32_sync", False),
    ("loss_repeated_mean", False),
    ("search_mode", "sharding_propagation"),
    ("search_mode", "dynamic_programming"),
    ("dataset_strategy", ((2, 1), (2,))),
    ("dataset_strategy", "full_batch"),
    ("full_batch", True),
    ("enable_alltoall", True),
    ("pipeline_stages", 1),
    ("strategy_ckpt_load_file", "in.json"),
    ("strategy_ckpt_save_file", "out/strategy.json"),
]


@pytest.mark.parametrize(("key", "value"), AUTO_VALUES)
def test_auto_set_get_reset(key: str, value: object) -> None:
    set_auto_parallel_context(**{key: value})
    assert get_auto_parallel_context(key) == value
    reset_auto_parallel_context()
    assert get_auto_parallel_context(key) == AUTO_DEFAULTS[key]


ALGO_VALUES = [
    ("fully_use_devices", True),
    ("elementwise_op_strategy_follow", True),
    ("enable_algo_approxi", True),
    ("algo_approxi_epsilon", 1.0),
    ("algo_approxi_epsilon", 1e-6),
    ("tensor_slice_align_enable", True),
    ("tensor_slice_align_size", 1),
    ("tensor_slice_align_size", 1024),
]


@pytest.mark.parametrize(("key", "value"), ALGO_VALUES)
def test_algo_set_get_reset(key: str, value: object) -> None:
    set_algo_parameters(**{key: value})
    assert get_algo_parameters(key) == value
    assert getattr(algo_parameters(), key) == value
    reset_algo_parameters()
    assert get_algo_parameters(key) == ALGO_DEFAULTS[key]


def test_set_many_keys_at_once_and_snapshot() -> None:
    set_auto_parallel_context(parallel_mode="auto_parallel", device_num=8, global_rank=5,
                              gradients_mean=True, search_mode="sharding_propagation")
    ctx = auto_parallel_context()
    assert (ctx.parallel_mode, ctx.device_num, ctx.global_rank, ctx.gradients_mean) == (
        "auto_parallel", 8, 5, True)
    assert ctx.device_num_is_set and ctx.global_rank_is_set


def test_snapshots_are_frozen_and_hashable() -> None:
    ctx, algo = auto_parallel_context(), algo_parameters()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.device_num = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        algo.fully_use_devices = False  # type: ignore[misc]
    assert hash(ctx) == hash(auto_parallel_context())
    assert hash(algo) == hash(algo_parameters())


def test_snapshot_does_not_follow_later_changes() -> None:
    before = auto_parallel_context()
    set_auto_parallel_context(device_num=8)
    assert before.device_num == 1 and auto_parallel_context().device_num == 8


def test_numpy_scalars_are_normalised_to_python() -> None:
    set_auto_parallel_context(device_num=np.int64(8), dataset_strategy=((np.int32(2), 1),))
    assert type(get_auto_parallel_context("device_num")) is int
    assert get_auto_parallel_context("dataset_strategy") == ((2, 1),)
    assert type(get_auto_parallel_context("dataset_strategy")[0][0]) is int
    set_algo_parameters(algo_approxi_epsilon=np.float32(0.5))
    assert type(get_algo_parameters("algo_approxi_epsilon")) is float
    set_algo_parameters(algo_approxi_epsilon=1)   # an int where a float goes, as a float
    assert get_algo_parameters("algo_approxi_epsilon") == 1.0
    assert type(get_algo_parameters("algo_approxi_epsilon")) is float


def test_empty_call_changes_nothing() -> None:
    set_auto_parallel_context()
    set_algo_parameters()
    assert get_auto_parallel_context("device_num") == 1


# ------------------------------------------------------------------------------------------
# Bad input: exception type and the words of the message.


def test_unknown_key_suggests_the_close_one() -> None:
    with _raises(ContextError, "set_auto_parallel_context", "'devce_num'",
                 "did you mean 'device_num'?"):
        set_auto_parallel_context(devce_num=8)
    with _raises(ContextError, "get_auto_parallel_context", "'parralel_mode'",
                 "did you mean 'parallel_mode'?"):
        get_auto_parallel_context("parralel_mode")
    with _raises(ContextError, "set_algo_parameters", "'fully_use_device'",
                 "did you mean 'fully_use_devices'?"):
        set_algo_parameters(fully_use_device=False)
    with _raises(ContextError, "get_algo_parameters", "'tensor_slice_align'"):
        get_algo_parameters("tensor_slice_align")


def test_unknown_key_without_close_match_lists_the_keys() -> None:
    with _raises(ContextError, "'zzz'", "device_num", "search_mode"):
        set_auto_parallel_context(zzz=1)
    assert "did you mean" not in _message(lambda: set_auto_parallel_context(zzz=1))


def _message(call: Any) -> str:
    with pytest.raises(Exception) as info:
        call()
    return str(info.value)


def test_getter_key_must_be_a_str() -> None:
    with _raises(ContextTypeError, "key", "a str", "3"):
        get_auto_parallel_context(3)  # type: ignore[arg-type]
    with _raises(ContextTypeError, "key", "a str"):
        get_algo_parameters(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("key", "value", "allowed"), [
    # bool is a subclass of int, but never an int here.
    ("device_num", True, "an int in [1, 4096]"),
    ("global_rank", False, "an int in [0, 4095]"),
    ("pipeline_stages", True, "an int in [1, inf]"),
    ("device_num", 8.0, "an int"),
    ("device_num", "8", "an int"),
    # MindSpore is strict about bools too.
    ("gradients_mean", 1, "a bool"),
    ("loss_repeated_mean", "yes", "a bool"),
    ("enable_alltoall", 0, "a bool"),
    ("full_batch", 1, "a bool"),
    ("gradient_fp32_sync", None, "a bool"),
    ("parallel_mode", 1, "one of 'stand_alone'"),
    ("search_mode", None, "one of 'recursive_programming'"),
    ("strategy_ckpt_load_file", 3, "a str"),
])
def test_auto_wrong_type_is_type_error(key: str, value: object, allowed: str) -> None:
    with _raises(ContextTypeError, key, allowed, repr(value), type(value).__name__):
        set_auto_parallel_context(**{key: value})


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("fully_use_devices", 1, "a bool"),
    ("enable_algo_approxi", "True", "a bool"),
    ("tensor_slice_align_enable", 0, "a bool"),
    ("elementwise_op_strategy_follow", None, "a bool"),
    ("tensor_slice_align_size", True, "an int in [1, 1024]"),
    ("tensor_slice_align_size", 16.0, "an int in [1, 1024]"),
    ("algo_approxi_epsilon", True, "a float in (0, 1]"),
])
def test_algo_wrong_type_is_type_error(key: str, value: object, allowed: str) -> None:
    with _raises(ContextTypeError, key, allowed, repr(value), type(value).__name__):
        set_algo_parameters(**{key: value})


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("device_num", 0, "[1, 4096]"),
    ("device_num", 4097, "[1, 4096]"),
    ("device_num", -8, "[1, 4096]"),
    ("global_rank", -1, "[0, 4095]"),
    ("global_rank", 4096, "[0, 4095]"),
    ("pipeline_stages", 0, "[1, inf]"),
])
def test_auto_out_of_range(key: str, value: int, allowed: str) -> None:
    with _raises(ContextError, "set_auto_parallel_context", key, allowed, f"got {value}"):
        set_auto_parallel_context(**{key: value})


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("algo_approxi_epsilon", 0.0, "(0, 1]"),
    ("algo_approxi_epsilon", -0.1, "(0, 1]"),
    ("algo_approxi_epsilon", 1.5, "(0, 1]"),
    ("tensor_slice_align_size", 0, "[1, 1024]"),
    ("tensor_slice_align_size", 1025, "[1, 1024]"),
])
def test_algo_out_of_range(key: str, value: object, allowed: str) -> None:
    with _raises(ContextError, "set_algo_parameters", key, allowed, f"got {value!r}"):
        set_algo_parameters(**{key: value})


@pytest.mark.parametrize("mode", ["semi_auto", "STAND_ALONE", "model_parallel", ""])
def test_unknown_parallel_mode(mode: str) -> None:
    with _raises(ContextError, "parallel_mode", repr(mode), "'stand_alone'", "'data_parallel'",
                 "'semi_auto_parallel'", "'auto_parallel'"):
        set_auto_parallel_context(parallel_mode=mode)


def test_hybrid_parallel_is_refused_with_the_alternative() -> None:
    with _raises(ContextError, "parallel_mode='hybrid_parallel'", "hand-written communication",
                 "'semi_auto_parallel'", ".shard()"):
        set_auto_parallel_context(parallel_mode="hybrid_parallel")


def test_unknown_search_mode_lists_the_registered_ones() -> None:
    with _raises(ContextError, "search_mode", "'dp'", "'recursive_programming'",
                 "'dynamic_programming'", "'sharding_propagation'"):
        set_auto_parallel_context(search_mode="dp")


# ------------------------------------------------------------------------------------------
# A call that raises changes nothing.


@pytest.mark.parametrize("bad", [
    {"search_mode": "bogus"},
    {"devce_num": 8},
    {"strategy_ckpt_config": {"save_file": "s.json", "load_fle": "x"}},
    {"dataset_strategy": ((2, 0),)},
    {"global_rank": 8},  # >= device_num=8 in the same call
])
def test_no_half_applied_auto_call(bad: dict[str, object]) -> None:
    before = auto_parallel_context()
    good = {"device_num": 8, "gradients_mean": True, "strategy_ckpt_save_file": "t.json"}
    for kwargs in ({**good, **bad}, {**bad, **good}):  # the bad key last, then first
        with pytest.raises((ValueError, TypeError)):
            set_auto_parallel_context(**kwargs)
        assert auto_parallel_context() == before


def test_no_half_applied_algo_call() -> None:
    for kwargs in ({"fully_use_devices": True, "tensor_slice_align_size": 0},
                   {"tensor_slice_align_size": 0, "fully_use_devices": True}):
        with pytest.raises(ContextError):
            set_algo_parameters(**kwargs)
        assert algo_parameters() == context.AlgoParameters(**ALGO_DEFAULTS)


_ENTRIES = st.sampled_from([
    ("device_num", 8), ("device_num", 0), ("device_num", True), ("global_rank", 3),
    ("global_rank", 9), ("gradients_mean", True), ("gradients_mean", 1),
    ("parallel_mode", "auto_parallel"), ("parallel_mode", "hybrid_parallel"),
    ("search_mode", "sharding_propagation"), ("search_mode", "nope"),
    ("full_batch", True), ("full_batch", False), ("dataset_strategy", "data_parallel"),
    ("dataset_strategy", ((2, 1),)), ("dataset_strategy", ((2, -1),)),
    ("strategy_ckpt_config", {"save_file": "a"}), ("strategy_ckpt_config", {"x": 1}),
    ("strategy_ckpt_save_file", "b"), ("enable_alltoall", True), ("pipeline_stages", 2),
])


@given(first=st.dictionaries(st.sampled_from(["device_num", "gradients_mean", "full_batch"]),
                             st.booleans()),
       call=st.lists(_ENTRIES, max_size=6))
def test_property_a_call_applies_fully_or_not_at_all(first: dict[str, bool],
                                                     call: list[tuple[str, object]]) -> None:
    reset_auto_parallel_context()
    set_auto_parallel_context(**{k: (4 if k == "device_num" else v) for k, v in first.items()})
    before = auto_parallel_context()
    kwargs = dict(call)
    try:
        set_auto_parallel_context(**kwargs)
    except (ValueError, TypeError):
        assert auto_parallel_context() == before
        return
    for key, value in kwargs.items():
        if key == "full_batch" or key.startswith("strategy_ckpt_"):
            continue  # views, checked in their own tests
        assert get_auto_parallel_context(key) == value


# ------------------------------------------------------------------------------------------
# The MPI world.


def test_validate_against_world_passes_when_unset() -> None:
    validate_against_world(8, 3)


def test_validate_against_world_device_num_message() -> None:
    set_auto_parallel_context(device_num=4)
    validate_against_world(4, 0)
    with pytest.raises(WorldMismatchError) as info:
        validate_against_world(8, 0)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == ("device_num is 4 on rank 0, but the MPI world has 8 ranks "
                               "(mpirun -n 8); set device_num=8 or launch with -n 4.")


def test_validate_against_world_global_rank_message() -> None:
    set_auto_parallel_context(global_rank=3)
    validate_against_world(8, 3)
    with _raises(WorldMismatchError, "global_rank is 3", "MPI rank 5 of 8", "global_rank=5"):
        validate_against_world(8, 5)


@pytest.mark.parametrize(("size", "rank", "exc", "words"), [
    (0, 0, ContextError, ("world_size", "[1, 4096]", "got 0")),
    (4097, 0, ContextError, ("world_size", "[1, 4096]")),
    (True, 0, ContextTypeError, ("world_size", "bool")),
    (8, 8, ContextError, ("world_rank", "[0, 7]", "8 ranks", "got 8")),
    (8, -1, ContextError, ("world_rank", "[0, 7]")),
    (8, True, ContextTypeError, ("world_rank", "bool")),
])
def test_world_arguments_are_validated(size: Any, rank: Any, exc: type[Exception],
                                       words: tuple[str, ...]) -> None:
    for func in (validate_against_world, set_world):
        with _raises(exc, func.__name__, *words):
            func(size, rank)
    assert context._world is None


def test_unset_device_num_and_rank_follow_the_world() -> None:
    set_world(8, 5)
    assert get_auto_parallel_context("device_num") == 8
    assert get_auto_parallel_context("global_rank") == 5
    ctx = auto_parallel_context()
    assert (ctx.device_num, ctx.global_rank) == (8, 5)
    assert not ctx.device_num_is_set and not ctx.global_rank_is_set
    reset_auto_parallel_context()  # the world is a fact of the job; reset keeps it
    assert get_auto_parallel_context("device_num") == 8


def test_known_world_checks_set_immediately() -> None:
    set_world(8, 5)
    set_auto_parallel_context(device_num=8, global_rank=5)
    with _raises(WorldMismatchError, "device_num is 4", "8 ranks", "mpirun -n 8",
                 "device_num=8", "-n 4"):
        set_auto_parallel_context(device_num=4, gradients_mean=True)
    with _raises(WorldMismatchError, "global_rank is 2", "MPI rank 5"):
        set_auto_parallel_context(global_rank=2)
    assert get_auto_parallel_context("device_num") == 8
    assert get_auto_parallel_context("global_rank") == 5
    assert get_auto_parallel_context("gradients_mean") is False


def test_set_world_after_a_mismatching_context_raises_but_records_the_world() -> None:
    set_auto_parallel_context(device_num=4)
    with _raises(WorldMismatchError, "device_num is 4", "8 ranks"):
        set_world(8, 0)
    assert context._world == (8, 0)
    set_auto_parallel_context(device_num=8)  # the fix is accepted


def test_global_rank_must_be_below_explicit_device_num() -> None:
    with _raises(ContextError, "global_rank", "[0, 3]", "device_num=4", "got 4"):
        set_auto_parallel_context(device_num=4, global_rank=4)
    set_auto_parallel_context(device_num=4, global_rank=3)
    with _raises(ContextError, "global_rank", "device_num=2"):
        set_auto_parallel_context(device_num=2)


# ------------------------------------------------------------------------------------------
# strategy_ckpt_config.


def test_strategy_ckpt_config_partial_dicts_merge() -> None:
    set_auto_parallel_context(strategy_ckpt_config={"save_file": "a.json"})
    set_auto_parallel_context(strategy_ckpt_config={"load_file": "b.json"})
    assert get_auto_parallel_context("strategy_ckpt_config") == {
        "load_file": "b.json", "save_file": "a.json", "only_trainable_params": True}
    set_auto_parallel_context(strategy_ckpt_config={"only_trainable_params": False})
    assert auto_parallel_context().strategy_ckpt_config == StrategyCkptConfig(
        "b.json", "a.json", False)


def test_strategy_ckpt_config_getter_returns_a_copy() -> None:
    got = get_auto_parallel_context("strategy_ckpt_config")
    got["save_file"] = "changed.json"
    assert get_auto_parallel_context("strategy_ckpt_save_file") == ""


def test_legacy_strategy_ckpt_keys_map_onto_the_dict() -> None:
    set_auto_parallel_context(strategy_ckpt_load_file="in.json", strategy_ckpt_save_file="o.json")
    assert get_auto_parallel_context("strategy_ckpt_config") == {
        "load_file": "in.json", "save_file": "o.json", "only_trainable_params": True}
    set_auto_parallel_context(strategy_ckpt_config={"load_file": "new.json"})
    assert get_auto_parallel_context("strategy_ckpt_load_file") == "new.json"


def test_strategy_ckpt_unknown_sub_key() -> None:
    with _raises(ContextError, "strategy_ckpt_config", "'load_fle'", "did you mean 'load_file'?",
                 "only_trainable_params"):
        set_auto_parallel_context(strategy_ckpt_config={"load_fle": "a.json"})


@pytest.mark.parametrize(("value", "words"), [
    ({"only_trainable_params": 1}, ("strategy_ckpt_config['only_trainable_params']", "a bool")),
    ({"load_file": None}, ("strategy_ckpt_config['load_file']", "a str", "NoneType")),
    ({"save_file": 3}, ("strategy_ckpt_config['save_file']", "a str")),
    ("a.json", ("strategy_ckpt_config", "a dict", "load_file", "str")),
])
def test_strategy_ckpt_wrong_types(value: object, words: tuple[str, ...]) -> None:
    with _raises(ContextTypeError, *words):
        set_auto_parallel_context(strategy_ckpt_config=value)


def test_strategy_ckpt_legacy_and_dict_in_one_call() -> None:
    set_auto_parallel_context(strategy_ckpt_config={"load_file": "a"}, strategy_ckpt_load_file="a")
    with _raises(ContextError, "strategy_ckpt_config=", "strategy_ckpt_load_file='b'",
                 "contradict"):
        set_auto_parallel_context(strategy_ckpt_config={"load_file": "c"},
                                  strategy_ckpt_load_file="b")
    assert get_auto_parallel_context("strategy_ckpt_load_file") == "a"


# ------------------------------------------------------------------------------------------
# dataset_strategy and full_batch.


@pytest.mark.parametrize(("strategy", "full_batch"), [
    ("full_batch", True), ("data_parallel", False), (((8, 1), (8,)), False)])
def test_dataset_strategy_sets_full_batch(strategy: object, full_batch: bool) -> None:
    set_auto_parallel_context(dataset_strategy=strategy)
    assert get_auto_parallel_context("full_batch") is full_batch
    assert auto_parallel_context().full_batch is full_batch


def test_full_batch_sets_dataset_strategy() -> None:
    set_auto_parallel_context(full_batch=True)
    assert get_auto_parallel_context("dataset_strategy") == "full_batch"
    set_auto_parallel_context(full_batch=False)
    assert get_auto_parallel_context("dataset_strategy") == "data_parallel"


def test_full_batch_false_keeps_a_tuple_and_true_replaces_it() -> None:
    set_auto_parallel_context(dataset_strategy=((4, 1),))
    set_auto_parallel_context(full_batch=False)
    assert get_auto_parallel_context("dataset_strategy") == ((4, 1),)
    set_auto_parallel_context(full_batch=True)
    assert get_auto_parallel_context("dataset_strategy") == "full_batch"


@pytest.mark.parametrize(("full_batch", "strategy"), [
    (True, "full_batch"), (False, "data_parallel"), (False, ((2, 1),))])
def test_consistent_full_batch_and_strategy_in_one_call(full_batch: bool, strategy: object) -> None:
    set_auto_parallel_context(full_batch=True)  # a state the call must override
    set_auto_parallel_context(dataset_strategy=strategy, full_batch=full_batch)
    assert get_auto_parallel_context("dataset_strategy") == strategy
    assert get_auto_parallel_context("full_batch") is full_batch


@pytest.mark.parametrize(("full_batch", "strategy"), [
    (True, "data_parallel"), (True, ((2, 1),)), (False, "full_batch")])
def test_contradicting_full_batch_and_strategy_in_one_call(full_batch: bool,
                                                           strategy: object) -> None:
    with _raises(ContextError, "dataset_strategy=", f"full_batch={full_batch}", "contradict"):
        set_auto_parallel_context(full_batch=full_batch, dataset_strategy=strategy)
    assert get_auto_parallel_context("dataset_strategy") == "data_parallel"


@pytest.mark.parametrize(("value", "exc", "words"), [
    ("model_parallel", ContextError, ("'model_parallel'",)),
    ([[2, 1]], ContextTypeError, ("list",)),
    (((2, 1), [2]), ContextTypeError, ("tuple",)),
    ((), ContextTypeError, ("()",)),
    (((),), ContextTypeError, ("((),)",)),
    (((2, True),), ContextTypeError, ("True",)),
    (((2.0, 1),), ContextTypeError, ("2.0",)),
    (((2, 0),), ContextError, ("cut 0 is not positive",)),
    (((-2, 1),), ContextError, ("cut -2 is not positive",)),
    (None, ContextTypeError, ("NoneType",)),
])
def test_bad_dataset_strategy(value: object, exc: type[Exception], words: tuple[str, ...]) -> None:
    with _raises(exc, "dataset_strategy", "'full_batch'", "'data_parallel'",
                 "tuple of tuples of positive ints", *words):
        set_auto_parallel_context(dataset_strategy=value)


# ------------------------------------------------------------------------------------------
# Search modes.


def test_register_search_mode_extends_the_allowed_set() -> None:
    with pytest.raises(ContextError):
        set_auto_parallel_context(search_mode="exact_search")
    register_search_mode("exact_search")
    register_search_mode("exact_search")  # twice is harmless
    assert search_modes().count("exact_search") == 1
    set_auto_parallel_context(search_mode="exact_search")
    assert get_auto_parallel_context("search_mode") == "exact_search"
    assert "'exact_search'" in _message(lambda: set_auto_parallel_context(search_mode="x"))


@pytest.mark.parametrize(("name", "exc"), [
    ("", ContextError), ("has space", ContextError), ("a-b", ContextError),
    (3, ContextTypeError), (None, ContextTypeError)])
def test_register_search_mode_rejects_bad_names(name: Any, exc: type[Exception]) -> None:
    with _raises(exc, "register_search_mode", "name", repr(name)):
        register_search_mode(name)


def test_auto_parallel_search_mode_is_the_old_name() -> None:
    with pytest.warns(FutureWarning, match="search_mode"):
        set_auto_parallel_context(auto_parallel_search_mode="sharding_propagation")
    assert get_auto_parallel_context("search_mode") == "sharding_propagation"
    assert get_auto_parallel_context("auto_parallel_search_mode") == "sharding_propagation"
    with pytest.warns(FutureWarning), _raises(ContextError, "contradict"):
        set_auto_parallel_context(search_mode="dynamic_programming",
                                  auto_parallel_search_mode="recursive_programming")
    with _raises(ContextError, "auto_parallel_search_mode", "'nope'"):
        set_auto_parallel_context(auto_parallel_search_mode="nope")


# ------------------------------------------------------------------------------------------
# The module itself.


def test_context_never_imports_mpi() -> None:
    tree = ast.parse(Path(context.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    # Its only simpar imports are the key-spec engine, which imports nothing from simpar, and
    # comm_fusion's values, which import only the engine.
    assert {m for m in imported if m.startswith(("mpi4py", "simpar"))} == {
        "simpar._keyspec", "simpar.comm_fusion"}, imported
    engine = ast.parse(Path(context.__file__).with_name("_keyspec.py").read_text())
    assert not [n for n in ast.walk(engine) if isinstance(n, (ast.Import, ast.ImportFrom))
                and "simpar" in ast.unparse(n)]
    fusion = ast.parse(Path(context.__file__).with_name("comm_fusion.py").read_text())
    assert {n.module for n in ast.walk(fusion) if isinstance(n, ast.ImportFrom)
            and "simpar" in (n.module or "")} == {"simpar._keyspec"}
    code = "import sys, simpar.context; assert 'mpi4py' not in sys.modules, 'mpi4py imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_surface_is_documented_and_typed() -> None:
    for name in context.__all__:
        obj = getattr(context, name)
        doc = inspect.getdoc(obj) or ""
        assert doc, name
        if inspect.isfunction(obj):
            assert "return" in obj.__annotations__, name
            assert ">>>" in doc or "Example" in doc, name


def test_docstring_examples_run() -> None:
    failures, tests = doctest.testmod(context, optionflags=doctest.ELLIPSIS)
    assert tests > 10 and failures == 0


# ------------------------------------------------------------------ keys not honoured yet
@pytest.fixture
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    from simpar import context

    monkeypatch.setattr(context, "_warned", set())


@pytest.mark.usefixtures("_fresh_warnings")
def test_a_key_simpar_does_not_honour_yet_warns_once_naming_it() -> None:
    import warnings

    from simpar.context import NotHonouredWarning

    try:
        with pytest.warns(NotHonouredWarning, match=r"gradient_fp32_sync=False is accepted but "
                          r"not honoured yet: simpar has no float16 gradients"):
            set_auto_parallel_context(gradient_fp32_sync=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", NotHonouredWarning)
            set_auto_parallel_context(gradient_fp32_sync=False)  # once only
            set_auto_parallel_context(gradient_fp32_sync=True)   # the default
            # Strategy files are written and read (simpar.strategy_file): no warning.
            set_auto_parallel_context(strategy_ckpt_config={"save_file": "out/strategy.json"})
            set_auto_parallel_context(strategy_ckpt_load_file="in.json")
        with warnings.catch_warnings():  # the searches honour these
            warnings.simplefilter("error", NotHonouredWarning)
            for mode in ("sharding_propagation", "dynamic_programming", "recursive_programming"):
                set_auto_parallel_context(search_mode=mode)
            set_algo_parameters(elementwise_op_strategy_follow=True, enable_algo_approxi=True,
                                algo_approxi_epsilon=0.5)
        with warnings.catch_warnings():  # MatMul honours the slice alignment, and every
            warnings.simplefilter("error", NotHonouredWarning)   # auto search fully_use_devices
            set_algo_parameters(tensor_slice_align_enable=True)
            set_algo_parameters(fully_use_devices=True)
        for key in ("force_fp32_communication", "parameter_broadcast", "dump_local_norm"):
            with pytest.raises(NotImplementedError, match=f"{key} is MindSpore's, but simpar "
                                                          "does not implement it: "):
                set_auto_parallel_context(**{key: True})
    finally:
        reset_auto_parallel_context()
        reset_algo_parameters()
