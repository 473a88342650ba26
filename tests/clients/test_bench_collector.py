"""A benchmark run's garbage-collector hold: rare, still collecting cycles, undone by the last of
overlapping holds."""

from __future__ import annotations

import gc
import weakref

import pytest

from loraserve.clients.bench.collector import rare_collections


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.set_threshold(*threshold)


class _Node:
    pass


def _dropped_cycle() -> weakref.ref:
    """A weak reference to a reference cycle no longer reachable."""
    node = _Node()
    node.me = node  # type: ignore[attr-defined]
    return weakref.ref(node)


def test_rare_collections_raise_gen0_inside_and_still_collect_cycles(restore_gc) -> None:
    before = gc.get_threshold()
    with rare_collections(5_000):
        assert gc.get_threshold() == (5_000, *before[1:])
        assert gc.get_count()[0] < 100  # (one collection on the way in)
        cycle = _dropped_cycle()
        keep = [[] for _ in range(1_000)]
        assert cycle() is not None  # not collected at Python's 700 allocations...
        keep += [[] for _ in range(5_000)]
        assert cycle() is None  # ... but once 5,000 more objects are held
        del keep
    assert gc.get_threshold() == before
    with pytest.raises(ValueError, match="positive"), rare_collections(0):
        pass


def test_overlapping_holds_restore_when_the_last_ends(restore_gc) -> None:
    before = gc.get_threshold()
    first, second = rare_collections(9_000), rare_collections(8_000)
    first.__enter__()
    second.__enter__()
    assert gc.get_threshold()[0] == 9_000  # the first hold's setting stands
    first.__exit__(None, None, None)  # ends before the second (runs gathered on one loop)
    assert gc.get_threshold()[0] == 9_000
    second.__exit__(None, None, None)
    assert gc.get_threshold() == before
