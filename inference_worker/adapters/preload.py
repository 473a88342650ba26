"""Adapters loaded at start-up, before the worker serves (`--preload-adapters`): a worker whose
slots can hold every adapter it will serve starts warm instead of fetching each from the store on
its first request (a thousand fetches take tens of seconds under load).

The adapters named (or, with `*`, every adapter the store lists, those the fleet asks for most
first, by its decayed request counts where it shares them) are fetched into the CPU tier,
`max_fetches` at a time, and copied into GPU slots while slots are free. Preloading never evicts:
what does not fit in free room is skipped and counted. An adapter that cannot be fetched (unknown,
invalid, the store unreachable) is logged and counted, and the worker starts anyway; so it does
when the time allowed runs out."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraserve.inference_worker.adapters.refs import AdapterRef
from loraserve.inference_worker.errors import WorkerError

if TYPE_CHECKING:
    from loraserve.inference_worker.adapters.worker_adapters import WorkerAdapters

log = logging.getLogger("loraserve.worker")

ALL = "*"


def parse_preload(spec: str) -> list[str] | None:
    """Adapter ids of `--preload-adapters`: comma-separated, or `*` for every adapter the store
    lists (None); malformed ids raise ValueError."""
    spec = spec.strip()
    if spec == ALL:
        return None
    ids = [s.strip() for s in spec.split(",") if s.strip()]
    for aid in ids:
        try:
            AdapterRef.parse(aid)
        except WorkerError as exc:
            raise ValueError(f"preload_adapters: {exc}") from None
    return list(dict.fromkeys(ids))


@dataclass
class PreloadReport:
    gpu: list[str] = field(default_factory=list)  # in a GPU slot (and the CPU tier)
    cpu: list[str] = field(default_factory=list)  # in the CPU tier only: no free slot was left
    skipped: list[str] = field(default_factory=list)  # no free CPU room was left
    failed: dict[str, str] = field(default_factory=dict)  # adapter id -> why
    timed_out: bool = False
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"preloaded {len(self.gpu)} adapters into GPU slots and {len(self.cpu)} into the CPU tier "
            f"only in {self.seconds:.1f} s; {len(self.skipped)} did not fit, {len(self.failed)} failed"
            + (" (time ran out)" if self.timed_out else "")
        )


async def preload(adapters: WorkerAdapters, spec: str, timeout_s: float) -> PreloadReport:
    """Preload what `spec` names (see the module's text) within `timeout_s`; on the event loop,
    before the worker serves."""
    report = PreloadReport()
    t0 = time.monotonic()
    wanted = parse_preload(spec)
    try:
        if wanted is None:
            if adapters.list_digests is None:
                raise WorkerError("the adapter source cannot list its adapters")
            listed = await asyncio.wait_for(adapters.list_digests(), timeout_s)
            wanted = await _most_popular_first(adapters, list(listed), timeout_s)
        left = max(0.0, timeout_s - (time.monotonic() - t0))
        await asyncio.wait_for(_load_all(adapters, wanted, report), left)
    except asyncio.TimeoutError:
        report.timed_out = True
    except WorkerError as exc:  # the store could not be listed: start without
        report.failed[ALL] = str(exc)
    report.seconds = time.monotonic() - t0
    (log.warning if report.failed or report.skipped or report.timed_out else log.info)("%s", report.line())
    for aid, why in list(report.failed.items())[:20]:
        log.warning("preload of %s failed: %s", aid, why)
    return report


async def _most_popular_first(adapters: WorkerAdapters, ids: list[str], timeout_s: float) -> list[str]:
    """`ids` by the fleet's decayed request counts, most asked-for first (what free room there is
    goes to them), then by id; by id alone where the fleet's counts cannot be read."""
    try:  # (the fleet sync thread, the coordinator's user once serving, has not started yet)
        counts = await asyncio.wait_for(
            asyncio.to_thread(adapters.coordinator.fleet_popularity), min(timeout_s, 10.0)
        )
    except Exception as exc:  # no fleet counts: the store's order
        log.info("preload: the fleet's adapter popularity could not be read (%s); by id", exc)
        counts = {}
    return sorted(ids, key=lambda aid: (-counts.get(aid, 0.0), aid))


async def _load_all(adapters: WorkerAdapters, wanted: list[str], report: PreloadReport) -> None:
    pool = adapters.pool
    fetches = asyncio.Semaphore(adapters.ahead.max_fetches)  # the worker's fetches at once
    # free slots go in the order wanted (most popular first), whichever fetch lands first: each
    # adapter takes its turn at the slots after the one before it
    turns = [asyncio.Event() for _ in wanted]
    keys: dict[str, str] = {}  # adapter id as given -> the version key it was fetched as
    landed = asyncio.Event()  # the first fetch is in: the CPU tier's room by bytes is known

    async def one(i: int, aid: str) -> None:
        try:
            key = await fetch(aid)
            if i:
                await turns[i - 1].wait()
            if key is not None:
                await into_slot(aid, key)
        finally:
            turns[i].set()

    async def into_slot(aid: str, key: str) -> None:
        try:
            slot = await asyncio.to_thread(pool.activate_now, key, False)  # a free slot, or none
        except Exception as exc:
            report.failed[aid] = str(exc) or type(exc).__name__
            return
        keys[aid] = key
        (report.gpu if slot is not None else report.cpu).append(aid)

    async def fetch(aid: str) -> str | None:
        ref = AdapterRef.parse(aid)
        async with fetches:
            # room by bytes is a guess until one fetch has landed; a fetch registers its flight
            # before it waits, so the flights are this preload's and any other that holds room
            if pool.fetcher.flights and not landed.is_set():
                await landed.wait()
            with pool.lock:
                full = pool.tiers.cpu.room - len(pool.fetcher.flights) <= 0
                if full and pool.arrival_tier(ref) == "store":  # (a held one needs no room)
                    report.skipped.append(aid)
                    return None
            try:
                return await pool.ensure_cpu(ref)
            except Exception as exc:  # whatever fails one adapter fails only its preload
                report.failed[aid] = str(exc) or type(exc).__name__
                return None
            finally:
                landed.set()

    await asyncio.gather(*(one(i, aid) for i, aid in enumerate(wanted)))
    # room by bytes is an estimate: what a later fetch displaced is reported as not kept
    with pool.lock:
        gone = {aid for aid, key in keys.items() if not pool.tiers.holds(key)}
    report.gpu = [aid for aid in report.gpu if aid not in gone]
    report.cpu = [aid for aid in report.cpu if aid not in gone]
    report.skipped += sorted(gone)
