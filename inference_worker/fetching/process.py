"""Adapter fetches in a child process of the worker (child.py): the store's stream is
received, checked and hashed there, beside the worker's interpreter instead of inside it, and the
worker makes one copy of each payload, from shared memory into its own (pinned) buffer.

Under serving load the worker's interpreter lock is busy with the step thread and the gRPC event
loop; a fetch receiving 1 MiB chunks on a thread of the worker waits for that lock at every chunk
(benchmarks/bench_fetch_contention.py, H100 host: 109 against 45 ms alone for a 22.5 MB payload;
from this process, 42 ms either way). The copy here lets go of the lock.

The process starts with `start()` (or the first fetch), and again after it ends: the fetches it
had in flight fail as the store being unreachable, and nothing else is lost. One that answers
nothing for longer than its fetches' own time limits allow is killed and replaced the same way.
Where there is no shared memory (no /dev/shm, or it is full), `Unavailable` tells the caller to
fetch in-process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# glibc's malloc in the fetch process keeps what it frees for the next messages instead of handing
# it back to the kernel (a MALLOC_* setting of the worker's own environment wins). By default a
# freed block of a megabyte (a received message, its bytes) is unmapped or trimmed away, and a
# 22.5 MB fetch faulted ~4,000-5,000 zeroed pages back in (H200 host: 44 -> 36 ms of the process's
# CPU a fetch, ~100 faults, benchmarks/bench_fetch_breakdown.py). What is kept is bounded by the
# process's own peak: its fetches' messages in flight.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(16 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
STOP_WAIT_S = 5.0
ANSWER_MARGIN_S = 10.0  # beyond the fetch's own time limits, before the process counts as stuck


class Unavailable(Exception):
    """No fetch process for this fetch (no shared memory for it): fetch in-process instead."""


class ProcessGone(Exception):
    """The fetch process ended before answering."""


class FetchFailure(Exception):
    """What the process reported: kind "rpc" (the store answered `code`, a grpc.StatusCode
    name), "data_loss" or "fetch" (the stream broke the contract or could not be completed)."""

    def __init__(self, kind: str, code: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.code, self.message = kind, code, message


@dataclass
class Fetched:
    manifest: bytes  # a serialized store_pb2.AdapterManifest
    buffer: torch.Tensor  # [total_bytes] uint8, the worker's own (pinned where CUDA is)
    handover: str = ""  # as clients.adapter_fetch.FetchedAdapter.handover


class _Child:
    """One running fetch process, its connections and the reader thread that resolves answers."""

    def __init__(self, owner: FetchProcess, config: dict[str, Any]) -> None:
        self.owner = owner
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraserve.inference_worker.fetching.child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**MALLOC_ENV, **os.environ},
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.outbox = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.inbox = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self.lock = threading.Lock()
        self.alive = True
        self.send(config)
        self.reader = threading.Thread(target=self._read, name="adapter-fetch-reader", daemon=True)
        self.reader.start()

    def send(self, msg: object) -> None:
        with self.lock:
            if not self.alive:
                raise ProcessGone("the adapter fetch process has ended")
            try:
                self.outbox.send(msg)
            except OSError as exc:
                raise ProcessGone(f"the adapter fetch process has ended: {exc}") from None

    def _read(self) -> None:
        while True:
            try:
                msg = self.inbox.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "dropped":
                self.owner.forget(msg[1])
                continue
            with self.lock:
                waiting = self.pending.pop(msg[1], None)
            if waiting is None:  # nobody waits any more: give the segment back
                if msg[0] == "ok":
                    self.release(msg[3])
                continue
            loop, future = waiting
            _call_on(loop, _resolve, future, msg, self)
        with self.lock:
            self.alive = False
            gone, self.pending = list(self.pending.values()), {}
        for loop, future in gone:
            _call_on(loop, _fail, future, ProcessGone("the adapter fetch process ended"))
        code = self.proc.wait()
        if not self.owner.closing:
            log.warning("the adapter fetch process exited with %s; the next fetch starts another", code)

    def end(self) -> None:
        """Kill the process; its reader fails what it still holds, the next fetch starts another."""
        with self.lock:
            self.alive = False
        self.proc.kill()

    def release(self, segment: str) -> None:
        try:
            self.send(("release", segment))
        except ProcessGone:
            pass

    def stop(self) -> None:
        try:
            self.send(("stop",))
        except ProcessGone:
            pass
        try:
            self.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.outbox.close()
        self.reader.join(STOP_WAIT_S)
        self.inbox.close()


def _call_on(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody waits for the answer any more
        pass


def _resolve(future: asyncio.Future[Any], msg: tuple, child: _Child) -> None:
    if future.cancelled():  # the fetch was cancelled after the answer was sent
        if msg[0] == "ok":
            child.release(msg[3])
        return
    future.set_result(msg)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class FetchProcess:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float,
        max_retries: int,
        tls_root_cert: bytes | None,
        max_fetches: int,
        options: Sequence[tuple[str, Any]],
        handover_dir: str | None = None,
    ) -> None:
        self._config = {
            "handover_dir": handover_dir,
            "address": address,
            "timeout_s": timeout_s,
            "max_retries": max_retries,
            "tls_root_cert": tls_root_cert,
            "max_fetches": max_fetches,
            "options": list(options),
        }
        self._child: _Child | None = None
        self._directory: Path | None = None
        self._maps: dict[str, mmap.mmap] = {}
        self._maps_lock = threading.Lock()
        self._ids = itertools.count()
        self._start_lock = threading.Lock()
        self.closing = False
        self.pin = torch.cuda.is_available()
        # every attempt of a fetch ends within timeout_s, and a retry waits at most 2 s before it
        self.answer_limit_s = (timeout_s + 2.0) * (max_retries + 1) + ANSWER_MARGIN_S

    @staticmethod
    def supported() -> bool:
        return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) and hasattr(os, "posix_fallocate")

    def start(self) -> _Child:
        """The running fetch process, started when there is none."""
        with self._start_lock:
            if self.closing:
                raise ProcessGone("the adapter fetches are shut down")
            if self._child is not None and self._child.alive and self._child.proc.poll() is None:
                return self._child
            if self._directory is None:
                self._directory = Path(tempfile.mkdtemp(prefix="loraserve-fetch-", dir=SHM_DIR))
            else:  # a dead process's segments: nobody maps them any more
                self._forget_all()
                for path in self._directory.iterdir():
                    path.unlink(missing_ok=True)
            self._child = _Child(self, {**self._config, "directory": str(self._directory)})
            return self._child

    async def fetch(
        self, adapter_id: str, digest: str, metadata: Sequence[tuple[str, str]] | None
    ) -> Fetched:
        """Raises FetchFailure (the store's answer or a broken stream), ProcessGone (the process
        ended meanwhile) or Unavailable (no shared memory for this payload)."""
        loop = asyncio.get_running_loop()
        child = self.start()
        req = next(self._ids)
        future: asyncio.Future[Any] = loop.create_future()
        with child.lock:
            child.pending[req] = (loop, future)
        try:
            child.send(("fetch", req, adapter_id, digest, list(metadata or ())))
        except ProcessGone:
            with child.lock:
                child.pending.pop(req, None)
            raise
        try:
            msg = await asyncio.wait_for(future, self.answer_limit_s)
        except asyncio.TimeoutError:  # the process is stuck: end it, so every fetch it holds fails now
            child.end()
            raise ProcessGone(
                f"the adapter fetch process did not answer within {self.answer_limit_s:.0f} s"
            ) from None
        finally:
            if not future.done():  # cancelled: an answer that comes later releases its segment
                with child.lock:
                    child.pending.pop(req, None)
        if msg[0] == "error":
            _, _, kind, code, message = msg
            if kind == "no_room":
                raise Unavailable(message)
            raise FetchFailure(kind, code, message)
        _, _, manifest, segment, nbytes, handover = msg
        try:
            buffer = await asyncio.to_thread(self._copy_out, segment, nbytes)
        except (OSError, ValueError) as exc:  # its process was replaced meanwhile, segments and all
            raise ProcessGone(f"the payload's shared memory went away: {exc}") from None
        finally:
            child.release(segment)
        return Fetched(manifest, buffer, handover)

    def _copy_out(self, segment: str, nbytes: int) -> torch.Tensor:
        """The payload in `segment`, copied into a buffer of the worker's (the copy runs without
        the interpreter lock)."""
        with self._maps_lock:
            mapped = self._maps.get(segment)
            if mapped is None:
                assert self._directory is not None
                fd = os.open(self._directory / segment, os.O_RDWR)
                try:
                    mapped = self._maps[segment] = mmap.mmap(fd, 0)
                finally:
                    os.close(fd)
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        buffer.copy_(torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes))
        return buffer

    def forget(self, segment: str) -> None:
        """The process removed `segment`: drop its mapping."""
        with self._maps_lock:
            mapped = self._maps.pop(segment, None)
        if mapped is not None:
            _close(mapped)

    def _forget_all(self) -> None:
        with self._maps_lock:
            maps, self._maps = list(self._maps.values()), {}
        for mapped in maps:
            _close(mapped)

    def close(self) -> None:
        with self._start_lock:
            self.closing = True
            child, self._child = self._child, None
        if child is not None:
            child.stop()
        self._forget_all()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


def _close(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:  # a copy out of it still runs: the mapping goes with its last view
        pass
