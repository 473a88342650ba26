"""From an OpenAI request to what the worker is asked: the adapter the `model` names, the prompt or
chat messages, the sampling parameters (as `build_request` keyword arguments). Fields the gateway
cannot honour and requests over the operator's limits are refused here, naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraserve.gateway.config import GatewayConfig
from loraserve.gateway.errors import APIError, unknown_model
from loraserve.gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

OPENAI_DEFAULT_TEMPERATURE = 1.0  # what OpenAI samples with when a request sets none
# OpenAI's roles the chat templates know by another name: "developer" is its newer "system"
ROLES = {"developer": "system"}


@dataclass(frozen=True)
class Plan:
    """One request, ready for the worker."""

    model: str  # as the client named it (echoed in responses)
    adapter_id: str  # "" for the base model
    kwargs: dict[str, Any]  # build_request keyword arguments, adapter_id excepted
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # alternatives per token when logprobs were asked for, else None
    # the request's names of the worker's fields where they differ (chat: messages for prompt), for
    # the param of a worker's error
    names: dict[str, str] = field(default_factory=dict)


def adapter_for(model: str, base_model: str) -> str:
    """The worker's adapter_id for a `model`: "" for the base model's name, else the adapter id
    (or id@digest) itself; the worker answers NOT_FOUND for one the store does not know. The base
    model's name with an @digest is refused here: a digest pins an adapter's version, and the base
    model has none (its name also hides an adapter of that id, with or without a digest)."""
    if model == base_model:
        return ""
    name, at, _ = model.partition("@")
    if at and name == base_model:
        why = f"{base_model!r} is the base model, which takes no @digest: send model={base_model!r}"
        raise unknown_model(model, why)
    return model


def _refuse(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def _sampling(req: SamplingFields, config: GatewayConfig) -> dict[str, Any]:
    if req.n > config.max_n:
        raise _refuse("n", f"{req.n} is over this server's limit of {config.max_n}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    if len(stop) > config.max_stop:
        raise _refuse("stop", f"{len(stop)} stop strings, over this server's limit of {config.max_stop}")
    if req.logit_bias:
        raise _refuse("logit_bias", "is not supported", "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise _refuse("stream_options", "is only allowed when 'stream' is enabled")
    temperature = OPENAI_DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    kw: dict[str, Any] = dict(
        max_tokens=req.max_tokens or 0,
        temperature=temperature,
        top_p=req.top_p or 0.0,
        top_k=req.top_k,
        stop=stop,
        n=req.n,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty or 0.0,
        ignore_eos=req.ignore_eos,
    )
    if req.seed is not None:
        kw["seed"] = req.seed
    return kw


def _plan(
    req: SamplingFields,
    base_model: str,
    kw: dict[str, Any],
    top_logprobs: int | None,
    names: dict[str, str] | None = None,
) -> Plan:
    return Plan(
        model=req.model,
        adapter_id=adapter_for(req.model, base_model),
        kwargs=kw,
        n=req.n,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        top_logprobs=top_logprobs,
        names=names or {},
    )


def completion_plan(req: CompletionRequest, config: GatewayConfig, base_model: str) -> Plan:
    if req.echo:
        raise _refuse("echo", "is not supported", "unsupported_parameter")
    if req.suffix:
        raise _refuse("suffix", "is not supported", "unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise _refuse("best_of", "must equal n (or be left out)", "unsupported_value")
    prompt: str | list[int]
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str | list):
        if len(req.prompt) != 1:
            raise _refuse(
                "prompt", f"one prompt per request, got a list of {len(req.prompt)}", "unsupported_value"
            )
        prompt = req.prompt[0]  # type: ignore[assignment]
    else:
        prompt = req.prompt  # type: ignore[assignment]
    if len(prompt) > config.max_prompt_chars:
        unit = "characters" if isinstance(prompt, str) else "tokens"
        raise _refuse(
            "prompt", f"{len(prompt)} {unit}, over this server's limit of {config.max_prompt_chars}"
        )
    kw = _sampling(req, config)
    kw["prompt"] = prompt
    if req.logprobs is not None:
        kw.update(logprobs=True, top_logprobs=req.logprobs)
    return _plan(req, base_model, kw, req.logprobs)


def chat_plan(req: ChatCompletionRequest, config: GatewayConfig, base_model: str) -> Plan:
    if req.tools:
        raise _refuse("tools", "tool calls are not supported", "unsupported_parameter")
    if req.response_format is not None and req.response_format.type != "text":
        raise _refuse(
            "response_format",
            f"only 'text' is supported, not {req.response_format.type!r}",
            "unsupported_value",
        )
    if req.top_logprobs and not req.logprobs:
        raise _refuse("top_logprobs", "needs logprobs: true")
    messages = [{"role": ROLES.get(m.role, m.role), "content": m.text()} for m in req.messages]
    size = sum(len(m["content"]) for m in messages)
    if size > config.max_prompt_chars:
        raise _refuse("messages", f"{size} characters, over this server's limit of {config.max_prompt_chars}")
    kw = _sampling(req, config)
    kw["max_tokens"] = req.max_completion_tokens or req.max_tokens or 0
    if not kw["max_tokens"]:  # OpenAI's chat has no default: a completion may fill the context
        kw["fill_context"] = True
    kw["messages"] = messages
    if not req.add_generation_prompt:
        kw["add_generation_prompt"] = False
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
        kw.update(logprobs=True, top_logprobs=top)
    names = {"prompt": "messages"}
    if req.max_completion_tokens:
        names["max_tokens"] = "max_completion_tokens"
    return _plan(req, base_model, kw, top, names)
