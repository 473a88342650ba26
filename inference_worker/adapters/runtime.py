"""Builds the worker's adapter manager from its configuration (called by the server when an
adapter store is configured): slot buffers sized by max_loras x max_lora_rank on the model's
device, the store as the source, Redis coordination when a Redis URL is configured (else
in-process), LoRA layers attached to the model."""

from __future__ import annotations

import socket

from inference_worker.adapters.store_source import StoreSource
from inference_worker.adapters.worker_adapters import WorkerAdapters
from inference_worker.config import WorkerConfig
from inference_worker.coordination import Coordinator, InProcessCoordinator
from inference_worker.engine.engine import LLMEngine


def create_adapter_manager(config: WorkerConfig, engine: LLMEngine) -> WorkerAdapters:
    model = engine.model
    tls_ca = None
    if config.store_tls_ca:
        with open(config.store_tls_ca, "rb") as f:
            tls_ca = f.read()
    source = StoreSource(config.store_address, token=config.store_token or "", tls_root_cert=tls_ca)
    coordinator: Coordinator
    if config.redis_url:
        from inference_worker.coordination.redis_coordinator import RedisCoordinator

        coordinator = RedisCoordinator(config.redis_url, config.redis_prefix)
    else:
        coordinator = InProcessCoordinator()
    max_tokens = max(engine.config.max_num_batched_tokens, engine.config.max_num_seqs)
    adapters = WorkerAdapters.create(
        model.config.raw, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        max_cpu_bytes=config.max_cpu_lora_mb << 20,
        dtype=model.dtype, device=model.device, max_tokens=max_tokens, source=source,
        coordinator=coordinator, worker_id=config.resolved_worker_id, poll_interval_s=config.adapter_poll_interval_s,
        address=config.advertise_address or _default_address(config.host, config.port))
    adapters.attach_model(model)
    return adapters


def _default_address(host: str, port: int) -> str:
    """Where other services reach this worker when no advertise address is configured: a wildcard
    bind is reached through the machine's host name."""
    return f"{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:{port}"
