"""MindSpore's comm_fusion for the gradient AllReduces (simpar.comm_fusion): the buckets each
mode makes, and the settings it refuses by name (pure: one process)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from simpar import context, graph, nn
from simpar.comm_fusion import AllReduceFusion, check_comm_fusion
from simpar.search import request_from_context

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


def test_all_reduce_fusion_config_is_a_view_of_the_index_mode() -> None:
    """MindSpore's ``all_reduce_fusion_config=[20, 35]`` is ``comm_fusion``'s "index" mode with
    those indices: one piece of state, read back either way; the plan request takes it; a bad
    list is refused naming the key (nothing changes); both keys contradicting in one call
    raise."""
    try:
        assert context.get_auto_parallel_context("all_reduce_fusion_config") == []
        context.set_auto_parallel_context(all_reduce_fusion_config=[20, 35])
        assert context.auto_parallel_context().comm_fusion == AllReduceFusion("index", (20, 35))
        assert context.get_auto_parallel_context("all_reduce_fusion_config") == [20, 35]
        assert context.get_auto_parallel_context("comm_fusion")["allreduce"] == {
            "mode": "index", "config": [20, 35]}
        g = graph.trace(nn.MLP(4, 8, 2), [((4, 4), np.float32)])
        assert request_from_context(g, mode="auto_parallel", device_num=2).comm_fusion == \
            AllReduceFusion("index", (20, 35))
        for bad, error in (([35, 20], context.ContextError), ([0], context.ContextError),
                           ([True], context.ContextError), ("20", context.ContextTypeError)):
            with pytest.raises(error, match=r"all_reduce_fusion_config must be a list of "
                                            r"increasing ints > 0 \(parameter indices\)"):
                context.set_auto_parallel_context(all_reduce_fusion_config=bad)
        assert context.get_auto_parallel_context("all_reduce_fusion_config") == [20, 35]
        with pytest.raises(context.ContextError, match="contradict each other"):
            context.set_auto_parallel_context(
                all_reduce_fusion_config=[2],
                comm_fusion={"allreduce": {"mode": "auto", "config": None}})
        context.set_auto_parallel_context(
            comm_fusion={"allreduce": {"mode": "auto", "config": None}})
        assert context.get_auto_parallel_context("all_reduce_fusion_config") == []
    finally:
        context.reset_auto_parallel_context()
