"""Builds the engine a worker configuration describes: device and dtype, the model, and a KV cache
sized from the memory budget. No gRPC here (usable on machines without the service stack)."""

from __future__ import annotations

import logging

import torch

from clients.payload import TORCH_DTYPES
from inference_worker.config import WorkerConfig
from inference_worker.engine.engine import EngineConfig, LLMEngine
from inference_worker.engine.model_runner import kv_bytes_per_block
from inference_worker.model.config import ModelConfigError
from inference_worker.model.loader import load_model, load_tokenizer

log = logging.getLogger("loraserve.worker")


def resolve_device(config: WorkerConfig) -> tuple[torch.device, torch.dtype]:
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelConfigError(f"device {config.device} requested but CUDA is not available")
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = TORCH_DTYPES[config.dtype]
    return device, dtype


def build_engine(config: WorkerConfig) -> LLMEngine:
    """Load the model and size the KV cache; every problem is a ModelConfigError at start-up."""
    device, dtype = resolve_device(config)
    model = load_model(config.model, dtype, device)
    tokenizer = load_tokenizer(config.model)
    max_len = config.max_model_len or min(model.config.max_position_embeddings, 8192)
    window = model.config.sliding_window
    if window is not None and max_len > window:
        # attention here is full, which equals sliding-window attention only up to the window
        if config.max_model_len:
            raise ModelConfigError(f"max_model_len {max_len} exceeds the model's sliding_window {window}; "
                                   "sliding-window attention is not supported")
        max_len = window
    if max_len > model.config.max_position_embeddings:
        raise ModelConfigError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                               f"{model.config.max_position_embeddings}")
    per_block = kv_bytes_per_block(model, config.block_size)
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    else:
        if config.kv_cache_mb:
            budget = config.kv_cache_mb << 20
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.85)
            if config.store_address:  # leave room for the adapter slot buffers, allocated after
                from inference_worker.lora.slots import LoRASlots

                budget -= LoRASlots.bytes_needed(model.config.raw, config.max_loras, config.max_lora_rank, dtype)
        else:
            budget = 256 << 20
        num_blocks = budget // per_block
    if num_blocks < 2:
        raise ModelConfigError(f"the KV cache budget holds {num_blocks} blocks of {per_block} bytes; need >= 2")
    engine_config = EngineConfig(
        max_num_seqs=config.max_num_seqs, max_model_len=max_len,
        max_num_batched_tokens=config.max_num_batched_tokens, block_size=config.block_size,
        num_blocks=num_blocks, max_queue_size=config.max_queue_size,
        default_max_tokens=config.default_max_tokens, use_cuda_graphs=config.cuda_graphs)
    log.info("model %s on %s (%s): %d KV blocks of %d tokens", model.config.name, device, dtype, num_blocks,
             config.block_size)
    return LLMEngine(model, tokenizer, engine_config)
