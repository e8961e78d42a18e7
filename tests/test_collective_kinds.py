"""The table of collective kinds is the one record every module reads: each redistribution
step kind has a row, adjoints pair up as DESIGN.md's "Backward through collectives" says,
simpar.comm runs each kind's function, and the cost model and the calibration read its
rounds and traffic.

    python -m pytest tests/test_collective_kinds.py -q
"""

from __future__ import annotations

import pytest

import simpar.comm as comm
from simpar.calibrate import KINDS as MEASURED
from simpar.calibrate import model_terms
from simpar.collective_kinds import KINDS, StepKind, by_function, kind_of
from simpar.cost import DeviceProfile, Link


def test_every_step_kind_has_a_row_and_its_adjoint_runs_it_back() -> None:
    adjoint = {"AllReduce": "AllReduce", "AllGather": "ReduceScatter",
               "ReduceScatter": "AllGather", "AllToAll": "AllToAll", "AllToAllV": "AllToAllV",
               "Slice": "Slice", "Zero": "Zero"}
    assert {str(k): str(k.adjoint) for k in StepKind} == adjoint
    assert all(k.adjoint.adjoint is k for k in StepKind)
    assert [str(k) for k in StepKind if k.local] == ["Slice", "Zero"]
    assert all(k.facts is KINDS[str(k)] for k in StepKind)


def test_simpar_comm_runs_every_collective_kind() -> None:
    for kind in KINDS.values():
        if kind.function:
            assert callable(getattr(comm, kind.function)), kind
            assert by_function(kind.function) is kind


def test_unknown_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match=r"kind must be one of .*got 'Gather'"):
        kind_of("Gather")
    with pytest.raises(ValueError, match=r"kind must be one of .*got 'Gather'"):
        DeviceProfile("p", {"float32": 1.0}, 1, 1.0, Link(1.0, 1.0), Link(1.0, 1.0),
                      8).collective_seconds("Gather", range(4), 8)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_profile_and_the_calibration_price_a_kind_by_its_row(p: int) -> None:
    unit = DeviceProfile("unit", {"float32": 1.0}, 1, 1.0, Link(1.0, 1.0), Link(1.0, 1.0), 8)
    for name in (*MEASURED, "Broadcast", "AllToAllV"):
        kind = kind_of(name)
        rounds, moved = kind.rounds(p), kind.traffic(p, 4096)
        assert unit.collective_seconds(name, range(p), 4096) == rounds + moved
    assert [model_terms(name, p, 4096) for name in MEASURED] == [
        (kind_of(n).rounds(p), kind_of(n).traffic(p, 4096)) for n in MEASURED]
    assert list(MEASURED) == ["AllReduce", "AllGather", "ReduceScatter", "AllToAll"]
