"""The coordinator in Redis, under one key prefix (shared with the store's registry):

    {prefix}clock                 integer, the cluster-wide LRU clock (INCR)
    {prefix}residency:{worker}    hash adapter id -> JSON {digest, tier, slot, last_used}
    {prefix}worker:{worker}       JSON heartbeat {address, info}, expires after its TTL
    {prefix}workers               set of worker ids that sent a heartbeat
    {prefix}pins:{worker}         set of pinned adapter ids
    {prefix}popularity:{worker}   hash adapter id -> decayed request count, expires after its TTL
    {prefix}popular               set of worker ids that published popularity
    {prefix}events                stream of invalidations; the store's registry appends
                                  {event: replaced|deleted, adapter_id, digest} there too
    {prefix}epoch                 a random id of this keyspace's life, created when absent by
                                  whoever reads it first (a worker or the store's registry)

Soft state only. When Redis cannot be reached, calls degrade instead of failing the caller (the
worker's coordination thread must keep going): the clock continues locally, writes are dropped,
reads return nothing, and for `backoff_s` Redis is not tried again. On the first successful call
after an outage this worker's residency and pins — kept in a local shadow, the worker's own
truth — are republished, so Redis converges back. The same happens when `epoch()` finds another
epoch: Redis lost its data (restarted with no persistence, flushed) without this process seeing
an error; the cluster clock is then also raised back to this process's.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from loraserve.inference_worker.coordination.coordinator import (
    FIRST_EVENT_ID,
    InvalidationEvent,
    Residency,
    WorkerHeartbeat,
)

log = logging.getLogger("loraserve.worker.coordination")

_REASONS = {"replaced": "registered", "registered": "registered", "deleted": "deleted"}

# KEYS[1] - epoch
# ARGV[1] - the epoch to create when there is none
# returns the epoch as it is now
EPOCH_SCRIPT = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  redis.call('SET', KEYS[1], ARGV[1])
  epoch = ARGV[1]
end
return epoch
"""

# KEYS[1] - the cluster LRU clock
# ARGV[1] - the least value to leave it at (this process's clock)
# returns the clock as it is now
CLOCK_FLOOR_SCRIPT = """
local now = tonumber(redis.call('GET', KEYS[1]) or '0')
if now < tonumber(ARGV[1]) then
  now = tonumber(ARGV[1])
  redis.call('SET', KEYS[1], now)
end
return now
"""


class RedisCoordinator:
    def __init__(
        self,
        url: str,
        prefix: str = "loraserve:",
        *,
        client: Any = None,
        backoff_s: float = 1.0,
        max_events: int = 10_000,
    ) -> None:
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        self.prefix = prefix
        self._redis = client or redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=0.5,
            socket_timeout=1.0,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 1),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._epoch_script = self._redis.register_script(EPOCH_SCRIPT)
        self._clock_floor = self._redis.register_script(CLOCK_FLOOR_SCRIPT)
        self._epoch: str | None = None  # the epoch seen last
        self._backoff_s, self._max_events = backoff_s, max_events
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._was_down = False
        self._local_clock = 0
        # this process's own state, republished after an outage
        self._shadow_residency: dict[tuple[str, str], Residency] = {}
        self._shadow_pins: dict[str, set[str]] = {}
        self._own_workers: set[str] = set()  # workers whose residency this process writes

    # ------------------------------------------------------------------ plumbing
    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def _call(self, fn: Callable[[], Any], default: Any = None) -> Any:
        """fn() against Redis, or `default` while Redis is unreachable."""
        if time.monotonic() < self._down_until:
            return default
        try:
            result = fn()
        except self._errors as exc:
            with self._lock:
                if not self._was_down:
                    log.warning("coordination (Redis) unreachable, serving from local state: %s", exc)
                self._was_down = True
                self._down_until = time.monotonic() + self._backoff_s
            return default
        if self._was_down:
            self._was_down = False
            self._republish()
        return result

    def _republish(self) -> None:
        with self._lock:
            residency = list(self._shadow_residency.values())
            pins = {w: set(p) for w, p in self._shadow_pins.items()}
            own = set(self._own_workers)
            clock = self._local_clock
        pipe = self._redis.pipeline(transaction=True)
        # replace, not merge: what Redis kept from before the outage may since have been evicted
        for worker in own:
            pipe.delete(self._key("residency", worker))
        for r in residency:
            pipe.hset(self._key("residency", r.worker_id), r.adapter_id, _residency_json(r))
        for worker, adapters in pins.items():
            pipe.delete(self._key("pins", worker))
            if adapters:
                pipe.sadd(self._key("pins", worker), *adapters)
        self._call(pipe.execute)
        # residency stamped with this clock must not look older than uses stamped after it
        self._call(lambda: self._clock_floor(keys=[self._key("clock")], args=[clock]))
        log.info("coordination (Redis) back: republished %d residency entries", len(residency))

    # ------------------------------------------------------------------ epoch
    def epoch(self) -> str:
        found = self._call(lambda: self._epoch_script(keys=[self._key("epoch")], args=[uuid.uuid4().hex]))
        if found is None:
            return ""
        with self._lock:
            lost = self._epoch is not None and found != self._epoch
            self._epoch = str(found)
        if lost:
            log.warning(
                "coordination (Redis) lost its data (its epoch changed): republishing this process's state"
            )
            self._republish()
        return str(found)

    # ------------------------------------------------------------------ clock
    def tick(self) -> int:
        value = self._call(lambda: int(self._redis.incr(self._key("clock"))))
        with self._lock:
            self._local_clock = max(self._local_clock + 1, value or 0)
            return self._local_clock

    # ------------------------------------------------------------------ residency
    def put_residency(self, residency: Residency) -> None:
        with self._lock:
            self._shadow_residency[(residency.worker_id, residency.adapter_id)] = residency
            self._own_workers.add(residency.worker_id)
        self._call(
            lambda: self._redis.hset(
                self._key("residency", residency.worker_id), residency.adapter_id, _residency_json(residency)
            )
        )

    def drop_residency(self, worker_id: str, adapter_id: str) -> None:
        with self._lock:
            self._shadow_residency.pop((worker_id, adapter_id), None)
            self._own_workers.add(worker_id)
        self._call(lambda: self._redis.hdel(self._key("residency", worker_id), adapter_id))

    def residencies(self, worker_id: str | None = None) -> list[Residency]:
        with self._lock:  # the shadow's writers hold it
            shadow = list(self._shadow_residency.items())
        workers = (
            [worker_id]
            if worker_id is not None
            else sorted(
                self._call(lambda: self._redis.smembers(self._key("workers")), set())
                | {w for (w, _), _ in shadow}
            )
        )
        out: list[Residency] = []
        for w in workers:
            entries = self._call(functools.partial(self._redis.hgetall, self._key("residency", w)), None)
            if entries is None:  # unreachable: this worker's own shadow is still known
                out += [r for (sw, _), r in shadow if sw == w]
                continue
            for adapter_id, raw in entries.items():
                d = json.loads(raw)
                out.append(
                    Residency(w, adapter_id, d["digest"], d["tier"], int(d["slot"]), int(d["last_used"]))
                )
        return out

    # ------------------------------------------------------------------ heartbeats
    def heartbeat(
        self, worker_id: str, address: str, ttl_s: float, info: dict[str, float | int | str]
    ) -> None:
        body = json.dumps({"address": address, "info": info, "expires_at": time.time() + ttl_s})

        def write() -> None:
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(self._key("worker", worker_id), body, px=max(1, int(ttl_s * 1000)))
            pipe.sadd(self._key("workers"), worker_id)
            pipe.execute()

        self._call(write)

    def live_workers(self) -> list[WorkerHeartbeat]:
        ids = sorted(self._call(lambda: self._redis.smembers(self._key("workers")), set()))
        if not ids:
            return []
        raws = self._call(lambda: self._redis.mget([self._key("worker", w) for w in ids]), [None] * len(ids))
        out, gone = [], []
        for w, raw in zip(ids, raws, strict=True):
            if raw is None:
                gone.append(w)
                continue
            d = json.loads(raw)
            out.append(WorkerHeartbeat(w, d["address"], float(d["expires_at"]), dict(d["info"])))
        if gone:
            self._call(lambda: self._redis.srem(self._key("workers"), *gone))
        return out

    def release_worker(self, worker_id: str) -> None:
        with self._lock:
            for key in [k for k in self._shadow_residency if k[0] == worker_id]:
                del self._shadow_residency[key]
            self._shadow_pins.pop(worker_id, None)
            self._own_workers.discard(worker_id)

        def release() -> None:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(
                self._key("worker", worker_id),
                self._key("residency", worker_id),
                self._key("pins", worker_id),
                self._key("popularity", worker_id),
            )
            pipe.srem(self._key("workers"), worker_id)
            pipe.srem(self._key("popular"), worker_id)
            pipe.execute()

        self._call(release)

    # ------------------------------------------------------------------ pins
    def set_pin(self, worker_id: str, adapter_id: str, pinned: bool) -> None:
        with self._lock:
            pins = self._shadow_pins.setdefault(worker_id, set())
            (pins.add if pinned else pins.discard)(adapter_id)
        key = self._key("pins", worker_id)
        self._call(lambda: self._redis.sadd(key, adapter_id) if pinned else self._redis.srem(key, adapter_id))

    def pins(self, worker_id: str) -> set[str]:
        got = self._call(lambda: self._redis.smembers(self._key("pins", worker_id)), None)
        if got is None:
            with self._lock:
                return set(self._shadow_pins.get(worker_id, ()))
        return set(got)

    # ------------------------------------------------------------------ popularity
    def publish_popularity(self, worker_id: str, counts: dict[str, float], ttl_s: float) -> None:
        key = self._key("popularity", worker_id)

        def write() -> None:
            # replaced whole: adapters that decayed out of the top disappear
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            if counts:
                pipe.hset(key, mapping={a: repr(float(n)) for a, n in counts.items()})
                pipe.pexpire(key, max(1, int(ttl_s * 1000)))
            pipe.sadd(self._key("popular"), worker_id)
            pipe.execute()

        self._call(write)

    def fleet_popularity(self) -> dict[str, float]:
        ids = sorted(self._call(lambda: self._redis.smembers(self._key("popular")), set()))
        if not ids:
            return {}

        def read() -> list[dict[str, str]]:
            pipe = self._redis.pipeline(transaction=False)
            for w in ids:
                pipe.hgetall(self._key("popularity", w))
            return list(pipe.execute())

        tables = self._call(read, [])
        total: dict[str, float] = {}
        for counts in tables:
            for adapter_id, raw in counts.items():
                total[adapter_id] = total.get(adapter_id, 0.0) + float(raw)
        gone = [w for w, counts in zip(ids, tables, strict=False) if not counts]
        if gone and len(tables) == len(ids):  # expired (or emptied): forget the worker
            self._call(lambda: self._redis.srem(self._key("popular"), *gone))
        return total

    # ------------------------------------------------------------------ invalidation events
    def publish_invalidation(self, adapter_id: str, digest: str, reason: str) -> str:
        fields: dict[Any, Any] = {"event": reason, "adapter_id": adapter_id, "digest": digest}
        return str(
            self._call(
                lambda: self._redis.xadd(
                    self._key("events"), fields, maxlen=self._max_events, approximate=True
                ),
                "",
            )
        )

    def read_invalidations(
        self, after_id: str = FIRST_EVENT_ID, limit: int = 1000
    ) -> list[InvalidationEvent]:
        start = "-" if after_id == FIRST_EVENT_ID else f"({after_id}"
        entries = self._call(
            lambda: self._redis.xrange(self._key("events"), min=start, max="+", count=limit), []
        )
        out = []
        for event_id, f in entries:
            reason = _REASONS.get(f.get("event", ""), f.get("event", ""))
            digest = "" if reason == "deleted" else f.get("digest", "")
            out.append(InvalidationEvent(str(event_id), f.get("adapter_id", ""), digest, reason))
        return out

    def close(self) -> None:
        self._redis.close()


def _residency_json(r: Residency) -> str:
    return json.dumps({"digest": r.digest, "tier": r.tier, "slot": r.slot, "last_used": r.last_used})
