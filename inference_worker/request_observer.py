"""What one Generate call records besides its answer: its use of the adapter (the per-adapter
metrics' ranking), the access-log fields (request id, adapter,
tokens in and out, queue time, TTFT) and, while tracing is on, the request's phases as spans
under the call's server span.

The engine times each request on its step thread (arrival, admission, first token, end: the
`Usage` it reports); the phases are recorded from those times once the request ends, so the
step loop does no tracing work. Queue = arrival -> admitted into the running batch (adapter
loads happen meanwhile, as their own spans), prefill = admitted -> first token, decode = first
token -> end.
"""

from __future__ import annotations

from loraserve.contract.usage import Usage
from loraserve.inference_worker.adapters.usage_metrics import AdapterUsageMetrics
from loraserve.inference_worker.engine.sequence import Sequence
from loraserve.serving import tracing
from loraserve.serving.access_log import note


class RequestObserver:
    def __init__(self, request_id: str, adapter_id: str, per_adapter: AdapterUsageMetrics) -> None:
        if adapter_id:
            per_adapter.arrived(adapter_id)
        self.context = tracing.current_context()  # the call's server span (None while off)
        self.adapter_id = adapter_id
        self._arrival_ns = 0
        note(request_id=request_id, adapter=adapter_id)

    def submitted(self, seq: Sequence) -> None:
        """The request's sequences carry its trace context to the step thread (adapter loads)."""
        if self.context is None:
            return
        self._arrival_ns = tracing.wall_ns(seq.arrival_time)
        for s in seq.group.seqs if seq.group is not None else (seq,):
            s.trace_context = self.context

    def finished(self, usage: Usage, adapter_digest: str) -> None:
        timings = {
            "queue_ms": round(usage.queue_time_ms, 3),
            "ttft_ms": round(usage.time_to_first_token_ms, 3),
            "engine_ms": round(usage.total_time_ms, 3),
        }
        note(tokens_in=usage.prompt_tokens, tokens_out=usage.completion_tokens, **timings)
        if self.context is None:
            return
        tracing.annotate(
            {
                "loraserve.adapter.id": self.adapter_id,
                "loraserve.adapter.digest": adapter_digest,
                "loraserve.tokens_in": usage.prompt_tokens,
                "loraserve.tokens_out": usage.completion_tokens,
                **{f"loraserve.{k}": v for k, v in timings.items()},
            }
        )
        t0, ms = self._arrival_ns, 1_000_000
        queued = t0 + int(usage.queue_time_ms * ms)
        first = max(queued, t0 + int(usage.time_to_first_token_ms * ms))
        end = max(first, t0 + int(usage.total_time_ms * ms))
        phases = [("worker.queue", t0, queued), ("worker.prefill", queued, first)]
        if usage.completion_tokens:
            phases.append(("worker.decode", first, end))
        for name, start, stop in phases:
            tracing.record_span(name, start, stop, {"loraserve.duration_ms": (stop - start) / ms})
