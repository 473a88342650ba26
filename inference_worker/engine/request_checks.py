"""The bounds of one generation request, checked before any CPU work is spent on it.

Sizes come first and cost O(1) per field: a prompt's characters are counted before it is
tokenized (tokenizing holds the interpreter lock, so a megabyte prompt would stall every RPC of
the process), token ids before they are scanned, messages before a template renders them. Each
refusal is InvalidRequest naming the limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

from loraserve.contract.streaming import MAX_STREAM_INTERVAL
from loraserve.inference_worker.engine.sampler import MAX_TOP_LOGPROBS
from loraserve.inference_worker.engine.sequence import SamplingParams
from loraserve.inference_worker.errors import InvalidRequest
from loraserve.inference_worker.model.chat_template import ChatMessage

# A prompt may average at most this many characters per token of max_model_len: ordinary text
# averages about 4, and a longer prompt could not fit anyway unless its tokens are unusually long
# (raise `max_prompt_chars` for such a workload).
CHARS_PER_TOKEN = 8
MAX_STOP_STRINGS = 16  # stop strings, and stop token ids, per request
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_MESSAGES = 1024  # chat messages per request
MAX_REQUEST_ID_CHARS = 256


def check_prompt_size(
    prompt: str,
    prompt_token_ids: Seq[int],
    messages: Seq[ChatMessage],
    *,
    max_model_len: int,
    max_chars: int,
) -> None:
    """Sizes only: what can be refused before tokenizing, scanning or rendering anything."""
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequest(
            f"prompt ({len(prompt_token_ids)} tokens) leaves no room to generate within "
            f"max_model_len {max_model_len}"
        )
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"a conversation holds at most {MAX_MESSAGES} messages, got {len(messages)}")
    chars = len(prompt) + sum(len(m.role) + len(m.content) for m in messages)
    if chars > max_chars:
        raise InvalidRequest(
            f"the prompt is {chars} characters, over the limit of {max_chars} characters "
            f"({CHARS_PER_TOKEN} per token of max_model_len {max_model_len}, or --max-prompt-chars)"
        )


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id is {len(request_id)} characters, over the limit of {MAX_REQUEST_ID_CHARS}"
        )


def check_stops(stop: Seq[str], stop_token_ids: Seq[int]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"send at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidRequest(
            f"a stop string is {longest} characters, over the limit of {MAX_STOP_CHARS} characters"
        )
    if len(stop_token_ids) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"send at most {MAX_STOP_STRINGS} stop token ids, got {len(stop_token_ids)}")


def check_sampling_params(p: SamplingParams, max_num_seqs: int) -> None:
    """Raise InvalidRequest for a sampling parameter outside its range (max_tokens is checked
    against the prompt by the builder)."""
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0, got {p.top_k}")
    if p.max_tokens < 0:
        raise InvalidRequest(f"max_tokens must be >= 0, got {p.max_tokens}")
    if not 0 <= p.stream_interval <= MAX_STREAM_INTERVAL:
        raise InvalidRequest(
            f"stream_interval must be in [0, {MAX_STREAM_INTERVAL}] (0 = the worker's default), "
            f"got {p.stream_interval}"
        )
    if not 1 <= p.n <= max_num_seqs:
        raise InvalidRequest(f"n must be in [1, max_num_seqs = {max_num_seqs}], got {p.n}")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")
    if p.top_logprobs and not p.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not (math.isfinite(v) and -2.0 <= v <= 2.0):
            raise InvalidRequest(f"{name} must be in [-2, 2], got {v}")
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        raise InvalidRequest(f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}")
