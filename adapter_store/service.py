"""The adapter store's logic, independent of gRPC: register, look up, list, delete and prepare
fetches. Blocking work (sources, parsing, hashing, the registry, the disk tier) runs in worker
threads.

A fetch finds its payload in the CPU cache (memory), else in the disk tier (disk), else rebuilds it
from the adapter's source (source); the tiers below memory are read once per adapter and digest
however many fetches wait for it (single flight). A payload read from the disk tier streams while it
is read (filling.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from loraserve.adapter_store.cache import AdapterCache
from loraserve.adapter_store.checkpoint import read_checkpoint
from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.disk_tier import DiskTier
from loraserve.adapter_store.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PayloadDamaged,
    ResourceExhausted,
    Unavailable,
)
from loraserve.adapter_store.filling import Filling
from loraserve.adapter_store.flight import SingleFlight
from loraserve.adapter_store.handover import HandoverDirectory
from loraserve.adapter_store.ids import check_adapter_id, decode_page_token, encode_page_token
from loraserve.adapter_store.metrics import StoreMetrics
from loraserve.adapter_store.optimize import OptimizedAdapter, optimize
from loraserve.adapter_store.payload_file import CorruptPayload, PayloadReader
from loraserve.adapter_store.registry import AdapterRecord, Registry, same_registration
from loraserve.adapter_store.sources import AdapterSource, SourceResolver
from loraserve.adapter_store.validate import Limits, LoraAdapter, validate
from loraserve.serving import tracing
from loraserve.serving.access_log import note

log = logging.getLogger("loraserve.store")

DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000


@dataclass(frozen=True)
class OpenedFetch:
    """What a fetch streams: `adapter.payload`, of which only bytes that `filling` has let through
    may be sent while it is still read from the disk tier (filling None: all of it, now)."""

    record: AdapterRecord
    adapter: OptimizedAdapter
    filling: Filling | None


class AdapterService:
    def __init__(
        self,
        config: StoreConfig,
        base_config: dict,
        registry: Registry,
        resolver: SourceResolver,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self.config = config
        self.base_config = base_config
        self.registry = registry
        self.resolver = resolver
        self.metrics = metrics or StoreMetrics()
        self.cache = AdapterCache(config.cache_max_adapters, config.cache_max_bytes, on_evict=self._evicted)
        self.flight = SingleFlight()
        # payloads being read from the disk tier, by (adapter id, digest): fetches stream them meanwhile
        self._reading: dict[tuple[str, str], tuple[OptimizedAdapter, Filling]] = {}
        self._fills: set[asyncio.Future[None]] = set()
        tier_dir = config.payload_cache_dir
        self.tier = DiskTier(tier_dir, config.cache_dir_max_bytes, self.metrics) if tier_dir else None
        self.handover = (
            HandoverDirectory(Path(config.handover_dir), config.handover_max_bytes, self.metrics)
            if config.handover_dir
            else None
        )
        base_name = config.expected_base_model_name(base_config) if config.check_base_model else None
        self.limits = Limits(
            max_lora_rank=config.max_lora_rank, base_model_name=base_name, serving_dtype=config.serving_dtype
        )
        self.draining = False
        self._pending_registrations = 0

    def start(self) -> None:
        """Start-up work: the hand-over directory is emptied; the disk tier indexes what earlier
        runs left (in the background)."""
        if self.handover is not None:
            self.handover.start()
        if self.tier is not None:
            self.tier.start(self.registry)

    def close(self) -> None:
        """Finish the disk tier's queued writes, then close the registry."""
        if self.tier is not None:
            self.tier.close()
        self.registry.close()

    # -- helpers ---------------------------------------------------------------------------
    def _check_serving(self) -> None:
        if self.draining:
            raise Unavailable("the store is draining (shutting down); retry on another instance")

    def _evicted(self, adapter_id: str, _: OptimizedAdapter) -> None:
        self.metrics.cache_evictions.inc()
        log.info("evicted adapter %s from the CPU cache", adapter_id)

    def _cache_gauges(self) -> None:
        self.metrics.cache_adapters.set(len(self.cache))
        self.metrics.cache_bytes.set(self.cache.bytes)

    def _build(self, source: AdapterSource, reason: str) -> tuple[LoraAdapter, OptimizedAdapter]:
        """Read, validate and optimize a checkpoint (blocking; runs in a worker thread)."""
        start = time.perf_counter()
        self.metrics.builds.labels(reason).inc()
        config_bytes, weights = source.read_checkpoint_files(self.config.max_adapter_bytes)
        ckpt = read_checkpoint(config_bytes, weights, max_tensors=self.config.max_tensors)
        del weights
        adapter = validate(ckpt, self.base_config, self.limits)
        optimized = optimize(adapter, self.base_config, self.config.serving_dtype)
        self.metrics.build_seconds.observe(time.perf_counter() - start)
        return adapter, optimized

    # -- operations ------------------------------------------------------------------------
    async def register(self, adapter_id: str, source: str, overwrite: bool) -> AdapterRecord:
        self._check_serving()
        check_adapter_id(adapter_id)
        if self._pending_registrations >= self.config.max_pending_registrations:
            raise ResourceExhausted(f"{self._pending_registrations} registrations are in flight; retry later")
        self._pending_registrations += 1
        try:
            # Keyed on the request as given, so identical concurrent requests join before any await.
            record = await self.flight.do(
                ("register", adapter_id, source, overwrite),
                lambda: self._register(adapter_id, source, overwrite),
            )
            self.metrics.registrations.labels("ok").inc()
            return record
        except Exception:
            self.metrics.registrations.labels("error").inc()
            raise
        finally:
            self._pending_registrations -= 1

    async def _register(self, adapter_id: str, source: str, overwrite: bool) -> AdapterRecord:
        src = await asyncio.to_thread(self.resolver.resolve, source)  # filesystem / boto3 client set-up
        if not overwrite:
            existing = await asyncio.to_thread(self.registry.get, adapter_id)
            if existing is not None and existing.source != src.uri:  # refused before the build
                raise AlreadyExists(
                    f"adapter {adapter_id!r} already exists, registered from {existing.source!r} "
                    "(set overwrite to replace it)"
                )
        a, o = await asyncio.to_thread(self._build, src, "register")
        record = AdapterRecord(
            adapter_id=adapter_id,
            source=src.uri,
            digest=o.digest,
            rank=o.rank,
            lora_alpha=a.lora_alpha,
            use_rslora=a.use_rslora,
            target_modules=a.target_modules,
            dtype=o.dtype,
            size_bytes=o.total_bytes,
            base_model=a.base_model,
            layout_version=o.layout_version,
            num_tensors=len(o.tensors),
            rank_pattern=a.rank_pattern,
            alpha_pattern=a.alpha_pattern,
        )
        generation = self.cache.generation()  # a delete after the put below makes it stale
        handover_since = self.handover.generation() if self.handover is not None else 0  # the same
        try:
            await asyncio.to_thread(self.registry.put, record, overwrite)
        except AlreadyExists:
            existing = await asyncio.to_thread(self.registry.get, adapter_id)
            if existing is None:  # deleted since: the client may register again
                raise
            return same_registration(existing, record)
        current = self.cache.put(adapter_id, o, record, generation, registered=True)
        self._cache_gauges()
        if self.tier is not None:
            # on disk before the reply (a failing disk only logs) unless deleted or registered
            # anew meanwhile, then older versions go
            if current:
                await self.tier.put(record, o)
            self.tier.discard(adapter_id, keep_digest=o.digest)
        if self.handover is not None and current:  # at hand now: workers' first fetches find it
            self.handover.offer_soon(o, None, handover_since)
        log.info(
            "registered adapter %s from %s (rank %d, %d bytes, digest %s)",
            adapter_id,
            src.uri,
            o.rank,
            o.total_bytes,
            o.digest[:12],
        )
        return record

    async def get(self, adapter_id: str) -> AdapterRecord:
        check_adapter_id(adapter_id)
        record = await asyncio.to_thread(self.registry.get, adapter_id)
        if record is None:
            raise NotFound(f"adapter {adapter_id!r} is not registered")
        return record

    async def list(self, page_size: int, page_token: str) -> tuple[list[AdapterRecord], str, int]:
        if page_size < 0:
            raise InvalidArgument(f"page_size must be >= 0, got {page_size}")
        limit = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        cursor = decode_page_token(page_token)
        # one record past the page says whether another follows; ids deleted while listed leave a
        # registry page short, so it is asked again from its cursor until it has them or ends
        records: list[AdapterRecord] = []
        while True:
            page, cursor, total = await asyncio.to_thread(
                self.registry.list, cursor, limit + 1 - len(records)
            )
            records += page
            if len(records) > limit or not cursor:
                break
        more = len(records) > limit
        records = records[:limit]
        next_token = encode_page_token(records[-1].adapter_id) if more else ""
        return records, next_token, total

    async def delete(self, adapter_id: str) -> AdapterRecord:
        self._check_serving()
        check_adapter_id(adapter_id)
        try:
            record = await asyncio.to_thread(self.registry.delete, adapter_id)
        finally:
            # the CPU cache's copy goes whatever the registry answers: an unreachable one may have
            # deleted the record and lost the reply, and that copy would be served under its last
            # known record while the registry stays unreachable (the disk tier is not read then)
            self.cache.drop(adapter_id)
            self._cache_gauges()
        if self.tier is not None:  # the registry answered: deleted, or not there
            self.tier.discard(adapter_id)
        if record is None:
            raise NotFound(f"adapter {adapter_id!r} is not registered")
        if self.handover is not None:
            self.handover.discard(record.digest)
        log.info("deleted adapter %s", adapter_id)
        return record

    async def fetch_record(self, adapter_id: str, digest: str) -> tuple[AdapterRecord, int]:
        """The record a fetch of `adapter_id` serves (FAILED_PRECONDITION when it is not `digest`),
        and the CPU cache's generation read before it (AdapterCache.put)."""
        self._check_serving()
        generation = self.cache.generation()  # what is read from here on is put with it
        try:
            record = await self.get(adapter_id)
        except Unavailable:
            # Registry down: what the cache holds keeps streaming under its last known record
            # (no registration or deletion can land meanwhile, for they need the registry too).
            known = self.cache.known_record(adapter_id)
            if known is None:
                raise
            log.warning(
                "registry unreachable: serving cached adapter %s from its last known record", adapter_id
            )
            record = known
        if digest and digest != record.digest:
            raise FailedPrecondition(
                f"adapter {adapter_id!r} has digest {record.digest}, not the requested "
                f"{digest} (it was re-registered)"
            )
        return record, generation

    async def open_fetch(
        self, adapter_id: str, offset: int, digest: str, looked_up: tuple[AdapterRecord, int] | None = None
    ) -> OpenedFetch:
        """The record (`looked_up` by fetch_record, else looked up now) and optimized payload to
        stream from `offset`: from the CPU cache, else the disk tier (still being read: see
        `OpenedFetch.filling`), else rebuilt from the source."""
        start = time.perf_counter()
        record, generation = looked_up or await self.fetch_record(adapter_id, digest)
        self._check_serving()
        cached = self.cache.get(adapter_id, record.digest, record)
        cache = "hit" if cached is not None else "miss"
        note(cache=cache)
        tracing.annotate({"loraserve.store.cache": cache})
        filling: Filling | None = None
        if cached is not None:
            self.metrics.cache_hits.inc()
            optimized, origin = cached, "memory"
        else:
            self.metrics.cache_misses.inc()
            key = (adapter_id, record.digest)
            reading = self._reading.get(key)
            if reading is not None:
                (optimized, filling), origin = reading, "disk"
            else:
                optimized, origin, filling = await self.flight.do(
                    ("load", *key), lambda: self._load(record, generation)
                )
        note(origin=origin)
        tracing.annotate({"loraserve.store.origin": origin})
        self.metrics.fetch_open_seconds.labels(origin).observe(time.perf_counter() - start)
        if not 0 <= offset <= optimized.total_bytes:
            raise InvalidArgument(f"offset {offset} is outside the payload of {optimized.total_bytes} bytes")
        self.metrics.fetches.inc()
        return OpenedFetch(record, optimized, filling)

    def handed_over_file(self) -> None:
        """A fetch was answered with a hand-over file already there (no payload read)."""
        note(origin="handover")
        tracing.annotate({"loraserve.store.origin": "handover"})
        self.metrics.fetches.inc()

    async def _load(
        self, record: AdapterRecord, generation: int
    ) -> tuple[OptimizedAdapter, str, Filling | None]:
        """The payload of `record` from the disk tier (opened, and read into the CPU cache meanwhile),
        else rebuilt from its source and put in the CPU cache (and the disk tier) unless the adapter
        changed since `generation` (AdapterCache.put); -> (payload, origin, filling)."""
        if self.tier is not None:
            with tracing.span("store.disk_open", {"loraserve.adapter.id": record.adapter_id}):
                reader = await asyncio.to_thread(self.tier.open, record)
            if reader is not None:
                filling = Filling(reader.total_bytes, self.config.chunk_bytes)
                key = (record.adapter_id, record.digest)
                self._reading[key] = (reader.adapter, filling)
                task = asyncio.ensure_future(self._fill(record, reader, filling, generation))
                self._fills.add(task)
                task.add_done_callback(self._fills.discard)
                return reader.adapter, "disk", filling
        optimized = await self._rebuild(record)
        if self.cache.put(record.adapter_id, optimized, record, generation) and self.tier is not None:
            self.tier.put_soon(record, optimized)  # not awaited: the fetch streams meanwhile
        self._cache_gauges()
        return optimized, "source", None

    async def _fill(
        self, record: AdapterRecord, reader: PayloadReader, filling: Filling, generation: int
    ) -> None:
        """Read the opened file's payload; checked, it joins the CPU cache, else the fetches that
        followed the read fail (PayloadDamaged: fetch again; Unavailable: resume; anything else is
        a bug, INTERNAL). Whatever happens, the fetches waiting on `filling` are released."""
        assert self.tier is not None
        error: BaseException | None = None
        try:
            with tracing.span("store.disk_read", {"loraserve.adapter.id": record.adapter_id}):
                await asyncio.to_thread(self.tier.read, reader, filling.advance, filling.chunks, filling.step)
        except CorruptPayload as exc:
            error = PayloadDamaged(
                f"adapter {record.adapter_id!r}: the store's disk copy was damaged ({exc}); it was "
                "removed, fetch the adapter again from offset 0"
            )
        except OSError as exc:
            error = Unavailable(
                f"adapter {record.adapter_id!r}: reading the store's disk copy failed ({exc})"
            )
        except BaseException as exc:  # a bug, or the store stopping: no fetch may wait forever
            if isinstance(exc, Exception):
                log.exception("disk tier: reading %s failed unexpectedly", record.adapter_id)
            error = exc if isinstance(exc, Exception) else Unavailable("the store is stopping")
            raise
        else:
            self.cache.put(record.adapter_id, reader.adapter, record, generation)
            self._cache_gauges()
        finally:
            reader.close()  # closed by the read already, unless it never ran
            del self._reading[(record.adapter_id, record.digest)]
            filling.finish(error)

    async def _rebuild(self, record: AdapterRecord) -> OptimizedAdapter:
        with tracing.span("store.build", {"loraserve.adapter.id": record.adapter_id}):
            src = await asyncio.to_thread(self.resolver.resolve, record.source)
            _, optimized = await asyncio.to_thread(self._build, src, "rebuild")
        if optimized.digest != record.digest:
            raise DataLoss(
                f"adapter {record.adapter_id!r}: its source {record.source} now optimizes to digest "
                f"{optimized.digest}, not the registered {record.digest}; the checkpoint "
                "changed since registration (re-register it with overwrite)"
            )
        return optimized
