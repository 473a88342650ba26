"""The model's chat conventions: its Jinja chat template, rendered the way transformers'
`apply_chat_template` renders it, and the tokens that end an assistant turn.

The template comes from the model directory (`chat_template.jinja`, else `chat_template` of
`tokenizer_config.json`, a string or a list of named templates of which "default" is used). It runs
in Jinja's immutable sandbox with transformers' settings and helpers: trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, `dict`, and
`namespace` without underscore attributes; the special tokens of tokenizer_config.json
(`bos_token`, `eos_token`, ...) are in its context. As in transformers, the rendered text is
tokenized without adding special tokens (the template writes them), and control tokens that a user
writes in a message are not escaped.

Generation of a chat request stops at every `eos_token_id` of generation_config.json and
config.json, at the tokenizer's `eos_token`, and at the template's end-of-turn token: the special
token the template writes right after an assistant message's content.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from loraserve.inference_worker.errors import InvalidRequest

log = logging.getLogger(__name__)

BASE_ROLES = ("system", "user", "assistant")
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_SENTINEL = "\u2063loraserve-end-of-turn-probe\u2063"


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it for
    training masks): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore attributes (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the attribute {name!r}")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _token_text(value: object) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _eos_ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    return frozenset(int(v) for v in (value if isinstance(value, list) else [value]))


class ChatTemplate:
    def __init__(
        self,
        source: str,
        tokenizer: Tokenizer,
        special_tokens: dict[str, str] | None = None,
        generation_eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.generation_eos_token_ids = generation_eos_token_ids
        self.roles = BASE_ROLES + (("tool",) if "tool" in source else ())
        self._template = compile_template(source)
        self.end_of_turn_token_ids = self._end_of_turn_ids()

    @classmethod
    def from_dir(cls, directory: str | Path, tokenizer: Tokenizer) -> ChatTemplate | None:
        """The template of a model directory; None when it has none (or it does not compile)."""
        d = Path(directory)
        config = _read_json(d / "tokenizer_config.json")
        source = None
        if (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text()
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # named templates
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        special = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(k))) is not None}
        eos = _eos_ids(_read_json(d / "generation_config.json").get("eos_token_id"))
        try:
            return cls(source, tokenizer, special, eos)
        except jinja2.TemplateError as exc:
            log.warning("the chat template of %s does not compile, chat is off: %s", d, exc)
            return None

    def _context(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> dict:
        return {
            **self.special_tokens,
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (raises InvalidRequest for a bad one)."""
        if not messages:
            raise InvalidRequest("messages is empty")
        for i, m in enumerate(messages):
            if m.role not in self.roles:
                raise InvalidRequest(f"messages[{i}].role {m.role!r} is not one of {', '.join(self.roles)}")
        plain = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._template.render(self._context(plain, add_generation_prompt))
        except jinja2.TemplateError as exc:  # raise_exception() of the template, sandbox refusals
            raise InvalidRequest(f"the model's chat template refused the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise InvalidRequest(f"the model's chat template failed on the messages: {exc!r}") from exc

    def _end_of_turn_ids(self) -> frozenset[int]:
        """The tokenizer's eos token and the special token written right after assistant text."""
        ids: set[int] = set()
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (tid := self.tokenizer.token_to_id(eos)) is not None:
            ids.add(tid)
        special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        for probe in (
            [("user", "Hi"), ("assistant", _SENTINEL)],
            [("system", "Hi"), ("user", "Hi"), ("assistant", _SENTINEL)],
        ):
            msgs = [{"role": r, "content": c} for r, c in probe]
            try:
                text = self._template.render(self._context(msgs, False))
            except Exception:  # a template with other expectations: try the next probe
                continue
            if _SENTINEL not in text:
                continue
            after = self.tokenizer.encode(text.rsplit(_SENTINEL, 1)[1], add_special_tokens=False).ids
            if after and after[0] in special:
                ids.add(after[0])
            break
        return frozenset(ids)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        log.warning("%s is not valid JSON; ignored", path)
        return {}
    return data if isinstance(data, dict) else {}
