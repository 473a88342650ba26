"""Pydantic models of the OpenAI API's requests and responses, as far as the gateway serves them
(https://platform.openai.com/docs/api-reference/completions, .../chat). Requests ignore fields they
do not know (clients send more than any server uses); fields the gateway cannot honour are refused
by `requests.py` with a message naming them. Per-field size limits are here; the limits an operator
sets (prompt length, n, stop count) are checked in `requests.py`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20  # the worker's limit, as OpenAI's
MAX_STOP_CHARS = 1024  # as the worker
MAX_MESSAGES = 1024

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Seed = Annotated[int, Field(ge=0, lt=1 << 64)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
# the worker's int32 fields: a larger count is a 400 here, not a failure to build the request
MaxTokens = Annotated[int, Field(ge=1, lt=1 << 31)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """What both endpoints share; top_k, repetition_penalty and ignore_eos are extensions (as vLLM's)."""

    model: str = Field(min_length=1, max_length=512)
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: str | None = Field(default=None, max_length=256)
    # extensions
    top_k: Annotated[int, Field(ge=0, lt=1 << 31)] = 0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    ignore_eos: bool = False
    # refused unless neutral (see requests.py)
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]  # a list of prompts: one here
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Request):
    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ResponseFormat(_Request):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True  # extension (as vLLM's)
    # refused when set (see requests.py)
    tools: list[dict] | None = None
    response_format: ResponseFormat | None = None


# ------------------------------------------------------------------------------------------ responses
FinishReason = Literal["stop", "length"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists over the choice's tokens."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class _Choice(BaseModel):
    """What every choice of a response has: its index and, once it ended, why."""

    index: int
    finish_reason: FinishReason = None


class _Response(BaseModel):
    """What every completion response and stream chunk has besides its `object` and choices."""

    id: str
    created: int
    model: str
    usage: Usage | None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraserve"
    root: str | None = None  # the adapter id without the digest, or the base model
    parent: str | None = None  # an adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
