"""Decayed request counts: a count halves every half-life, the top-k ranks them; the fleet's
counts as last read fade at the same rate instead of vanishing with a worker."""

from __future__ import annotations

import pytest

from loraserve.inference_worker.adapters.popularity import FleetMemory, PopularityCounter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_counts_halve_every_half_life_and_rank() -> None:
    clock = Clock()
    pop = PopularityCounter(half_life_s=10.0, clock=clock)
    for _ in range(8):
        pop.record("a")
    pop.record("b", 2.0)
    assert pop.top(5) == {"a": 8.0, "b": 2.0}
    clock.t += 10.0
    pop.record("b")  # b: 2 decayed to 1, plus 1
    assert pop.top(5) == pytest.approx({"a": 4.0, "b": 2.0})
    clock.t += 20.0
    assert pop.top(1) == pytest.approx({"a": 1.0})
    clock.t += 200.0
    assert pop.top(5) == {}  # decayed under the floor


def test_entries_stay_bounded_keeping_the_most_popular() -> None:
    clock = Clock()
    pop = PopularityCounter(half_life_s=60.0, max_entries=10, clock=clock)
    for i in range(100):
        for _ in range(i % 7 + 1):
            pop.record(f"x{i}")
    assert len(pop._counts) <= 20
    assert set(pop.top(3)) <= {f"x{i}" for i in range(100) if i % 7 == 6}


def test_bad_half_life() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        PopularityCounter(half_life_s=0)
    with pytest.raises(ValueError, match="half_life_s"):
        FleetMemory(half_life_s=-1.0)


def test_a_leaving_workers_counts_fade_instead_of_vanishing() -> None:
    clock = Clock()
    memory = FleetMemory(10.0, clock=clock)
    assert memory.merge({"a": 8.0, "b": 4.0}) == {"a": 8.0, "b": 4.0}
    clock.t += 10.0
    # b's worker left: its counts are gone from the fleet's, the memory halves them instead
    assert memory.merge({"a": 6.0}) == pytest.approx({"a": 6.0, "b": 2.0})
    clock.t += 10.0
    # a count that grew is taken as it is now; one that fell faster than the decay is held up
    assert memory.merge({"a": 1.0, "c": 5.0}) == pytest.approx({"a": 3.0, "b": 1.0, "c": 5.0})
    # an empty read (the coordinator unreachable) is not merged, nor does it change the memory
    assert memory.merge({}) == {}
    assert memory.merge({"c": 5.0}) == pytest.approx({"a": 3.0, "b": 1.0, "c": 5.0})
    clock.t += 200.0  # everything decays under the floor and is forgotten
    assert memory.merge({"d": 1.0}) == {"d": 1.0}


def test_fleet_memory_stays_bounded_keeping_the_largest() -> None:
    clock = Clock()
    memory = FleetMemory(60.0, max_entries=5, clock=clock)
    memory.merge({f"x{i}": float(i) for i in range(20)})
    clock.t += 1.0
    got = memory.merge({"new": 100.0})
    assert len(got) == 5 and "new" in got and set(got) - {"new"} == {"x16", "x17", "x18", "x19"}
