"""The registry in Redis with a copy in the store's data directory, from which Redis is restored
when it lost the registry (restarted with no persistence, its volume lost, flushed).

Redis is the registry while its epoch lives (registry_redis.py): every call reads and writes it
there. The copy (a SqliteRegistry) follows it: each write of this store is written to the copy
once Redis has taken it, and the copy remembers the epoch and the registry version it holds, so
that a watch thread (every `watch_s`) can compare them with Redis at the cost of one round trip:

    Redis's epoch other than the copy's (or none), or its version below the copy's
        -> Redis lost the registry, or its last writes: every record of the copy that Redis does
           not hold is put back, the epoch re-created where there is none, then the copy made
           equal to Redis (records another store registered are kept, not removed); nothing is
           put back where another store already put back a copy of the same epoch at the same
           version or a later one (Redis's registry:restored): what this copy holds more was
           deleted since, maybe after the loss, through that store;
    Redis's version above the copy's (another store wrote, or a copy write failed)
        -> the copy is made equal to Redis.

A call that finds the registry lost (`RegistryLost`) runs the same check and is made again, so
an empty Redis is never answered as every adapter deleted — not by ListAdapters (which workers'
store checks read), not to the disk tier's start-up sweep — while a deletion, before or after the
loss, is honoured: it leaves the copy too. A copy that cannot be written (disk full, read-only)
fails no call: it is made equal to Redis again once it can be.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

from loraserve.adapter_store.errors import Unavailable
from loraserve.adapter_store.metrics import StoreMetrics
from loraserve.adapter_store.registry import AdapterRecord, SqliteRegistry
from loraserve.adapter_store.registry_redis import RedisRegistry, RegistryLost

log = logging.getLogger("loraserve.store")

T = TypeVar("T")
WATCH_S = 1.0
LIST_PAGE = 1000
ATTEMPTS = 3  # a call made again after a restore; a Redis lost over and over answers UNAVAILABLE


class MirroredRegistry:
    def __init__(
        self,
        redis: RedisRegistry,
        copy: SqliteRegistry,
        watch_s: float = WATCH_S,
        metrics: StoreMetrics | None = None,
    ) -> None:
        if redis.adopt:
            raise ValueError("the mirror sets the Redis registry's epoch: make it with adopt=False")
        self.redis, self.copy, self.metrics = redis, copy, metrics
        meta = copy.meta()
        if meta.get("prefix", redis.prefix) != redis.prefix:
            # a copy of another registry (the store moved to another key prefix): never put back
            # into this one; it is replaced by this registry's at the first check
            log.warning("registry copy is of prefix %r, not %r: replaced", meta["prefix"], redis.prefix)
            meta = {}
        self._copy_epoch: str | None = meta.get("epoch")  # None: a new copy, never in step with Redis
        self._copy_version = int(meta.get("version", "0"))
        self._foreign = "epoch" not in meta  # what the copy holds is not to be put back
        self._copy_stale = False  # a write to the copy failed: made equal to Redis at the next check
        # writes, restores and copy updates one at a time: the copy takes writes in Redis's order
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watch_s = watch_s
        self._thread = threading.Thread(target=self._watch, name="registry-copy", daemon=True)
        self._thread.start()

    # -- Registry ----------------------------------------------------------------------------
    def put(self, record: AdapterRecord, overwrite: bool) -> AdapterRecord | None:
        def write() -> AdapterRecord | None:
            old, version = self.redis.write(record, overwrite)
            self._copied(lambda meta: self.copy.put(record, overwrite=True, meta=meta), version)
            return old

        return self._call(write, exclusive=True)

    def get(self, adapter_id: str) -> AdapterRecord | None:
        return self._call(lambda: self.redis.get(adapter_id))

    def delete(self, adapter_id: str) -> AdapterRecord | None:
        def remove() -> AdapterRecord | None:
            old, version = self.redis.remove(adapter_id)
            self._copied(lambda meta: self.copy.delete(adapter_id, meta=meta), version)
            return old

        return self._call(remove, exclusive=True)

    def list(self, after: str, limit: int) -> tuple[list[AdapterRecord], str, int]:
        return self._call(lambda: self.redis.list(after, limit))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            self.redis.close()
            self.copy.close()

    # -- keeping Redis and the copy in step --------------------------------------------------
    def check(self) -> None:
        """Compare Redis with the copy and act (the module's table). Unavailable when Redis is
        unreachable (or lost again meanwhile); calls then check again before they run."""
        with self._lock:
            try:
                epoch, version = self.redis.state()
                if epoch is None or epoch != self._copy_epoch or version < self._copy_version:
                    self._restore(epoch, version)
                elif version > self._copy_version or self._copy_stale:
                    self.redis.epoch = epoch
                    self._follow()
                self.redis.epoch = self._copy_epoch
            except BaseException:
                self.redis.epoch = None
                raise

    def _call(self, op: Callable[[], T], exclusive: bool = False) -> T:
        for _ in range(ATTEMPTS):
            epoch = self.redis.epoch
            try:
                if epoch is None:
                    self.check()
                    epoch = self.redis.epoch
                if exclusive:
                    with self._lock:
                        return op()
                return op()
            except RegistryLost:
                with self._lock:
                    if self.redis.epoch == epoch:  # not checked again by another call meanwhile
                        self.redis.epoch = None
        raise Unavailable("registry (Redis) lost its data again while it was restored; retry")

    def _restore(self, epoch: str | None, version: int) -> None:
        known = None if self._foreign else self._copy_epoch  # the epoch whose registry the copy holds
        outcome = "from_copy"
        try:
            records = [] if known is None else self.copy.records(skip_unreadable=True)
        except (sqlite3.Error, OSError) as exc:  # nothing to restore from: Redis is taken as it is
            log.error("registry copy unreadable (%s): Redis's registry is not restored from it", exc)
            records, known, outcome = [], None, "copy_unreadable"
        held, why = len(records), ""
        if known is not None and self.redis.restored(known) >= self._copy_version:
            # another store put back a copy of that epoch that knew as much as this one, or more:
            # what this copy holds beyond it was deleted since (before the loss, or after it)
            records, why, outcome = [], " (another store put back a copy that knew as much)", "other_store"
        restored = self.redis.restore(records) if records else 0
        # a copy whose file lags what it knows (a failed write) is not recorded: others put theirs back
        mark = known if known is not None and not self._copy_stale else ""
        now, _ = self.redis.claim(uuid.uuid4().hex, self._copy_version, mark)
        if self._copy_epoch is not None:  # a loss (not the first start of a new copy)
            if self.metrics is not None:
                self.metrics.registry_restores.labels(outcome).inc()
                self.metrics.registry_restored_adapters.inc(restored)
            log.warning(
                "registry (Redis) lost its data (epoch %s, version %d; the copy knew epoch %s, version "
                "%d): restored %d of the copy's %d adapters%s",
                epoch,
                version,
                self._copy_epoch,
                self._copy_version,
                restored,
                held,
                why,
            )
        fresh = self._copy_epoch is None
        self.redis.epoch = now
        copied = self._follow()
        if fresh:
            log.info("registry copy made from Redis's registry (epoch %s, %d adapters)", now, copied)

    def _follow(self) -> int:
        """Make the copy equal to Redis (whose epoch is `self.redis.epoch`); -> how many records."""
        epoch, version = self.redis.state()
        if epoch is None or epoch != self.redis.epoch:
            raise RegistryLost("registry (Redis) lost while the copy was made equal to it")
        records: list[AdapterRecord] = []
        after = ""
        while True:
            page, after, _ = self.redis.list(after, LIST_PAGE)
            records += page
            if not after:
                break
        # writes of other stores while listed leave Redis's version above `version`: listed again
        # at the next check
        self._copy_epoch, self._copy_version = epoch, version
        try:
            self.copy.replace_all(
                records, {"epoch": epoch, "version": str(version), "prefix": self.redis.prefix}
            )
        except (sqlite3.Error, OSError) as exc:
            self._copy_failed(exc)  # the file lags what Redis holds: written again at the next check
            return len(records)
        self._copy_stale = self._foreign = False
        return len(records)

    def _copied(self, write: Callable[[dict[str, str] | None], object], version: int) -> None:
        """Apply this store's write, which made registry version `version`, to the copy (under the
        lock; `write(meta)` sets meta in the write's own transaction): the copy's version follows
        only when no other store's write came between."""
        if version == 0:  # nothing changed in Redis (a delete of nothing); the copy must not hold it
            version = self._copy_version
        follows = version == self._copy_version + 1
        try:
            write({"version": str(version)} if follows else None)
            if follows:
                self._copy_version = version
            elif version != self._copy_version:
                self._copy_stale = True
        except (sqlite3.Error, OSError) as exc:
            self._copy_failed(exc)

    def _copy_failed(self, exc: BaseException) -> None:
        if not self._copy_stale:
            log.warning("registry copy: writing it failed (%s); retried at the next check", exc)
        self._copy_stale = True

    def _watch(self) -> None:
        while not self._stop.wait(self._watch_s):
            try:
                self.check()
            except Unavailable as exc:  # unreachable, or lost again: the next round tries again
                log.debug("registry copy: check failed: %s", exc)
            except Exception:
                log.exception("registry copy: check failed unexpectedly")
