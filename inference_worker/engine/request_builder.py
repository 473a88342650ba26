"""A request as the engine takes it: the prompt rendered and tokenized, every limit checked, the
defaults filled in, and its n sequences built (raises InvalidRequest naming the limit).

Runs on the caller's thread (the service calls it off the event loop: a chat template renders here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tokenizers import Tokenizer

from loraserve.inference_worker.engine.adapter_hooks import AdmissionPolicy
from loraserve.inference_worker.engine.block_manager import BlockManager
from loraserve.inference_worker.engine.config import EngineConfig
from loraserve.inference_worker.engine.request_checks import (
    check_prompt_size,
    check_request_id,
    check_sampling_params,
    check_stops,
)
from loraserve.inference_worker.engine.sequence import (
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from loraserve.inference_worker.engine.text_stream import NO_TEXT, TextStream
from loraserve.inference_worker.errors import InvalidRequest
from loraserve.inference_worker.model.chat_template import ChatMessage, ChatTemplate


class RequestBuilder:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        chat: ChatTemplate | None,
        blocks: BlockManager,
        policy: AdmissionPolicy,
    ) -> None:
        self.config, self.tokenizer, self.vocab_size = config, tokenizer, vocab_size
        self.eos_token_ids, self.chat = eos_token_ids, chat
        self.blocks, self.policy = blocks, policy

    def _prompt_ids(
        self,
        prompt: str,
        prompt_token_ids: list[int],
        messages: list[ChatMessage] | None,
        add_generation_prompt: bool,
    ) -> tuple[list[int], frozenset[int]]:
        """-> the prompt's token ids and the tokens that end it as EOS."""
        eos = self.eos_token_ids
        if messages:
            if prompt or prompt_token_ids:
                raise InvalidRequest("set either messages or prompt / prompt_token_ids, not both")
            if self.chat is None:
                raise InvalidRequest("this model has no chat template; send a prompt instead of messages")
            text = self.chat.render(messages, add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids  # the template adds them
            eos = eos | self.chat.end_of_turn_token_ids
        elif prompt_token_ids:
            ids = list(prompt_token_ids)
            vocab = self.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        else:
            ids = self.tokenizer.encode(prompt).ids if prompt else []
        if not ids:
            raise InvalidRequest("the prompt is empty: send a prompt, prompt_token_ids or messages")
        return ids, eos

    def _max_tokens(self, num_prompt_tokens: int, asked: int, fill_context: bool) -> int:
        """max_tokens for a prompt of that length, checked to fit; when 0 was asked, the default,
        or with `fill_context` what the context (max_model_len, or the KV cache) leaves."""
        cfg, n = self.config, num_prompt_tokens
        if n >= cfg.max_model_len:
            raise InvalidRequest(
                f"prompt ({n} tokens) leaves no room to generate within max_model_len {cfg.max_model_len}"
            )
        if asked or not fill_context:
            max_tokens = asked or min(cfg.default_max_tokens, cfg.max_model_len - n)
        else:
            kv = self.blocks.num_usable_blocks * cfg.block_size
            if n >= kv:
                raise InvalidRequest(
                    f"prompt ({n} tokens) leaves no room to generate within the KV cache ({kv} tokens)"
                )
            max_tokens = min(cfg.max_model_len, kv) - n
        if n + max_tokens > cfg.max_model_len or max_tokens <= 0:
            raise InvalidRequest(
                f"prompt ({n} tokens) plus max_tokens ({asked or max_tokens}) "
                f"exceeds max_model_len {cfg.max_model_len}"
            )
        if self.blocks.blocks_needed(n + max_tokens) > self.blocks.num_usable_blocks:
            raise InvalidRequest(
                f"prompt plus max_tokens ({n + max_tokens} tokens) exceeds the KV "
                f"cache ({self.blocks.num_usable_blocks * cfg.block_size} tokens)"
            )
        return max_tokens

    def build(
        self,
        request_id: str,
        prompt: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        adapter_id: str = "",
        deadline: float | None = None,
        messages: list[ChatMessage] | None = None,
        add_generation_prompt: bool = True,
    ) -> Sequence:
        """-> the request's first sequence; with params.n > 1 the siblings hang on it (`forks`).
        Sizes are checked first, before anything is tokenized, scanned or rendered."""
        cfg, p = self.config, params
        check_request_id(request_id)
        check_prompt_size(
            prompt,
            prompt_token_ids,
            messages or (),
            max_model_len=cfg.max_model_len,
            max_chars=cfg.prompt_char_limit,
        )
        check_stops(p.stop, p.stop_token_ids)
        if p.stop and not p.detokenize:
            raise ValueError("stop strings need the text: a request with them is detokenized here")
        check_sampling_params(p, cfg.max_num_seqs)
        ids, eos = self._prompt_ids(prompt, prompt_token_ids, messages, add_generation_prompt)
        max_tokens = self._max_tokens(len(ids), p.max_tokens, p.fill_context)
        if max_tokens != p.max_tokens:
            p = replace(p, max_tokens=max_tokens)
        if not p.stream_interval:  # the engine's, once, rather than at every step
            p = replace(p, stream_interval=cfg.stream_interval)
        seqs = [
            Sequence(
                request_id=request_id,
                prompt_token_ids=ids,
                # completion i samples with seed + i, so it equals a lone request with that seed
                params=replace(p, seed=(p.seed + i) & 0xFFFF_FFFF_FFFF_FFFF)
                if p.seed is not None and i
                else p,
                on_output=on_output,
                text_stream=TextStream(self.tokenizer, p.stop) if p.detokenize else NO_TEXT,
                adapter_id=adapter_id,
                deadline=deadline,
                eos_token_ids=eos,
                index=i,
                status=SequenceStatus.PENDING if i else SequenceStatus.WAITING,
            )
            for i in range(p.n)
        ]
        first = seqs[0]
        first.forks = seqs[1:]
        group = SequenceGroup(request_id, seqs)
        for seq in seqs:
            seq.group = group
        self.policy.validate(first)
        return first
