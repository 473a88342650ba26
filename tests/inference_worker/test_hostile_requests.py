"""Requests built to hurt the worker: a prompt of megabytes, too many or too long stop strings,
conversations past every bound. Each is refused with INVALID_ARGUMENT and a message naming the
limit, before any tokenization, while health keeps answering within 1 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraserve.inference_worker.engine.sequence import SamplingParams
from loraserve.inference_worker.errors import InvalidRequest
from loraserve.inference_worker.model.chat_template import ChatMessage
from tests.helpers.health import HealthProbe
from tests.helpers.workers import make_engine, stub_for

# just under gRPC's default 4 MiB message limit: the largest prompt a client can send
MAXIMAL_PROMPT = "hello world, this is text. " * 140_000


def _make(engine, prompt: str = "hello", messages=None, **sampling) -> None:
    engine.make_sequence("r", prompt, [], SamplingParams(**sampling), lambda out: None, messages=messages)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    return make_engine(tiny_model_dir, max_model_len=64)


def test_a_prompt_past_the_character_bound_is_refused_before_tokenizing(engine, monkeypatch) -> None:
    limit = engine.config.prompt_char_limit
    assert limit == 8 * 64
    with pytest.raises(InvalidRequest, match="tokens\\) leaves no room"):  # tokenized, then counted
        _make(engine, "a b " * (limit // 4))

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a prompt over the character bound")

    monkeypatch.setattr(engine.tokenizer, "encode", no_tokenizing, raising=False)
    with pytest.raises(InvalidRequest, match=f"over the limit of {limit} characters"):
        _make(engine, "x" * (limit + 1))
    with pytest.raises(InvalidRequest, match=f"over the limit of {limit} characters"):
        _make(engine, "", messages=[ChatMessage("user", "y" * (limit + 1))])


def test_prompt_token_ids_past_max_model_len_are_refused(engine) -> None:
    with pytest.raises(InvalidRequest, match="max_model_len 64"):
        engine.make_sequence("r", "", [1] * 1_000_000, SamplingParams(), lambda out: None)


def test_stop_strings_and_messages_are_bounded(engine) -> None:
    from loraserve.inference_worker.engine.request_checks import (
        MAX_MESSAGES,
        MAX_STOP_CHARS,
        MAX_STOP_STRINGS,
    )

    with pytest.raises(InvalidRequest, match=f"at most {MAX_STOP_STRINGS} stop strings"):
        _make(engine, stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1)))
    with pytest.raises(InvalidRequest, match=f"over the limit of {MAX_STOP_CHARS} characters"):
        _make(engine, stop=("z" * (MAX_STOP_CHARS + 1),))
    with pytest.raises(InvalidRequest, match=f"at most {MAX_STOP_STRINGS} stop token ids"):
        _make(engine, stop_token_ids=tuple(range(MAX_STOP_STRINGS + 1)))
    with pytest.raises(InvalidRequest, match=f"at most {MAX_MESSAGES} messages"):
        _make(engine, "", messages=[ChatMessage("user", "hi")] * (MAX_MESSAGES + 1))
    _make(engine, stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS)))


def test_health_answers_while_the_worker_refuses_a_maximal_prompt(start_worker) -> None:
    import grpc

    from loraserve.v1 import worker_pb2

    bg = start_worker()
    stub = stub_for(bg.address)
    errors: list[grpc.RpcError] = []
    with HealthProbe(bg.address) as probe:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(worker_pb2.GenerateRequest(prompt=MAXIMAL_PROMPT), timeout=30)
            errors.append(err.value)
    assert probe.latencies and max(probe.latencies) < 1.0, probe.latencies
    for e in errors:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        assert "over the limit of" in e.details(), e.details()
