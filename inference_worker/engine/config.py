"""The engine's limits and sizes (filled from the worker's config by the composition root)."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.inference_worker.engine.request_checks import CHARS_PER_TOKEN


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512  # token budget of one step; longer prompts are chunked
    block_size: int = 16
    num_blocks: int = 1024  # KV cache blocks (one is reserved)
    max_queue_size: int = 256  # waiting requests before RESOURCE_EXHAUSTED
    default_max_tokens: int = 16
    use_cuda_graphs: bool = True
    kernel_warmup: bool = True  # compile every kernel variant at start (CUDA): kernel_warmup.py
    # plan and launch step N + 1 before reading step N's tokens back (engine.py); None = on CUDA
    # (not for a tensor-parallel leader, whose other ranks take their inputs from the plan)
    async_scheduling: bool | None = None
    max_prompt_chars: int = (
        0  # characters of a prompt (or a conversation); 0 = CHARS_PER_TOKEN x max_model_len
    )
    # a running request's tokens go out every this many (its first token and its end at once)
    stream_interval: int = 1

    @property
    def prompt_char_limit(self) -> int:
        return self.max_prompt_chars or CHARS_PER_TOKEN * self.max_model_len
