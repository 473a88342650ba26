"""The adapter fetch process (started by process.py, `python -m` this module): receives
adapters from the store and leaves each payload in a shared-memory segment for the worker to copy.

Receiving a payload is tens of MB through gRPC in 1 MiB chunks, each decoded, copied and hashed:
in the worker's own interpreter every chunk waits for the lock that the step thread and the event
loop keep busy under load (measured: a fetch three times slower beside them). Here it has an
interpreter of its own.

Protocol (multiprocessing connections over the process's stdin and stdout; stdout itself goes to
stderr, so a stray print cannot corrupt it):
    in:  config dict, then ("fetch", id, adapter_id, digest, metadata) | ("release", segment)
         | ("stop",)
    out: ("ok", id, manifest bytes, segment, nbytes, handover) | ("error", id, kind, code, message)
         | ("dropped", segment)
kind: "rpc" (the store answered `code`, a grpc.StatusCode name), "data_loss", "fetch" (the stream
broke the contract or could not be completed), "no_room" (no shared memory for the payload).
A segment holds one payload from "ok" until the worker releases it; the process ends at "stop" or
when its stdin closes (the worker is gone)."""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

SEGMENT_ALIGN = 1 << 20


@dataclass
class Segment:
    name: str
    size: int
    map: mmap.mmap


class Segments:
    """Shared-memory files in `directory` (made by the worker, removed by it), reused: a fetch takes
    the smallest free one that fits, or a new one. At most `keep` exist while free ones can go, and
    free ones go when shared memory is full."""

    def __init__(self, directory: Path, keep: int, dropped: Callable[[str], None]) -> None:
        self.directory, self.keep, self._dropped = directory, keep, dropped
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._all: dict[str, Segment] = {}
        self._count = 0

    def take(self, nbytes: int) -> Segment:
        with self._lock:
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                return seg
            while self._free and len(self._all) >= self.keep:
                self._drop(max(self._free, key=lambda s: s.size))
        try:
            return self._create(nbytes)
        except OSError:
            with self._lock:  # shared memory full: the free segments go, then one more try
                if not self._free:
                    raise
                while self._free:
                    self._drop(self._free[0])
            return self._create(nbytes)

    def _create(self, nbytes: int) -> Segment:
        with self._lock:
            self._count += 1
            name = f"seg{self._count}"
        size = -(-max(nbytes, 1) // SEGMENT_ALIGN) * SEGMENT_ALIGN
        path = self.directory / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # reserve the pages now: on a full tmpfs this fails here instead of a SIGBUS mid-write
            os.posix_fallocate(fd, 0, size)
            seg = Segment(name, size, mmap.mmap(fd, size))
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        with self._lock:
            self._all[name] = seg
        return seg

    def release(self, name: str) -> None:
        with self._lock:
            seg = self._all.get(name)
            if seg is not None and seg not in self._free:
                self._free.append(seg)

    def _drop(self, seg: Segment) -> None:
        self._free.remove(seg)
        del self._all[seg.name]
        try:
            seg.map.close()
        except BufferError:  # a view of it still alive: the mapping goes with the view
            pass
        (self.directory / seg.name).unlink(missing_ok=True)
        self._dropped(seg.name)


class Child:
    def __init__(self, config: dict[str, Any], send: Callable[[tuple], None]) -> None:
        from loraserve.clients.channel import open_channel

        self.config, self._send = config, send
        workers = int(config["max_fetches"])
        # one connection to the store per fetch thread: gRPC works one connection's bytes on one
        # thread at a time, so fetches sharing a connection share its pace (a pool of its own keeps
        # each channel's connection apart from the others'); the options are the worker's own
        # (StoreSource.channel_options: its keepalive with them)
        self.channels: list[grpc.Channel] = [
            open_channel(
                config["address"],
                root_certificates=config.get("tls_root_cert"),
                options=[*config["options"], ("grpc.use_local_subchannel_pool", 1)],
            )
            for _ in range(workers)
        ]
        self._local = threading.local()
        unused = iter(self.channels)
        self.threads = concurrent.futures.ThreadPoolExecutor(
            workers,
            thread_name_prefix="adapter-fetch",
            initializer=lambda: setattr(self._local, "channel", next(unused)),  # each thread its own
        )
        self.segments = Segments(
            Path(config["directory"]), keep=workers + 2, dropped=lambda n: send(("dropped", n))
        )

    def fetch(self, req: int, adapter_id: str, digest: str, metadata: list[tuple[str, str]]) -> None:
        import grpc
        import numpy as np

        from loraserve.clients.adapter_fetch import DataLossError, FetchError, fetch_adapter

        taken: list[Segment] = []

        def allocate(nbytes: int) -> np.ndarray:
            seg = self.segments.take(nbytes)
            taken.append(seg)
            return np.frombuffer(seg.map, dtype=np.uint8, count=nbytes)

        try:
            fetched = fetch_adapter(
                self._local.channel,
                adapter_id,
                digest=digest,
                max_retries=int(self.config["max_retries"]),
                timeout=float(self.config["timeout_s"]),
                metadata=metadata,
                allocate=allocate,
                handover_dir=self.config.get("handover_dir"),
            )
        except Exception as exc:  # every failure goes back to the worker, which maps it
            for seg in taken:
                self.segments.release(seg.name)
            if isinstance(exc, grpc.RpcError):
                code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
                details = exc.details() if hasattr(exc, "details") else str(exc)
                self._send(("error", req, "rpc", code.name, details or ""))
            elif isinstance(exc, DataLossError):
                self._send(("error", req, "data_loss", "", str(exc)))
            elif isinstance(exc, FetchError):
                self._send(("error", req, "fetch", "", str(exc)))
            elif isinstance(exc, OSError):
                self._send(("error", req, "no_room", "", f"{type(exc).__name__}: {exc}"))
            else:
                self._send(("error", req, "fetch", "", f"{type(exc).__name__}: {exc}"))
            return
        nbytes = int(fetched.manifest.total_bytes)
        self._send(("ok", req, fetched.manifest.SerializeToString(), taken[0].name, nbytes, fetched.handover))

    def serve(self, recv: Callable[[], Any]) -> None:
        while True:
            try:
                msg = recv()
            except (EOFError, OSError):
                return
            if msg[0] == "fetch":
                self.threads.submit(self.fetch, *msg[1:])
            elif msg[0] == "release":
                self.segments.release(msg[1])
            elif msg[0] == "stop":
                return


def main() -> None:
    # Ctrl-C and a SIGTERM to the whole process group reach this process too: the worker decides
    # when it ends (it sends "stop" or closes the pipe), so neither is ours to act on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox = Connection(os.dup(0), writable=False)
    outbox = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # prints and logs go to stderr; stdout carries only the protocol
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            try:
                outbox.send(msg)
            except OSError:  # the worker is gone
                pass

    try:
        config = inbox.recv()
    except (EOFError, OSError):
        return
    child = Child(config, send)
    try:
        child.serve(inbox.recv)
    finally:
        child.threads.shutdown(wait=False, cancel_futures=True)
        for channel in child.channels:
            channel.close()
        # the worker removes the segments too; this covers a worker that was killed
        shutil.rmtree(config["directory"], ignore_errors=True)
    sys.stderr.flush()
    os._exit(0)  # fetches still streaming end with the process


if __name__ == "__main__":
    main()
