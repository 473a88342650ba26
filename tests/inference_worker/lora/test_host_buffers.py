"""The host buffer pool: a payload's buffer is reused once the payload is gone and every read
recorded on it completed; idle bytes stay bounded; takes from many threads stay consistent."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from loraserve.inference_worker.lora.host_buffers import MIB, HostBufferPool, size_class


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class Owner:
    pass


@pytest.mark.parametrize(
    "nbytes,cls",
    [(1, 1), (1000, 1024), (MIB - 1, MIB), (MIB, MIB), (MIB + 1, 2 * MIB), (5 * MIB + 7, 6 * MIB)],
)
def test_size_classes(nbytes, cls) -> None:
    assert size_class(nbytes) == cls


def test_a_buffer_comes_back_when_its_owner_is_gone() -> None:
    counted: list[str] = []
    pool = HostBufferPool(64 * MIB, pin=False, count=counted.append)
    data = pool.take(3 * MIB + 5)
    assert data.numel() == 3 * MIB + 5 and data.dtype == torch.uint8
    owner = Owner()
    pool.adopt(owner, data, [])
    ptr = data.data_ptr()
    del data
    assert pool.take(3 * MIB).data_ptr() != ptr  # the owner still holds it: a new buffer
    del owner
    gc.collect()
    assert pool.idle_bytes == 4 * MIB
    again = pool.take(3 * MIB + 100)  # same class
    assert again.data_ptr() == ptr and pool.idle_bytes == 0
    assert counted == ["miss", "miss", "hit"] and (pool.num_hits, pool.num_misses) == (1, 2)


def test_a_buffer_with_a_read_in_flight_is_not_reused() -> None:
    pool = HostBufferPool(64 * MIB, pin=False)
    data = pool.take(MIB)
    ptr = data.data_ptr()
    event = FakeEvent()
    pool.give_back(data, [event])
    del data
    assert pool.take(MIB).data_ptr() != ptr  # the copy from it has not completed
    event.done = True
    assert pool.take(MIB).data_ptr() == ptr


def test_idle_bytes_are_bounded() -> None:
    pool = HostBufferPool(3 * MIB, pin=False)
    bufs = [pool.take(MIB) for _ in range(5)]
    for b in bufs:
        pool.give_back(b)
    assert pool.idle_bytes == 3 * MIB
    pool.give_back(torch.empty(MIB, dtype=torch.uint8))  # full: dropped
    assert pool.idle_bytes == 3 * MIB
    pool.clear()
    assert pool.idle_bytes == 0


def test_takes_and_returns_from_many_threads() -> None:
    pool = HostBufferPool(256 * MIB, pin=False)
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            for i in range(200):
                n = (seed * 7 + i) % 3 * MIB + MIB
                data = pool.take(n)
                data.fill_(seed)  # no buffer is handed to two threads at once
                assert bool((data == seed).all())
                pool.give_back(data)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.num_hits + pool.num_misses == 1600 and pool.num_misses <= 8 * 3
