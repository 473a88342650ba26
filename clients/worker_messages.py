"""What InferenceWorker's clients send and return (clients/worker_client.py): the request built
from keyword arguments, and a generation, its completions, deltas and logprobs as plain objects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loraserve.contract.usage import Usage
from loraserve.v1 import worker_pb2

FINISH_REASONS = {
    worker_pb2.FINISH_REASON_UNSPECIFIED: None,
    worker_pb2.FINISH_REASON_LENGTH: "length",
    worker_pb2.FINISH_REASON_STOP: "stop",
    worker_pb2.FINISH_REASON_EOS: "eos",
    worker_pb2.FINISH_REASON_CANCELLED: "cancelled",
}


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    top_logprobs: list[TopLogprob] = field(default_factory=list)  # most likely first

    @classmethod
    def from_pb(cls, t: worker_pb2.TokenLogprob) -> TokenLogprob:
        return cls(
            t.token_id,
            t.token,
            t.logprob,
            t.token_bytes,
            [TopLogprob(a.token_id, a.token, a.logprob, a.token_bytes) for a in t.top_logprobs],
        )


@dataclass(frozen=True)
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked for


@dataclass(frozen=True)
class Generation:
    request_id: str
    text: str  # text, token_ids and finish_reason repeat completions[0]
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage  # completion_tokens summed over all completions
    adapter_id: str = ""
    adapter_digest: str = ""
    completions: list[Completion] = field(default_factory=list)  # n entries, by index


@dataclass(frozen=True)
class Delta:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta of each index
    usage: Usage | None = None  # set on the very last delta of the stream only
    index: int = 0  # which completion (0..n-1)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of this delta's tokens


ChatMessages = Sequence[Mapping[str, str] | tuple[str, str] | worker_pb2.ChatMessage]


def chat_message(m: Mapping[str, str] | tuple[str, str] | worker_pb2.ChatMessage) -> worker_pb2.ChatMessage:
    """{"role": ..., "content": ...}, (role, content) or a ChatMessage -> ChatMessage."""
    if isinstance(m, worker_pb2.ChatMessage):
        return m
    if isinstance(m, tuple):
        role, content = m
        return worker_pb2.ChatMessage(role=role, content=content)
    return worker_pb2.ChatMessage(role=m["role"], content=m.get("content") or "")


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: ChatMessages | None = None,
    add_generation_prompt: bool | None = None,
    adapter_id: str = "",
    max_tokens: int = 0,
    fill_context: bool = False,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    n: int = 0,
    logprobs: bool = False,
    top_logprobs: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 0.0,
    request_id: str = "",
    stream_interval: int = 0,
) -> worker_pb2.GenerateRequest:
    """A GenerateRequest from a prompt (text or token ids) or chat `messages`; zero values mean
    the server's defaults (n 1, repetition_penalty 1.0 = off, the worker's stream interval).
    `fill_context`: with max_tokens 0, as many tokens as the context leaves, not the default.
    `stream_interval` k: a stream's tokens come k to a message (its first alone, at once)."""
    sampling = worker_pb2.SamplingParams(
        max_tokens=max_tokens,
        fill_context=fill_context,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
    )
    if seed is not None:
        sampling.seed = seed
    req = worker_pb2.GenerateRequest(
        adapter_id=adapter_id, sampling=sampling, request_id=request_id, stream_interval=stream_interval
    )
    if messages is not None:
        req.messages.extend(chat_message(m) for m in messages)
        if add_generation_prompt is not None:
            req.add_generation_prompt = add_generation_prompt
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt is not None:
        req.prompt_token_ids.extend(prompt)
    return req


def _completion(c: worker_pb2.Completion) -> Completion:
    return Completion(
        c.index,
        c.text,
        list(c.token_ids),
        FINISH_REASONS[c.finish_reason],
        [TokenLogprob.from_pb(t) for t in c.logprobs],
    )


def generation_from_pb(r: worker_pb2.GenerateResponse) -> Generation:
    completions = [_completion(c) for c in r.completions] or [
        Completion(0, r.text, list(r.token_ids), FINISH_REASONS[r.finish_reason])
    ]
    return Generation(
        r.request_id,
        r.text,
        list(r.token_ids),
        FINISH_REASONS[r.finish_reason],
        Usage.from_pb(r.usage),
        r.adapter_id,
        r.adapter_digest,
        completions,
    )


def delta_from_pb(r: worker_pb2.GenerateStreamResponse) -> Delta:
    return Delta(
        r.request_id,
        r.text,
        list(r.token_ids),
        FINISH_REASONS[r.finish_reason],
        Usage.from_pb(r.usage) if r.HasField("usage") else None,
        r.index,
        [TokenLogprob.from_pb(t) for t in r.logprobs],
    )
