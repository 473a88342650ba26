"""Payloads handed over through a directory that the store and its workers share on one host.

A fetch streams a payload through gRPC: ~1 GB/s into a Python receiver, then a sha256 pass over it
on the worker (~1.5 GB/s), so a 22 MB adapter costs a worker ~30 ms under load. A worker on the
store's host can instead ask for the payload as a file (`FetchAdapterRequest.handover`): the store
writes the payload it holds in memory, whose digest it has checked (built from the source, or read
from the disk tier and verified), once into `directory` as a file named by its digest, and answers
with the manifest alone, naming the file. The worker copies the file into its own buffer: a copy
between two processes' memory on one machine, as the worker's own fetch process hands payloads
over (inference_worker/fetching/), not a transfer over a network, so no second digest pass.

A payload is written when it is registered (it is in memory then) and when a fetch asks for one that
is not there: from the CPU cache at once (the write and the worker's copy take less than a stream),
from the disk tier once its read has been checked (that fetch streams as the file is read). A fetch of a payload whose file is there reads nothing of the payload on the store's
side (not the CPU cache, not the disk tier): the directory is one more tier, in the host's memory,
shared by every worker there.

The directory is the store's: a real directory of the store's user that no other user may write
into (workers trust its files by name), made when it is not there. The store removes the files an
earlier run left there at start-up (the names it writes: digests, temporaries), keeps at most
`max_bytes` of files (least recently handed over go first) and removes an adapter's file when it
is deleted. A file handed over within the last `keep_s` seconds is not removed for room, so a
worker has that long to open it; a worker that finds no file (another host, a file removed
meanwhile) fetches the payload as a stream instead. Files are written under a temporary name and
renamed into place complete, so a worker never sees part of one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from loraserve.adapter_store.change_clock import ChangeClock
from loraserve.adapter_store.filling import Filling
from loraserve.adapter_store.metrics import StoreMetrics
from loraserve.adapter_store.optimize import OptimizedAdapter
from loraserve.contract.adapter_layout import DIGEST_RE
from loraserve.contract.payload import PayloadTensor

log = logging.getLogger("loraserve.store.handover")

_TMP_PREFIX = ".writing-"
_WRITE_STEP = 8 << 20  # bytes per write call
# digests whose last discard is remembered; an offer read before the oldest forgotten discard is
# refused whatever its digest (a stream, never a deleted adapter's file left behind)
MAX_DISCARDS = 16_384


@dataclass(frozen=True)
class PayloadShape:
    """What a manifest says of a payload (servicer.manifest_to_pb), kept for each file without the
    payload itself."""

    tensors: list[PayloadTensor]
    total_bytes: int
    digest: str
    layout_version: int
    rank: int

    @classmethod
    def of(cls, o: OptimizedAdapter) -> PayloadShape:
        return cls(list(o.tensors), o.total_bytes, o.digest, o.layout_version, o.rank)


@dataclass
class _File:
    shape: PayloadShape
    handed_out: float  # time.monotonic() when last handed out (or written)


class HandoverDirectory:
    def __init__(self, directory: Path, max_bytes: int, metrics: StoreMetrics, keep_s: float = 10.0) -> None:
        self.directory, self.max_bytes, self.keep_s = directory, max_bytes, keep_s
        self.metrics = metrics
        self._files: OrderedDict[str, _File] = OrderedDict()  # by digest, least recently handed out first
        self._bytes = 0
        self._writing: dict[str, asyncio.Future[bool]] = {}
        self._soon: set[asyncio.Future[str | None]] = set()  # writes nobody waits for
        self._warned = 0.0  # time.monotonic() of the last failed write logged
        self._discards = ChangeClock(1, MAX_DISCARDS)  # digest -> its last discard

    def start(self) -> None:
        """Make the directory (readable by the workers) unless it is there, check that it is the
        store's own, and remove the files an earlier run left: names the store writes only, so a
        directory given by mistake (/dev/shm, a home) loses nothing else."""
        try:
            self.directory.mkdir(parents=True)
            os.chmod(self.directory, 0o755)  # whatever the umask
        except FileExistsError:
            pass
        self._check_own()
        for path in self.directory.iterdir():
            ours = DIGEST_RE.fullmatch(path.name) or path.name.startswith(_TMP_PREFIX)
            if ours and (path.is_file() or path.is_symlink()):
                path.unlink(missing_ok=True)
        self._gauges()

    def _check_own(self) -> None:
        """Workers take a file here as the checked payload its name says, unhashed: the directory
        must be a real one that no other user can write into (not a link, not a shared /tmp)."""
        st = os.lstat(self.directory)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(
                f"handover_dir {self.directory} must be a directory, not a symbolic link or file"
            )
        if st.st_uid != os.geteuid():
            raise ValueError(
                f"handover_dir {self.directory} is owned by uid {st.st_uid}, not the store's "
                f"{os.geteuid()}: give the store a directory of its own"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ValueError(
                f"handover_dir {self.directory} is writable by other users (mode "
                f"{stat.S_IMODE(st.st_mode):o}): give the store a directory of its own (it makes one "
                "that is not there)"
            )

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def generation(self) -> int:
        """The clock now: take it before reading the registry record whose payload is offered."""
        return self._discards.now

    async def offer(
        self, optimized: OptimizedAdapter, filling: Filling | None, generation: int, fetch: bool = True
    ) -> str | None:
        """The file name of `optimized`'s payload in the directory, written now if it is not there;
        None when it cannot be (no room, an I/O error, its digest discarded since `generation`: a
        record read before a delete): the fetch streams instead. A payload still read from the disk
        tier (`filling`) is written once its digest has been checked there. `fetch`: a fetch is
        handed the file (else it is written for later ones, and one there is not counted)."""
        digest = optimized.digest
        if filling is not None:
            await filling.verified()  # a damaged disk copy raises here, as its stream would
        if self._discarded(digest, generation):
            return None
        if self.present(digest, count=fetch):
            return digest
        if (
            optimized.total_bytes > self.max_bytes
        ):  # it would evict every other file, and still pass the bound
            self.metrics.handovers.labels("too_large").inc()
            return None
        writing = self._writing.get(digest)
        if writing is None:
            writing = asyncio.ensure_future(self._write(optimized, generation))
            self._writing[digest] = writing
            writing.add_done_callback(lambda _: self._writing.pop(digest, None))
        if not await asyncio.shield(writing):
            return None
        return digest if self.present(digest, count=False) is not None else None  # counted written

    def offer_soon(self, optimized: OptimizedAdapter, filling: Filling | None, generation: int) -> None:
        """Write `optimized`'s file in the background: just registered (its payload is at hand), or
        once the disk tier's read of it (`filling`) has been checked."""
        task = asyncio.ensure_future(self._offer_quietly(optimized, filling, generation))
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)

    async def _offer_quietly(
        self, optimized: OptimizedAdapter, filling: Filling | None, generation: int
    ) -> str | None:
        try:
            return await self.offer(optimized, filling, generation, fetch=False)
        except Exception as exc:  # a damaged disk copy: the fetch reading it says so
            log.debug("hand-over of %s not written: %s", optimized.digest[:12], exc)
            return None

    def present(self, digest: str, count: bool = True) -> PayloadShape | None:
        """The payload of `digest` when its file is there (it is then handed out now, counted as a
        hand-over of a file there when `count`), else None."""
        entry = self._files.get(digest)
        if entry is None:
            return None
        if not (self.directory / digest).exists():  # removed under us (by hand, or a cleaner)
            self._forget(digest)
            return None
        entry.handed_out = time.monotonic()
        self._files.move_to_end(digest)
        if count:
            self.metrics.handovers.labels("present").inc()
        return entry.shape

    async def _write(self, optimized: OptimizedAdapter, generation: int) -> bool:
        digest, size = optimized.digest, optimized.total_bytes
        self._make_room(size)
        try:
            await asyncio.to_thread(self._write_file, optimized)
        except OSError as exc:
            self.metrics.handovers.labels("failed").inc()
            now = time.monotonic()
            if now - self._warned > 60:  # full, read-only, not permitted: each fetch would say it
                self._warned = now
                log.warning("hand-over of %s skipped (streamed instead): %s", digest[:12], exc)
            return False
        if self._discarded(digest, generation):  # deleted while written: not left behind
            self._remove(digest)
            return False
        self._forget(digest)  # (counted once, were it there already)
        self._files[digest] = _File(PayloadShape.of(optimized), time.monotonic())
        self._bytes += size
        self.metrics.handovers.labels("written").inc()
        self.metrics.handover_written_bytes.inc(size)
        self._make_room(0, keep=digest)
        self._gauges()
        return True

    def _write_file(self, optimized: OptimizedAdapter) -> None:
        final = self.directory / optimized.digest
        tmp = self.directory / f"{_TMP_PREFIX}{optimized.digest}-{os.getpid()}-{time.monotonic_ns()}"
        view = memoryview(optimized.payload.numpy())  # type: ignore[arg-type]
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            os.fchmod(fd, 0o644)  # readable by workers of another user whatever the store's umask
            for start in range(0, len(view), _WRITE_STEP):
                part = view[start : start + _WRITE_STEP]
                while part:
                    part = part[os.write(fd, part) :]
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    def _make_room(self, incoming: int, keep: str | None = None) -> None:
        """Remove least recently handed-over files until `incoming` more bytes fit, sparing `keep`
        and files handed out within keep_s (the bound may be passed by those until they age)."""
        now = time.monotonic()
        for digest in list(self._files):
            if self._bytes + incoming <= self.max_bytes:
                break
            if digest == keep or now - self._files[digest].handed_out < self.keep_s:
                continue
            self._remove(digest)
            self.metrics.handover_evictions.inc()

    def discard(self, digest: str) -> None:
        """An adapter of this digest was deleted: its file goes, and so does one that an offer of a
        record read before now writes later (another adapter with the same payload gets it written
        again on its next fetch)."""
        self._discards.change(digest, (0,))
        if digest in self._files:
            self._remove(digest)

    def _discarded(self, digest: str, generation: int) -> bool:
        return generation < self._discards.since(digest, 0)

    def _remove(self, digest: str) -> None:
        try:
            (self.directory / digest).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove hand-over file %s: %s", digest[:12], exc)
        self._forget(digest)

    def _forget(self, digest: str) -> None:
        entry = self._files.pop(digest, None)
        if entry is not None:
            self._bytes -= entry.shape.total_bytes
            self._gauges()

    def _gauges(self) -> None:
        self.metrics.handover_files.set(len(self._files))
        self.metrics.handover_bytes.set(self._bytes)
