"""A load-generator target in memory, importable by the generator's own processes (a test's
module-level class would drag the test module into each of them)."""

from __future__ import annotations

import asyncio
import os

from loraserve.clients.bench.targets import Chunk, TargetError
from loraserve.clients.bench.workload import BenchRequest


class EchoTarget:
    """Streams `max_tokens` one-token chunks after `delay_s`; every `fail_every`-th request index
    fails with UNAVAILABLE. Each chunk names the process that served it (as `worker`)."""

    description = "echo"

    def __init__(self, fail_every: int = 0, delay_s: float = 0.01) -> None:
        self.fail_every, self.delay_s = fail_every, delay_s

    async def start(self) -> None: ...

    async def vocab_size(self) -> int | None:
        return 10

    async def stream(self, request: BenchRequest):
        await asyncio.sleep(self.delay_s)
        if self.fail_every and request.index % self.fail_every == 0:
            raise TargetError("UNAVAILABLE", "draining")
        for _ in range(request.max_tokens):
            yield Chunk(1, worker=str(os.getpid()))
            await asyncio.sleep(0)

    async def close(self) -> None: ...


class UnreachableTarget(EchoTarget):
    async def start(self) -> None:
        raise TargetError("UNAVAILABLE", "no such worker")


class FirstFails(EchoTarget):
    """The first process to start one fails (it creates `marker`); the others start normally."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    async def start(self) -> None:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        raise TargetError("UNAVAILABLE", "no such worker")
