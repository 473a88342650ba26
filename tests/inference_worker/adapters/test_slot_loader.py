"""Slot loads on the slot loader's thread: a CPU-tier hit waits (admitting nothing) until its copy
ended, then serves the same weights as a load on the step thread; a loading slot is never a
victim; an adapter removed or superseded while it loads is freed once the copy ends; a failed copy
fails the one request that asks next and leaves the slot free; an admin load of the same version
waits for the copy in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from loraserve.inference_worker.adapters import AdapterRef
from loraserve.inference_worker.errors import WorkerError
from tests.helpers.pool_harness import Harness


@pytest.fixture
def make(tiny_model_dir, lora_store):
    made: list[Harness] = []

    def build(**kw) -> Harness:
        h = Harness(tiny_model_dir, lora_store.address, **kw)
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


def gate(h: Harness) -> threading.Event:
    """Hold every copy of `h`'s slots until the returned event is set."""
    opened = threading.Event()
    real = h.slots.load

    def held(slot, payload):
        assert opened.wait(20)
        real(slot, payload)

    h.slots.load = held  # type: ignore[method-assign]
    return opened


def slot_weights(h: Harness, slot: int) -> list[torch.Tensor]:
    s = h.slots
    return [
        *(s.a_all[g][:, slot].clone() for g in sorted(s.a_all)),
        *(s.b_all[g][:, slot].clone() for g in sorted(s.b_all)),
        s.ranks[:, :, slot].clone(),
    ]


def test_async_load_admits_after_the_copy_with_the_same_weights(make):
    sync, loader = make(async_loads=False), make(async_loads=True)
    for h in (sync, loader):
        h.run(h.ensure_cpu("all-r4"))
    s_sync, _ = sync.acquire(1, "all-r4")
    opened = gate(loader)
    assert loader.acquire(1, "all-r4") is None  # the copy is queued: the sequence waits
    (busy,) = [s for s in loader.pool.tiers.table.slots if s.loading]
    assert loader.acquire(1, "all-r4") is None  # and keeps waiting while it runs
    opened.set()
    s_async, _ = loader.acquire_eventually(1, "all-r4")
    assert s_async == busy.index and not busy.loading
    for a, b in zip(slot_weights(sync, s_sync), slot_weights(loader, s_async), strict=True):
        assert torch.equal(a, b)
    # one CPU lookup and one GPU load, counted once each
    m = loader.pool.metrics
    assert m.value("loraserve_worker_adapter_lookups_total", {"result": "cpu"}) == 1
    assert m.value("loraserve_worker_adapter_lookups_total", {"result": "gpu"}) == 0
    assert m.value("loraserve_worker_adapter_loads_total", {"tier": "gpu", "result": "ok"}) == 1
    assert loader.pool.state_of(AdapterRef.parse("all-r4")).num_gpu_loads == 1


def test_a_loading_slot_is_never_a_victim(make):
    h = make(async_loads=True, max_loras=1, max_cpu_loras=3)
    for ref in ("all-r4", "qv-r8"):
        h.run(h.ensure_cpu(ref))
    opened = gate(h)
    assert h.acquire(1, "all-r4") is None
    # the one slot is loading and held by no running sequence: another adapter still waits
    for _ in range(3):
        assert h.acquire(2, "qv-r8") is None
    assert [s.adapter_id for s in h.pool.tiers.table.slots] == ["all-r4"]
    opened.set()
    h.acquire_eventually(1, "all-r4")
    h.pool.release(1)
    h.acquire_eventually(2, "qv-r8")  # now it may take the idle slot


def test_removed_while_loading_is_freed_when_the_copy_ends(make):
    h = make(async_loads=True, max_loras=2)
    h.run(h.ensure_cpu("all-r4"))
    opened = gate(h)
    assert h.acquire(1, "all-r4") is None
    assert h.pool.unload("all-r4")
    (s,) = [s for s in h.pool.tiers.table.slots if s.loading]
    assert s.stale and h.pool.tiers.table.lookup(s.key or "") is None  # admits nothing new
    opened.set()
    h.settle()
    assert all(s.free for s in h.pool.tiers.table.slots)
    assert h.pool.metrics.value("loraserve_worker_adapter_slots_used") == 0


def test_a_failed_copy_fails_one_request_and_frees_the_slot(make):
    h = make(async_loads=True, max_loras=2)
    h.run(h.ensure_cpu("all-r4"))
    real, calls = h.slots.load, []

    def broken(slot, payload):
        calls.append(slot)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (staging)")
        real(slot, payload)

    h.slots.load = broken  # type: ignore[method-assign]
    assert h.acquire(1, "all-r4") is None
    h.settle()
    assert all(s.free for s in h.pool.tiers.table.slots)
    with pytest.raises(WorkerError) as err:
        h.acquire_eventually(1, "all-r4")
    assert err.value.code == "RESOURCE_EXHAUSTED" and "out of memory" in str(err.value)
    m = h.pool.metrics
    assert m.value("loraserve_worker_adapter_loads_total", {"tier": "gpu", "result": "error"}) == 1
    h.acquire_eventually(2, "all-r4")  # the next request loads it again
    assert len(calls) == 2


def test_admin_load_waits_for_the_copy_in_flight(make):
    h = make(async_loads=True, max_loras=2)
    key = h.run(h.ensure_cpu("all-r4"))
    opened = gate(h)
    assert h.acquire(1, "all-r4") is None
    got: list[int] = []
    admin = threading.Thread(target=lambda: got.append(h.pool.activate_now(key).index))
    admin.start()
    time.sleep(0.1)
    assert not got  # waiting for the loader, without the state lock: the step thread goes on
    assert h.acquire(2, "all-r4") is None
    opened.set()
    admin.join(10)
    assert got and got[0] == h.acquire_eventually(1, "all-r4")[0]
    assert h.pool.metrics.value("loraserve_worker_adapter_loads_total", {"tier": "gpu", "result": "ok"}) == 1
