"""Complementary placement of the fleet's popular adapters: which adapters a worker prefetches,
and which colder CPU-tier entries they may replace.

Every worker plans from the same inputs — the fleet's decayed request counts, which live worker
holds which adapter, the live workers' placement keys (advertised addresses) — so the workers'
plans agree without a claim or a lock:

- a **hot** adapter (at least `replicate_share` of the fleet's counted requests) is wanted on
  every worker, so the router can spread its traffic over several holders;
- any other adapter that a live worker holds stays there: nobody else fetches it;
- an adapter that **no live worker holds** is wanted by its home only, the live worker first in
  rendezvous order (`clients.placement`), which is also where the router sends a request for it.
  Two idle workers never fetch the same one in the same round, and what the fleet holds is the
  union of different sets rather than the same top set twice.

A worker takes its wanted adapters in popularity order (ties by id): into free CPU room first,
then each in place of the least valuable evictable CPU-tier entry, only while that entry is worth
strictly less than the candidate; at most `max_moves` per round. An entry is worth its popularity,
except a **surplus copy**: a non-hot adapter that other live workers hold too, where this worker
is not the first holder in the adapter's rendezvous order. It is worth nothing, so it is the first
to make room. Such copies come from traffic, not from placement: under load the router sends a
request to a less loaded worker that lacks its adapter, which fetches it, and the two copies stay
while both workers use them. Shedding them turns the room back into different adapters (measured
through the services: after a saturated phase two workers held ~100 adapters twice, most of the
top 50). Transient disagreement (a worker's heartbeat expiring, residency published a round late)
costs at most a duplicate fetch: placement is soft state like the rest of the coordination.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loraserve.clients.placement import home
from loraserve.inference_worker.coordination import Coordinator

REPLICATE_SHARE = 0.02  # under Zipf 1.0 over 1,000 adapters: the top 6, a third of the requests


@dataclass(frozen=True)
class FleetView:
    """What one coordination round read about the fleet, seen from worker `me`."""

    me: str  # this worker's placement key
    popularity: dict[str, float]  # adapter id -> the fleet's decayed request count
    workers: tuple[str, ...]  # placement keys of the live workers, this one included
    # adapter id -> placement keys of the other live workers that hold it
    holders: dict[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def read(
        cls,
        coordinator: Coordinator,
        worker_id: str,
        key: str,
        remember: Callable[[dict[str, float]], dict[str, float]] | None = None,
    ) -> FleetView:
        """Popularity, live workers and their residency (coordinator round trips: sync thread).
        remember: merges the fleet's counts with what was read before (`popularity.FleetMemory`)."""
        popularity = coordinator.fleet_popularity()
        if remember is not None:
            popularity = remember(popularity)
        keys = {hb.worker_id: hb.address or hb.worker_id for hb in coordinator.live_workers()}
        keys[worker_id] = key
        holders: dict[str, set[str]] = {}
        for r in coordinator.residencies():
            if r.worker_id != worker_id and r.worker_id in keys and r.tier in ("gpu", "cpu"):
                holders.setdefault(r.adapter_id, set()).add(keys[r.worker_id])
        return cls(
            key, popularity, tuple(sorted(set(keys.values()))), {a: frozenset(h) for a, h in holders.items()}
        )

    def value(self, adapter_id: str) -> float:
        return self.popularity.get(adapter_id, 0.0)


@dataclass(frozen=True)
class Move:
    adapter_id: str  # to fetch into this worker's CPU tier
    victim: str | None  # CPU-tier version key to evict for it; None when free room takes it


def plan_moves(
    view: FleetView,
    *,
    held: set[str],
    room: int,
    evictable: Iterable[tuple[str, str]],
    max_moves: int,
    replicate_share: float = REPLICATE_SHARE,
) -> list[Move]:
    """This worker's prefetches for one round.

    held: adapter ids this worker holds in either tier or is fetching; room: CPU entries free
    for prefetch; evictable: (version key, adapter id) of the CPU-tier entries a prefetch may
    replace (the caller leaves out what queued or running requests need and pinned adapters)."""
    total = sum(view.popularity.values())

    def hot(count: float) -> bool:
        return total > 0 and count >= replicate_share * total

    def worth(aid: str) -> float:
        """What keeping this worker's CPU-tier copy of `aid` is worth."""
        count, others = view.value(aid), view.holders.get(aid)
        if others and not hot(count) and home(aid, others | {view.me}) != view.me:
            return 0.0  # a surplus copy: the first holder in rendezvous order keeps it
        return count

    victims = sorted((worth(aid), key) for key, aid in evictable)  # the least worth first
    moves: list[Move] = []
    for aid, count in sorted(view.popularity.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(moves) >= max_moves or count <= 0:
            break
        if aid in held:
            continue
        if not hot(count) and (view.holders.get(aid) or home(aid, view.workers) != view.me):
            continue
        if room > 0:
            room -= 1
            moves.append(Move(aid, None))
            continue
        if not victims or victims[0][0] >= count:
            break  # every later candidate is less popular still
        moves.append(Move(aid, victims.pop(0)[1]))
    return moves
