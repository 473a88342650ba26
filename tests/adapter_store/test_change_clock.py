"""ChangeClock: per key and kind, when it last changed; a key never seen, or forgotten past the
bound, answers the floor (the latest mark forgotten), so a write read before it is refused."""

from __future__ import annotations

from loraserve.adapter_store.change_clock import ChangeClock


def test_each_kind_keeps_its_own_mark() -> None:
    c = ChangeClock(2, 8)
    read = c.now
    c.change("a", (0,))
    assert c.since("a", 0) > read and c.since("a", 1) == 0  # kind 1 kept the floor
    c.change("a", (0, 1))
    assert c.since("a", 0) == c.since("a", 1) == c.now
    assert c.since("b", 0) == 0


def test_past_the_bound_the_floor_answers_for_what_was_forgotten() -> None:
    c = ChangeClock(2, 2)
    c.change("a", (0, 1))
    marked = c.now
    c.change("b", (0,))
    c.change("a", (0,))  # "a" is the most recent again: "b" goes first
    c.change("c", (0,))
    assert len(c) == 2 and c.since("b", 1) == c.since("z", 0) == c.now - 2
    assert c.since("a", 1) == marked  # held keys keep their own marks
