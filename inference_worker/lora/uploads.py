"""How an adapter's payload reaches the device on its way into a GPU slot (lora/slots.py): one
host-to-device copy of the whole pinned payload into a staging buffer, from which the slots' own
device-side copies read.

The upload (11–22 MB for a 1B model at rank 8–16, ~0.25–0.5 ms over PCIe) runs on a copy stream of
its own, so the steps already queued on the caller's stream keep running beside it; the caller's
stream waits for it before the copies out of the buffer, which it runs itself, so the step that
first reads the slot is ordered after the load and the steps queued before it, which may still read
the slot's old weights, before the slot is overwritten. A few staging buffers (STAGING_BUFFERS,
taken in turn) let the next upload start while the last one's copies out still wait their turn;
past the first, one is made only while free device memory is ample (STAGING_ROOM), so they do not
eat the headroom the KV cache left for the steps. Without the copy stream (measuring the
difference; tensor-parallel shards) the upload runs in line on the caller's stream, through one
buffer.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
STAGING_BUFFERS = 3  # uploads that may be in flight ahead of their copies out
STAGING_ROOM = 4  # a second or third staging buffer only while free memory is this many times its size
KEPT = 1024  # views a staging buffer keeps (its heads by size, the slots' copy views)


class Staging:
    """A device buffer a payload is uploaded into. `uploaded` is recorded on the copy stream after
    an upload, `released` on the caller's stream after the copies out of it: the next upload into
    it waits for that. `views` holds the slots' copy views into it (they go with it)."""

    def __init__(self, nbytes: int, device: torch.device, copy_stream: torch.cuda.Stream | None) -> None:
        # Allocated on the caller's stream. Memory it frees is reused there in stream order, and
        # its uploads on the copy stream are marked (record_stream), so the allocator also waits for
        # them before reusing it. The memory may have been a dropped buffer's whose copies out are
        # still queued on the caller's stream: `released` recorded now makes the first upload into
        # it wait for them.
        self.stream = torch.cuda.current_stream(device)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if copy_stream is not None:
            self.buffer.record_stream(copy_stream)
        self.heads: dict[int, torch.Tensor] = {}  # the buffer's first n bytes, by n
        self.views: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.uploaded = torch.cuda.Event()
        self.released = torch.cuda.Event()
        self.released.record(self.stream)

    def head(self, nbytes: int) -> torch.Tensor:
        got = self.heads.get(nbytes)
        if got is None:
            if len(self.heads) >= KEPT:
                self.heads.clear()
            got = self.heads[nbytes] = self.buffer[:nbytes]
        return got


class Uploads:
    """The staging buffers and the copy stream of one device's slots. Not thread-safe: the slots'
    lock holds from `upload` to `copied_out`."""

    def __init__(self, device: torch.device, copy_stream: bool) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if copy_stream else None
        self._stagings: list[Staging] = []
        self._next = 0  # staging buffers are taken in turn
        self._max = STAGING_BUFFERS if self.copy_stream is not None else 1

    def upload(self, data: torch.Tensor, pinned: bool) -> tuple[Staging, torch.cuda.Stream]:
        """Queue the copy of host bytes `data` into a staging buffer; -> (the buffer, the caller's
        stream), which waits for the copy: what the caller queues there next may read the buffer,
        and `copied_out` is called once it has queued the copies out."""
        nbytes = data.numel()
        staging = self._take(nbytes)
        head = staging.head(nbytes)
        stream = torch.cuda.current_stream(self.device)
        if stream != staging.stream:  # (the step thread always loads on one stream)
            staging.buffer.record_stream(stream)
        copy = self.copy_stream
        if copy is None:
            head.copy_(data, non_blocking=pinned)
        else:
            if not staging.released.query():  # the last copies out of it are still queued
                copy.wait_event(staging.released)
            with torch.cuda.stream(copy):
                head.copy_(data, non_blocking=pinned)
            staging.uploaded.record(copy)
            stream.wait_event(staging.uploaded)
        return staging, stream

    def copied_out(self, staging: Staging, stream: torch.cuda.Stream) -> None:
        """The copies out of `staging` are queued on `stream`: its next upload waits for them."""
        if self.copy_stream is not None:
            staging.released.record(stream)

    def _take(self, nbytes: int) -> Staging:
        """The next staging buffer in turn (made on first use, replaced by a larger one when smaller
        than `nbytes`). Taken in turn rather than by asking which is free: each question to the
        device is a point where the step thread may lose the interpreter. Its last copies out were
        queued STAGING_BUFFERS loads ago, so an upload rarely waits for them."""
        # never past the buffers made so far (one that could not be made is made next time)
        index = min(self._next % self._max, len(self._stagings))
        staging = self._stagings[index] if index < len(self._stagings) else None
        if staging is not None and staging.buffer.numel() >= nbytes:
            self._next = index + 1
            return staging
        try:
            if index > 0 and not self._room_for(nbytes):
                raise torch.OutOfMemoryError("little free device memory")
            made = Staging(nbytes, self.device, self.copy_stream)
        except torch.OutOfMemoryError:
            if index == 0:
                raise
            # the first buffers go on serving; the headroom the KV cache left stays for the steps
            log.warning(
                "little free device memory for another adapter staging buffer of %.1f MB: loads "
                "share %d (their uploads then wait more often for the copies before them)",
                nbytes / 1e6,
                index,
            )
            del self._stagings[index:]
            self._max, self._next = index, 0
            return self._take(nbytes)
        if index < len(self._stagings):
            self._stagings[index] = made
        else:
            self._stagings.append(made)
        self._next = index + 1
        return made

    def _room_for(self, nbytes: int) -> bool:
        """Whether the device's free memory (the driver's: what torch holds unused is the steps'
        working set) is at least STAGING_ROOM times another staging buffer's size."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free >= STAGING_ROOM * nbytes
