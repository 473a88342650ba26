"""The router's order of workers for one request, on views (no servers): holders first (GPU,
then CPU, the least loaded first), an adapter held nowhere to its rendezvous home, and no
worker kept first while it is overloaded against the least loaded one."""

from __future__ import annotations

from loraserve.clients.placement import home, rendezvous_order
from loraserve.clients.router import WorkerView, order_workers

ADDRESSES = ("10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061")


def views(load: dict[str, int] | None = None, **held: tuple[set[str], set[str]]) -> list[WorkerView]:
    """held: address index as `w0`..`w2` -> (GPU ids, CPU ids)."""
    out = []
    for i, a in enumerate(ADDRESSES):
        gpu, cpu = held.get(f"w{i}", (set(), set()))
        out.append(WorkerView(a, client=None, load=(load or {}).get(a, 0), gpu=gpu, cpu=cpu))  # type: ignore[arg-type]
    return out


def order(adapter_id: str, ws: list[WorkerView], max_imbalance: int = 16) -> list[str]:
    return [w.address for w in order_workers(adapter_id, ws, max_imbalance)]


def test_holders_first_gpu_then_cpu_then_least_loaded() -> None:
    a0, a1, a2 = ADDRESSES
    ws = views({a0: 5, a1: 1, a2: 0}, w0=({"x"}, set()), w1=(set(), {"x"}))
    assert order("x", ws)[:2] == [a0, a1]  # GPU before CPU, though busier
    ws = views({a0: 5, a1: 1, a2: 0}, w0=({"x"}, set()), w1=({"x"}, set()))
    assert order("x", ws)[:2] == [a1, a0]  # two GPU holders: the least loaded
    assert order("x@" + "0" * 64, ws)[:2] == [a1, a0]  # a pinned version routes by its id


def test_an_adapter_held_nowhere_goes_to_its_home_every_time() -> None:
    ws = views({ADDRESSES[0]: 3, ADDRESSES[1]: 0, ADDRESSES[2]: 7})
    for i in range(50):
        aid = f"tail-{i}"
        got = order(aid, ws)
        assert got == rendezvous_order(aid, ADDRESSES)  # the same order the prefetch partition uses
        assert got[0] == home(aid, ADDRESSES)
    homes = {order(f"tail-{i}", ws)[0] for i in range(60)}
    assert homes == set(ADDRESSES)  # spread over the fleet


def test_an_overloaded_holder_loses_its_place() -> None:
    a0, a1, a2 = ADDRESSES
    ws = views({a0: 16, a1: 0, a2: 0}, w0=({"x"}, set()))
    assert order("x", ws)[0] == a0  # 16 over the least loaded: within the bound
    ws = views({a0: 17, a1: 0, a2: 0}, w0=({"x"}, set()))
    got = order("x", ws)
    assert got[-1] == a0 and got[:2] == rendezvous_order("x", [a1, a2])
    # the bound grows with the load: twice the least loaded is still fine
    ws = views({a0: 80, a1: 40, a2: 40}, w0=({"x"}, set()))
    assert order("x", ws)[0] == a0
    ws = views({a0: 81, a1: 40, a2: 40}, w0=({"x"}, set()))
    assert order("x", ws)[0] != a0
    # an overloaded home gives its unheld adapters to the next in rendezvous order
    aid = next(f"t{i}" for i in range(100) if home(f"t{i}", ADDRESSES) == a0)
    ws = views({a0: 30, a1: 0, a2: 0})
    assert order(aid, ws) == rendezvous_order(aid, [a1, a2]) + [a0]


def test_base_requests_go_to_the_least_loaded() -> None:
    a0, a1, a2 = ADDRESSES
    assert order("", views({a0: 4, a1: 2, a2: 9})) == [a1, a0, a2]


def test_between_refreshes_the_router_counts_its_own_requests() -> None:
    """The workers' reports are read every refresh_s; in between, each request the router sends
    counts on its worker until it ends. Requests for an adapter two workers hold alternate between
    them instead of all going to the one that read as less loaded at the last refresh, and a
    holder that reads as overloaded gets its adapters' requests again once it is not."""
    from contextlib import ExitStack

    from loraserve.clients.router import WorkerRouter

    router = WorkerRouter(ADDRESSES[:2], refresh_s=1e9, clock=lambda: 1.0)
    try:
        w0, w1 = router.workers
        for w, load in ((w0, 3), (w1, 0)):  # as if just refreshed: no report is read in this test
            w.seen_at, w.load, w.gpu = 0.0, load, {"x"}
        with ExitStack() as running:
            sent = []
            for _ in range(9):
                w = router.candidates("x")[0]
                running.enter_context(router.routed(w))
                sent.append(w.address)
            # w1 takes the first three (it read 0 against 3), then they alternate
            assert sent[:3] == [w1.address] * 3 and sorted(sent[3:]) == sorted([w0.address, w1.address] * 3)
            assert (w0.load, w1.load) == (6, 6)
        assert (w0.load, w1.load) == (3, 0)  # each request off its worker once it ended
        # the overloaded holder: sent to the other worker only while it is over the bound
        w0.load, w0.gpu, w1.gpu = 17, {"y"}, set()
        assert router.candidates("y")[0] is w1
        with ExitStack() as running:
            for _ in range(3):
                running.enter_context(router.routed(router.candidates("y")[0]))
            assert router.candidates("y")[0] is w0  # 17 against 3: within max(16, 3) again
        w1.load = 0
        with router.routed(w1):
            w1.load = 0  # a report read before the request reached the worker: its end finds 0
        assert w1.load == 0  # never negative
    finally:
        router.close()
