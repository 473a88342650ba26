"""Decayed request counts: a count halves every half-life, the top-k ranks them."""

from __future__ import annotations

import pytest

from loraserve.inference_worker.adapters.popularity import PopularityCounter


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
