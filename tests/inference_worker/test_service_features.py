"""Chat, n completions, logprobs and penalties through a real worker over gRPC, checked against
transformers (the tiny model in fp32 on CPU) and against lone requests."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from loraserve.clients.worker_client import WorkerClient
from loraserve.v1 import worker_pb2
from tests.helpers.workers import stub_for

transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "Hello world."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path):
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return tok, model


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position: [len(ids), V]."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_chat_equals_the_prompt_transformers_renders(worker, hf, chat) -> None:
    tok, _ = hf
    for add in (True, False):
        ids = list(tok.apply_chat_template(chat, add_generation_prompt=add, tokenize=True, return_dict=False))
        with WorkerClient(worker.address) as w:
            got = w.generate(messages=chat, add_generation_prompt=add, max_tokens=8, ignore_eos=True)
            want = w.generate(ids, max_tokens=8, ignore_eos=True)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "request_, message",
    [
        (worker_pb2.GenerateRequest(messages=[worker_pb2.ChatMessage(role="robot", content="x")]), "robot"),
        (
            worker_pb2.GenerateRequest(
                prompt="hi", messages=[worker_pb2.ChatMessage(role="user", content="x")]
            ),
            "not both",
        ),
        (worker_pb2.GenerateRequest(add_generation_prompt=True), "messages"),
        (
            worker_pb2.GenerateRequest(
                prompt="hi", sampling=worker_pb2.SamplingParams(top_logprobs=21, logprobs=True)
            ),
            "top_logprobs",
        ),
        (
            worker_pb2.GenerateRequest(prompt="hi", sampling=worker_pb2.SamplingParams(top_logprobs=2)),
            "needs logprobs",
        ),
        (
            worker_pb2.GenerateRequest(prompt="hi", sampling=worker_pb2.SamplingParams(presence_penalty=2.5)),
            "presence",
        ),
        (
            worker_pb2.GenerateRequest(prompt="hi", sampling=worker_pb2.SamplingParams(frequency_penalty=-3)),
            "frequency",
        ),
        (
            worker_pb2.GenerateRequest(
                prompt="hi", sampling=worker_pb2.SamplingParams(repetition_penalty=-1)
            ),
            "repetition_penalty",
        ),
        (worker_pb2.GenerateRequest(prompt="hi", sampling=worker_pb2.SamplingParams(n=-2)), "n must be"),
        (worker_pb2.GenerateRequest(prompt="hi", sampling=worker_pb2.SamplingParams(n=1000)), "n must be"),
    ],
)
def test_bad_requests_are_invalid_argument(worker, request_, message) -> None:
    stub = stub_for(worker.address)
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(request_, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_n_completions_generate_and_stream(worker) -> None:
    kw = dict(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    with WorkerClient(worker.address) as w:
        full = w.generate("Once upon a time", n=3, logprobs=True, **kw)
        deltas = list(w.generate_stream("Once upon a time", n=3, logprobs=True, **kw))
        lone = [w.generate("Once upon a time", **{**kw, "seed": 77 + i}) for i in range(3)]
    assert [c.index for c in full.completions] == [0, 1, 2]
    assert [c.token_ids for c in full.completions] == [g.token_ids for g in lone]
    assert [c.text for c in full.completions] == [g.text for g in lone]
    assert (full.text, full.token_ids, full.finish_reason) == (lone[0].text, lone[0].token_ids, "length")
    assert full.usage.prompt_tokens == lone[0].usage.prompt_tokens
    assert full.usage.completion_tokens == 36
    for c in full.completions:
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
    # the stream: deltas per index, a finish reason once per index, usage on the very last only
    for i, c in enumerate(full.completions):
        mine = [d for d in deltas if d.index == i]
        assert [t for d in mine for t in d.token_ids] == c.token_ids
        assert "".join(d.text for d in mine) == c.text
        assert [d.finish_reason for d in mine if d.finish_reason] == ["length"]
        assert [lp.token_id for d in mine for lp in d.logprobs] == c.token_ids
    assert [d.usage is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].usage.completion_tokens == 36


def test_logprobs_equal_the_models_log_softmax(worker, hf) -> None:
    _, model = hf
    ids = worker.engine.tokenizer.encode("The quick brown fox").ids
    with WorkerClient(worker.address) as w:
        out = w.generate(
            ids, max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=5, temperature=0.8, seed=1
        )
    c = out.completions[0]
    ref = hf_logprobs(model, ids + c.token_ids)[len(ids) - 1 : -1]  # [10, V], position of each token
    assert len(c.logprobs) == 10
    for pos, lp in enumerate(c.logprobs):
        assert lp.logprob == pytest.approx(ref[pos, lp.token_id].item(), abs=1e-4)
        assert [a.token_id for a in lp.top_logprobs] == ref[pos].topk(5).indices.tolist()
        for a in lp.top_logprobs:
            assert a.logprob == pytest.approx(ref[pos, a.token_id].item(), abs=1e-4)
            assert a.token_bytes.decode("utf-8", errors="replace") == a.token
    assert b"".join(lp.token_bytes for lp in c.logprobs).decode("utf-8", errors="replace") == c.text


def test_penalties_equal_a_direct_greedy_loop(worker, hf) -> None:
    """Greedy with all three penalties equals a loop over transformers' logits that applies HF's
    RepetitionPenaltyLogitsProcessor and OpenAI's presence/frequency formula by hand."""
    _, model = hf
    ids = worker.engine.tokenizer.encode("Hello world. Hello world. Hello").ids
    rep, pres, freq = 1.4, 0.6, 0.9
    with WorkerClient(worker.address) as w:
        got = w.generate(
            ids,
            max_tokens=16,
            ignore_eos=True,
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
        ).token_ids
        plain = w.generate(ids, max_tokens=16, ignore_eos=True).token_ids
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=rep)
    out: list[int] = []
    for _ in range(16):
        with torch.inference_mode():
            logits = model(torch.tensor([ids + out])).logits[:, -1].float()
        logits = processor(torch.tensor([ids + out]), logits)[0]
        for t in set(out):
            logits[t] -= out.count(t) * freq + pres
        out.append(int(logits.argmax()))
    assert got == out
    assert got != plain  # the penalties changed something


def test_generate_cli_chat_n_logprobs_and_penalties(worker, tmp_path: Path, capsys) -> None:
    from loraserve.clients.worker_cli import generate_main

    chat = CHATS[1]
    path = tmp_path / "chat.json"
    path.write_text(__import__("json").dumps(chat[:-1]))
    base = ["--worker", worker.address, "--max-tokens", "6", "--ignore-eos"]
    with WorkerClient(worker.address) as w:
        want = w.generate(messages=chat, max_tokens=6, ignore_eos=True).text
        want_n = w.generate(
            "Hello", max_tokens=6, ignore_eos=True, n=2, temperature=1.0, seed=5, repetition_penalty=1.2
        )
    for argv in (
        [*base, "--messages", str(path), "--chat", chat[-1]["content"]],
        [*base, *(f"--message={m['role']}:{m['content']}" for m in chat)],
    ):
        assert generate_main(argv) == 0
        assert capsys.readouterr().out == want + "\n"
    argv = [*base, "-n", "2", "--temperature", "1", "--seed", "5", "--repetition-penalty", "1.2"]
    assert generate_main([*argv, "--top-logprobs", "2", "Hello"]) == 0
    out = capsys.readouterr().out
    for c in want_n.completions:
        assert f"--- completion {c.index} [length]\n{c.text}\n" in out
    assert out.count("TOKEN") == 2 and "TOP ALTERNATIVES" in out
    for bad in (["--message", "user:x", "Hello"], ["--message", "nocolon"], []):
        with pytest.raises(SystemExit):
            generate_main([*base, *bad])
    assert generate_main([*base, "--message", "robot:x"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
