"""When the serving benchmark's warm-up goes on (--settle): while the share of requests whose
adapter came from the store keeps falling and is above the floor."""

from __future__ import annotations

from benchmarks.serving_report import still_warming, store_share


def test_store_share_is_what_was_not_resident() -> None:
    summary = {"ttft_ms_by_tier": {"gpu": {"count": 70}, "cpu": {"count": 20}, "store": {"count": 10}}}
    assert store_share(summary) == 0.1
    assert store_share({"ttft_ms_by_tier": {}}) is None  # no adapter requests


def test_warming_goes_on_while_the_store_share_falls_and_stops_at_a_floor_or_a_level() -> None:
    assert still_warming(None, 0.4)  # the first look: only the floor decides
    assert still_warming(0.4, 0.2)  # halved: the tiers are still filling
    assert not still_warming(0.2, 0.18)  # levelled off: tiers smaller than the adapter set
    assert not still_warming(0.05, 0.015)  # at the floor: every adapter is resident
    assert not still_warming(0.3, None)
    assert not still_warming(None, 0.01)
