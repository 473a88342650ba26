"""Adapters of waiting requests, through the engine: look-ahead brings a queued request's adapter
into a slot before the request is admitted; and under a skewed workload the batch stays full
while the queue's head waits for a slow adapter fetch (no head-of-line blocking)."""

from __future__ import annotations

import time

import pytest

from tests.helpers.local_worker import LocalWorker

PROMPT = [5, 17, 42, 99, 7, 3]


def wait_until(check, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def lookups(w: LocalWorker, result: str) -> float:
    return w.adapters.pool.metrics.value("loraserve_worker_adapter_lookups_total", {"result": result})


@pytest.mark.parametrize("lookahead", [3, 0])
def test_queued_adapter_is_in_a_slot_before_admission(tiny_model_dir, lora_store, lookahead):
    # no popularity prefetch: it could bring the adapter in as well, whatever look-ahead does
    w = LocalWorker(
        tiny_model_dir,
        lora_store.address,
        max_loras=2,
        max_cpu_loras=6,
        max_num_seqs=2,
        lookahead=lookahead,
        prefetch=0,
    )
    try:
        # the fetch process is up (as a served worker's is, long before its first request): the
        # base requests below run for well under a second on this model
        w.call(w.adapters.pool.fetcher.source.fetch("all-r4"))
        # the running set is full of long base requests: the adapter request must queue
        longs = [w.submit(PROMPT, "", max_tokens=40) for _ in range(2)]
        wait_until(lambda: w.engine.num_running == 2)
        queued = w.submit(PROMPT, "qv-r8", max_tokens=4)
        if lookahead:
            wait_until(lambda: w.adapters.list_adapters() and w.adapters.list_adapters()[0].tier == "gpu")
            assert not queued.done() and not any(f.done() for f in longs)  # staged while still queued
        _, err, out = queued.result(60)
        assert err is None and out.usage.adapter_tier == "store"  # arrived before its adapter
        # with look-ahead its admission found the adapter in a slot; without, it missed (once per
        # step until its fetch ended: how many steps that took depends on the machine's load),
        # then was copied in from the CPU tier
        # the request is counted once, where its adapter was on arrival, however often it missed
        by_tier = {
            t: w.adapters.pool.metrics.value("loraserve_worker_adapter_requests_total", {"tier": t})
            for t in ("gpu", "cpu", "store")
        }
        assert by_tier == {"gpu": 0, "cpu": 0, "store": 1}
        misses, gpu, cpu = (lookups(w, r) for r in ("miss", "gpu", "cpu"))
        if lookahead:
            assert (misses, gpu, cpu) == (0, 1, 0)
        else:
            assert misses >= 1 and (gpu, cpu) == (0, 1)
    finally:
        w.close()


def test_batch_stays_full_while_the_head_waits_for_its_adapter(tiny_model_dir, lora_store):
    max_num_seqs = 4
    w = LocalWorker(
        tiny_model_dir, lora_store.address, max_loras=2, max_cpu_loras=6, max_num_seqs=max_num_seqs,
        fetch_delay_s=1.5,
    )  # fmt: skip
    try:
        for hot in ("qv-r8", "all-r4"):
            w.call(w.adapters.load_adapter(hot, "gpu"))
        scheduler = w.engine.scheduler
        steps: list[tuple[int, int]] = []  # per step: (running, waiting requests other than the head)
        schedule = scheduler.schedule

        def recording_schedule():
            batch = schedule()
            steps.append(
                (len(scheduler.running), sum(1 for s in scheduler.waiting if s.adapter_id != "mlp-rs16"))
            )
            return batch

        scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        head = w.submit(PROMPT, "mlp-rs16", max_tokens=4)  # cold: its fetch takes 1.5 s
        # skewed (Zipf-like) traffic behind it: mostly the hottest adapter, some of the next, some base
        skewed = ["qv-r8"] * 8 + ["all-r4"] * 4 + [""] * 4
        rest = [w.submit(PROMPT, a, max_tokens=8) for a in skewed]
        for fut in rest:
            _, err, _ = fut.result(30)
            assert err is None
        assert not head.done()  # everything behind the head finished while it waited
        full = [running == max_num_seqs for running, others in steps if others]
        assert full and all(full), steps  # whenever others waited, the batch was full
        _, err, out = head.result(30)
        assert err is None and out.usage.adapter_tier == "store"
    finally:
        w.close()
