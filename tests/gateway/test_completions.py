"""/v1/completions and /v1/chat/completions through the official `openai` client: whole and
streamed, n, logprobs in each endpoint's shape, stop, usage, the base model and adapters, and the
results equal the worker's own over gRPC."""

from __future__ import annotations

import math

import pytest

from loraserve.clients.worker_client import WorkerClient
from tests.helpers.gateway import ADAPTERS, openai_client, start_worker

PROMPT = "Once upon a time"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def base_name(gateway_worker) -> str:
    with WorkerClient(gateway_worker.address, timeout=30) as w:
        return w.info().model


def test_models_lists_the_base_model_and_every_adapter(client, base_name) -> None:
    models = client.models.list().data
    assert models[0].id == base_name
    assert {m.id for m in models[1:]} == set(ADAPTERS)
    assert all(m.object == "model" for m in models)
    assert client.models.retrieve(ADAPTERS[0]).id == ADAPTERS[0]


@pytest.mark.parametrize("model", ["base", ADAPTERS[0], ADAPTERS[1]])
def test_completion_equals_the_workers_greedy_output(client, gateway_worker, base_name, model) -> None:
    model = base_name if model == "base" else model
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    with WorkerClient(gateway_worker.address, timeout=30) as w:
        want = w.generate(PROMPT, adapter_id="" if model == base_name else model, max_tokens=8)
    (choice,) = out.choices
    assert out.object == "text_completion" and out.model == model
    assert choice.text == want.text and choice.index == 0
    assert choice.finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert out.usage.prompt_tokens == want.usage.prompt_tokens
    assert out.usage.completion_tokens == len(want.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_a_prompt_of_token_ids_in_each_shape(client, tiny_model_dir) -> None:
    """OpenAI's prompt is a string, token ids, or a list of either (one of them here)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(PROMPT).ids
    want = client.completions.create(model=ADAPTERS[0], prompt=PROMPT, max_tokens=6, temperature=0)
    for prompt in (ids, [ids], [PROMPT]):
        out = client.completions.create(model=ADAPTERS[0], prompt=prompt, max_tokens=6, temperature=0)
        assert out.choices[0].text == want.choices[0].text
        assert out.usage.prompt_tokens == want.usage.prompt_tokens


def test_streamed_completion_equals_the_whole_one(client) -> None:
    whole = client.completions.create(model=ADAPTERS[2], prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=ADAPTERS[2],
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_whole_and_streamed(client, gateway_worker, base_name) -> None:
    out = client.chat.completions.create(model=base_name, messages=MESSAGES, max_tokens=12, temperature=0)
    with WorkerClient(gateway_worker.address, timeout=30) as w:
        want = w.generate(messages=MESSAGES, max_tokens=12)
    (choice,) = out.choices
    assert out.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert out.usage.prompt_tokens == want.usage.prompt_tokens
    stream = client.chat.completions.create(
        model=base_name, messages=MESSAGES, max_completion_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_a_developer_message_is_a_system_message(client, base_name) -> None:
    """OpenAI's newer name for the system role ("developer"), as its clients send it."""
    kw = dict(model=base_name, max_tokens=6, temperature=0)
    developer = [{"role": "developer", "content": "Be brief."}, *MESSAGES[1:]]
    out = client.chat.completions.create(messages=developer, **kw)
    want = client.chat.completions.create(messages=MESSAGES, **kw)
    assert out.choices[0].message.content == want.choices[0].message.content
    assert out.usage.prompt_tokens == want.usage.prompt_tokens


def test_n_completions_with_a_seed(client) -> None:
    kw = dict(model=ADAPTERS[0], prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7)
    out = client.completions.create(n=3, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    # completion i samples with seed + i: each equals a lone request with that seed
    for i, c in enumerate(out.choices):
        lone = client.completions.create(**{**kw, "seed": 7 + i})
        assert c.text == lone.choices[0].text
    streamed = client.completions.create(n=3, stream=True, **kw)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in out.choices]
    chat = client.chat.completions.create(
        model=ADAPTERS[0], messages=MESSAGES, max_tokens=5, temperature=1.0, seed=3, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_completion_logprobs_shape(client) -> None:
    out = client.completions.create(
        model=ADAPTERS[1],
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},  # exactly max_tokens tokens
    )
    lp = out.choices[0].logprobs
    assert out.usage.completion_tokens == 5
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    if "\ufffd" not in out.choices[0].text:  # no token split inside a UTF-8 character
        assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and len(top) <= 3
        # greedy: the sampled token is the most likely one
        assert math.isclose(max(top.values()), logprob, rel_tol=1e-5, abs_tol=1e-6)


def test_chat_logprobs_shape_and_stream(client, gateway_worker, base_name) -> None:
    out = client.chat.completions.create(
        model=base_name, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    with WorkerClient(gateway_worker.address, timeout=30) as w:
        want = w.generate(messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2)
    assert [t.token for t in content] == [t.token for t in want.completions[0].logprobs]
    for got, ref in zip(content, want.completions[0].logprobs, strict=True):
        assert got.logprob == pytest.approx(ref.logprob) and bytes(got.bytes) == ref.token_bytes
        assert [a.token for a in got.top_logprobs] == [a.token for a in ref.top_logprobs]
        assert len(got.top_logprobs) == 2
    streamed = client.chat.completions.create(
        model=base_name,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == [t.token for t in content]


def test_stop_strings_end_the_completion(client) -> None:
    free = client.completions.create(model=ADAPTERS[0], prompt=PROMPT, max_tokens=16, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    out = client.completions.create(
        model=ADAPTERS[0], prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def short_context_worker(tiny_model_dir, gateway_store):
    bg = start_worker(tiny_model_dir, gateway_store, max_model_len=80)
    yield bg
    bg.stop()


def test_chat_without_max_tokens_generates_until_the_context_is_full(
    short_context_worker, start_gateway
) -> None:
    """OpenAI's chat endpoints have no default max_tokens (a completion ends at a stop or the
    context's end); the legacy completions endpoint's default is 16."""
    gw = start_gateway(worker=short_context_worker.address)
    with WorkerClient(short_context_worker.address, timeout=30) as w:
        base = w.info().model
    with openai_client(gw.url) as c:
        kw = dict(model=base, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
        out = c.chat.completions.create(**kw)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens + out.usage.completion_tokens == 80
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
        legacy = c.completions.create(
            model=base, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
        )
        assert legacy.usage.completion_tokens == 16
