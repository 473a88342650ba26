"""Adapters brought in ahead of need, never at the expense of what is needed now.

Look-ahead (the engine's step thread, once per step): the adapters of the first `window` waiting
requests, in arrival order, are fetched from the store into the CPU tier (at most
`max_fetches` fetches in flight) and copied into a GPU slot when one is free, so a request's
adapter is resident by its turn. The positions are remembered in the pool (`wanted`): a GPU slot
an earlier-queued request waits for is never chosen as a victim for a later one, and the CPU tier
evicts such adapters only when nothing else is left to evict. Nothing waits on the network here:
a fetch is started on the event loop and look-ahead moves on.

Popularity prefetch (the coordinator sync thread, every residency round): with the fleet's decayed
request counts (each worker publishes its own through the coordinator), a worker whose CPU tier
has room fetches the most popular adapters it lacks, at most `max_prefetch` per round and never
more than the room, so a prefetch evicts nothing.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

from loraserve.inference_worker.adapters.pool import AdapterPool
from loraserve.inference_worker.adapters.refs import AdapterRef
from loraserve.inference_worker.errors import WorkerError

log = logging.getLogger(__name__)


class AheadOfNeed:
    def __init__(
        self, pool: AdapterPool, *, window: int = 16, max_fetches: int = 4, max_prefetch: int = 8
    ) -> None:
        cpu = pool.tiers.cpu.max_adapters
        if window < 0 or max_fetches < 1 or max_prefetch < 0:
            raise ValueError("look-ahead window and prefetch must be >= 0, fetches in flight >= 1")
        if window >= cpu:
            raise ValueError(f"the look-ahead window ({window}) must be below the CPU cache's {cpu} adapters")
        self.pool, self.window, self.max_fetches, self.max_prefetch = pool, window, max_fetches, max_prefetch
        self.num_staged = 0  # adapters copied into a free GPU slot ahead of their request
        self.num_fetched_ahead = 0  # fetches started by look-ahead
        self.num_prefetched = 0  # fetches started by popularity prefetch

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
                free = pool.tiers.table.free_slot()
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
    def prefetch(self, fleet: dict[str, float]) -> list[str]:
        """Start fetches of the fleet's most popular adapters this worker lacks, as many as its
        CPU tier has room for (at most `max_prefetch`); the adapter ids started."""
        pool = self.pool
        with pool.lock:
            room = pool.tiers.cpu.room - len(pool.fetcher.flights) - len(pool.wanted)
            count = min(room, self.max_prefetch)
            if count <= 0:
                return []
            held = set(pool.tiers.digests()) | {r.adapter_id for r in pool.fetcher.flights}
            ranked = sorted(fleet.items(), key=lambda kv: (-kv[1], kv[0]))
            picks = [a for a, _ in ranked if a not in held][:count]
            started = []
            for adapter_id in picks:
                try:
                    ref = AdapterRef.parse(adapter_id)
                    pool.fetcher.fetch(ref)
                except WorkerError:
                    continue
                started.append(adapter_id)
            self.num_prefetched += len(started)
            return started
