"""WorkerRouter's refreshes of its workers' views against workers that hang (real gRPC servers on
port 0 whose calls never end, and a listener that never answers): no routing decision waits for
them, they run all at once, a worker whose refresh times out is down for down_s, and a worker that
was down comes back only once a refresh finds it answering."""

from __future__ import annotations

import threading
import time

import pytest

from loraserve.clients.router import WorkerRouter
from tests.helpers.fake_workers import FakeWorker, fake_workers, silent_listener

pytestmark = pytest.mark.timeout(60)


def _addresses(router: WorkerRouter, adapter_id: str = "x") -> list[str]:
    return [w.address for w in router.candidates(adapter_id)]


def _wait_for(check, timeout: float = 10.0) -> float:
    """Seconds until check() held; fails after `timeout`."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, "not within the time"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_hung_workers_hold_up_no_routing_decision() -> None:
    """Two workers hang (a gRPC server whose calls never end, a listener that never answers) and are
    probed again every down_s; four threads route all the while, each decision in milliseconds. The
    first decision waits for the first views, of all three workers at once: one refresh timeout."""
    healthy, hung = FakeWorker(gpu={"x"}), FakeWorker(gpu={"x"})
    hung.hung = True
    with fake_workers(healthy, hung) as (good, bad), silent_listener() as silent:
        with WorkerRouter([silent, bad, good], refresh_s=0.0, refresh_timeout_s=1.0, down_s=0.2) as router:
            t0 = time.monotonic()
            assert _addresses(router) == [good]
            assert time.monotonic() - t0 < 1.8  # one timeout for the three, not one each
            slowest: list[float] = []
            seen: list[list[str]] = []

            def route() -> None:
                worst = 0.0
                end = time.monotonic() + 2.5
                while time.monotonic() < end:
                    t = time.monotonic()
                    seen.append(_addresses(router))
                    worst = max(worst, time.monotonic() - t)
                    time.sleep(0.01)
                slowest.append(worst)

            threads = [threading.Thread(target=route) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert max(slowest) < 0.2, slowest
            assert len(seen) > 100 and all(s == [good] for s in seen)
            # the hung ones were asked again (after each down_s), in the background
            assert hung.calls.count("GetWorkerInfo") >= 3


def test_routes_on_the_last_view_while_a_refresh_hangs() -> None:
    """A worker that hangs after its first view keeps its place while its refresh is out, and is
    down once the refresh timed out."""
    holder, other = FakeWorker(gpu={"x"}), FakeWorker()
    with fake_workers(holder, other) as (a, b):
        with WorkerRouter([a, b], refresh_s=0.0, refresh_timeout_s=1.0, down_s=60.0) as router:
            assert _addresses(router) == [a, b]
            holder.hung = True
            t0 = time.monotonic()
            assert _addresses(router) == [a, b]  # the last view: the holder first
            assert time.monotonic() - t0 < 0.2
            waited = _wait_for(lambda: _addresses(router) == [b])
            assert 0.5 < waited < 3.0  # once its refresh (1 s) timed out


def test_a_worker_that_was_down_comes_back_once_a_refresh_finds_it_answering() -> None:
    """A worker a call found unavailable (mark_down) gets no request after down_s until a refresh
    answers, though its view is recent (refresh_s 60): while it still hangs, the probe times out
    and it is down again; once it answers, it is back."""
    holder, other = FakeWorker(gpu={"x"}), FakeWorker()
    with fake_workers(holder, other) as (a, b):
        with WorkerRouter([a, b], refresh_s=60.0, refresh_timeout_s=0.5, down_s=0.3) as router:
            view = router.candidates("x")[0]
            assert view.address == a
            holder.hung = True
            router.mark_down(view)
            assert _addresses(router) == [b]
            time.sleep(0.4)  # past down_s: probed, not routed to
            for _ in range(20):
                assert _addresses(router) == [b]
                time.sleep(0.05)
            holder.hung = False
            _wait_for(lambda: _addresses(router) == [a, b])


def test_a_refresh_answering_unavailable_takes_the_worker_down_at_once() -> None:
    with fake_workers(FakeWorker()) as (b,):
        with fake_workers(FakeWorker(gpu={"x"})) as (a,):
            pass
        # a's server is gone: its refresh is refused at once, not after the refresh timeout
        with WorkerRouter([a, b], refresh_s=0.0, refresh_timeout_s=5.0, down_s=60.0) as router:
            t0 = time.monotonic()
            assert _addresses(router) == [b]
            assert time.monotonic() - t0 < 2.0
