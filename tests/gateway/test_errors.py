"""Every failure reaches the `openai` client as OpenAI's error shape with the HTTP status mapped
from the worker's gRPC status (or the gateway's own checks): unknown model 404, invalid 400,
overloaded 429, draining 503, missing key 401, wrong key 403, body over the limit 413; `code` is
OpenAI's short name of the failure (model_not_found, invalid_value, ...), never the HTTP status."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.helpers.gateway import ADAPTERS, API_KEY, openai_client, start_worker


def _assert_error(
    exc: openai.APIStatusError, status: int, kind: str, words: str, code: str | None, param: str | None = None
) -> None:
    assert exc.status_code == status, exc
    assert isinstance(exc.body, dict) and exc.body["type"] == kind, exc.body
    assert words in exc.body["message"], exc.body["message"]
    assert set(exc.body) == {"message", "type", "param", "code"}, exc.body
    assert exc.body["code"] == exc.code == code and exc.body["param"] == exc.param == param, exc.body


def test_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    _assert_error(e.value, 404, "not_found_error", "no-such-adapter", "model_not_found", "model")
    with pytest.raises(openai.NotFoundError) as e:  # streaming: refused before the stream starts
        client.chat.completions.create(
            model="no-such-adapter", messages=[{"role": "user", "content": "Hi"}], stream=True
        )
    _assert_error(e.value, 404, "not_found_error", "no-such-adapter", "model_not_found", "model")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-adapter")
    _assert_error(e.value, 404, "not_found_error", "no-such-adapter", "model_not_found", "model")


def test_the_base_model_takes_no_digest(client) -> None:
    """`id@digest` pins an adapter's version; the base model has none to pin."""
    base = client.models.list().data[0].id
    for digest in ("0" * 64, "xyz", ""):
        model = f"{base}@{digest}"
        words = f"{base!r} is the base model, which takes no @digest: send model={base!r}"
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=model, prompt="Hi", max_tokens=2)
        _assert_error(e.value, 404, "not_found_error", words, "model_not_found", "model")
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
            )
        _assert_error(e.value, 404, "not_found_error", words, "model_not_found", "model")
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(model)
        _assert_error(e.value, 404, "not_found_error", words, "model_not_found", "model")
    assert client.completions.create(model=base, prompt="Hi", max_tokens=2).model == base


def test_an_adapter_s_digest_is_the_one_the_store_serves(client, gateway_store) -> None:
    """GET /v1/models/id@digest: the adapter while the store serves that version of it, else the
    404 of an unknown model (a malformed digest too)."""
    from loraserve.clients.store_client import StoreClient

    with StoreClient(gateway_store.address, timeout=30) as store:
        digest = store.get(ADAPTERS[0]).digest
    for other in ("0" * 64, digest.upper(), digest[:-1], "xyz", ""):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(f"{ADAPTERS[0]}@{other}")
        words = f"{ADAPTERS[0]}@{other}"
        _assert_error(e.value, 404, "not_found_error", words, "model_not_found", "model")
    model = f"{ADAPTERS[0]}@{digest}"
    got = client.models.retrieve(model)
    assert (got.id, got.root, got.object) == (model, ADAPTERS[0], "model")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve(f"no-such-adapter@{digest}")
    _assert_error(e.value, 404, "not_found_error", "no-such-adapter", "model_not_found", "model")


@pytest.mark.parametrize(
    ("kw", "words", "code", "param"),
    [
        (dict(temperature=5.0), "temperature", "invalid_value", "temperature"),
        (dict(n=100), "n: 100 is over this server's limit of 16", "invalid_value", "n"),
        (dict(stop=[f"s{i}" for i in range(17)]), "17 stop strings", "invalid_value", "stop"),
        (dict(extra_body={"logit_bias": {"5": 1.0}}), "logit_bias", "unsupported_parameter", "logit_bias"),
        (dict(top_p=0.0), "top_p", "invalid_value", "top_p"),
        # the worker's own checks (INVALID_ARGUMENT), the field named from its message
        (dict(max_tokens=100_000), "max_model_len", "context_length_exceeded", "max_tokens"),
        (dict(prompt=[1 << 30]), "outside the vocabulary", "invalid_value", "prompt"),
        (dict(max_tokens=1 << 31), "max_tokens", "invalid_value", "max_tokens"),  # int32: not a 500
        (dict(extra_body={"top_k": 1 << 40}), "top_k", "invalid_value", "top_k"),
        (dict(prompt=""), "prompt is empty", "invalid_value", "prompt"),
        (dict(prompt=["a", "b"]), "one prompt per request", "unsupported_value", "prompt"),
        (dict(prompt=[[1, 2], [3]]), "one prompt per request", "unsupported_value", "prompt"),
        (dict(model=f"{ADAPTERS[0]}@xyz"), "digest 'xyz'", "invalid_value", "model"),
        (dict(model=f"{ADAPTERS[0]}@{'0' * 64}"), "not the requested", "model_not_available", "model"),
        (dict(extra_body={"prompt": None}), "prompt", "invalid_type", "prompt"),
    ],
)
def test_invalid_requests_are_400(client, kw, words, code, param) -> None:
    body = dict(model=ADAPTERS[0], prompt="Hello", max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**body)
    _assert_error(e.value, 400, "invalid_request_error", words, code, param)


def test_invalid_chat_requests_are_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=ADAPTERS[0], messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=ADAPTERS[0], messages=[{"role": "wizard", "content": "Hi"}])
    assert "wizard" in e.value.body["message"]  # the worker's chat template check
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=ADAPTERS[0], messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=1 << 40
        )
    assert e.value.body["param"] == "max_completion_tokens"
    # the worker's context check names the field the client set
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=ADAPTERS[0], messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=100_000
        )
    _assert_error(
        e.value,
        400,
        "invalid_request_error",
        "max_model_len",
        "context_length_exceeded",
        "max_completion_tokens",
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=ADAPTERS[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=100_000
        )
    _assert_error(
        e.value, 400, "invalid_request_error", "max_model_len", "context_length_exceeded", "max_tokens"
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=ADAPTERS[0],
            messages=[{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "x"}],
        )
    _assert_error(e.value, 400, "invalid_request_error", "wizard", "invalid_value", "messages.1.role")


def test_stream_options_needs_stream(client) -> None:
    """As OpenAI: stream_options of a whole response is refused, not silently ignored."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=ADAPTERS[0], prompt="Hi", max_tokens=2, stream_options={"include_usage": True}
        )
    words = "stream_options: is only allowed when 'stream' is enabled"
    _assert_error(e.value, 400, "invalid_request_error", words, "invalid_value", "stream_options")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=ADAPTERS[0],
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            stream=False,
            stream_options={"include_usage": False},
        )
    _assert_error(e.value, 400, "invalid_request_error", words, "invalid_value", "stream_options")
    # null is no option: accepted, as is stream_options with stream
    out = client.completions.create(
        model=ADAPTERS[0], prompt="Hi", max_tokens=2, extra_body={"stream_options": None}
    )
    assert out.usage.completion_tokens <= 2


@pytest.mark.parametrize(
    ("body", "message", "param", "code"),
    [
        (b"{not json", "the request body is not valid JSON: Expecting property name", None, "invalid_json"),
        (b"", "the request body is empty", None, "invalid_json"),
        (b"[1, 2]", "the request body must be a JSON object", None, "invalid_json"),
        # a value no member of a union accepts: the member the value was meant for, no member tags
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content.0.type: Input should be 'text'",
            "messages.0.content.0.type",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content: ",
            "messages.0.content",
            "invalid_type",
        ),
        ({"stop": [""]}, "stop.0: String should have at least 1 character", "stop.0", "invalid_value"),
        ({"model": None}, "model: Input should be a valid string", "model", "invalid_type"),
        ({"messages": None, "model": None}, "model: ", "model", "invalid_type"),  # the first field
        ({"model": ""}, "model: String should have at least 1 character", "model", "invalid_value"),
    ],
)
def test_malformed_bodies_name_what_is_wrong(gateway, body, message, param, code) -> None:
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    if isinstance(body, dict):
        body = json.dumps(
            {"model": ADAPTERS[0], "messages": [{"role": "user", "content": "Hi"}], **body}
        ).encode()
    r = httpx.post(gateway.url + "/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"].startswith(message), error
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["code"] == code, error
    body = {"messages": [{"role": "user", "content": "Hi"}]}  # no model
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)
    assert r.json()["error"] == {
        "message": "model: Field required",
        "type": "invalid_request_error",
        "param": "model",
        "code": "missing_required_parameter",
    }


@pytest.mark.parametrize(
    ("prompt", "message", "param"),
    [
        # the union member the client meant is the one that got furthest into the value
        (["a", 3], "prompt.1: Input should be a valid string", "prompt.1"),
        (["a", "b", None], "prompt.2: Input should be a valid string", "prompt.2"),
        ([1, "x", 2, "y"], "prompt.1: Input should be a valid integer", "prompt.1"),
        ([1, 2, 1 << 40], "prompt.2: Input should be less than 2147483648", "prompt.2"),
        ([[1, 2], [3, "x"]], "prompt.1.1: Input should be a valid integer", "prompt.1.1"),
        ([[1, -1]], "prompt.0.1: Input should be greater than or equal to 0", "prompt.0.1"),
        ([[1], 2], "prompt.1: Input should be a valid list", "prompt.1"),
        ([1.5], "prompt.0: Input should be a valid integer", "prompt.0"),
        (5, "prompt: Input should be a valid string", "prompt"),
        ({"text": "Hi"}, "prompt: Input should be a valid string", "prompt"),
    ],
)
def test_a_bad_prompt_names_its_bad_element(gateway, prompt, message, param) -> None:
    headers = {"authorization": f"Bearer {API_KEY}"}
    body = {"model": ADAPTERS[0], "prompt": prompt, "max_tokens": 2}
    r = httpx.post(gateway.url + "/v1/completions", json=body, headers=headers)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"].startswith(message) and error["param"] == param, error


def test_api_key_refused_and_accepted(gateway) -> None:
    r = httpx.post(gateway.url + "/v1/completions", json={"model": ADAPTERS[0], "prompt": "Hi"})
    assert r.status_code == 401 and r.json()["error"] == {
        "message": "missing API key: send 'Authorization: Bearer <key>'",
        "type": "authentication_error",
        "param": None,
        "code": "missing_api_key",
    }
    with (
        openai_client(gateway.url, api_key="sk-wrong") as bad,
        pytest.raises(openai.PermissionDeniedError) as e,
    ):
        bad.models.list()
    _assert_error(e.value, 403, "permission_error", "invalid API key", "invalid_api_key")
    with openai_client(gateway.url, api_key=API_KEY) as good:
        assert good.models.list().data
    # health and metrics stay open to probes and scrapers
    assert httpx.get(gateway.url + "/health").json() == {"status": "ok"}
    assert "loraserve_gateway_requests" in httpx.get(gateway.url + "/metrics").text


def test_request_size_limits(start_gateway, gateway_worker) -> None:
    gw = start_gateway(worker=gateway_worker.address, max_body_bytes=4096, max_prompt_chars=100)
    r = httpx.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x" * 5000})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "request_too_large"
    chunked = (b"x" * 1000 for _ in range(10))  # no Content-Length: refused while it is read
    r = httpx.post(gw.url + "/v1/completions", content=chunked, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    with openai_client(gw.url) as c, pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=ADAPTERS[0], prompt="x" * 101, max_tokens=2)
    assert "101 characters, over this server's limit of 100" in e.value.body["message"]
    r = httpx.post(
        gw.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(gw.url + "/v1/no-such-route")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"


@pytest.fixture
def small_worker(tiny_model_dir, gateway_store):
    """One running sequence, one waiting, then RESOURCE_EXHAUSTED; Generate needs a token."""
    bg = start_worker(
        tiny_model_dir,
        gateway_store,
        max_num_seqs=1,
        max_queue_size=1,
        max_num_batched_tokens=64,
        generate_token="worker-secret",
    )
    yield bg
    bg.stop()


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_overloaded_is_429_and_draining_is_503(small_worker, start_gateway) -> None:
    gw = start_gateway(worker=small_worker.address, worker_token="worker-secret")
    engine = small_worker.engine
    long = dict(
        model=ADAPTERS[0], prompt="Hello", max_tokens=2000, temperature=0, extra_body={"ignore_eos": True}
    )
    with openai_client(gw.url) as c:
        running = c.completions.create(stream=True, **long)  # headers come with the first token
        waiting: list = []
        t = threading.Thread(target=lambda: waiting.append(c.completions.create(**{**long, "max_tokens": 2})))
        t.start()
        _wait_for(lambda: engine.num_waiting == 1)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=ADAPTERS[0], prompt="Hi", max_tokens=2)
        _assert_error(e.value, 429, "rate_limit_error", "", "rate_limit_exceeded")
        running.close()  # the client goes away: its sequence is freed, the waiting one runs
        t.join(60)
        assert waiting and waiting[0].usage.completion_tokens == 2
        small_worker.server.servicer.draining = True  # what SIGTERM's drain sets first
        try:
            with pytest.raises(openai.InternalServerError) as e:
                c.completions.create(model=ADAPTERS[0], prompt="Hi", max_tokens=2)
            _assert_error(e.value, 503, "service_unavailable_error", "draining", "service_unavailable")
        finally:
            small_worker.server.servicer.draining = False


def test_worker_token_is_forwarded(small_worker, start_gateway) -> None:
    wrong = start_gateway(worker=small_worker.address, worker_token="not-it")
    with openai_client(wrong.url) as c, pytest.raises(openai.PermissionDeniedError) as e:
        c.completions.create(model=ADAPTERS[0], prompt="Hi", max_tokens=2)
    assert e.value.code == "permission_denied"
    missing = start_gateway(worker=small_worker.address)
    with openai_client(missing.url) as c, pytest.raises(openai.AuthenticationError) as e:
        c.completions.create(model=ADAPTERS[0], prompt="Hi", max_tokens=2)
    assert e.value.code == "unauthenticated"
