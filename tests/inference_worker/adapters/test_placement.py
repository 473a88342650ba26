"""Complementary placement: which popular adapters each worker prefetches (the same plan computed
by every worker), which colder entries they replace, and the fleet view it is planned from, read
through both coordinators."""

from __future__ import annotations

import time

from loraserve.clients.placement import home
from loraserve.inference_worker.adapters.placement import FleetView, Move, plan_moves
from loraserve.inference_worker.adapters.popularity import FleetMemory
from loraserve.inference_worker.coordination import Residency
from tests.inference_worker.coordination import test_coordinator

coordinator = test_coordinator.coordinator  # the contract suite's fixture: both implementations

WORKERS = ("10.0.0.1:50061", "10.0.0.2:50061")
IDS = [f"ad-{i:02d}" for i in range(24)]


def view(me: str, popularity: dict[str, float], holders: dict[str, set[str]] | None = None) -> FleetView:
    return FleetView(me, popularity, WORKERS, {a: frozenset(h) for a, h in (holders or {}).items()})


def plan(v: FleetView, *, held=(), room=100, evictable=(), max_moves=100, share=0.5) -> list[Move]:
    return plan_moves(
        v, held=set(held), room=room, evictable=list(evictable), max_moves=max_moves, replicate_share=share
    )


def test_adapters_held_nowhere_are_split_by_their_home() -> None:
    popularity = {a: float(len(IDS) - i) for i, a in enumerate(IDS)}
    got = {w: [m.adapter_id for m in plan(view(w, popularity))] for w in WORKERS}
    assert set(got[WORKERS[0]]).isdisjoint(got[WORKERS[1]])
    assert set(got[WORKERS[0]]) | set(got[WORKERS[1]]) == set(IDS)
    for w in WORKERS:
        assert got[w] == [a for a in IDS if home(a, WORKERS) == w]  # most popular first
        assert all(m.victim is None for m in plan(view(w, popularity)))  # free room: nothing evicted


def test_held_elsewhere_stays_there_unless_hot() -> None:
    a, b = WORKERS
    popularity = {"hot": 50.0, "warm": 10.0, **{x: 1.0 for x in IDS}}
    holders = {"hot": {b}, "warm": {b}}
    got = [m.adapter_id for m in plan(view(a, popularity, holders), share=0.4)]
    assert "hot" in got and "warm" not in got  # hot: 50 / 84 of the requests, replicated
    got = [m.adapter_id for m in plan(view(a, popularity, holders), share=0.7)]
    assert "hot" not in got
    # what this worker holds or fetches already is never planned again
    assert "hot" not in [m.adapter_id for m in plan(view(a, popularity), held={"hot"}, share=0.4)]


def test_displaces_only_strictly_colder_entries_least_popular_first() -> None:
    a = WORKERS[0]
    mine = [x for x in IDS if home(x, WORKERS) == a][:3]
    popularity = {mine[0]: 9.0, mine[1]: 4.0, mine[2]: 2.0, "old-1": 3.0, "old-2": 1.0, "old-3": 4.0}
    evictable = [("old-1@d", "old-1"), ("old-2@d", "old-2"), ("old-3@d", "old-3")]
    got = plan(view(a, popularity), room=0, evictable=evictable, share=1.0)
    # 9 replaces the coldest (1), 4 replaces 3; 2 is colder than every entry left: stop
    assert got == [Move(mine[0], "old-2@d"), Move(mine[1], "old-1@d")]
    # room first, then displacement, bounded per round
    got = plan(view(a, popularity), room=1, evictable=evictable, share=1.0, max_moves=2)
    assert got == [Move(mine[0], None), Move(mine[1], "old-2@d")]
    # an equally popular entry is not displaced
    equal = {mine[0]: 3.0, "old-1": 3.0}
    assert plan(view(a, equal), room=0, evictable=[("old-1@d", "old-1")], share=1.0) == []


def test_ties_are_ordered_by_id() -> None:
    a = WORKERS[0]
    mine = sorted(x for x in IDS if home(x, WORKERS) == a)
    popularity = {x: 1.0 for x in reversed(mine)}
    assert [m.adapter_id for m in plan(view(a, popularity), max_moves=3, share=1.0)] == mine[:3]


def test_fleet_view_reads_live_holders_by_address(coordinator) -> None:
    coordinator.heartbeat("w1", WORKERS[0], 30.0, {})
    coordinator.heartbeat("w2", WORKERS[1], 30.0, {})
    coordinator.heartbeat("gone", "10.0.0.9:50061", 0.05, {})
    coordinator.put_residency(Residency("w1", "a", "d", "cpu", -1, 1))
    coordinator.put_residency(Residency("w2", "a", "d", "gpu", 0, 2))
    coordinator.put_residency(Residency("w2", "b", "d", "cpu", -1, 2))
    coordinator.put_residency(Residency("gone", "c", "d", "cpu", -1, 1))
    coordinator.publish_popularity("w2", {"a": 2.0, "c": 1.0}, 30.0)
    time.sleep(0.1)  # the third worker's heartbeat expires
    v = FleetView.read(coordinator, "w1", WORKERS[0])
    assert v.me == WORKERS[0] and v.workers == WORKERS
    assert v.popularity == {"a": 2.0, "c": 1.0}
    # its own residency is not read back (the worker's tiers are the truth); the gone one's is ignored
    assert v.holders == {"a": frozenset({WORKERS[1]}), "b": frozenset({WORKERS[1]})}
    # through a memory: what was read before is kept (decayed), but an empty read (the
    # coordinator unreachable, or nothing counted) is not merged, so no prefetch acts on memory alone
    memory = FleetMemory(300.0)
    memory.merge({"old": 5.0})
    v = FleetView.read(coordinator, "w1", WORKERS[0], memory.merge)
    assert set(v.popularity) == {"a", "c", "old"} and v.popularity["a"] == 2.0
    coordinator.publish_popularity("w2", {}, 30.0)
    assert FleetView.read(coordinator, "w1", WORKERS[0], memory.merge).popularity == {}


def test_a_surplus_copy_is_the_first_to_make_room() -> None:
    """A non-hot adapter held by two workers: the one first in its rendezvous order keeps it, the
    other's copy is worth nothing and makes room for any wanted adapter; a hot one stays replicated."""
    a, b = WORKERS
    twice = next(x for x in IDS if home(x, WORKERS) == b)  # b keeps it, a's copy is surplus
    mine = [x for x in IDS if home(x, WORKERS) == a and x != twice][:2]
    popularity = {twice: 8.0, mine[0]: 2.0, mine[1]: 1.0, "cold": 0.5, "hot": 30.0}
    evictable = [(f"{twice}@d", twice), ("cold@d", "cold"), ("hot@d", "hot")]
    holders = {twice: {b}, "hot": {b}}
    held = {twice, "cold", "hot"}
    got = plan(view(a, popularity, holders), held=held, room=0, evictable=evictable, share=0.5)
    # the surplus copy (8 requests counted) goes before the colder unique entry (0.5)
    assert got == [Move(mine[0], f"{twice}@d"), Move(mine[1], "cold@d")]
    # seen from b, the keeper: its copy is worth its count, so nothing colder than 8 displaces it
    evictable_b = [(f"{twice}@d", twice), ("cold@d", "cold")]
    wanted_b = next(x for x in IDS if home(x, WORKERS) == b and x != twice)
    popularity_b = {twice: 8.0, wanted_b: 2.0, "cold": 0.5}
    got = plan(
        view(b, popularity_b, {twice: {a}}), held={twice, "cold"}, room=0, evictable=evictable_b, share=1.0
    )
    assert got == [Move(wanted_b, "cold@d")]
    # a hot adapter held twice is not surplus: replicas spread its traffic
    evictable_hot = [("hot@d", "hot")]
    assert plan(view(a, popularity, holders), held=held, room=0, evictable=evictable_hot, share=0.5) == []
