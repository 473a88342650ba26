"""Adapter fetches in the worker's fetch process (inference_worker/fetching),
against the real store: the same payload as a fetch in the worker's own process, the store's
answers as the same adapter failures, and a process that dies, a fetch given up on and a full
shared memory costing nothing but the fetches they touch."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from loraserve.inference_worker.adapters.store_source import StoreSource
from loraserve.inference_worker.errors import AdapterMismatch, AdapterNotFound, DependencyUnavailable
from loraserve.inference_worker.fetching import process as fetch_process

pytestmark = pytest.mark.skipif(not fetch_process.FetchProcess.supported(), reason="no /dev/shm")


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _with_source(address: str, body, **kw):
    source = StoreSource(address, timeout_s=10, max_retries=1, fetch_process=True, **kw)
    try:
        return await body(source)
    finally:
        await source.close()


def _segments(source: StoreSource) -> list[str]:
    process = source._process
    assert process is not None and process._directory is not None
    return sorted(p.name for p in process._directory.iterdir())


def test_same_payload_as_in_process(lora_store):
    async def body(source):
        here = await StoreSource(lora_store.address, timeout_s=10)._fetch_here("all-r4", "", None)
        there = await source.fetch("all-r4")
        again = await source.fetch("all-r4")  # a segment reused
        return here, there, again, _segments(source)

    here, there, again, segments = run(_with_source(lora_store.address, body))
    for got in (there, again):
        assert (got.adapter_id, got.digest, got.rank) == (here.adapter_id, here.digest, here.rank)
        assert got.tensors == here.tensors
        assert torch.equal(got.data, here.data)
    assert there.data.data_ptr() != again.data.data_ptr()  # each fetch its own buffer
    assert len(segments) == 1


def test_store_answers_become_adapter_failures(lora_store):
    async def body(source):
        with pytest.raises(AdapterNotFound):
            await source.fetch("no-such-adapter")
        with pytest.raises(AdapterMismatch):
            await source.fetch("all-r4", digest="0" * 64)
        return await source.fetch("qv-r8")  # the process still serves

    assert run(_with_source(lora_store.address, body)).rank == 8


def test_unreachable_store_is_dependency_unavailable(tmp_path):
    from tests.helpers.ports import free_port

    async def body(source):
        with pytest.raises(DependencyUnavailable):
            await source.fetch("all-r4")

    run(_with_source(f"127.0.0.1:{free_port()}", body, max_fetches=1))


def test_a_killed_process_fails_its_fetches_and_is_replaced(lora_store):
    async def body(source):
        await source.fetch("all-r4")
        child = source._process._child
        os.kill(child.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while child.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not child.alive
        got = await source.fetch("mlp-rs16")  # a new process
        assert source._process._child is not child
        return got

    assert run(_with_source(lora_store.address, body)).rank == 16


def test_the_process_keeps_freed_memory_unless_told_otherwise(lora_store, monkeypatch):
    """The fetch process starts with glibc malloc settings that keep freed blocks for the next
    messages (fetching.process.MALLOC_ENV); a setting of the worker's own environment wins."""
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)

    async def body(source):
        await source.fetch("all-r4")
        pid = source._process._child.proc.pid
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if b"=" in e)

    environment = run(_with_source(lora_store.address, body))
    assert environment["MALLOC_MMAP_THRESHOLD_"] == fetch_process.MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert environment["MALLOC_TRIM_THRESHOLD_"] == "12345"


def test_a_sigterm_to_the_process_group_is_the_worker_s_to_act_on(lora_store):
    """`kill -- -PGID`, `timeout` or a terminal reach the fetch process too: it ignores SIGTERM
    and SIGINT and goes on serving, ending only when the worker stops it."""

    async def body(source):
        await source.fetch("all-r4")
        child = source._process._child
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(child.proc.pid, sig)
        await asyncio.sleep(0.3)
        assert child.alive and child.proc.poll() is None
        got = await source.fetch("mlp-rs16")
        assert source._process._child is child  # the same process served it
        return got, child

    got, child = run(_with_source(lora_store.address, body))
    assert got.rank == 16 and child.proc.poll() is not None  # closing the source ended it


def test_a_fetch_killed_midway_fails_as_unavailable(lora_store):
    async def body(source):
        source.start()
        child = source._process._child
        os.kill(child.proc.pid, signal.SIGSTOP)  # the fetch cannot finish before the kill
        pending = asyncio.ensure_future(source.fetch("patterned"))
        while not child.pending:
            await asyncio.sleep(0)
        os.kill(child.proc.pid, signal.SIGKILL)
        with pytest.raises(DependencyUnavailable, match="ended"):
            await pending
        return await source.fetch("patterned")  # a new process

    assert run(_with_source(lora_store.address, body)).adapter_id == "patterned"


def test_a_stuck_process_is_ended_and_replaced(lora_store):
    async def body(source):
        await source.fetch("all-r4")
        process = source._process
        process.answer_limit_s = 1.0
        child = process._child
        os.kill(child.proc.pid, signal.SIGSTOP)  # neither dead nor answering
        t0 = time.monotonic()
        with pytest.raises(DependencyUnavailable, match="did not answer"):
            await source.fetch("qv-r8")
        waited = time.monotonic() - t0
        got = await source.fetch("qv-r8")  # a new process
        assert process._child is not child and child.proc.poll() is not None
        return waited, got

    waited, got = run(_with_source(lora_store.address, body))
    assert waited < 10 and got.rank == 8


def test_cancelled_fetches_give_their_segments_back(lora_store):
    async def body(source):
        for _ in range(12):  # twice the segments the process may keep: each must come back
            task = asyncio.ensure_future(source.fetch("all-r4"))
            await asyncio.sleep(0.005)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await source.fetch("all-r4")
        await asyncio.sleep(0.2)  # late answers release their segments
        process = source._process
        return len(_segments(source)), process._config["max_fetches"]

    count, workers = run(_with_source(lora_store.address, body))
    assert count <= workers + 2


def test_a_segment_gone_before_its_copy_fails_as_unavailable_and_goes_back(lora_store):
    """A segment that went before the worker copied its payload out fails that fetch as the store
    being unreachable, its segment goes back to the process, and the next fetch of the same
    adapter succeeds."""

    async def body(source):
        source.start()
        process = source._process
        real = process._copy_out

        def gone(segment, nbytes):
            process._copy_out = real  # once
            raise FileNotFoundError(f"segment {segment} removed (test)")

        process._copy_out = gone
        with pytest.raises(DependencyUnavailable, match="shared memory went away"):
            await source.fetch("all-r4")
        got = await source.fetch("all-r4")
        return got, _segments(source)

    got, segments = run(_with_source(lora_store.address, body))
    assert got.adapter_id == "all-r4" and got.rank == 4
    assert len(segments) == 1  # the failed fetch's segment was given back and reused


def test_no_shared_memory_left_falls_back_to_in_process(lora_store):
    async def body(source):
        source.start()
        directory = source._process._directory
        directory.rmdir()
        directory.write_bytes(b"")  # no segment can be made there (as with a full /dev/shm)
        try:
            got = await source.fetch("attn-l1-r2")
        finally:
            directory.unlink()
            directory.mkdir()
        return got, _segments(source)

    got, segments = run(_with_source(lora_store.address, body))
    assert got.adapter_id == "attn-l1-r2" and got.rank == 2
    assert segments == []


def test_close_removes_the_shared_memory(lora_store):
    async def body(source):
        await source.fetch("all-r4")
        return source._process._directory, source._process._child.proc

    directory, proc = run(_with_source(lora_store.address, body))
    assert not directory.exists()
    assert proc.poll() is not None


def test_fetches_at_once_use_connections_of_their_own(lora_store, caplog):
    """Each fetch thread of the process has a connection to the store of its own (one connection's
    bytes are worked on one thread at a time): fetches that overlap reach the store from more than
    one peer, and never from more than the process has threads (each thread keeps its one)."""
    names = ["all-r4", "qv-r8", "mlp-rs16", "patterned"] * 3

    async def body(source):
        await source.fetch("all-r4")  # the process is up before the fetches that overlap
        caplog.clear()
        return await asyncio.gather(*(source.fetch(n) for n in names))

    with caplog.at_level("INFO", logger="loraserve.access"):
        got = run(_with_source(lora_store.address, body, max_fetches=3))
    assert [g.adapter_id for g in got] == names
    peers = [
        r.fields["peer"]  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "loraserve.access" and r.fields["method"] == "FetchAdapter"  # type: ignore[attr-defined]
    ]
    # as many peers as threads took fetches: more than one (the fetches overlap), at most three
    assert len(peers) == len(names) and 2 <= len(set(peers)) <= 3, peers


@pytest.mark.parametrize("in_process", [False, True])
def test_a_store_on_this_host_hands_payloads_over_as_files(
    tiny_model_dir, lora_adapter_root, lora_store, tmp_path, in_process
):
    """With the store's hand-over directory, the fetch process (and the worker's own fetch) read
    the payload from its file: the same payload as a stream, marked as handed over; a directory
    that is not the store's is streamed, marked as missed."""
    from tests.helpers.lora_store import start_lora_store

    shared = tmp_path / "handover"
    handle = start_lora_store(tiny_model_dir, lora_adapter_root, tmp_path / "store", handover_dir=str(shared))
    handle.register("all-r4", "all-r4")

    async def body(source):
        fetch = (lambda a: source._fetch_here(a, "", None)) if in_process else source.fetch
        return await fetch("all-r4"), await fetch("all-r4")

    try:
        reference = run(_with_source(lora_store.address, lambda s: s.fetch("all-r4")))
        first, second = run(_with_source(handle.address, body, handover_dir=str(shared)))
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        missed, _ = run(_with_source(handle.address, body, handover_dir=str(elsewhere)))
    finally:
        handle.store.stop()
    assert reference.transport == "stream"
    assert (first.transport, second.transport, missed.transport) == ("file", "file", "missed")
    for got in (first, second, missed):
        assert (got.digest, got.tensors) == (reference.digest, reference.tensors)
        assert torch.equal(got.data, reference.data)
