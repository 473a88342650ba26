"""Prometheus metrics of one worker, in their own registry (several workers may share a process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from loraserve.inference_worker.adapters.usage_metrics import AdapterUsageMetrics
from loraserve.inference_worker.engine.scheduler import ADMISSION_OUTCOMES, AdmissionOutcome
from loraserve.serving.gc_tuning import GCPauses

if TYPE_CHECKING:
    from loraserve.contract.usage import Usage
    from loraserve.inference_worker.engine.engine import LLMEngine


class WorkerMetrics:
    def __init__(self, engine: LLMEngine, top_adapters: int = 20) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.per_adapter = AdapterUsageMetrics(r, top_adapters)
        self.requests = Counter(
            "loraserve_worker_requests",
            "Generate requests by method and status code",
            ["method", "code"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "loraserve_worker_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generated_tokens = Counter("loraserve_worker_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "loraserve_worker_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.queue_time = Histogram(
            "loraserve_worker_queue_time_seconds",
            "Arrival to admission",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=r,
        )
        Gauge("loraserve_worker_queue_depth", "Requests waiting for admission", registry=r).set_function(
            lambda: engine.num_waiting
        )
        Gauge(
            "loraserve_worker_running_sequences", "Sequences in the running batch", registry=r
        ).set_function(lambda: engine.num_running)
        Gauge("loraserve_worker_kv_free_blocks", "Free KV cache blocks", registry=r).set_function(
            lambda: engine.num_free_blocks
        )
        # each engine step that ran the model: its wall time (scheduling to sampled tokens), and the
        # sequences and tokens it carried (how full the running batch was kept)
        self.step_seconds = Histogram(
            "loraserve_worker_step_seconds",
            "Wall time of an engine step, by kind (prefill: a prefill chunk in the step)",
            ["kind"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
            registry=r,
        )
        self.step_sequences = Histogram(
            "loraserve_worker_step_sequences",
            "Sequences in an engine step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.step_adapters = Histogram(
            "loraserve_worker_step_adapters",
            "Distinct adapters (GPU slots) among the rows of an engine step: the LoRA kernels' work "
            "grows with them",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.step_tokens = Histogram(
            "loraserve_worker_step_tokens",
            "Tokens in an engine step",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384),
            registry=r,
        )
        self._step_kinds = {k: self.step_seconds.labels(k) for k in ("prefill", "decode")}
        # a step below max_num_seqs with requests waiting says here what held them back
        admissions = Counter(
            "loraserve_worker_step_admissions",
            "Engine steps that ran, by what ended their admission pass: queue_empty (nothing left to "
            "admit), max_num_seqs, token_budget, kv_memory, adapter_wait (adapters not resident yet), "
            "pending_token, preempted",
            ["outcome"],
            registry=r,
        )
        self._admissions = {o: admissions.labels(o) for o in ADMISSION_OUTCOMES}
        # the process's garbage collections: none of its threads runs Python while one does
        self.gc_pause = Histogram(
            "loraserve_worker_gc_pause_seconds",
            "Duration of a garbage collection of the worker's process, by generation",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.gc_cpu = Histogram(
            "loraserve_worker_gc_cpu_seconds",
            "CPU time of the thread that ran a garbage collection, by generation: what the collection "
            "itself cost. The pause can be longer: it also counts another thread that took the "
            "interpreter before the collection's end was timed (loraserve/serving/gc_tuning.py)",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        by_gen = [self.gc_pause.labels(str(g)) for g in range(3)]
        cpu_by_gen = [self.gc_cpu.labels(str(g)) for g in range(3)]
        self._gc = GCPauses(
            lambda gen, seconds: by_gen[gen].observe(seconds),
            lambda gen, seconds: cpu_by_gen[gen].observe(seconds),
        )
        engine.step_observer = self.observe_step
        # host or device bound (CUDA): how long the step thread waited for steps' tokens, and the
        # device time of one step in 16 (engine/device_timing.py)
        self.device_wait = Counter(
            "loraserve_worker_device_wait_seconds",
            "Time the engine's step thread waited for the device to finish steps",
            registry=r,
        )
        self.step_device_seconds = Histogram(
            "loraserve_worker_step_device_seconds",
            "Device time of sampled engine steps, first launch to sampled tokens on the host",
            buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512),
            registry=r,
        )
        engine.timing.observer = self.observe_device
        self._server: Any = None  # prometheus_client's WSGIServer once serving

    def count_request(self, method: str, code: str, adapter_id: str = "") -> None:
        self.requests.labels(method, code).inc()
        if adapter_id:
            self.per_adapter.observe_request(adapter_id, code)

    def observe_finished(self, usage: Usage, adapter_id: str = "") -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generated_tokens.inc(usage.completion_tokens)
        if adapter_id:
            self.per_adapter.observe_tokens(adapter_id, usage.prompt_tokens, usage.completion_tokens)
        if usage.completion_tokens:
            self.ttft.observe(usage.time_to_first_token_ms / 1e3)
        self.queue_time.observe(usage.queue_time_ms / 1e3)

    def observe_step(
        self,
        kind: str,
        seconds: float,
        sequences: int,
        tokens: int,
        admission: AdmissionOutcome,
        adapters: int = 0,
    ) -> None:
        self._step_kinds[kind].observe(seconds)
        self._admissions[admission].inc()
        self.step_sequences.observe(sequences)
        self.step_adapters.observe(adapters)
        self.step_tokens.observe(tokens)

    def observe_device(self, waited: float, span: float | None) -> None:
        if waited:
            self.device_wait.inc(waited)
        if span is not None:
            self.step_device_seconds.observe(span)

    def serve(self, host: str, port: int) -> int:
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        self._gc.close()
        if self._server is not None:
            self._server.shutdown()
            self._server = None
