"""From the worker's generations and stream deltas to OpenAI's response objects and stream chunks,
for both endpoints: finish reasons, usage, and logprobs in each endpoint's own shape (the legacy
parallel lists of /v1/completions, the per-token objects of /v1/chat/completions)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from loraserve.clients.worker_messages import Delta, Generation
from loraserve.clients.worker_messages import TokenLogprob as WorkerLogprob
from loraserve.contract.usage import Usage as WorkerUsage
from loraserve.gateway.requests import Plan
from loraserve.gateway.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    TokenLogprob,
    TopLogprob,
    Usage,
)

# the worker's finish reasons -> OpenAI's: its end-of-sequence token is a natural stop
FINISH: dict[str | None, FinishReason] = {
    None: None,
    "stop": "stop",
    "eos": "stop",
    "length": "length",
    "cancelled": "stop",
}


def usage_of(u: WorkerUsage) -> Usage:
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
    )


def completion_logprobs(lps: Sequence[WorkerLogprob], top: int, offset: int = 0) -> CompletionLogprobs:
    """Legacy shape; text_offset counts characters from `offset` (the text before these tokens)."""
    out = CompletionLogprobs()
    for lp in lps:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({a.token: a.logprob for a in lp.top_logprobs[:top]} if top else {})
        out.text_offset.append(offset)
        offset += len(lp.token)
    return out


def chat_logprobs(lps: Sequence[WorkerLogprob]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                token=lp.token,
                logprob=lp.logprob,
                bytes=list(lp.token_bytes),
                top_logprobs=[
                    TopLogprob(token=a.token, logprob=a.logprob, bytes=list(a.token_bytes))
                    for a in lp.top_logprobs
                ],
            )
            for lp in lps
        ]
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion(plan: Plan, gen: Generation) -> Completion:
    return Completion(
        id=new_id("cmpl"),
        created=int(time.time()),
        model=plan.model,
        choices=[
            CompletionChoice(
                index=c.index,
                text=c.text,
                finish_reason=FINISH[c.finish_reason],
                logprobs=None
                if plan.top_logprobs is None
                else completion_logprobs(c.logprobs, plan.top_logprobs),
            )
            for c in gen.completions
        ],
        usage=usage_of(gen.usage),
    )


def chat_completion(plan: Plan, gen: Generation) -> ChatCompletion:
    return ChatCompletion(
        id=new_id("chatcmpl"),
        created=int(time.time()),
        model=plan.model,
        choices=[
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(content=c.text),
                finish_reason=FINISH[c.finish_reason],
                logprobs=None if plan.top_logprobs is None else chat_logprobs(c.logprobs),
            )
            for c in gen.completions
        ],
        usage=usage_of(gen.usage),
    )


@dataclass
class CompletionChunks:
    """Stream chunks of /v1/completions, one per worker delta; `offsets` tracks each choice's text
    length for the logprobs' text_offset."""

    plan: Plan
    id: str = field(default_factory=lambda: new_id("cmpl"))
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(
            id=self.id, created=self.created, model=self.plan.model, choices=choices, usage=usage
        )

    def first(self) -> list[Completion]:
        return []

    def delta(self, d: Delta) -> list[Completion]:
        if not d.text and d.finish_reason is None and not d.logprobs:
            return []
        offset = self.offsets.get(d.index, 0)
        self.offsets[d.index] = offset + len(d.text)
        logprobs = None
        if self.plan.top_logprobs is not None:
            logprobs = completion_logprobs(d.logprobs, self.plan.top_logprobs, offset)
        choice = CompletionChoice(
            index=d.index, text=d.text, finish_reason=FINISH[d.finish_reason], logprobs=logprobs
        )
        return [self._chunk([choice])]

    def usage(self, u: WorkerUsage) -> Completion:
        return self._chunk([], usage_of(u))


@dataclass
class ChatChunks:
    """Stream chunks of /v1/chat/completions: each choice opens with a delta carrying the role."""

    plan: Plan
    id: str = field(default_factory=lambda: new_id("chatcmpl"))
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.plan.model, choices=choices, usage=usage
        )

    def first(self) -> list[ChatCompletionChunk]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(self.plan.n)
        ]

    def delta(self, d: Delta) -> list[ChatCompletionChunk]:
        if not d.text and d.finish_reason is None and not d.logprobs:
            return []
        choice = ChatChunkChoice(
            index=d.index,
            delta=ChatDelta(content=d.text or None),
            finish_reason=FINISH[d.finish_reason],
            logprobs=None if self.plan.top_logprobs is None else chat_logprobs(d.logprobs),
        )
        return [self._chunk([choice])]

    def usage(self, u: WorkerUsage) -> ChatCompletionChunk:
        return self._chunk([], usage_of(u))
