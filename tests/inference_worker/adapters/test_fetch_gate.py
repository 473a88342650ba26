"""The order of adapter fetches when every fetch thread is busy (adapters/fetch_gate.py): one that
a request or an operator waits for goes before one that only brings an adapter in ahead of need,
urgency is judged when a place frees, and a fetch given up while it waits costs no place."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from loraserve.inference_worker.adapters.fetch_gate import FetchGate
from loraserve.inference_worker.adapters.fetcher import AdapterFetcher
from loraserve.inference_worker.adapters.metrics import AdapterMetrics
from loraserve.inference_worker.adapters.refs import AdapterRef


def run(coro, timeout: float = 10):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Entries:
    """Tasks that each take a place of the gate, note that they entered, and hold it until let go."""

    def __init__(self, gate: FetchGate) -> None:
        self.gate, self.order, self.inside_max = gate, [], 0
        self.go: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, name: str, urgent=lambda: False) -> None:
        self.go[name] = asyncio.Event()

        async def body() -> None:
            async with self.gate.slot(urgent):
                self.order.append(name)
                self.inside_max = max(self.inside_max, self.gate.running)
                await self.go[name].wait()

        self.tasks[name] = asyncio.ensure_future(body())

    async def release(self, name: str) -> None:
        self.go[name].set()
        await self.tasks[name]
        await asyncio.sleep(0)  # the next one enters


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_places_are_taken_in_arrival_order_one_kept_for_urgent_fetches() -> None:
    """Of three places, fetches nobody waits for take two, in arrival order."""

    async def body():
        gate = FetchGate(3)
        e = Entries(gate)
        for name in "abcde":
            e.start(name)
        await settle()
        assert e.order == ["a", "b"] and gate.num_waiting == 3 and gate.running == 2
        for name in "abcde":
            await e.release(name)
        assert e.order == list("abcde") and e.inside_max == 2
        assert gate.running == 0 and gate.background == 0

    run(body())


def test_a_fetch_somebody_waits_for_starts_at_once_in_the_place_kept_for_it() -> None:
    async def body():
        gate = FetchGate(4)
        e = Entries(gate)
        for i in range(6):
            e.start(f"prefetch-{i}")
        await settle()
        assert gate.running == 3 and gate.num_waiting == 3
        e.start("request", urgent=lambda: True)
        await settle()
        assert e.order[-1] == "request" and gate.running == 4
        await e.release("request")  # its place stays free for the next urgent fetch
        assert gate.running == 3 and gate.num_waiting == 3
        await e.release("prefetch-0")  # a prefetch's place goes to the next prefetch
        assert e.order[-1] == "prefetch-3" and gate.running == 3
        for i in (1, 2, 3, 4, 5):
            await e.release(f"prefetch-{i}")
        assert gate.running == 0 and gate.background == 0 and e.inside_max == 4

    run(body())


def test_an_urgent_fetch_goes_before_those_that_waited_longer() -> None:
    async def body():
        gate = FetchGate(1)
        e = Entries(gate)
        e.start("holder")
        e.start("prefetch-1")
        e.start("prefetch-2")
        e.start("request", urgent=lambda: True)
        await settle()
        for name in ("holder", "request", "prefetch-1", "prefetch-2"):
            await e.release(name)
        assert e.order == ["holder", "request", "prefetch-1", "prefetch-2"]

    run(body())


def test_urgency_is_judged_when_a_place_frees() -> None:
    """A prefetch that a request joined while it waited is urgent by then."""

    async def body():
        gate = FetchGate(1)
        e = Entries(gate)
        joined = {"p2": False}
        e.start("holder")
        e.start("p1")
        e.start("p2", urgent=lambda: joined["p2"])
        await settle()
        joined["p2"] = True
        for name in ("holder", "p2", "p1"):
            await e.release(name)
        assert e.order == ["holder", "p2", "p1"]

    run(body())


def test_a_question_about_urgency_that_fails_counts_as_not_urgent() -> None:
    async def body():
        gate = FetchGate(1)
        e = Entries(gate)
        e.start("holder")
        e.start("first")
        e.start("broken", urgent=lambda: 1 / 0)
        await settle()
        for name in ("holder", "first", "broken"):
            await e.release(name)
        assert e.order == ["holder", "first", "broken"]

    run(body())


def test_a_fetch_given_up_while_it_waits_costs_no_place() -> None:
    async def body():
        gate = FetchGate(1)
        e = Entries(gate)
        e.start("holder")
        e.start("gone")
        e.start("next")
        await settle()
        e.tasks["gone"].cancel()
        await settle()
        assert gate.num_waiting == 1
        await e.release("holder")
        assert e.order == ["holder", "next"] and gate.running == 1
        await e.release("next")
        assert gate.running == 0
        async with gate.slot(lambda: False):  # free: in at once
            assert gate.running == 1

    run(body())


def test_a_fetch_given_up_as_it_is_let_in_passes_its_place_on() -> None:
    async def body():
        gate = FetchGate(1)
        e = Entries(gate)
        holder = gate.slot(lambda: False)
        await holder.__aenter__()
        e.start("gone")
        e.start("next")
        await settle()
        await holder.__aexit__(None, None, None)  # lets "gone" in; its task has not resumed yet
        e.tasks["gone"].cancel()
        with pytest.raises(asyncio.CancelledError):
            await e.tasks["gone"]
        await settle()
        assert e.order == ["next"] and gate.running == 1
        await e.release("next")
        assert gate.running == 0 and gate.num_waiting == 0

    run(body())


def test_closed_the_waiting_fetches_fail_and_later_ones_too() -> None:
    async def body():
        gate = FetchGate(1)
        e = Entries(gate)
        e.start("holder")
        e.start("waiting")
        await settle()
        gate.close(lambda: RuntimeError("stopping"))
        with pytest.raises(RuntimeError, match="stopping"):
            await e.tasks["waiting"]
        with pytest.raises(RuntimeError, match="stopping"):
            async with gate.slot(lambda: True):
                pass
        await e.release("holder")  # the one running ends as it would
        assert e.order == ["holder"] and gate.running == 0

    run(body())


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FetchGate(0)


class HeldSource:
    """An adapter source whose fetches each wait until the test lets them go; one at a time."""

    max_fetches = 1

    def __init__(self) -> None:
        self.started: list[str] = []
        self.go: dict[str, threading.Event] = {}

    async def fetch(self, adapter_id: str, digest: str = ""):
        self.started.append(adapter_id)
        event = self.go.setdefault(adapter_id, threading.Event())
        await asyncio.to_thread(event.wait, 10)
        return SimpleNamespace(key=f"{adapter_id}@{'0' * 64}", nbytes=1, adapter_id=adapter_id, transport="")

    def let_go(self, adapter_id: str) -> None:
        self.go.setdefault(adapter_id, threading.Event()).set()


class Installer:
    def generation(self, adapter_id: str) -> int:
        return 0

    def check(self, payload) -> None:
        pass

    def install(self, payload, generation: int) -> bool:
        return True


def _wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_the_fetcher_sends_a_request_s_fetch_before_queued_prefetches() -> None:
    """Through the worker's fetcher: with its source's one fetch thread busy, a fetch a request
    waits for starts before prefetches started earlier, and a prefetch a request joins goes next."""
    source = HeldSource()
    lock = threading.RLock()
    fetcher = AdapterFetcher(source, Installer(), lock, AdapterMetrics())
    assert fetcher.gate is not None and fetcher.gate.capacity == 1
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        fetcher.start(loop)
        with lock:
            flights = [fetcher.fetch(AdapterRef(f"p{i}")) for i in range(4)]  # prefetches
        _wait_for(lambda: source.started == ["p0"])
        with lock:
            flights.append(fetcher.fetch(AdapterRef("request"), waiter=7))
        _wait_for(lambda: fetcher.gate is not None and fetcher.gate.num_waiting == 4)
        source.let_go("p0")
        _wait_for(lambda: source.started == ["p0", "request"])
        with lock:
            fetcher.fetch(AdapterRef("p3"), waiter=8)  # a request joins a queued prefetch
        source.let_go("request")
        _wait_for(lambda: source.started == ["p0", "request", "p3"])
        for name in ("p3", "p1", "p2"):
            source.let_go(name)
        for f in flights:
            assert f.future is not None
            f.future.result(10)
        assert source.started == ["p0", "request", "p3", "p1", "p2"]
        assert fetcher.gate.running == 0
    finally:
        for name in list(source.go):
            source.let_go(name)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
