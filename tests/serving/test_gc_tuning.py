"""The worker's garbage-collector settings: frozen startup objects, a raised youngest threshold."""

from __future__ import annotations

import gc
import sys
import threading

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
    cpu: list[tuple[int, float]] = []
    pauses = GCPauses(lambda gen, seconds: seen.append((gen, seconds)), lambda g, s: cpu.append((g, s)))
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
    assert [g for g, _ in seen] == [1, 0, 2] == [g for g, _ in cpu]
    assert all(0 < s < 5 for _, s in seen)
    assert all(0 <= c <= s + 1e-3 for (_, s), (_, c) in zip(seen, cpu, strict=True))
    assert seen[-1][1] > seen[-2][1]  # the full collection walked the junk, the youngest did not
    n = len(seen)
    gc.collect()
    assert len(seen) == n  # closed: no longer called
    pauses.close()  # (twice is harmless)


def test_the_cpu_time_leaves_out_another_thread_s_turn() -> None:
    """A collection longer than the switch interval gives the interpreter, at its timing callback,
    to a thread that waits for it: the pause counts that thread's turn, the CPU time does not."""
    junk = [[[] for _ in range(50)] for _ in range(4_000)]  # a full collection walks it: ~10 ms
    stop = threading.Event()

    def hold() -> None:  # the interpreter kept in C for ~20 ms at a time (no switch inside)
        while not stop.is_set():
            sum(range(1_000_000))

    walls: list[float] = []
    cpus: list[float] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # (the worker's)
    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    pauses = GCPauses(lambda g, s: walls.append(s), lambda g, s: cpus.append(s))
    gc.disable()
    try:
        for _ in range(5):
            gc.collect(2)
    finally:
        pauses.close()
        gc.enable()
        stop.set()
        holder.join(10)
        sys.setswitchinterval(interval)
    del junk
    assert len(walls) == len(cpus) == 5
    assert all(c <= w + 1e-3 for w, c in zip(walls, cpus, strict=True))
    assert max(w - c for w, c in zip(walls, cpus, strict=True)) > 0.005  # the holder's turn
