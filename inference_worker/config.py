"""The worker's one configuration object, filled from `loraserve worker --flags` and LORASERVE_* variables.

Every field `name` has a flag `--name` (dashes) and a variable `LORASERVE_NAME`; a flag beats the
variable, the variable beats the default. Invariants are checked at construction.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraserve.contract.streaming import MAX_STREAM_INTERVAL
from loraserve.serving.gc_tuning import DEFAULT_GEN0_THRESHOLD
from loraserve.serving.settings import SERVER_HELP, config_from_args

DTYPES = ("auto", "float32", "bfloat16", "float16")

_HELP = {
    **SERVER_HELP,
    "model": "Hugging Face model directory (config.json, *.safetensors, tokenizer.json)",
    "device": "cpu, cuda, cuda:N or auto (cuda when available)",
    "dtype": "compute dtype; auto = bfloat16 on CUDA, float32 on CPU; keep it the store's serving dtype",
    "max_num_seqs": "largest running batch",
    "max_model_len": "largest prompt plus completion (0 = the model's max_position_embeddings, at most 8192)",
    "max_num_batched_tokens": "token budget of one step; longer prompts are prefilled in chunks",
    "max_prompt_chars": "largest prompt (or conversation) in characters, refused before tokenizing "
    "(0 = 8 per token of max_model_len)",
    "block_size": "tokens per KV cache block",
    "kv_cache_mb": "KV cache budget in MiB (0 = auto: 256 MiB on CPU, 85%% of free memory on CUDA)",
    "num_kv_blocks": "exact number of KV blocks (overrides kv_cache_mb)",
    "max_queue_size": "waiting requests before RESOURCE_EXHAUSTED",
    "default_max_tokens": "max_tokens when a request leaves it 0 (unless it asks for what the context "
    "leaves: SamplingParams.fill_context, the OpenAI gateway's chat without max_tokens)",
    "cuda_graphs": "capture CUDA graphs for decode steps",
    "kernel_warmup": "compile every kernel variant a step can launch before serving (CUDA; cached on "
    "disk by Triton, so a restart is quick)",
    "async_scheduling": "plan and launch the next step while the device runs the current one, "
    "reading its tokens back after (CUDA, not with tensor parallelism)",
    "stream_interval": "a running request's tokens are sent every this many steps (its first token "
    "and its end at once); more sends fewer messages per token when the server is the bottleneck "
    f"(a request's own stream_interval, when it sets one, is used instead); 1 to {MAX_STREAM_INTERVAL}",
    "gc_threshold": "allocations between collections of Python's youngest garbage-collector generation "
    "(Python's own default is 700); what is alive once the worker is up is frozen out of collection",
    "switch_interval_ms": "Python's thread switch interval: how long the gRPC event loop may keep the "
    "interpreter before the step thread gets it back (Python's own default is 5)",
    "stream_process": "serve clients from a front process of the worker's: generations reach it over a "
    "local socket a step's worth at a time, so sending their token streams does not compete with "
    "the engine for this process's interpreter; other calls pass through it unchanged",
    "stream_processes": "front processes (with stream_process): each sends the token streams of the "
    "clients' connections the kernel gives it (they share the port); more when one front process, "
    "at a core of its own, is what limits the worker's streamed tokens a second",
    "tensor_parallel_size": "ranks (one process and GPU each) the model is sharded over; rank 0 serves "
    "and starts the others (1 = one process)",
    "tensor_parallel_timeout_s": "seconds a rank waits for another inside a step before the worker "
    "gives up and exits (a rank that dies is noticed at once; this bounds a rank that hangs)",
    "max_loras": "GPU adapter slots",
    "slot_copy_stream": "upload adapters into GPU slots on a copy stream of their own, beside the steps "
    "already queued (CUDA); off, each upload waits for them and the next step for it",
    "max_cpu_loras": "adapters kept in the CPU cache",
    "max_lora_rank": "largest adapter rank accepted",
    "max_cpu_lora_mb": "CPU cache budget for adapter payloads, in MiB",
    "adapter_lookahead": "waiting requests whose adapters are fetched ahead of their turn (0 = off; "
    "at most half the CPU cache)",
    "adapter_prefetch": "adapters fetched per coordination round from the fleet's most popular that "
    "complementary placement gives this worker, in place of colder CPU cache entries (0 = off)",
    "popularity_half_life_s": "how fast an adapter's request count fades: it halves every this many "
    "seconds without requests. The fleet ranks adapters for prefetch by these counts; they tell the "
    "head of the adapter set from its tail only when the adapters near the CPU tiers' edge have been "
    "asked for a few times within it, so fleets with little traffic want it longer",
    "adapter_poll_interval_s": "seconds between checks of the store for re-registered or deleted adapters",
    "store_address": "adapter store address host:port (adapters disabled when empty)",
    "preload_adapters": "adapters loaded before the worker serves, comma-separated, or * for every "
    "adapter the store lists: fetched into the CPU tier and copied into GPU slots while slots are free, "
    "never evicting; one that fails is logged and skipped",
    "preload_timeout_s": "seconds preloading may take; the worker then serves with what is loaded",
    "max_fetches": "adapter fetches from the store that run at once (the worker's fetch threads; "
    "look-ahead starts no more); each holds one adapter's payload in flight",
    "fetch_process": "receive adapters from the store in a child process, handed over through shared "
    "memory (/dev/shm; in the worker's own process where there is none)",
    "store_handover_dir": "the adapter store's --handover-dir as this worker sees it, when both run on one host "
    "(a shared tmpfs): payloads come as files written there instead of gRPC streams (a file this worker "
    "cannot read is streamed)",
    "store_timeout_s": "seconds one attempt of an adapter fetch or store listing may take before it is retried",
    "store_token": "bearer token sent to the store",
    "store_tls_ca": "PEM CA bundle to verify the store's TLS certificate",
    "redis_url": "Redis URL for coordination (in-process coordination when empty)",
    "redis_prefix": "prefix of every Redis key",
    "worker_id": "stable id of this worker (default: hostname-port)",
    "advertise_address": "address other services reach this worker at (default host:port)",
    "generate_token": "bearer token required by Generate/GenerateStream",
    "admin_token": "bearer token required by LoadAdapter/UnloadAdapter/PinAdapter",
    "metrics_top_adapters": "adapters with their own label in the per-adapter metrics (the most used; "
    'the rest are counted as adapter="other")',
    "grace_period_s": "seconds running generations get to finish on SIGTERM",
}


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 50052
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_model_len: int = 0
    max_num_batched_tokens: int = 512
    max_prompt_chars: int = 0
    block_size: int = 16
    kv_cache_mb: int = 0
    num_kv_blocks: int = 0
    max_queue_size: int = 256
    default_max_tokens: int = 16
    cuda_graphs: bool = True
    kernel_warmup: bool = True
    async_scheduling: bool = True
    switch_interval_ms: float = 0.5
    gc_threshold: int = DEFAULT_GEN0_THRESHOLD
    stream_interval: int = 1
    stream_process: bool = True
    stream_processes: int = 1
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 300.0
    max_loras: int = 4
    slot_copy_stream: bool = True
    max_cpu_loras: int = 16
    max_lora_rank: int = 64
    max_cpu_lora_mb: int = 8192
    adapter_lookahead: int = 16
    adapter_prefetch: int = 8
    popularity_half_life_s: float = 300.0
    adapter_poll_interval_s: float = 2.0
    store_address: str = ""
    max_fetches: int = 4
    preload_adapters: str = ""
    preload_timeout_s: float = 300.0
    fetch_process: bool = True
    store_handover_dir: str | None = None
    store_timeout_s: float = 60.0
    store_token: str | None = field(default=None, repr=False)
    store_tls_ca: str | None = None
    redis_url: str | None = None
    redis_prefix: str = "loraserve:"
    worker_id: str = ""
    advertise_address: str = ""
    generate_token: str | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    metrics_port: int | None = None
    otlp_endpoint: str = ""
    metrics_top_adapters: int = 20
    grace_period_s: float = 30.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        problems = []
        if not self.model:
            problems.append("model is required (a Hugging Face model directory)")
        for name in ("port", "metrics_port"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 65535:
                problems.append(f"{name} {v} is out of range")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_queue_size",
            "default_max_tokens",
            "max_loras",
            "max_cpu_loras",
            "max_lora_rank",
            "max_cpu_lora_mb",
            "tensor_parallel_size",
            "gc_threshold",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be positive")
        for name in (
            "max_model_len",
            "max_prompt_chars",
            "kv_cache_mb",
            "num_kv_blocks",
            "adapter_lookahead",
            "adapter_prefetch",
        ):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            # a request's own stream_interval has the same bound
            problems.append(f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}]")
        if not 1 <= self.stream_processes <= 64:
            problems.append("stream_processes must be in [1, 64]")
        elif self.stream_processes > 1 and not self.stream_process:
            problems.append("stream_processes > 1 needs stream_process (the front processes)")
        if not 1 <= self.max_fetches <= 64:
            problems.append("max_fetches must be in [1, 64]")
        if self.preload_adapters.strip():
            from loraserve.inference_worker.adapters.preload import parse_preload

            if not self.store_address:
                problems.append("preload_adapters needs an adapter store (store_address)")
            try:
                parse_preload(self.preload_adapters)
            except ValueError as exc:
                problems.append(str(exc))
        if not self.preload_timeout_s > 0:
            problems.append("preload_timeout_s must be > 0")
        if not 0 < self.store_timeout_s <= 3600:
            problems.append("store_timeout_s must be in (0, 3600]")
        if not 0.05 <= self.switch_interval_ms <= 100:
            problems.append("switch_interval_ms must be within [0.05, 100]")
        if self.block_size not in (8, 16, 32, 64, 128):
            problems.append("block_size must be one of 8, 16, 32, 64, 128")
        if self.max_num_batched_tokens < self.max_num_seqs:
            problems.append("max_num_batched_tokens must be >= max_num_seqs (every running sequence decodes)")
        if self.max_cpu_loras < self.max_loras:
            problems.append(
                "max_cpu_loras must be >= max_loras (every GPU-resident adapter is in the CPU cache)"
            )
        if self.max_lora_rank > 512:
            problems.append("max_lora_rank must be <= 512")
        if self.num_kv_blocks == 1:
            problems.append("num_kv_blocks must be 0 (auto) or >= 2")
        if self.grace_period_s < 0:
            problems.append("grace_period_s must be >= 0")
        if not 1 <= self.metrics_top_adapters <= 1000:
            problems.append("metrics_top_adapters must be in [1, 1000]")
        if self.adapter_poll_interval_s <= 0:
            problems.append("adapter_poll_interval_s must be > 0")
        if not self.popularity_half_life_s > 0:
            problems.append("popularity_half_life_s must be > 0")
        if self.tensor_parallel_timeout_s <= 0:
            problems.append("tensor_parallel_timeout_s must be > 0")
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            problems.append(
                "with tensor_parallel_size > 1 the device is cpu, cuda or auto (rank r uses cuda:r)"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("tls_cert and tls_key go together")
        if problems:
            raise ValueError("invalid worker configuration: " + "; ".join(problems))

    def replace(self, **changes: Any) -> WorkerConfig:
        return dataclasses.replace(self, **changes)

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{self.port}"

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> WorkerConfig:
        return config_from_args(
            cls,
            argv,
            env,
            prog="loraserve worker",
            description="Run an inference worker.",
            help=_HELP,
            required=("model",),
            choices={"dtype": DTYPES},
        )
