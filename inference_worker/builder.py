"""The worker's composition root: from one `WorkerConfig`, the model, then its adapters (when an
adapter store is configured: slot buffers, LoRA layers on the model, the store as the source,
Redis or in-process coordination), then the engine over both, with a KV cache sized from what
memory is left. Each part is built once here; nothing is installed into another afterwards.
No gRPC server here (the server binds its port first, so the worker id and address are known).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from loraserve.clients.cli_options import progress_bar
from loraserve.contract.payload import TORCH_DTYPES
from loraserve.inference_worker.adapters.fetcher import AdapterSource
from loraserve.inference_worker.adapters.pool import AdapterPool
from loraserve.inference_worker.adapters.store_source import StoreSource
from loraserve.inference_worker.adapters.worker_adapters import WorkerAdapters
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.coordination import Coordinator, InProcessCoordinator
from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.engine.model_runner import kv_bytes_per_block
from loraserve.inference_worker.lora.layer import worker_launch_options
from loraserve.inference_worker.lora.slots import LoRASlots
from loraserve.inference_worker.model.chat_template import ChatTemplate
from loraserve.inference_worker.model.config import ModelConfigError
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.inference_worker.model.loader import load_model, load_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from loraserve.inference_worker.parallel.group import TensorParallelGroup
    from loraserve.inference_worker.parallel.launcher import FollowerProcesses

log = logging.getLogger("loraserve.worker")


@dataclass
class Worker:
    engine: LLMEngine
    adapters: WorkerAdapters | None  # None: base model only (no adapter store configured)
    followers: FollowerProcesses | None = None  # the other tensor-parallel ranks (None: one process)


def build_worker(config: WorkerConfig, *, source: AdapterSource | None = None) -> Worker:
    """Model -> adapters -> engine. Adapters come with `config.store_address` (the store as their
    source) or an explicit `source`. Every configuration problem is a ModelConfigError.

    With tensor_parallel_size N > 1 this process is rank 0: it starts ranks 1..N-1 first
    (parallel/launcher.py), and the followers build their parts in this same order
    (parallel/follower.py)."""
    if config.tensor_parallel_size > 1:
        return _build_tensor_parallel(config, source)
    device, dtype = resolve_device(config)
    with progress_bar(f"loading {config.model}") as on_progress:  # a bar on a terminal only
        model = load_model(config.model, dtype, device, on_progress)
    if source is None and config.store_address:
        source = store_source(config)
    adapters = build_adapters(config, model, source) if source is not None else None
    engine_config = engine_config_for(config, model)
    tokenizer = load_tokenizer(config.model)
    chat = ChatTemplate.from_dir(config.model, tokenizer)
    return Worker(LLMEngine(model, tokenizer, engine_config, adapters, chat=chat), adapters)


def _build_tensor_parallel(config: WorkerConfig, source: AdapterSource | None) -> Worker:
    from loraserve.inference_worker.model.config import ModelConfig
    from loraserve.inference_worker.parallel.launcher import start_leader
    from loraserve.inference_worker.parallel.shard import check_tensor_parallel

    check_tensor_parallel(ModelConfig.from_dir(config.model), config.tensor_parallel_size)  # before spawning
    device, dtype = resolve_device(config)
    tp, followers = start_leader(config, device)
    try:
        with progress_bar(f"loading {config.model} (rank 0)") as on_progress:
            model = load_model(config.model, dtype, device, on_progress, tp=tp)
        if source is None and config.store_address:
            source = store_source(config)
        tokenizer = load_tokenizer(config.model)
        chat = ChatTemplate.from_dir(config.model, tokenizer)
        return build_leader(config, model, tokenizer, source, tp, followers, chat)
    except BaseException:
        followers.kill()
        tp.close()
        raise


def build_leader(
    config: WorkerConfig,
    model: LlamaModel,
    tokenizer: Tokenizer,
    source: AdapterSource | None,
    tp: TensorParallelGroup,
    followers: FollowerProcesses,
    chat: ChatTemplate | None = None,
) -> Worker:
    """Rank 0's adapters and engine over its shard of the model, with the set-up collectives in the
    order the followers run them (parallel/follower.py `build_runner`): whether adapters exist,
    then the KV block count (the least any rank has room for)."""
    from loraserve.inference_worker.parallel.leader import LeaderRunner, MirroredSlots

    tp.broadcast_int(int(source is not None))
    adapters = build_adapters(config, model, source, tp) if source is not None else None
    engine_config = engine_config_for(config, model)
    engine_config = replace(engine_config, num_blocks=tp.min_over_ranks(engine_config.num_blocks))
    slots = adapters.pool.slots if adapters is not None else None
    assert slots is None or isinstance(slots, MirroredSlots)
    runner_type = partial(LeaderRunner, tp, followers, slots)
    engine = LLMEngine(model, tokenizer, engine_config, adapters, chat=chat, runner_type=runner_type)
    return Worker(engine, adapters, followers)


def resolve_device(config: WorkerConfig, rank: int = 0) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of a rank (`rank` picks cuda:rank under tensor parallelism)."""
    tp = config.tensor_parallel_size
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelConfigError(f"device {config.device} requested but CUDA is not available")
    if tp > 1 and device.type == "cuda":
        if torch.cuda.device_count() < tp:
            raise ModelConfigError(
                f"tensor_parallel_size {tp} needs {tp} GPUs; {torch.cuda.device_count()} are visible"
            )
        device = torch.device("cuda", rank)
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = TORCH_DTYPES[config.dtype]
    return device, dtype


def store_source(config: WorkerConfig) -> StoreSource:
    tls_ca = None
    if config.store_tls_ca:
        with open(config.store_tls_ca, "rb") as f:
            tls_ca = f.read()
    return StoreSource(
        config.store_address,
        token=config.store_token or "",
        tls_root_cert=tls_ca,
        max_fetches=config.max_fetches,
        fetch_process=config.fetch_process,
        timeout_s=config.store_timeout_s,
        handover_dir=config.store_handover_dir or None,
    )


def build_adapters(
    config: WorkerConfig, model: LlamaModel, source: AdapterSource, tp: TensorParallelGroup | None = None
) -> WorkerAdapters:
    """Slot buffers sized max_loras x max_lora_rank on the model's device, LoRA layers attached to
    the model, launching the kernels with the device's options. With `tp`, rank 0's shard of the
    slots, whose changes are mirrored to the followers."""
    coordinator: Coordinator
    if config.redis_url:
        from loraserve.inference_worker.coordination.redis_coordinator import RedisCoordinator

        coordinator = RedisCoordinator(config.redis_url, config.redis_prefix)
    else:
        coordinator = InProcessCoordinator()
    if tp is None:
        slots = LoRASlots(
            model.config.raw,
            config.max_loras,
            config.max_lora_rank,
            model.dtype,
            model.device,
            copy_stream=config.slot_copy_stream,
        )
    else:
        from loraserve.inference_worker.parallel.leader import MirroredSlots

        slots = MirroredSlots(
            model.config.raw, config.max_loras, config.max_lora_rank, model.dtype, model.device, tp.shard
        )
    pool = AdapterPool(
        slots,
        source,
        coordinator,
        max_cpu_loras=config.max_cpu_loras,
        max_cpu_bytes=config.max_cpu_lora_mb << 20,
        worker_id=config.resolved_worker_id,
        popularity_half_life_s=config.popularity_half_life_s,
    )
    list_digests = source.digests if isinstance(source, StoreSource) else None
    adapters = WorkerAdapters(
        pool,
        coordinator,
        max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
        list_digests=list_digests,
        interval_s=config.adapter_poll_interval_s,
        lookahead=min(config.adapter_lookahead, config.max_cpu_loras // 2),
        prefetch=config.adapter_prefetch,
        max_fetches=getattr(source, "max_fetches", config.max_fetches),  # the fetch gate's size
        address=config.advertise_address or _default_address(config.host, config.port),
    )
    if tp is None:
        adapters.attach_to(model, worker_launch_options(model.device))
    else:
        from loraserve.inference_worker.lora.row_parallel import attach_sharded_lora

        attach_sharded_lora(model, slots, tp.all_reduce, worker_launch_options(model.device))
    return adapters


def engine_config_for(config: WorkerConfig, model: LlamaModel) -> EngineConfig:
    """The engine's limits; the KV cache takes what device memory is left once the model and the
    adapter slots are allocated."""
    max_len = config.max_model_len or min(model.config.max_position_embeddings, 8192)
    window = model.config.sliding_window
    if window is not None and max_len > window:
        # attention here is full, which equals sliding-window attention only up to the window
        if config.max_model_len:
            raise ModelConfigError(
                f"max_model_len {max_len} exceeds the model's sliding_window {window}; "
                "sliding-window attention is not supported"
            )
        max_len = window
    if max_len > model.config.max_position_embeddings:
        raise ModelConfigError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    per_block = kv_bytes_per_block(model, config.block_size)
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    else:
        if config.kv_cache_mb:
            budget = config.kv_cache_mb << 20
        elif model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            budget = int(free * 0.85)
        else:
            budget = 256 << 20
        num_blocks = budget // per_block
    if num_blocks < 2:
        raise ModelConfigError(
            f"the KV cache budget holds {num_blocks} blocks of {per_block} bytes; need >= 2"
        )
    log.info(
        "model %s on %s (%s): %d KV blocks of %d tokens",
        model.config.name,
        model.device,
        model.dtype,
        num_blocks,
        config.block_size,
    )
    return EngineConfig(
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        num_blocks=num_blocks,
        max_queue_size=config.max_queue_size,
        default_max_tokens=config.default_max_tokens,
        use_cuda_graphs=config.cuda_graphs,
        kernel_warmup=config.kernel_warmup,
        async_scheduling=None if config.async_scheduling else False,  # None: where it applies
        max_prompt_chars=config.max_prompt_chars,
        stream_interval=config.stream_interval,
    )


def _default_address(host: str, port: int) -> str:
    """Where other services reach this worker when no advertise address is configured: a wildcard
    bind is reached through the machine's host name."""
    return f"{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:{port}"
