"""Token counts and latencies of one finished request: what the engine measures, the worker
sends as `worker_pb2.Usage` and the clients hand back; one type on both sides of the wire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraserve.v1 import worker_pb2


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    queue_time_ms: float  # arrival -> admitted into the running batch
    time_to_first_token_ms: float  # arrival -> first generated token
    total_time_ms: float  # arrival -> finished
    adapter_tier: str = ""  # where the adapter was at arrival: gpu, cpu, store; "" = base model

    @classmethod
    def from_pb(cls, u: worker_pb2.Usage) -> Usage:
        return cls(
            u.prompt_tokens,
            u.completion_tokens,
            u.queue_time_ms,
            u.time_to_first_token_ms,
            u.total_time_ms,
            u.adapter_tier,
        )

    def to_pb(self) -> worker_pb2.Usage:
        from loraserve.v1 import worker_pb2  # the engine builds Usage without the stubs

        return worker_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            queue_time_ms=self.queue_time_ms,
            time_to_first_token_ms=self.time_to_first_token_ms,
            total_time_ms=self.total_time_ms,
            adapter_tier=self.adapter_tier,
        )
