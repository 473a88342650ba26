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
