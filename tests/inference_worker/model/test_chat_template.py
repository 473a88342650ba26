"""Chat messages rendered with the model's template, token for token as transformers'
apply_chat_template renders them, and the chat request's stop tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraserve.inference_worker.engine.sequence import FinishReason, RequestOutput, SamplingParams
from loraserve.inference_worker.errors import InvalidRequest
from loraserve.inference_worker.model.chat_template import ChatMessage, ChatTemplate
from loraserve.inference_worker.model.loader import load_tokenizer
from tests.helpers.engine_run import generate
from tests.helpers.workers import make_engine

CONVERSATIONS = [
    [("user", "Hello world.")],
    [("system", "You answer in one word."), ("user", "What is 2 + 2?")],
    [
        ("system", "Be brief."),
        ("user", "Name a colour."),
        ("assistant", "Blue."),
        ("user", "Another, with {{ 7 * 7 }} and {% raw %}?"),
    ],
    [("user", "Grüße, ☃ and 日本語"), ("assistant", "")],
    [("user", "  spaces around  \n"), ("assistant", "ok\n\nsure"), ("user", "<|im_end|> inside")],
]

# exercises what transformers adds to Jinja: raise_exception, tojson, strftime_now, namespace,
# loop controls, lstrip/trim_blocks, and the special tokens in the context
FEATURE_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
    {% if m['content'] == 'skip me' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
[{{ ns.n }}|{{ m['role'] }}] {{ m | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}[assistant {{ strftime_now('%Y') }}]{% endif %}"""

ALTERNATING_TEMPLATE = """{% for m in messages %}
{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}
<{{ m['role'] }}>{{ m['content'] }}</s>
{% endfor %}"""


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def chat(tiny_model_dir: Path) -> ChatTemplate:
    t = ChatTemplate.from_dir(tiny_model_dir, load_tokenizer(tiny_model_dir))
    assert t is not None
    return t


def _messages(conv) -> list[ChatMessage]:
    return [ChatMessage(r, c) for r, c in conv]


def _hf(hf_tokenizer, conv, add_generation_prompt: bool, template: str | None = None):
    msgs = [{"role": r, "content": c} for r, c in conv]
    kw = dict(add_generation_prompt=add_generation_prompt, chat_template=template)
    text = hf_tokenizer.apply_chat_template(msgs, tokenize=False, **kw)
    ids = hf_tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False, **kw)
    return text, list(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_rendering_equals_transformers(chat, hf_tokenizer, conv, add_generation_prompt) -> None:
    text = chat.render(_messages(conv), add_generation_prompt)
    want_text, want_ids = _hf(hf_tokenizer, conv, add_generation_prompt)
    assert text == want_text
    assert chat.tokenizer.encode(text, add_special_tokens=False).ids == want_ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_transformers_jinja_extensions_render_the_same(chat, hf_tokenizer, add_generation_prompt) -> None:
    conv = [("system", "s"), ("user", 'quote " and ü'), ("assistant", "skip me"), ("user", "last")]
    mine = ChatTemplate(FEATURE_TEMPLATE, chat.tokenizer, chat.special_tokens)
    text = mine.render(_messages(conv), add_generation_prompt)
    want_text, want_ids = _hf(hf_tokenizer, conv, add_generation_prompt, FEATURE_TEMPLATE)
    assert text == want_text and '"ü"' not in text and "ü" in text  # tojson keeps non-ASCII
    assert chat.tokenizer.encode(text, add_special_tokens=False).ids == want_ids


def test_stop_tokens_of_a_chat(chat, tiny_model_dir: Path) -> None:
    tok = chat.tokenizer
    im_end, eos = tok.token_to_id("<|im_end|>"), tok.token_to_id("</s>")
    assert chat.end_of_turn_token_ids == {im_end, eos}
    assert chat.generation_eos_token_ids == {eos, im_end}  # generation_config.json's list
    engine = make_engine(tiny_model_dir)
    assert {im_end, eos} <= engine.requests.eos_token_ids


def test_bad_messages(chat, tiny_model_dir: Path) -> None:
    with pytest.raises(InvalidRequest, match="messages is empty"):
        chat.render([])
    with pytest.raises(InvalidRequest, match=r"messages\[1\]\.role 'robot'"):
        chat.render(_messages([("user", "hi"), ("robot", "beep")]))
    with pytest.raises(InvalidRequest, match="tool"):
        chat.render(_messages([("tool", "42")]))  # the ChatML template knows no tool role
    alternating = ChatTemplate(ALTERNATING_TEMPLATE, chat.tokenizer, chat.special_tokens)
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        alternating.render(_messages([("user", "a"), ("user", "b")]))
    # the sandbox: templates cannot change what they are given or reach Python internals
    for source in ("{{ messages.append(1) }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}"):
        with pytest.raises(InvalidRequest, match="chat template"):
            ChatTemplate(source, chat.tokenizer).render(_messages([("user", "x")]))
    engine = make_engine(tiny_model_dir)
    with pytest.raises(InvalidRequest, match="not both"):
        engine.make_sequence("x", "hi", [], SamplingParams(), print, messages=_messages([("user", "x")]))


def test_model_without_a_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    engine = make_engine(plain)
    assert engine.chat is None
    with pytest.raises(InvalidRequest, match="no chat template"):
        engine.make_sequence("x", "", [], SamplingParams(), print, messages=_messages([("user", "x")]))


def test_chat_generation_is_the_rendered_prompts_and_stops_at_end_of_turn(chat, tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    conv = _messages(CONVERSATIONS[1])
    ids = chat.tokenizer.encode(chat.render(conv), add_special_tokens=False).ids
    full = generate(engine, ids, SamplingParams(max_tokens=10, ignore_eos=True))

    def run_chat(params: SamplingParams) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        engine.submit(engine.make_sequence("c", "", [], params, outs.append, messages=conv))
        while not (outs and outs[-1].last):
            engine.step()
        return outs

    outs = run_chat(SamplingParams(max_tokens=10, ignore_eos=True))
    assert [t for o in outs for t in o.token_ids] == full
    assert outs[-1].usage is not None and outs[-1].usage.prompt_tokens == len(ids)
    # the end-of-turn token ends chat requests (as EOS), not plain ones
    engine.chat.end_of_turn_token_ids = frozenset({full[3]})
    outs = run_chat(SamplingParams(max_tokens=10))
    cut = full.index(full[3])
    assert [t for o in outs for t in o.token_ids] == full[:cut] and outs[-1].finish_reason is FinishReason.EOS
    assert generate(engine, ids, SamplingParams(max_tokens=10)) == full
