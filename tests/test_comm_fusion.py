"""MindSpore's comm_fusion for the gradient AllReduces (simpar.comm_fusion): the buckets each
mode makes, and the settings it refuses by name (pure: one process)."""

from __future__ import annotations

from typing import Any

import pytest

from simpar import context
from simpar.comm_fusion import AllReduceFusion, check_comm_fusion

MB = 2**20


@pytest.mark.parametrize(("fusion", "sizes", "buckets"), [
    (AllReduceFusion(), [5, 7, 9], [range(0, 3)]),              # the default: one bucket
    (AllReduceFusion(), [], []),
    (AllReduceFusion("index", (1, 3)), [1] * 5, [range(0, 1), range(1, 3), range(3, 5)]),
    (AllReduceFusion("index", (2, 9)), [1] * 4, [range(0, 2), range(2, 4)]),   # past the end
    (AllReduceFusion("size", 2), [MB, MB, MB, 3 * MB, MB],                     # 3 MB alone
     [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]),
    (AllReduceFusion("auto", None), [32 * MB, 32 * MB, 1], [range(0, 2), range(2, 3)]),
    (AllReduceFusion("size", 64, openstate=False), [1, 2, 3],
     [range(0, 1), range(1, 2), range(2, 3)]),
])
def test_each_mode_buckets_the_gradients_in_order(fusion: AllReduceFusion, sizes: list[int],
                                                  buckets: list[range]) -> None:
    got = fusion.buckets(sizes)
    assert got == buckets
    assert [k for b in got for k in b] == list(range(len(sizes)))


@pytest.mark.parametrize(("config", "error", "message"), [
    ([], TypeError, r"comm_fusion must be a dict with keys from openstate, allreduce, but got "
                    r"\[\]"),
    ({"fusion": 1}, ValueError, "comm_fusion has no key 'fusion'; allowed: openstate, "
                                "allreduce, allgather, reducescatter"),
    ({"allgather": {"mode": "auto", "config": None}}, NotImplementedError,
     r"comm_fusion\['allgather'\]: simpar fuses only the gradient AllReduces"),
    ({"reducescatter": {"mode": "size", "config": 8}}, NotImplementedError,
     r"comm_fusion\['reducescatter'\]"),
    ({"openstate": "yes"}, TypeError, r"comm_fusion\['openstate'\] must be a bool, but got "
                                      "'yes'"),
    ({"allreduce": {"config": 8}}, TypeError, r"comm_fusion\['allreduce'\] must be a dict "
                                              r"\{\"mode\""),
    ({"allreduce": {"mode": "fast"}}, ValueError, r"comm_fusion\['allreduce'\]\['mode'\] must "
                                                  r"be one of \['auto', 'size', 'index'\], but "
                                                  "got 'fast'"),
    ({"allreduce": {"mode": "auto", "config": 32}}, ValueError,
     r"must be None in 'auto' mode \(the threshold is 64 MB\), but got 32"),
    ({"allreduce": {"mode": "size", "config": True}}, ValueError,
     r"must be an int > 0 \(MB\) in 'size' mode, but got True"),
    ({"allreduce": {"mode": "index", "config": [0, 4]}}, ValueError,
     r"must be a list of increasing ints > 0 \(parameter indices\) in 'index' mode, but got "
     r"\[0, 4\]"),
    ({"allreduce": {"mode": "index", "config": 4}}, ValueError, "in 'index' mode, but got 4"),
])
def test_bad_settings_are_refused_naming_the_key(config: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        check_comm_fusion("set_auto_parallel_context", "comm_fusion", config)
    try:   # the context key refuses it the same way, and keeps what it had
        with pytest.raises(error, match=message):
            context.set_auto_parallel_context(comm_fusion=config)
        assert context.auto_parallel_context().comm_fusion == AllReduceFusion()
    finally:
        context.reset_auto_parallel_context()


def test_the_context_key_takes_mindspore_s_dict_and_gives_it_back() -> None:
    try:
        assert context.get_auto_parallel_context("comm_fusion") == {
            "openstate": True, "allreduce": {"mode": "index", "config": []}}
        for config, value in [
                ({"allreduce": {"mode": "auto", "config": None}}, AllReduceFusion("auto", None)),
                ({"openstate": False, "allreduce": {"mode": "size", "config": 32}},
                 AllReduceFusion("size", 32, False)),
                ({"allreduce": {"mode": "index", "config": [20, 35]}},
                 AllReduceFusion("index", (20, 35)))]:
            context.set_auto_parallel_context(comm_fusion=config)
            assert context.auto_parallel_context().comm_fusion == value
            assert context.get_auto_parallel_context("comm_fusion") == {
                "openstate": config.get("openstate", True), "allreduce": config["allreduce"]}
    finally:
        context.reset_auto_parallel_context()
    assert context.auto_parallel_context().comm_fusion == AllReduceFusion()
