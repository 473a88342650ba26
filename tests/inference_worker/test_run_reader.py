"""RunReader: what queued behind an item and may follow it comes out merged with it, in order;
the first that may not is held and comes next; an item that nothing can join comes out as it is,
without a run being built."""

from __future__ import annotations

import asyncio

from loraserve.inference_worker.run_reader import RunReader


def read_all(items: list[int], n: int) -> tuple[list[int], list[list[int]]]:
    """`n` reads over `items` queued at once, where an item may follow one of the same parity;
    -> what came out, and the runs that were merged."""
    runs: list[list[int]] = []

    def merged(run: list[int]) -> int:
        runs.append(list(run))
        return sum(run)

    async def go() -> list[int]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        reader = RunReader(queue, lambda a, b: a % 2 == b % 2, merged)
        return [await reader.next() for _ in range(n)]

    return asyncio.run(go()), runs


def test_queued_items_that_follow_one_another_come_out_as_one() -> None:
    got, runs = read_all([2, 4, 6, 1, 3, 8], 3)
    assert got == [12, 4, 8] and runs == [[2, 4, 6], [1, 3]]


def test_an_item_nothing_joins_is_never_merged() -> None:
    got, runs = read_all([2, 1, 4], 3)
    assert got == [2, 1, 4] and runs == []  # each followed by one it may not merge with, or nothing


def test_the_reader_waits_for_the_next_item() -> None:
    async def go() -> list[int]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        reader = RunReader(queue, lambda a, b: True, sum)
        queue.put_nowait(5)
        got = [await reader.next()]
        waiting = asyncio.ensure_future(reader.next())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        queue.put_nowait(6)
        queue.put_nowait(7)
        got.append(await waiting)
        return got

    assert asyncio.run(go()) == [5, 13]
