"""Chat on the real SmolLM2-135M-Instruct (fetched and converted by `loraserve model fetch`): the
prompt our worker renders equals transformers' apply_chat_template token for token, and greedy chat
completions from our engine equal transformers' generate (fp32, CPU), both stopping at the end of
the assistant's turn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.engine.sequence import RequestOutput, SamplingParams
from loraserve.inference_worker.model.chat_template import ChatMessage, ChatTemplate
from loraserve.inference_worker.model.loader import load_model, load_tokenizer
from tests.helpers.engine_run import run_request

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Write a Python function that adds two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Now make it add three numbers."},
    ],
    [
        {"role": "user", "content": "Say hello in French."},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "And in German, with an umlaut: Grüß dich?"},
    ],
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path) -> Path:
    return smollm2_dir


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    tokenizer = load_tokenizer(model_dir)
    return LLMEngine(
        load_model(model_dir, torch.float32, "cpu"),
        tokenizer,
        EngineConfig(max_num_seqs=4, max_model_len=1024, num_blocks=256, use_cuda_graphs=False),
        chat=ChatTemplate.from_dir(model_dir, tokenizer),
    )


def _messages(conv) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"]) for m in conv]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_prompt_equals_apply_chat_template(engine, hf, add_generation_prompt) -> None:
    tok, _ = hf
    chat = engine.chat
    assert chat is not None and chat.end_of_turn_token_ids == {tok.convert_tokens_to_ids("<|im_end|>")}
    for conv in CONVERSATIONS:
        want = tok.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        text = chat.render(_messages(conv), add_generation_prompt)
        assert text == tok.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert engine.tokenizer.encode(text, add_special_tokens=False).ids == list(want)


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_greedy_chat_equals_transformers(engine, hf, conv) -> None:
    tok, model = hf
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([list(ids)]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=tok.pad_token_id
        )[0, len(ids) :].tolist()
    outs: list[RequestOutput] = []
    seq = engine.make_sequence(
        "c", "", [], SamplingParams(max_tokens=MAX_NEW), outs.append, messages=_messages(conv)
    )
    run_request(engine, seq, outs)
    got = [t for o in outs for t in o.token_ids]
    eos = engine.requests.eos_token_ids
    if out[-1] in eos:  # transformers keeps the end-of-turn token, we report it as the finish reason
        assert got == out[:-1] and outs[-1].finish_reason.value == "eos"
    else:
        assert got == out and outs[-1].finish_reason.value == "length"
    assert outs[-1].usage is not None and outs[-1].usage.prompt_tokens == len(ids)
    assert "".join(o.text for o in outs) == tok.decode(got, skip_special_tokens=True)
