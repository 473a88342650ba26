"""Adapters brought in ahead of need, never at the expense of what is needed now.

Look-ahead (the engine's step thread, once per step): the adapters of the first `window` waiting
requests, in arrival order, are fetched from the store into the CPU tier (at most
`max_fetches` fetches in flight) and copied into a GPU slot when one is free, so a request's
adapter is resident by its turn. The positions are remembered in the pool (`wanted`): a GPU slot
an earlier-queued request waits for is never chosen as a victim for a later one, and the CPU tier
evicts such adapters only when nothing else is left to evict. Nothing waits on the network here:
a fetch is started on the event loop and look-ahead moves on.

Popularity prefetch (the coordinator sync thread, every residency round): with the fleet's decayed
request counts and residency (`placement.FleetView`), a worker fetches the popular adapters that
the complementary placement gives it (`placement.plan_moves`: the hot ones, and those no live
worker holds whose rendezvous home it is), at most `max_prefetch` per round, into free CPU room or
in place of a strictly less popular CPU-tier entry. Never evicted for a prefetch: an adapter that
a queued request waits for (`wanted`), one a running sequence uses, a pinned one.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

from loraserve.inference_worker.adapters.placement import REPLICATE_SHARE, FleetView, plan_moves
from loraserve.inference_worker.adapters.pool import AdapterPool
from loraserve.inference_worker.adapters.refs import AdapterRef, split_key
from loraserve.inference_worker.errors import WorkerError

log = logging.getLogger(__name__)


class AheadOfNeed:
    def __init__(
        self,
        pool: AdapterPool,
        *,
        window: int = 16,
        max_fetches: int = 4,
        max_prefetch: int = 8,
        replicate_share: float = REPLICATE_SHARE,
    ) -> None:
        cpu = pool.tiers.cpu.max_adapters
        if window < 0 or max_fetches < 1 or max_prefetch < 0:
            raise ValueError("look-ahead window and prefetch must be >= 0, fetches in flight >= 1")
        if window >= cpu:
            raise ValueError(f"the look-ahead window ({window}) must be below the CPU cache's {cpu} adapters")
        self.pool, self.window, self.max_fetches, self.max_prefetch = pool, window, max_fetches, max_prefetch
        self.replicate_share = replicate_share
        self.num_staged = 0  # adapters copied into a free GPU slot ahead of their request
        self.num_fetched_ahead = 0  # fetches started by look-ahead
        self.num_prefetched = 0  # fetches started by popularity prefetch
        self.num_displaced = 0  # CPU-tier entries a prefetch replaced with a more popular adapter
        self._slots_full = False  # this look-ahead pass found no free GPU slot (a scan of them all)

    # ------------------------------------------------------------------ step thread
    def look_ahead(self, waiting: Iterable[tuple[int, str]]) -> None:
        """`waiting`: (sequence key, adapter reference) of the queued requests in arrival order."""
        order: dict[AdapterRef, list[int]] = {}  # distinct adapters by first position -> their sequences
        positions: dict[int, int] = {}
        for pos, (seq_key, adapter) in enumerate(itertools.islice(waiting, self.window)):
            if not adapter:
                continue
            try:
                ref = AdapterRef.parse(adapter)
            except WorkerError:
                continue  # refused at submission already
            order.setdefault(ref, []).append(seq_key)
            positions[seq_key] = pos
        pool = self.pool
        with pool.lock:
            pool.wanted = {ref.adapter_id: positions[keys[0]] for ref, keys in reversed(order.items())}
            pool.queue_pos = positions
            self._slots_full = False  # no slot frees up under the lock: once full, full for this pass
            for ref, keys in order.items():
                if not self._stage(ref, keys):
                    break

    def _stage(self, ref: AdapterRef, waiters: list[int]) -> bool:
        """Bring `ref` one tier closer (under the state lock); False when no more fetches may start.
        A failed fetch is recorded for the `waiters`, which fail with it at admission, and is not
        retried for them meanwhile."""
        pool = self.pool
        key = pool.versions.resolve(ref)
        if key is not None:
            if pool.tiers.table.lookup(key) is not None:
                return True
            payload = pool.tiers.cpu.peek(key)
            if payload is not None:
                free = None if self._slots_full else pool.tiers.table.free_slot()
                self._slots_full = free is None
                if free is not None:
                    try:
                        pool.tiers.activate(free, payload)
                        self.num_staged += 1
                    except (RuntimeError, ValueError) as exc:  # admission retries and reports it
                        log.warning("look-ahead could not stage %s: %s", key, exc)
                return True
        flight = pool.fetcher.flights.get(ref)
        if flight is not None:
            flight.waiters.update(waiters)
            return True
        if any(pool.fetcher.has_failed(k) for k in waiters):
            return True
        if len(pool.fetcher.flights) >= self.max_fetches:
            return False
        try:
            for k in waiters:
                pool.fetcher.fetch(ref, k)
        except WorkerError:
            return False  # no store or no event loop: admission reports it
        self.num_fetched_ahead += 1
        return True

    # ------------------------------------------------------------------ coordinator sync thread
    def prefetch(self, view: FleetView) -> list[str]:
        """Start this round's fetches of the popular adapters the placement gives this worker,
        evicting the colder entries they replace; the adapter ids started."""
        pool = self.pool
        with pool.lock:
            tiers = pool.tiers
            busy = {s.adapter_id for s in tiers.table.slots if s.running > 0}
            keep = busy | set(pool.wanted) | tiers.table.pins
            evictable = [(k, a) for k in tiers.cpu.keys() if (a := split_key(k)[0]) not in keep]
            moves = plan_moves(
                view,
                # what an operator unloaded here counts as held: prefetch must not bring it back
                held=set(tiers.digests()) | {r.adapter_id for r in pool.fetcher.flights} | set(pool.kept_out),
                room=tiers.cpu.room - len(pool.fetcher.flights) - len(pool.wanted),
                evictable=evictable,
                max_moves=self.max_prefetch,
                replicate_share=self.replicate_share,
            )
            started = []
            for move in moves:
                try:
                    pool.fetcher.fetch(AdapterRef.parse(move.adapter_id))
                except WorkerError:
                    continue  # a malformed id, or no store or event loop: its victim stays
                # the payload lands under this lock, after the eviction
                if move.victim is not None and tiers.evict_cpu(move.victim):
                    self.num_displaced += 1
                started.append(move.adapter_id)
            self.num_prefetched += len(started)
            return started
