"""The fleet's resident share under Zipf traffic, simulated with the real placement, CPU tier,
slot table, popularity counter and router order (no model, no network; fetches land at once).

Two workers with 256-entry CPU tiers, 1,000 adapters, Zipf exponent 1.0 (the top 256 carry 82 %
of the requests, the top 512 91 %: only the two tiers together can hold what 90 % of requests
need), Poisson arrivals at 20 req/s, a request in flight for 2 s (the router's load), a
coordination round every 0.5 s with at most 8 prefetches a worker. Compared: the previous policy
(a worker prefetches the fleet's most popular adapters it lacks into free CPU room only, blind to
where the rest of the fleet holds them) and complementary placement (`placement.plan_moves`).
Both route through `order_workers`: holders first, an adapter held nowhere to its home. The last
test adds each worker's 64 GPU slots (the real slot table) to compare how slots are recycled.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import torch

from loraserve.clients.router import WorkerView, order_workers
from loraserve.inference_worker.adapters.cpu_cache import CpuCache
from loraserve.inference_worker.adapters.placement import FleetView, plan_moves
from loraserve.inference_worker.adapters.popularity import FleetMemory, PopularityCounter
from loraserve.inference_worker.adapters.slot_table import SlotTable
from loraserve.inference_worker.lora.payload import AdapterPayload

NUM_ADAPTERS, CPU_ENTRIES, RATE, IN_FLIGHT_S, ROUND_S, MAX_PREFETCH = 1000, 256, 20.0, 2.0, 0.5, 8
IDS = [f"adapter-{i:04d}" for i in range(NUM_ADAPTERS)]  # Zipf rank = index
_CUMULATIVE = list(itertools.accumulate(1.0 / (k + 1) for k in range(NUM_ADAPTERS)))


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class SimWorker:
    address: str
    clock: Clock
    half_life_s: float = 60.0
    num_slots: int = 0  # GPU slots (the real SlotTable), filled from the CPU tier on use
    backed_first: bool = True  # recycle the slots whose version the CPU tier holds first (the worker's)
    remember: bool = True  # plan from the fleet's counts merged with its memory of them (the worker's)
    cache: CpuCache = field(default_factory=lambda: CpuCache(CPU_ENTRIES, 1 << 40))
    in_flight: deque[float] = field(default_factory=deque)  # end times of routed requests

    def __post_init__(self) -> None:
        self.popularity = PopularityCounter(self.half_life_s, clock=self.clock)
        self.memory = FleetMemory(self.half_life_s, clock=self.clock) if self.remember else None
        self.view = WorkerView(self.address, client=None)  # type: ignore[arg-type]
        self.table = SlotTable(self.num_slots, backed=self.cache.__contains__ if self.backed_first else None)
        self.ticks = itertools.count(1)

    def holds(self, adapter_id: str) -> bool:
        """In either tier: what the worker publishes and the router reads."""
        return adapter_id in self.view.cpu

    def in_slot(self, adapter_id: str) -> bool:
        return self.table.lookup(adapter_id + "@d") is not None

    def _left(self, adapter_id: str) -> None:
        if adapter_id + "@d" not in self.cache and not self.in_slot(adapter_id):
            self.view.cpu.discard(adapter_id)

    def insert(self, adapter_id: str) -> None:
        payload = AdapterPayload(adapter_id, "d", 8, torch.zeros(1, dtype=torch.uint8), [])
        for key in self.cache.put(payload):
            self._left(key.split("@")[0])
        self.view.cpu.add(adapter_id)

    def evict(self, key: str) -> None:
        self.cache.remove(key)
        self._left(key.split("@")[0])

    def use(self, adapter_id: str) -> None:
        """A request runs with the adapter (and is done before the next: no slot stays busy)."""
        if not self.num_slots:
            return
        key = adapter_id + "@d"
        s = self.table.lookup(key)
        if s is None:
            s = self.table.victim()
            assert s is not None
            old = s.adapter_id
            self.table.assign(s, key, adapter_id, "d", 8, 1, next(self.ticks))
            if old:
                self._left(old)
        s.last_tick = next(self.ticks)


TRUE_POPULARITY = {aid: 1.0 / (rank + 1) for rank, aid in enumerate(IDS)}  # Zipf 1.0, unnormalized


class FleetSim:
    def __init__(
        self,
        policy: str,
        seed: int,
        half_life_s: float = 60.0,
        oracle: bool = False,
        num_slots: int = 0,
        backed_first: bool = True,
        stale_loads_s: float = 0.0,
        remember: bool = True,
        rate: float = RATE,
        in_flight_s: float = IN_FLIGHT_S,
    ) -> None:
        """`oracle`: the workers plan from the true popularity instead of their decayed counts;
        `num_slots`: GPU slots per worker; `backed_first`: slots recycled as the worker does
        (those whose version the CPU tier holds first) or least recently used alone;
        `stale_loads_s`: the router orders by the loads the workers reported at its last refresh,
        every this many seconds, blind to its own requests since (the router before it counted
        them); 0: by the loads now (this simulation has one router, which counts all requests);
        `remember`: each worker plans from the fleet's counts merged with its `FleetMemory` (the
        worker's), else from the live workers' counts alone; `rate`: Poisson arrivals a second,
        each request in flight for `in_flight_s` (the router's load)."""
        self.policy, self.rng, self.clock = policy, random.Random(seed), Clock()
        self.oracle = oracle
        self.workers = [
            SimWorker(f"10.0.0.{i}:50061", self.clock, half_life_s, num_slots, backed_first, remember)
            for i in (1, 2)
        ]
        self.next_round = 0.0
        self.rate, self.in_flight_s = rate, in_flight_s
        self.stale_loads_s, self.next_refresh = stale_loads_s, 0.0

    def coordinate(self) -> None:
        """One round: every worker publishes its counts, reads the fleet's, prefetches."""
        fleet: dict[str, float] = {}
        for w in self.workers:
            for aid, n in w.popularity.top(256).items():
                fleet[aid] = fleet.get(aid, 0.0) + n
        if self.oracle:
            fleet = dict(TRUE_POPULARITY)
        keys = tuple(sorted(w.address for w in self.workers))
        counted = fleet
        for w in self.workers:
            fleet = w.memory.merge(counted) if w.memory is not None and not self.oracle else counted
            if self.policy == "free_room_only":
                ranked = sorted(fleet.items(), key=lambda kv: (-kv[1], kv[0]))
                room = min(w.cache.room, MAX_PREFETCH)
                for aid in [a for a, _ in ranked if not w.holds(a)][:room]:
                    w.insert(aid)
                continue
            held_by: dict[str, set[str]] = {}  # the fleet's adapters the other workers hold
            for o in self.workers:
                if o is not w:
                    for aid in o.view.cpu & fleet.keys():
                        held_by.setdefault(aid, set()).add(o.address)
            view = FleetView(w.address, fleet, keys, {a: frozenset(h) for a, h in held_by.items()})
            evictable = [(k, k.split("@")[0]) for k in w.cache.keys()]
            moves = plan_moves(
                view, held=set(w.view.cpu), room=w.cache.room, evictable=evictable, max_moves=MAX_PREFETCH
            )
            for m in moves:
                if m.victim is not None:
                    w.evict(m.victim)
                w.insert(m.adapter_id)

    def serve(self, num_requests: int) -> float:
        """Run `num_requests` arrivals; the share whose adapter the serving worker held."""
        hits = 0
        for _ in range(num_requests):
            self.clock.t += self.rng.expovariate(self.rate)
            while self.clock.t >= self.next_round:
                self.coordinate()
                self.next_round += ROUND_S
            aid = IDS[bisect.bisect_left(_CUMULATIVE, self.rng.random() * _CUMULATIVE[-1])]
            for w in self.workers:
                while w.in_flight and w.in_flight[0] <= self.clock.t:
                    w.in_flight.popleft()
            if not self.stale_loads_s:
                for w in self.workers:
                    w.view.load = len(w.in_flight)
            elif self.clock.t >= self.next_refresh:
                for w in self.workers:
                    w.view.load = len(w.in_flight)  # as reported, until the next refresh
                self.next_refresh = self.clock.t + self.stale_loads_s
            address = order_workers(aid, [w.view for w in self.workers])[0].address
            w = next(w for w in self.workers if w.address == address)
            w.in_flight.append(self.clock.t + self.in_flight_s)
            w.popularity.record(aid)
            if w.holds(aid):
                hits += 1
                if not w.in_slot(aid):  # a slot hit leaves the CPU tier's order alone
                    w.cache.get(aid + "@d")
            else:
                w.insert(aid)
            w.use(aid)
        return hits / num_requests

    def lose_a_worker(self) -> None:
        """The first worker goes away: its tiers and published counts with it."""
        self.workers = self.workers[1:]

    def duplicates(self) -> int:
        return len(self.workers[0].view.cpu & self.workers[1].view.cpu)


def run(policy: str) -> dict[str, float]:
    sim = FleetSim(policy, seed=1)
    out = {"cold": sim.serve(600), "cold_duplicates": sim.duplicates()}
    sim.serve(5400)  # 5 minutes of traffic: the decayed counts (60 s half-life) have settled
    out["steady"] = sim.serve(3000)
    sim.lose_a_worker()
    sim.serve(1000)
    out["one_worker_left"] = sim.serve(2000)
    return out


def test_complementary_placement_uses_both_tiers() -> None:
    old, new = run("free_room_only"), run("complementary")
    # a cold fleet: the previous policy fills both tiers' free room with the same top set
    assert old["cold_duplicates"] >= 150 and new["cold_duplicates"] <= 64
    # steady state: near the two tiers' capacity (the top 512 carry 91 %; one tier's 256, 82 %)
    assert new["steady"] >= 0.85
    assert new["steady"] >= old["steady"] + 0.01
    # the survivor of a worker loss replaces its colder entries with what its traffic now asks for
    assert new["one_worker_left"] >= old["one_worker_left"] + 0.02


@functools.cache
def steady(half_life_s: float, **options: object) -> tuple[float, int]:
    """The complementary fleet after 12.5 minutes of traffic (long enough for a 300 s half-life
    to settle): its resident share over the next 4,000 requests, the mean of seeds 1 and 2, and
    how many distinct adapters the second seed's fleet then holds. Cached: tests share runs."""
    shares = []
    for seed in (1, 2):
        sim = FleetSim("complementary", seed=seed, half_life_s=half_life_s, **options)  # type: ignore[arg-type]
        sim.serve(15000)
        shares.append(sim.serve(4000))
    return sum(shares) / len(shares), len(sim.workers[0].view.cpu | sim.workers[1].view.cpu)


def test_the_default_half_life_ranks_the_tail_well_enough_to_near_the_ceiling() -> None:
    """At 20 req/s over 1,000 adapters, an adapter near the tiers' edge (rank ~500) is asked for
    about once in 6 minutes: with counts halving every 60 s its count is mostly noise, and the fleet
    holds tail adapters in place of top-512 ones. The worker's default half-life (300 s) keeps
    enough of its history: the steady state moves toward the 91 % ceiling."""
    from loraserve.inference_worker.config import WorkerConfig

    default = WorkerConfig.popularity_half_life_s
    assert default == 300.0
    assert steady(default)[0] >= 0.885
    assert steady(default)[0] >= steady(60.0)[0] + 0.005


def test_what_is_left_below_the_ceiling_is_the_counts_noise() -> None:
    """The same fleet planning from the true popularity instead of counted requests: placement,
    routing and on-demand fetches then hold the fleet within a point of the 91 % ceiling, so what
    the counted fleet lacks is ranking, not placement. At 20 req/s an adapter of rank ~500 is asked
    for about once in three minutes; its decayed count is a few requests, too noisy to rank it
    against ranks 400-700."""
    oracle, counted = steady(300.0, oracle=True)[0], steady(300.0)[0]
    assert oracle >= 0.90  # the ceiling, 0.911, less the hot adapters' replicas
    assert oracle >= counted + 0.01


def test_slots_whose_version_the_cpu_tier_holds_are_recycled_first() -> None:
    """With each worker's 64 GPU slots modeled (the real SlotTable): a slot hit leaves the CPU
    tier's order alone, so the tier ages out the copies of adapters that live in slots. Recycling
    the slots that are still backed by the tier first keeps those adapters in their slots, and the
    two tiers hold different adapters: up to 640 on two workers (a ceiling of 94.0 %) instead of
    the CPU tiers' 512 (91.1 %)."""
    lru, backed = steady(300.0, num_slots=64, backed_first=False), steady(300.0, num_slots=64)
    assert backed[0] >= 0.91  # past the CPU tiers' ceiling: the slots hold adapters of their own
    assert backed[0] >= lru[0] + 0.015
    assert backed[1] >= lru[1] + 50


def coverage(sim: FleetSim) -> tuple[float, int]:
    """The Zipf share of requests whose adapter some worker holds, and how many adapters both hold."""
    held = sim.workers[0].view.cpu | sim.workers[1].view.cpu
    return sum(TRUE_POPULARITY[aid] for aid in held) / _CUMULATIVE[-1], sim.duplicates()


def test_copies_a_burst_left_on_both_workers_are_shed() -> None:
    """Under load the router sends requests to a less loaded worker that lacks their adapter (it
    fetches it), so after a saturated phase two workers held ~100 adapters twice, most of the top
    50 (measured through the services). Only hot adapters are worth two copies; for any other, the
    holder later in its rendezvous order lets its copy go first when it needs room for one of its
    wanted adapters, so the fleet holds different adapters again within seconds."""
    sim = FleetSim("complementary", seed=3, half_life_s=300.0, num_slots=64)
    sim.serve(15000)
    steady_share, steady_twice = coverage(sim)
    for w in sim.workers:  # ranks 7-106 on both workers, as the saturated phase left them
        for aid in IDS[6:106]:
            if not w.holds(aid):
                w.insert(aid)
    burst_share, burst_twice = coverage(sim)
    assert burst_twice >= 90 and burst_share <= steady_share - 0.02
    sim.serve(600)  # 30 s at 20 req/s
    share, twice = coverage(sim)
    assert twice <= steady_twice + 15
    assert share >= steady_share - 0.005


def test_a_saturated_router_that_counts_its_own_requests_keeps_adapters_apart() -> None:
    """Saturation (167 req/s, 127 requests in flight, as the services ran). A router that orders
    workers by the loads reported at its last refresh (every 2 s) and nothing since sends, for a
    whole period, every request of the worker that read as overloaded to the other one, which
    fetches copies of its adapters: the fleet ends up holding the top adapters twice. Counting its
    own requests between refreshes (`WorkerRouter.routed`) keeps the loads current."""
    got = {}
    for stale in (2.0, 0.0):
        sim = FleetSim(
            "complementary",
            seed=4,
            half_life_s=300.0,
            num_slots=64,
            stale_loads_s=stale,
            rate=167.0,
            in_flight_s=0.76,
        )
        sim.serve(10000)
        share = sim.serve(10000)
        got[stale] = (share, *coverage(sim))
    (stale_share, _, stale_twice), (share, held, twice) = got[2.0], got[0.0]
    assert stale_twice >= 80 and twice <= 20
    assert share >= stale_share + 0.08  # requests whose adapter was resident
    assert held >= 0.92  # the fleet's holdings: near the two workers' 94 % ceiling


def test_the_survivor_of_a_worker_loss_remembers_the_fleets_counts() -> None:
    """Each worker counts only the requests routed to it, so under complementary placement its own
    counts know little of the other worker's adapters. When that worker leaves, its published
    counts go with it; remembering the fleet's counts as last read (`FleetMemory`, decaying at the
    half-life) lets the survivor, now their home, prefetch the lost worker's popular adapters at
    once instead of learning them again request by request."""
    got = {}
    for remember in (False, True):
        sim = FleetSim("complementary", seed=1, half_life_s=300.0, num_slots=64, remember=remember)
        sim.serve(15000)
        whole = sim.serve(2000)
        sim.lose_a_worker()
        got[remember] = whole, sim.serve(600)  # the first 30 s after the loss
    (whole_forgot, lost_forgot), (whole, lost) = got[False], got[True]
    assert abs(whole - whole_forgot) <= 0.01  # no cost while the fleet is whole
    assert lost >= lost_forgot + 0.05
    assert lost >= 0.78
