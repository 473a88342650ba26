"""The adapter pool against a real store: tiers, single flight, pins, failures, versions, and the
coordinator sync that carries invalidations in and residency out."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from loraserve.inference_worker.adapters import AdapterRef
from loraserve.inference_worker.errors import WorkerError
from tests.helpers.workers import wait_for


def code_of(excinfo) -> str:
    assert isinstance(excinfo.value, WorkerError), excinfo.value
    return excinfo.value.code


def test_single_flight_fetch(harness, lora_store):
    h = harness()
    fetches = lora_store.store.service.metrics.value("loraserve_store_fetches_total")

    async def many():
        return await asyncio.gather(*[h.ensure_cpu("all-r4") for _ in range(8)])

    keys = h.run(many())
    assert len(set(keys)) == 1 and keys[0].startswith("all-r4@")
    assert lora_store.store.service.metrics.value("loraserve_store_fetches_total") == fetches + 1
    assert h.pool.metrics.value("loraserve_worker_adapter_loads_total", {"tier": "cpu", "result": "ok"}) == 1
    # sequences waiting on the same adapter share that one fetch too
    assert h.acquire(1, "qv-r8") is None
    assert h.acquire(2, "qv-r8") is None
    assert h.acquire_eventually(1, "qv-r8")[0] == h.acquire_eventually(2, "qv-r8")[0]
    assert lora_store.store.service.metrics.value("loraserve_store_fetches_total") == fetches + 2


def test_a_load_given_up_leaves_the_fetch_to_the_requests_queued_for_it(harness, lora_store):
    h = harness()
    fetches = lora_store.store.service.metrics.value("loraserve_store_fetches_total")
    release = threading.Event()
    fetch = h.source.fetch

    async def held(*args, **kwargs):  # the store's answer comes once the test says so
        await asyncio.to_thread(release.wait, 10)
        return await fetch(*args, **kwargs)

    h.source.fetch = held
    try:
        load = asyncio.run_coroutine_threadsafe(h.ensure_cpu("all-r4"), h.loop)  # an operator's load
        ref = AdapterRef.parse("all-r4")
        assert wait_for(lambda: ref in h.pool.fetcher.flights)
        assert h.acquire(1, "all-r4") is None  # a request queued for the same adapter
        flight = h.pool.fetcher.flights[ref]
        assert flight.waiters == {1} and flight.awaited
        load.cancel()  # the operator gives up
        end = time.monotonic() + 5
        while not load.done() and time.monotonic() < end:
            time.sleep(0.01)
        for _ in range(3):  # loop turns in which a cancellation passed on to the flight would land
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), h.loop).result(5)
        assert flight.future is not None and not flight.future.done()
        release.set()
        slot, _ = h.acquire_eventually(1, "all-r4")
        assert slot is not None
        assert lora_store.store.service.metrics.value("loraserve_store_fetches_total") == fetches + 1
    finally:
        release.set()
        h.source.fetch = fetch


def test_tiers_are_lru_and_busy_slots_are_never_evicted(harness):
    h = harness(max_loras=2, max_cpu_loras=3)
    names = ["qv-r8", "all-r4", "mlp-rs16", "patterned"]
    for n in names:
        h.run(h.ensure_cpu(n))
    held = {s.adapter_id for s in h.pool.list()}
    assert held == {"all-r4", "mlp-rs16", "patterned"}  # qv-r8 was least recently used
    assert h.pool.metrics.value("loraserve_worker_adapter_evictions_total", {"tier": "cpu"}) == 1
    s1, _ = h.acquire_eventually(1, "all-r4")
    s2, _ = h.acquire_eventually(2, "mlp-rs16")
    assert {s1, s2} == {0, 1}
    # both slots are used by running sequences: a third adapter waits (and blocks nobody)
    assert h.acquire(3, "patterned") is None
    assert h.acquire(4, "all-r4")[0] == s1
    h.pool.release(2, num_tokens=5)
    s3, _ = h.acquire_eventually(3, "patterned")
    assert s3 == s2  # the idle slot was reused; the busy one kept its adapter
    assert h.pool.metrics.value("loraserve_worker_adapter_evictions_total", {"tier": "gpu"}) == 1
    by_id = {s.adapter_id: s for s in h.pool.list()}
    assert by_id["all-r4"].tier == "gpu" and by_id["all-r4"].num_running == 2
    assert by_id["mlp-rs16"].tier == "cpu" and by_id["mlp-rs16"].num_tokens == 5
    assert by_id["patterned"].slot == s2 and by_id["patterned"].num_gpu_loads == 1
    assert h.pool.metrics.value("loraserve_worker_adapter_slots_used") == 2


def test_a_slot_backed_by_the_cpu_tier_is_recycled_before_one_that_is_not(harness):
    """qv-r8 is the least recently used slot, but its CPU copy is gone (displaced): recycling its
    slot would lose the adapter to the store. all-r4's slot goes instead; all-r4 stays resident in
    the CPU tier, a copy away from a slot."""
    h = harness(max_loras=2, max_cpu_loras=3)
    for n in ("qv-r8", "all-r4", "mlp-rs16"):
        h.run(h.ensure_cpu(n))
    for seq, n in ((1, "qv-r8"), (2, "all-r4")):
        h.acquire_eventually(seq, n)
        h.pool.release(seq)
    with h.pool.lock:
        assert h.pool.tiers.evict_cpu(h.pool.versions.resolve(AdapterRef("qv-r8")))
    tiers = {s.adapter_id: s.tier for s in h.pool.list()}
    assert tiers == {"qv-r8": "gpu", "all-r4": "gpu", "mlp-rs16": "cpu"}
    h.acquire_eventually(3, "mlp-rs16")
    tiers = {s.adapter_id: s.tier for s in h.pool.list()}
    assert tiers == {"qv-r8": "gpu", "all-r4": "cpu", "mlp-rs16": "gpu"}  # three adapters, none lost
    # with every idle slot unbacked, the least recently used goes as before
    with h.pool.lock:
        assert h.pool.tiers.evict_cpu(h.pool.versions.resolve(AdapterRef("mlp-rs16")))
    h.pool.release(3)
    h.acquire_eventually(4, "all-r4")
    assert {s.adapter_id: s.tier for s in h.pool.list()} == {"mlp-rs16": "gpu", "all-r4": "gpu"}


def test_pins(harness):
    h = harness(max_loras=3, max_cpu_loras=6)
    a = h.run(h.adapters.pin_adapter("qv-r8", True))
    assert a.pinned and a.tier == "gpu"
    h.run(h.adapters.pin_adapter("all-r4", True))
    with pytest.raises(WorkerError) as e:
        h.run(h.adapters.pin_adapter("mlp-rs16", True))
    assert code_of(e) == "RESOURCE_EXHAUSTED" and "at most 2" in str(e.value)
    # traffic for other adapters rotates through the one unpinned slot; pins stay put
    for i, n in enumerate(["mlp-rs16", "patterned", "attn-l1-r2", "mlp-rs16"]):
        h.acquire_eventually(10 + i, n)
        h.pool.release(10 + i)
    by_id = {s.adapter_id: s for s in h.pool.list()}
    assert by_id["qv-r8"].tier == "gpu" and by_id["qv-r8"].num_gpu_loads == 1
    assert by_id["all-r4"].tier == "gpu" and by_id["all-r4"].num_gpu_loads == 1
    assert h.pool.metrics.value("loraserve_worker_adapter_slots_pinned") == 2
    with pytest.raises(WorkerError) as e:
        h.run(h.adapters.unload_adapter("qv-r8"))
    assert code_of(e) == "FAILED_PRECONDITION"
    assert not h.run(h.adapters.pin_adapter("qv-r8", False)).pinned
    assert h.run(h.adapters.unload_adapter("qv-r8")) is True
    assert "qv-r8" not in {s.adapter_id for s in h.pool.list()}
    assert h.run(h.adapters.unload_adapter("qv-r8")) is False


def test_unload_refuses_adapters_in_use(harness):
    h = harness()
    h.acquire_eventually(1, "qv-r8")
    with pytest.raises(WorkerError) as e:
        h.run(h.adapters.unload_adapter("qv-r8"))
    assert code_of(e) == "FAILED_PRECONDITION" and "in use" in str(e.value)
    h.pool.release(1)
    assert h.run(h.adapters.unload_adapter("qv-r8"))


def test_failures_fail_only_their_requests(harness, lora_store):
    h = harness()
    with pytest.raises(WorkerError) as e:
        h.acquire(1, "bad id!")
    assert code_of(e) == "INVALID_ARGUMENT"
    assert h.acquire(2, "no-such-adapter") is None
    assert h.acquire(3, "qv-r8") is None
    with pytest.raises(WorkerError) as e:
        h.acquire_eventually(2, "no-such-adapter")
    assert code_of(e) == "NOT_FOUND"
    assert h.acquire_eventually(3, "qv-r8")[1]
    # a retry is a new attempt, not a cached failure
    assert h.acquire(4, "no-such-adapter") is None
    assert (
        h.pool.metrics.value("loraserve_worker_adapter_loads_total", {"tier": "cpu", "result": "not_found"})
        >= 1
    )


def test_digest_mismatch_is_data_loss(harness, lora_store):
    h = harness()
    info = lora_store.register("corrupt-me", "all-r4", overwrite=True)
    service = lora_store.store.service
    h.run(h.ensure_cpu("corrupt-me"))  # ensure the store has it cached, then flip a byte there
    cached = service.cache.get("corrupt-me", info.digest)
    cached.payload[100] ^= 0xFF
    try:
        h.run(h.adapters.unload_adapter("corrupt-me"))
        with pytest.raises(WorkerError) as e:
            h.run(h.ensure_cpu("corrupt-me"))
        assert code_of(e) == "DATA_LOSS"
    finally:
        cached.payload[100] ^= 0xFF
    assert h.run(h.ensure_cpu("corrupt-me")) == f"corrupt-me@{info.digest}"


def test_versions_by_digest(harness, lora_store):
    h = harness()
    info = lora_store.register("versioned", "qv-r8", overwrite=True)
    slot, digest = h.acquire_eventually(1, f"versioned@{info.digest}")
    assert digest == info.digest
    with pytest.raises(WorkerError) as e:
        h.acquire_eventually(2, "versioned@" + "0" * 64)
    assert code_of(e) == "FAILED_PRECONDITION"
    with pytest.raises(WorkerError) as e:
        h.acquire(3, "versioned@not-hex")
    assert code_of(e) == "INVALID_ARGUMENT"


def test_invalidation_drops_stale_versions(harness, lora_store):
    h = harness()
    old = lora_store.register("swap", "qv-r8", overwrite=True)
    slot, digest = h.acquire_eventually(1, "swap")
    assert digest == old.digest
    new = lora_store.register("swap", "alt-qv-r8", overwrite=True)
    assert new.digest != old.digest
    h.coordinator.publish_invalidation("swap", new.digest, "registered")
    h.sync.poll_invalidations()
    # the running sequence keeps its version; nothing new is admitted onto it
    assert h.acquire(2, "swap") is None
    assert h.pool.list()[0].num_running == 1
    _, d2 = h.acquire_eventually(2, "swap")
    assert d2 == new.digest
    h.pool.release(1)
    assert {s.digest for s in h.pool.list() if s.adapter_id == "swap"} == {new.digest}
    assert h.pool.metrics.value("loraserve_worker_adapter_invalidations_total") >= 1


def test_pinned_adapter_reloads_its_new_version(harness, lora_store):
    import time

    h = harness(max_loras=2)
    lora_store.register("pinned-swap", "qv-r8", overwrite=True)
    assert h.run(h.adapters.pin_adapter("pinned-swap", True)).tier == "gpu"
    new = lora_store.register("pinned-swap", "alt-qv-r8", overwrite=True)
    h.coordinator.publish_invalidation("pinned-swap", new.digest, "registered")
    h.sync.poll_invalidations()
    deadline = time.monotonic() + 10
    while not any(s.digest == new.digest and s.tier == "gpu" and s.pinned for s in h.pool.list()):
        assert time.monotonic() < deadline, h.pool.list()
        time.sleep(0.02)


def test_residency_reaches_the_coordinator_off_the_step_thread(harness):
    h = harness(max_loras=2, max_cpu_loras=3)
    h.acquire_eventually(1, "qv-r8")
    h.run(h.ensure_cpu("all-r4"))
    assert h.coordinator.residencies(h.pool.worker_id) == []  # admission wrote nothing to the coordinator
    assert h.sync.flush_residency() == 2
    got = {r.adapter_id: r for r in h.coordinator.residencies(h.pool.worker_id)}
    assert got["qv-r8"].tier == "gpu" and got["qv-r8"].slot >= 0 and got["qv-r8"].last_used > 0
    assert got["all-r4"].tier == "cpu" and got["all-r4"].last_used == 0
    h.pool.release(1)
    h.run(h.adapters.unload_adapter("qv-r8"))
    h.sync.flush_residency()
    assert [r.adapter_id for r in h.coordinator.residencies(h.pool.worker_id)] == ["all-r4"]
    assert h.sync.flush_residency() == 0
