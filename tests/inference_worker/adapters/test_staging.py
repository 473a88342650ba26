"""Adapters ahead of need: look-ahead stages queued requests' adapters before their turn (bounded,
never evicting what running or earlier-queued requests need); popularity prefetch brings in the
fleet's popular adapters that the complementary placement gives a worker, across workers sharing
a coordinator (in-process and Redis), replacing colder entries but never needed or pinned ones."""

from __future__ import annotations

import time

import pytest

from loraserve.clients.placement import home
from loraserve.inference_worker.adapters import AdapterRef
from loraserve.inference_worker.adapters.placement import FleetView
from loraserve.inference_worker.adapters.staging import AheadOfNeed
from loraserve.inference_worker.coordination import InProcessCoordinator
from loraserve.inference_worker.errors import AdapterInUse, WorkerError


def eventually(check, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := check():
            return got
        time.sleep(0.01)
    raise TimeoutError(check)


def tier(h, ref: str) -> str:
    return h.pool.arrival_tier(AdapterRef.parse(ref))


def lookups(h, result: str) -> float:
    return h.pool.metrics.value("loraserve_worker_adapter_lookups_total", {"result": result})


def test_queued_adapter_is_staged_before_its_turn(harness, lora_store):
    h = harness(max_loras=3, max_cpu_loras=6, lookahead=4)
    h.acquire_eventually(1, "all-r4")
    h.acquire_eventually(2, "mlp-rs16")  # running: two slots busy, one free
    queue = [(3, "qv-r8"), (4, ""), (5, "patterned")]  # arrival order; 4 is a base request
    h.adapters.ahead.look_ahead(queue)
    # fetched into the CPU tier without any admission attempt for 3 or 5
    eventually(lambda: tier(h, "qv-r8") == "cpu" and tier(h, "patterned") == "cpu")
    assert h.adapters.ahead.num_fetched_ahead == 2
    # the next step copies the first in arrival order into the free slot, nothing is evicted
    h.adapters.ahead.look_ahead(queue)
    assert tier(h, "qv-r8") == "gpu" and tier(h, "patterned") == "cpu"
    assert h.pool.metrics.value("loraserve_worker_adapter_evictions_total", {"tier": "gpu"}) == 0
    assert {tier(h, "all-r4"), tier(h, "mlp-rs16")} == {"gpu"}
    # its turn: admitted at once from a slot, no miss, no fetch
    misses, fetches = (
        lookups(h, "miss"),
        lora_store.store.service.metrics.value("loraserve_store_fetches_total"),
    )
    assert h.acquire(3, "qv-r8") is not None
    assert lookups(h, "miss") == misses
    assert lora_store.store.service.metrics.value("loraserve_store_fetches_total") == fetches


def test_a_pass_with_every_slot_taken_scans_the_slots_once(harness, monkeypatch):
    h = harness(max_loras=2, max_cpu_loras=6, lookahead=4)
    for ref in ("all-r4", "qv-r8", "patterned", "mlp-rs16"):
        h.run(h.ensure_cpu(ref))
    h.acquire_eventually(1, "all-r4")
    h.acquire_eventually(2, "qv-r8")  # both slots run
    table = h.pool.tiers.table
    scans: list[int] = []
    real = table.free_slot
    monkeypatch.setattr(table, "free_slot", lambda: scans.append(1) or real())
    h.adapters.ahead.look_ahead([(3, "patterned"), (4, "mlp-rs16")])  # both in the CPU tier only
    assert scans == [1] and tier(h, "patterned") == tier(h, "mlp-rs16") == "cpu"
    h.pool.release(1)
    h.pool.release(2)
    h.pool.tiers.drop_slot(table.slots[0])  # a slot frees up: the next pass stages into it
    h.adapters.ahead.look_ahead([(3, "patterned"), (4, "mlp-rs16")])
    assert tier(h, "patterned") == "gpu" and tier(h, "mlp-rs16") == "cpu"


def test_an_earlier_queued_request_keeps_its_slot(harness):
    h = harness(max_loras=2, max_cpu_loras=6, lookahead=4)
    for ref in ("all-r4", "qv-r8", "patterned"):
        h.run(h.ensure_cpu(ref))
    s_qv, _ = h.acquire_eventually(2, "qv-r8")
    s_all, _ = h.acquire_eventually(1, "all-r4")
    h.pool.release(1)
    h.pool.release(2)  # both slots idle; qv-r8's is the least recently used
    # queue: 10 waits for qv-r8 (position 0), 11 for patterned (position 1)
    h.adapters.ahead.look_ahead([(10, "qv-r8"), (11, "patterned")])
    slot, _ = h.acquire(11, "patterned")
    assert slot == s_all  # not qv-r8's slot, though it is idle and used longer ago
    assert tier(h, "qv-r8") == "gpu"
    # a request behind both may take neither: patterned's slot runs, qv-r8's is queued for
    h.adapters.ahead.look_ahead([(10, "qv-r8"), (12, "mlp-rs16")])
    h.run(h.ensure_cpu("mlp-rs16"))
    assert h.acquire(12, "mlp-rs16") is None
    assert tier(h, "qv-r8") == "gpu"
    assert h.acquire(10, "qv-r8")[0] == s_qv


def test_cpu_tier_keeps_what_queued_requests_need(harness):
    h = harness(max_loras=1, max_cpu_loras=3, lookahead=1)
    for ref in ("qv-r8", "all-r4", "patterned"):  # qv-r8 is the least recently used
        h.run(h.ensure_cpu(ref))
    h.adapters.ahead.look_ahead([(1, "qv-r8")])
    h.run(h.ensure_cpu("mlp-rs16"))
    held = {key.split("@")[0] for key in h.pool.tiers.cpu.keys()}
    assert held == {"qv-r8", "patterned", "mlp-rs16"}  # the least recently used unqueued one left


def test_look_ahead_is_bounded(harness):
    h = harness(max_loras=2, max_cpu_loras=8, lookahead=2)
    queue = [(1, "qv-r8"), (2, "all-r4"), (3, "patterned"), (4, "mlp-rs16")]
    h.adapters.ahead.look_ahead(queue)
    assert h.adapters.ahead.num_fetched_ahead == 2  # the window: the first two queued only
    assert h.pool.wanted == {"qv-r8": 0, "all-r4": 1}
    eventually(lambda: not h.pool.fetcher.flights)
    ahead = AheadOfNeed(h.pool, window=4, max_fetches=1)
    ahead.look_ahead(queue)
    assert ahead.num_fetched_ahead == 1 and len(h.pool.fetcher.flights) <= 1  # fetches in flight
    with pytest.raises(ValueError, match="look-ahead window"):
        AheadOfNeed(h.pool, window=8)


def test_a_failed_look_ahead_fetch_fails_its_requests_once(harness):
    h = harness(max_loras=1, max_cpu_loras=4, lookahead=2)
    queue = [(1, "no-such-adapter"), (2, "no-such-adapter")]
    h.adapters.ahead.look_ahead(queue)
    eventually(lambda: h.pool.fetcher.has_failed(1) and h.pool.fetcher.has_failed(2))
    for _ in range(5):  # later steps do not ask the store again while the failure waits
        h.adapters.ahead.look_ahead(queue)
    assert h.adapters.ahead.num_fetched_ahead == 1
    assert (
        h.pool.metrics.value("loraserve_worker_adapter_loads_total", {"tier": "cpu", "result": "not_found"})
        == 1
    )
    for seq_key in (1, 2):  # each request fails with the store's answer at admission
        with pytest.raises(WorkerError) as e:
            h.acquire(seq_key, "no-such-adapter")
        assert e.value.code == "NOT_FOUND"


def held(h) -> set[str]:
    return {key.split("@")[0] for key in h.pool.tiers.cpu.keys()}


def test_prefetch_fills_free_room_with_the_most_popular(harness):
    h = harness(max_loras=1, max_cpu_loras=3, prefetch=8)
    h.run(h.ensure_cpu("all-r4"))
    fleet = {"qv-r8": 9.0, "all-r4": 7.0, "patterned": 5.0, "mlp-rs16": 1.0}
    started = h.adapters.ahead.prefetch(FleetView("worker", fleet, ("worker",)))
    assert started == ["qv-r8", "patterned"]  # the most popular it lacks, as many as there is room
    eventually(lambda: tier(h, "qv-r8") == "cpu" and tier(h, "patterned") == "cpu")
    # full, and mlp-rs16 is colder than everything held: nothing is displaced
    assert h.adapters.ahead.prefetch(FleetView("worker", fleet, ("worker",))) == []
    assert h.pool.metrics.value("loraserve_worker_adapter_evictions_total", {"tier": "cpu"}) == 0


def test_prefetch_displaces_colder_entries_never_needed_or_pinned_ones(harness):
    h = harness(max_loras=2, max_cpu_loras=4, prefetch=8)
    for ref in ("qv-r8", "all-r4", "patterned", "attn-l1-r2"):
        h.run(h.ensure_cpu(ref))
    h.pool.set_pin("patterned", h.pool.versions.resolve(AdapterRef("patterned")))  # pinned
    h.acquire_eventually(1, "qv-r8")  # a running sequence uses it
    with h.pool.lock:
        h.pool.wanted = {"all-r4": 0}  # a queued request waits for it
    cold = {"qv-r8": 0.05, "all-r4": 0.1, "patterned": 0.1, "attn-l1-r2": 0.2}
    fleet = FleetView("worker", {**cold, "mlp-rs16": 5.0}, ("worker",))
    assert h.adapters.ahead.prefetch(fleet) == ["mlp-rs16"]
    eventually(lambda: tier(h, "mlp-rs16") == "cpu")
    assert held(h) == {"qv-r8", "all-r4", "patterned", "mlp-rs16"}  # the one evictable entry left
    assert h.adapters.ahead.num_displaced == 1
    assert h.pool.metrics.value("loraserve_worker_adapter_evictions_total", {"tier": "cpu"}) == 1
    # attn-l1-r2 is now wanted, but more popular than nothing evictable: mlp-rs16 (5) stays
    again = FleetView("worker", {**cold, "mlp-rs16": 5.0, "attn-l1-r2": 4.0}, ("worker",))
    assert h.adapters.ahead.prefetch(again) == []
    with h.pool.lock:
        h.pool.wanted = {}
    h.pool.release(1)  # nothing needs qv-r8 any more: the coldest entry goes for a hotter one
    assert h.adapters.ahead.prefetch(again) == ["attn-l1-r2"]
    eventually(lambda: tier(h, "attn-l1-r2") == "cpu")
    assert held(h) == {"attn-l1-r2", "all-r4", "patterned", "mlp-rs16"}


def test_prefetch_leaves_out_what_an_operator_unloaded_until_it_is_asked_for(harness):
    """An unload is not undone by the next prefetch round, however popular the adapter still
    counts; a request for it, an operator's load or a pin ends that."""
    h = harness(max_loras=2, max_cpu_loras=3, prefetch=8)
    fleet = FleetView("worker", {"qv-r8": 9.0, "all-r4": 7.0, "patterned": 5.0}, ("worker",))
    assert h.adapters.ahead.prefetch(fleet) == ["qv-r8", "all-r4", "patterned"]
    eventually(lambda: held(h) == {"qv-r8", "all-r4", "patterned"})
    assert h.pool.unload("qv-r8") and h.pool.unload("patterned")
    assert h.adapters.ahead.prefetch(fleet) == []  # room for both, the most popular: left out
    assert held(h) == {"all-r4"}
    assert not h.pool.unload("mlp-rs16")  # not held: kept out all the same
    h.pool.set_pin("all-r4", h.pool.versions.resolve(AdapterRef("all-r4")))
    with pytest.raises(AdapterInUse):
        h.pool.unload("all-r4")  # refused: nothing changes for it
    assert list(h.pool.kept_out) == ["qv-r8", "patterned", "mlp-rs16"]
    # a request for it: served on demand, and no longer kept out
    h.acquire_eventually(1, "qv-r8")
    h.pool.release(1)
    assert list(h.pool.kept_out) == ["patterned", "mlp-rs16"]
    # so do an operator's load and a pin
    h.run(h.ensure_cpu("patterned"))
    assert list(h.pool.kept_out) == ["mlp-rs16"]
    h.pool.set_pin("all-r4", None)
    h.run(h.ensure_cpu("mlp-rs16"))
    with h.pool.lock:
        h.pool.kept_out["mlp-rs16"] = None  # unloaded meanwhile, say
    h.pool.set_pin("mlp-rs16", h.pool.versions.resolve(AdapterRef("mlp-rs16")))
    assert not h.pool.kept_out


@pytest.fixture(params=["in_process", pytest.param("redis", marks=pytest.mark.redis)])
def shared_coordinator(request):
    """One coordinator per worker, over shared state: the same object in-process, or two Redis
    clients under one prefix (as two worker processes have)."""
    if request.param == "in_process":
        c = InProcessCoordinator()
        yield lambda: c
        return
    from loraserve.inference_worker.coordination.redis_coordinator import RedisCoordinator

    url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
    made: list[RedisCoordinator] = []
    yield lambda: made.append(RedisCoordinator(url, prefix)) or made[-1]
    for c in made:
        c.close()


def test_two_workers_prefetch_complementary_adapters(harness, shared_coordinator):
    names = ["qv-r8", "all-r4", "mlp-rs16", "patterned", "attn-l1-r2"]
    a, b = (
        harness(coordinator=shared_coordinator(), worker_id=w, max_loras=1, max_cpu_loras=5, prefetch=8)
        for w in ("w-a", "w-b")
    )
    for h in (a, b):
        h.adapters.ahead.replicate_share = 0.5  # no adapter is hot here
        h.sync.heartbeat()
    for i, name in enumerate(names):  # the traffic so far went to a worker of an earlier fleet
        for _ in range(i + 1):
            a.pool.popularity.record(name)
    for _round in range(2):
        for h in (a, b):
            h.sync.share_popularity()  # publish counts, read the fleet, prefetch
        eventually(lambda: not a.pool.fetcher.flights and not b.pool.fetcher.flights)
        for h in (a, b):
            h.sync.flush_residency()
    homes = {w: {n for n in names if home(n, ("w-a", "w-b")) == w} for w in ("w-a", "w-b")}
    assert homes["w-a"] and homes["w-b"]  # both get some (the split depends only on the ids)
    assert held(a) == homes["w-a"] and held(b) == homes["w-b"]  # different adapters, all held once
    # a hot adapter is held by both, so the router can spread its traffic
    for _ in range(40):
        b.pool.popularity.record("mlp-rs16")
    for h in (b, a):
        h.adapters.ahead.replicate_share = 0.3
        h.sync.share_popularity()
    eventually(lambda: "mlp-rs16" in held(a) and "mlp-rs16" in held(b))
    # a leaves (a scale-in): its counts and residency go with it. b counted none of a's adapters
    # (the router sent their requests to a), but remembers what the fleet's counts said of them and,
    # now the home of every adapter, takes them
    a.sync.coordinator.release_worker("w-a")
    b.sync.share_popularity()
    eventually(lambda: not b.pool.fetcher.flights)
    assert held(b) == set(names)
