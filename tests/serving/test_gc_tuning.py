"""The worker's garbage-collector settings: frozen startup objects, a raised youngest threshold."""

from __future__ import annotations

import gc

import pytest

from loraserve.inference_worker.config import WorkerConfig
from loraserve.serving.gc_tuning import GCPauses, tune_gc


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_tune_gc_freezes_what_is_alive_and_raises_gen0(restore_gc) -> None:
    gen1, gen2 = gc.get_threshold()[1:]
    alive = [object() for _ in range(10)], {"a": []}
    tune_gc(12_345)
    assert gc.get_threshold() == (12_345, gen1, gen2)
    assert gc.get_freeze_count() > 0
    listed = {id(o) for o in gc.get_objects()}
    assert all(gc.is_tracked(o) and id(o) not in listed for o in alive)  # frozen: not listed
    cycle: list = []
    cycle.append(cycle)
    ref = id(cycle)
    del cycle
    assert gc.collect() >= 1  # cycles made after it are still collected
    assert ref not in {id(o) for o in gc.get_objects()}


def test_tune_gc_refuses_a_threshold_below_one(restore_gc) -> None:
    with pytest.raises(ValueError, match="positive"):
        tune_gc(0)


def test_worker_config_checks_the_threshold() -> None:
    assert WorkerConfig(model="m").gc_threshold == 10_000
    with pytest.raises(ValueError, match="gc_threshold must be positive"):
        WorkerConfig(model="m", gc_threshold=0)
    assert WorkerConfig.from_args(["--model", "m", "--gc-threshold", "2000"]).gc_threshold == 2000


def test_gc_pauses_times_each_collection_by_generation_until_closed() -> None:
    seen: list[tuple[int, float]] = []
    pauses = GCPauses(lambda gen, seconds: seen.append((gen, seconds)))
    gc.disable()  # (only the collections below)
    try:
        junk = [[[] for _ in range(50)] for _ in range(2_000)]  # something for a full collection to walk
        gc.collect(1)  # (moved out of the young generations)
        gc.collect(0)
        gc.collect(2)
        del junk
    finally:
        pauses.close()
        gc.enable()
    assert [g for g, _ in seen] == [1, 0, 2]
    assert all(0 < s < 5 for _, s in seen)
    assert seen[-1][1] > seen[-2][1]  # the full collection walked the junk, the youngest did not
    n = len(seen)
    gc.collect()
    assert len(seen) == n  # closed: no longer called
    pauses.close()  # (twice is harmless)
