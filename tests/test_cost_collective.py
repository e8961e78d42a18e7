"""A collective's traffic and time have one owner, simpar.collective_kinds; the redistribution
planner, the ops' CommSpecs and the planners' tie-breaks all read it.

    python -m pytest tests/test_cost_collective.py -q
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from simpar.cost import (
    DeviceProfile,
    Link,
    latency_rounds,
    load_profile,
    sample_ranks,
    seconds,
    traffic,
)
from simpar.layout import TensorLayout
from simpar.ops import CommSpec
from simpar.redistribution import plan


@pytest.mark.parametrize(("kind", "p", "n", "want"), [
    ("AllReduce", 8, 1024, 2 * 7 * 1024 // 8), ("AllGather", 8, 1024, 7 * 1024),
    ("ReduceScatter", 4, 1024, 3 * 1024 // 4), ("AllToAll", 2, 10, 5),
    ("AllReduce", 1, 1024, 0), ("AllReduce", 8, 8, 14),   # 1 int64 over 8 ranks: 14 bytes
])
def test_traffic_is_the_ring_algorithms(kind: str, p: int, n: int, want: int) -> None:
    assert traffic(kind, p, n) == want


def test_traffic_refuses_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="kind must be one of .*got 'Broadcast'"):
        traffic("Broadcast", 8, 1)


def test_time_is_alpha_beta() -> None:
    # a ring's rounds: 2 (p-1) for an AllReduce, p-1 for the others (issue 29: one formula)
    assert latency_rounds("AllReduce", 8) == 14 and latency_rounds("AllToAllV", 8) == 7
    assert seconds("AllGather", 8, 25_000, alpha=1e-6, bandwidth=25e9) == pytest.approx(
        7e-6 + 1e-6)


@pytest.mark.parametrize("kind", ["AllReduce", "AllGather", "ReduceScatter", "AllToAll"])
def test_the_default_link_and_a_device_profile_count_the_same_rounds(kind: str) -> None:
    link = Link(latency=1.0, bandwidth=1e30)     # only the rounds cost anything
    profile = DeviceProfile("rounds", {"float32": 1.0}, 1, 1.0, link, link, 8)
    for p in (2, 3, 8):
        assert profile.collective_seconds(kind, range(p), 64) == pytest.approx(
            seconds(kind, p, 0, alpha=1.0))
    assert list(sample_ranks(8)) == list(range(8))
    big = sample_ranks(4096)
    assert len(big) == 65 and big[0] == 0 and big[-1] == 4095


def test_the_planner_and_the_op_rules_count_bytes_with_it() -> None:
    src = TensorLayout((8,), (0, -1), (64, 16))
    gather = plan(src, src.replicated())
    (step,) = gather.collectives()
    assert step.recv_bytes(0, 4) == traffic("AllGather", 8, 8 * 16 * 4)
    assert gather.seconds(4) == pytest.approx(seconds("AllGather", 8, 7 * 8 * 16 * 4))
    spec = CommSpec("AllReduce", (2, 4), (1,), 100)
    assert spec.recv_bytes(0, 4) == traffic("AllReduce", 4, 400)


def test_no_other_module_writes_the_formulas_down() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent / "simpar"
    copies = [str(f.relative_to(root)) for f in root.rglob("*.py")
              if f.parent.name != "cost" and re.search(r"\(p - 1\) \*", f.read_text())]
    assert copies == [], copies  # (docstrings write the table as "(p-1)/p n")


@pytest.mark.parametrize("profile", ["ascend910b", "cpu-local"])
def test_many_collectives_price_as_each_alone_bit_for_bit(profile: str) -> None:
    prof = load_profile(profile)
    groups = [(0,), (0, 1), tuple(range(8)), tuple(range(0, 32, 8)), (3, 11, 19, 27, 35)]
    which = np.array([0, 1, 2, 3, 4, 2, 1, 4, 3, 0])
    nbytes = np.array([7, 8, 1 << 20, 3 * (1 << 20) + 5, 12, 0, 999, 1 << 33, 6, 1 << 30])
    for kind in ("AllGather", "ReduceScatter", "AllReduce", "AllToAll"):
        many = prof.step_collectives_seconds(kind, groups, which, nbytes)
        one = [prof.step_collective_seconds(kind, groups[w], int(n), 0)
               for w, n in zip(which, nbytes)]
        assert many.tolist() == one
    with pytest.raises(ValueError, match="AllToAllV is priced on the bytes each rank"):
        prof.step_collectives_seconds("AllToAllV", groups, which, nbytes)
