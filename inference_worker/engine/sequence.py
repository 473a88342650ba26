"""One request as the engine tracks it: tokens, sampling parameters, KV blocks, timings."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.contract.usage import Usage
from loraserve.inference_worker.engine.text_stream import NoText, TextStream


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    ERROR = "error"


class SequenceStatus(enum.Enum):
    PENDING = "pending"  # a sibling of an n > 1 request, waiting for the first one's prompt KV
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    # with max_tokens 0: what the context leaves after the prompt, not the engine's default
    fill_context: bool = False
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # completions of the prompt
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position (needs logprobs)
    presence_penalty: float = 0.0  # OpenAI: over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # Hugging Face: over prompt and generated tokens, 1 = off
    # a running sequence's tokens go out every this many (its first at once, its end whenever it
    # comes); 0 = the engine's EngineConfig.stream_interval
    stream_interval: int = 0
    # False: the output's text is made elsewhere from its tokens (the stream relay's front), and
    # the outputs carry tokens only; for requests without stop strings
    detokenize: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the `top_logprobs` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class RequestOutput:
    """What one step produced for one request, delivered to its `on_output` callback."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: Exception | None = None
    adapter_id: str = ""
    adapter_digest: str = ""
    index: int = 0  # which of the request's n completions
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when asked for

    @property
    def finished(self) -> bool:
        """This completion (index) ended."""
        return self.finish_reason is not None

    @property
    def last(self) -> bool:
        """The request's last output: every completion ended (it carries the usage) or one failed."""
        return self.usage is not None or self.error is not None


_ids = itertools.count(1)


@dataclass(eq=False)  # one sequence is one object: compared (list.remove, `in`) by identity
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    text_stream: TextStream | NoText
    adapter_id: str = ""  # "" = base model; passed through untouched ("id@digest" allowed)
    deadline: float | None = None  # time.monotonic() deadline, None = none
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    # tokens sampled on the device but not yet read back (0 or 1: with asynchronous scheduling the
    # next step is planned while this one runs); `pending_row` is that token's row in the step's
    # sampled-token tensor, which the next step's input reads on the device
    num_pending: int = 0
    pending_row: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    # set by the adapters at admission (can_admit): GPU slot (-1 = base) and the version's digest
    lora_slot: int = -1
    adapter_digest: str = ""
    adapter_tier: str = ""  # set at submission: where the adapter was then (gpu, cpu, store)
    error: Exception | None = None  # set when admission failed for good (e.g. adapter load)
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    sent_token_count: int = 0  # output tokens already delivered
    # tokens that end this sequence as EOS (the model's, plus the chat template's end of turn)
    eos_token_ids: frozenset[int] = frozenset()
    index: int = 0  # which of the request's n completions
    # siblings (n > 1) that start from this sequence's prompt KV once its prefill is done
    forks: list[Sequence] = field(default_factory=list)
    group: SequenceGroup | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # parallel to output_token_ids
    trace_context: object = None  # the request's OpenTelemetry context (None while tracing is off)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Output tokens so far, the one still on the device included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def ends_with_pending(self) -> bool:
        """Its token on the device is its last (max_tokens): no step needs to run for it."""
        return self.num_pending > 0 and self.num_generated >= self.params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """[token_at(i) for i in range(start, end)], by slices."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model: 1 while decoding, more while (re)prefilling
        (after a preemption the generated tokens are recomputed with the prompt)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def take_unsent(
        self,
        finish_reason: FinishReason | None = None,
        usage: Usage | None = None,
        error: Exception | None = None,
    ) -> RequestOutput:
        """The tokens, text and logprobs not sent yet, as one output (now counted as sent); with a
        `finish_reason`, the last one (the adapter that served it, the request's usage when done)."""
        start, end = self.sent_token_count, len(self.output_token_ids)
        self.sent_token_count = end
        final = finish_reason is not None
        # every sequence, every step: positional arguments, half the cost of keywords (request_id,
        # token_ids, text, finish_reason, usage, error, adapter_id, adapter_digest, index, logprobs)
        return RequestOutput(
            self.request_id,
            self.output_token_ids[start:end],
            self.text_stream.take(final),
            finish_reason,
            usage,
            error,
            self.adapter_id if final else "",
            self.adapter_digest if final else "",
            self.index,
            self.output_logprobs[start:end],
        )

    def usage(self, now: float) -> Usage:
        admitted = self.admitted_time if self.admitted_time is not None else now
        first = self.first_token_time if self.first_token_time is not None else now
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=len(self.output_token_ids),
            queue_time_ms=(admitted - self.arrival_time) * 1e3,
            time_to_first_token_ms=(first - self.arrival_time) * 1e3,
            total_time_ms=(now - self.arrival_time) * 1e3,
            adapter_tier=self.adapter_tier,
        )


@dataclass
class SequenceGroup:
    """The n completions of one request. The request is done when all of them finished; its
    usage counts the prompt once and the generated tokens of every completion."""

    request_id: str
    seqs: list[Sequence]
    num_finished: int = 0

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.seqs)

    def finished_one(self) -> None:
        """One completion ended. When the last has, the sequences let go of the group (nothing reads
        it then): they are freed by reference counts, not left in a cycle for the collector."""
        self.num_finished += 1
        if self.done:
            for s in self.seqs:
                s.group = None

    def usage(self, now: float) -> Usage:
        first, *_ = self.seqs
        u = first.usage(now)
        firsts = [s.first_token_time for s in self.seqs if s.first_token_time is not None]
        return dataclasses.replace(
            u,
            completion_tokens=sum(len(s.output_token_ids) for s in self.seqs),
            time_to_first_token_ms=(min(firsts) - first.arrival_time) * 1e3
            if firsts
            else u.time_to_first_token_ms,
        )
