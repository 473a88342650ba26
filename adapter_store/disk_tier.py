"""The disk tier of optimized payloads: a directory of payload files (payload_file.py) between the
CPU cache and the adapter's source, so that a CPU cache miss reads ~20 MB from local disk instead of
fetching, validating and optimizing the checkpoint again.

It is a cache, never the truth: a file is looked up by the registry's current digest and checked in
full as it is read; a bad one is deleted and the caller rebuilds from the source. Writes, removals,
eviction (LRU by last use, bounded by bytes) and the start-up sweep run on one writer thread, in
the order they were asked for; reads (and the removal of a file a read found bad) run on the
caller's thread. The order of last use is kept in memory, exact within a run, and in the files'
mtimes, which the start-up sweep reads back. A failing disk (full, read-only, permission denied)
fails no registration and no fetch: each kind of failure is counted, logged once per streak, and
the store carries on as if the tier were empty.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from loraserve.adapter_store.metrics import StoreMetrics
from loraserve.adapter_store.optimize import OptimizedAdapter
from loraserve.adapter_store.payload_file import (
    TEMP_PREFIX,
    CorruptPayload,
    PayloadKey,
    PayloadReader,
    open_payload,
    write_payload,
)
from loraserve.adapter_store.registry import AdapterRecord, Registry

log = logging.getLogger("loraserve.store")

MAX_SCANNED_FILES = 200_000  # start-up work bound: directory entries looked at
REGISTRY_PAGE = 1000


class DiskTier:
    def __init__(self, directory: Path, max_bytes: int, metrics: StoreMetrics) -> None:
        self.directory, self.max_bytes, self.metrics = directory, max_bytes, metrics
        # file -> its size in bytes, least recently used first
        self._index: OrderedDict[PayloadKey, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._failing: set[str] = set()  # operations whose last attempt failed
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="payload-disk")

    # -- what the service calls ------------------------------------------------------------
    def start(self, registry: Registry) -> Future[None]:
        """Index the files a previous run left and remove those the registry no longer names."""
        return self._writer.submit(self._guard, "open", lambda: self._open(registry))

    async def put(self, record: AdapterRecord, adapter: OptimizedAdapter) -> None:
        """Write the payload of `record` (never raises; returns once it is on disk or has failed)."""
        await asyncio.wrap_future(self.put_soon(record, adapter))

    def put_soon(self, record: AdapterRecord, adapter: OptimizedAdapter) -> Future[None]:
        key = PayloadKey(record.adapter_id, adapter.digest)
        return self._writer.submit(self._guard, "write", lambda: self._write(key, adapter))

    def discard(self, adapter_id: str, keep_digest: str | None = None) -> Future[None]:
        """Remove the files of every version of `adapter_id` but `keep_digest`."""
        return self._writer.submit(self._guard, "remove", lambda: self._discard(adapter_id, keep_digest))

    def open(self, record: AdapterRecord) -> PayloadReader | None:
        """The file of `record`'s digest, its header checked (`read` then fills and checks its
        payload), or None (absent, bad or unreadable: the miss is counted). Blocking."""
        key = PayloadKey(record.adapter_id, record.digest)
        path = self.directory / key.file_name
        try:
            reader = open_payload(path, key, record.size_bytes)
            adapter = reader.adapter
            if (adapter.rank, adapter.dtype, adapter.layout_version, len(adapter.tensors)) != (
                record.rank,
                record.dtype,
                record.layout_version,
                record.num_tensors,
            ):
                reader.close()
                raise CorruptPayload("rank, dtype, layout version or tensor count disagree with the registry")
        except FileNotFoundError:
            self._forget(key)
            self.metrics.disk_misses.inc()
            return None
        except (CorruptPayload, OSError) as exc:
            self._read_failed(key, exc)
            return None
        return reader

    def read(
        self,
        reader: PayloadReader,
        progress: Callable[[int], None] | None = None,
        chunks: list[bytes] | None = None,
        step: int | None = None,
    ) -> OptimizedAdapter:
        """Fill and check the payload of an opened file (`PayloadReader.read`, which also makes the
        chunk messages of `step` bytes into `chunks`, when given); a hit when it is good, else the
        failure is counted (a bad file removed) and re-raised. Blocking."""
        key = reader.key
        try:
            adapter = reader.read(progress, chunks, step)
        except (CorruptPayload, OSError) as exc:
            self._read_failed(key, exc)
            raise
        path = self.directory / key.file_name
        try:
            size = path.stat().st_size
            os.utime(path)  # last use, which orders eviction across restarts too
        except OSError:
            size = None  # removed meanwhile, or a read-only tier: it still served this read
        self._succeeded("read")
        if size is not None:
            self._record(key, size)
        self.metrics.disk_hits.inc()
        self.metrics.disk_read_bytes.inc(adapter.total_bytes)
        return adapter

    def _read_failed(self, key: PayloadKey, exc: BaseException) -> None:
        self.metrics.disk_misses.inc()
        if isinstance(exc, CorruptPayload):
            log.warning(
                "disk tier: %s is damaged (%s); removed, rebuilding from the source", key.file_name, exc
            )
            self.metrics.disk_corrupt.inc()
            self._guard("remove", lambda: self._unlink(key))
        else:
            self._failed("read", exc)

    def flush(self) -> None:
        """Wait until every write, removal and eviction asked for so far is done."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True, cancel_futures=True)

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    # -- the writer thread -------------------------------------------------------------------
    def _write(self, key: PayloadKey, adapter: OptimizedAdapter) -> None:
        path = self.directory / key.file_name
        if adapter.total_bytes > self.max_bytes or path.exists():
            return  # too large for the tier, or already there (same name, same bytes)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._record(key, write_payload(self.directory, key, adapter))
        self.metrics.disk_written_bytes.inc(adapter.total_bytes)
        self._evict(keep=key)

    def _evict(self, keep: PayloadKey | None = None) -> None:
        """Remove least recently used files until the tier fits its byte bound."""
        while True:
            with self._lock:
                if self._bytes <= self.max_bytes:
                    break
                victim = next((k for k in self._index if k != keep), None)
            if victim is None:
                break
            self._unlink(victim)
            self.metrics.disk_evictions.inc()

    def _discard(self, adapter_id: str, keep_digest: str | None) -> None:
        prefix = f"{adapter_id}@"
        if not self.directory.is_dir():
            return
        for entry in os.scandir(self.directory):
            key = PayloadKey.from_file_name(entry.name)
            if key is not None and entry.name.startswith(prefix) and key.digest != keep_digest:
                self._unlink(key)

    def _open(self, registry: Registry) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, PayloadKey, int]] = []
        with os.scandir(self.directory) as entries:
            for n, entry in enumerate(entries):
                if n >= MAX_SCANNED_FILES:
                    log.warning("disk tier: more than %d entries in %s; indexed the first", n, self.directory)
                    break
                if entry.name.startswith(TEMP_PREFIX):
                    os.unlink(entry.path)  # a write that a crash interrupted
                elif (key := PayloadKey.from_file_name(entry.name)) is not None:
                    st = entry.stat()
                    found.append((st.st_mtime, key, st.st_size))
        digests = self._registered_digests(registry)
        kept = []
        for _mtime, key, size in sorted(found, key=lambda f: f[0]):
            if digests is not None and digests.get(key.adapter_id) != key.digest:
                os.unlink(self.directory / key.file_name)  # an adapter deleted or re-registered meanwhile
                self.metrics.disk_orphans.inc()
            else:
                kept.append((key, size))
        with self._lock:
            # files of this run (already indexed) were used more recently than those of earlier runs
            for key, size in reversed(kept):
                if key not in self._index:
                    self._index[key] = size
                    self._index.move_to_end(key, last=False)
                    self._bytes += size
        log.info(
            "disk tier %s: %d payloads (%d bytes) kept from earlier runs, %d orphans removed",
            self.directory,
            len(kept),
            sum(size for _, size in kept),
            len(found) - len(kept),
        )
        self._evict()

    def _registered_digests(self, registry: Registry) -> dict[str, str] | None:
        """adapter id -> digest of every registered adapter; None when the registry cannot say
        (then no file is removed: each is still checked against the digest on use)."""
        digests: dict[str, str] = {}
        after = ""
        try:
            while True:
                records, after, _ = registry.list(after, REGISTRY_PAGE)
                digests.update((r.adapter_id, r.digest) for r in records)
                if not after:  # not a short page: ids deleted while listed shorten a page too
                    return digests
        except Exception as exc:  # Unavailable, or any failure of the registry's backend
            log.warning("disk tier: registry unreadable at start-up (%s); orphan files are kept", exc)
            return None

    # -- bookkeeping -------------------------------------------------------------------------
    def _record(self, key: PayloadKey, size: int) -> None:
        """Index `key`'s file of `size` bytes as the most recently used."""
        with self._lock:
            self._bytes += size - self._index.get(key, 0)
            self._index[key] = size
            self._index.move_to_end(key)
        self._gauges()

    def _unlink(self, key: PayloadKey) -> None:
        (self.directory / key.file_name).unlink(missing_ok=True)
        self._forget(key)

    def _forget(self, key: PayloadKey) -> None:
        with self._lock:
            self._bytes -= self._index.pop(key, 0)
        self._gauges()

    def _gauges(self) -> None:
        with self._lock:
            count, size = len(self._index), self._bytes
        self.metrics.disk_payloads.set(count)
        self.metrics.disk_bytes.set(size)

    def _guard(self, op: str, work: Callable[[], None]) -> None:
        """Run `work`, turning any failure into a count and (once per streak) a log line."""
        try:
            work()
        except OSError as exc:
            self._failed(op, exc)
        except Exception as exc:  # a bug of the tier: it must still fail nothing but itself
            log.exception("disk tier: %s failed unexpectedly", op)
            self._failed(op, exc, logged=True)
        else:
            self._succeeded(op)

    def _failed(self, op: str, exc: BaseException, logged: bool = False) -> None:
        self.metrics.disk_errors.labels(op).inc()
        with self._lock:
            first = op not in self._failing
            self._failing.add(op)
        if first and not logged:
            log.warning(
                "disk tier %s: %s failed (%s); the store goes on without the tier until it works again",
                self.directory,
                op,
                exc,
            )

    def _succeeded(self, op: str) -> None:
        with self._lock:
            recovered = op in self._failing
            self._failing.discard(op)
        if recovered:
            log.info("disk tier %s: %s works again", self.directory, op)
