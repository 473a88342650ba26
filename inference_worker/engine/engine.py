"""The engine: requests in, token/text deltas out, one step at a time on a dedicated thread.

`submit()` and `abort()` may be called from any thread (the gRPC handlers call them on the asyncio
loop); they only touch an inbox under a lock. The step thread drains the inbox, schedules, runs the
model, samples, and hands each request's `RequestOutput` to its `on_output` callback (the service
forwards it to the loop with `call_soon_threadsafe`). A cancelled request or an expired deadline is
removed before the next step and its KV blocks return to the pool at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from loraserve.inference_worker.engine.adapter_hooks import AdmissionPolicy, BaseOnlyPolicy, EngineAdapters
from loraserve.inference_worker.engine.block_manager import BlockManager
from loraserve.inference_worker.engine.model_runner import ModelRunner
from loraserve.inference_worker.engine.sampler import MAX_TOP_LOGPROBS, Sampler
from loraserve.inference_worker.engine.scheduler import Scheduler
from loraserve.inference_worker.engine.sequence import (
    FinishReason,
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    TokenLogprob,
)
from loraserve.inference_worker.engine.text_stream import TextStream
from loraserve.inference_worker.errors import DeadlineExceeded, InvalidRequest, QueueFull, WorkerError
from loraserve.inference_worker.model.chat_template import ChatMessage, ChatTemplate
from loraserve.inference_worker.model.llama import LlamaModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512  # token budget of one step; longer prompts are chunked
    block_size: int = 16
    num_blocks: int = 1024  # KV cache blocks (one is reserved)
    max_queue_size: int = 256  # waiting requests before RESOURCE_EXHAUSTED
    default_max_tokens: int = 16
    use_cuda_graphs: bool = True


class LLMEngine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer,
        config: EngineConfig,
        adapters: EngineAdapters | None = None,
        chat: ChatTemplate | None = None,
    ) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.chat = chat  # the model's chat template; None when it has none
        self.adapters = adapters
        self.policy: AdmissionPolicy = adapters if adapters is not None else BaseOnlyPolicy()
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.blocks, self.policy, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.runner = ModelRunner(
            model,
            config.num_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_model_len,
            config.use_cuda_graphs,
            adapters,
        )
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(model.config.eos_token_ids) | (
            chat.generation_eos_token_ids if chat is not None else frozenset()
        )
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._by_request: dict[str, SequenceGroup] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self.num_steps = 0
        self.num_prefill_tokens = 0  # tokens run through prefill (an n > 1 prompt counts once)
        # Optional: receives all (callback, output) pairs of one step at once, so a service can hand
        # them to its event loop with one thread-safe wake-up per step instead of one per sequence.
        self.output_dispatcher: (
            Callable[[list[tuple[Callable[[RequestOutput], None], RequestOutput]]], None] | None
        ) = None
        self._pending: list[tuple[Callable[[RequestOutput], None], RequestOutput]] = []
        self._text_pending: list[Sequence] = []  # sampled last step, text not yet processed

    # --------------------------------------------------------------------- any thread
    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def idle(self) -> bool:
        return not self._by_request

    def make_sequence(
        self,
        request_id: str,
        prompt: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_output,
        adapter_id: str = "",
        deadline: float | None = None,
        messages: list[ChatMessage] | None = None,
        add_generation_prompt: bool = True,
    ) -> Sequence:
        """Validate a request and build its sequence (raises InvalidRequest and friends). With
        params.n > 1 the siblings hang on the first sequence (`forks`). Chat `messages` are
        rendered with the model's template here: call it off the event loop."""
        cfg = self.config
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
            vocab = self.model.config.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        else:
            ids = self.tokenizer.encode(prompt).ids if prompt else []
        if not ids:
            raise InvalidRequest("the prompt is empty: send a prompt, prompt_token_ids or messages")
        p = params
        if not math.isfinite(p.temperature) or p.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {p.temperature}")
        if not 0.0 < p.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {p.top_p}")
        if p.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {p.top_k}")
        if p.max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be >= 0, got {p.max_tokens}")
        if not 1 <= p.n <= cfg.max_num_seqs:
            raise InvalidRequest(f"n must be in [1, max_num_seqs = {cfg.max_num_seqs}], got {p.n}")
        if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")
        if p.top_logprobs and not p.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(p, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
            raise InvalidRequest(
                f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}"
            )
        if len(ids) >= cfg.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) leaves no room to generate within max_model_len "
                f"{cfg.max_model_len}"
            )
        max_tokens = p.max_tokens or min(cfg.default_max_tokens, cfg.max_model_len - len(ids))
        if len(ids) + max_tokens > cfg.max_model_len or max_tokens <= 0:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) plus max_tokens ({p.max_tokens or max_tokens}) "
                f"exceeds max_model_len {cfg.max_model_len}"
            )
        if self.blocks.blocks_needed(len(ids) + max_tokens) > self.blocks.num_usable_blocks:
            raise InvalidRequest(
                f"prompt plus max_tokens ({len(ids) + max_tokens} tokens) exceeds the KV "
                f"cache ({self.blocks.num_usable_blocks * cfg.block_size} tokens)"
            )
        if max_tokens != p.max_tokens:
            p = replace(p, max_tokens=max_tokens)
        seqs = [
            Sequence(
                request_id=request_id,
                prompt_token_ids=ids,
                # completion i samples with seed + i, so it equals a lone request with that seed
                params=replace(p, seed=(p.seed + i) & 0xFFFF_FFFF_FFFF_FFFF)
                if p.seed is not None and i
                else p,
                on_output=on_output,
                text_stream=TextStream(self.tokenizer, p.stop),
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

    def submit(self, seq: Sequence) -> None:
        with self._lock:
            if seq.request_id in self._by_request:
                raise InvalidRequest(f"request id {seq.request_id!r} is already running")
            if self.num_waiting >= self.config.max_queue_size:
                raise QueueFull(f"the waiting queue is full ({self.config.max_queue_size} requests)")
            assert seq.group is not None, "sequences come from make_sequence()"
            self._by_request[seq.request_id] = seq.group
            self._inbox.append(seq)
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._wake.notify()

    def wake(self) -> None:
        """Make the step loop look at its queue again (an adapter load finished)."""
        with self._lock:
            self._wake.notify()

    def start(self) -> None:
        self.runner.capture_graphs()  # before serving, so no request waits for it
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ step thread
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._inbox and not self._aborts and not self.scheduler.has_work:
                    self._wake.wait()
                if self._stop:
                    break
            ran = True
            try:
                ran = self.step()
            except Exception as exc:
                log.exception("engine step failed")
                for seq in list(self.scheduler.running):
                    self._finish(seq, FinishReason.ERROR, error=exc)
                self._flush()
            if not ran:  # everything waits (e.g. for an adapter load): sleep until woken, not spin
                with self._lock:
                    if not self._stop and not self._inbox and not self._aborts:
                        self._wake.wait(timeout=0.01)
        for group in list(self._by_request.values()):
            for seq in group.seqs:
                self._finish(seq, FinishReason.CANCELLED)
        self._flush()

    def _drain_inbox(self) -> None:
        with self._lock:
            new, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        for seq in new:
            self.scheduler.add(seq)
        for rid in aborts:
            aborted = self._by_request.get(rid)
            for seq in aborted.seqs if aborted is not None else ():
                self._finish(seq, FinishReason.CANCELLED)
        now = time.monotonic()
        expired = [g for g in self._by_request.values() if (d := g.seqs[0].deadline) is not None and d <= now]
        for group in expired:
            for seq in group.seqs:
                self._finish(seq, FinishReason.CANCELLED, error=DeadlineExceeded("deadline exceeded"))

    def step(self) -> bool:
        """One scheduling round and model call; False when there was nothing to run."""
        try:
            return self._step()
        finally:
            self._flush()

    def _step(self) -> bool:
        self._drain_inbox()
        sched = self.scheduler.schedule()
        for seq in sched.failed:
            self._finish(seq, FinishReason.ERROR, error=seq.error)
        if sched.empty:
            self._process_text()
            return False
        logits, seqs = self.runner.execute(sched)  # asynchronous on CUDA
        for seq, n in sched.prefills:
            seq.num_computed_tokens += n
            self.num_prefill_tokens += n
        for seq in sched.decodes:
            seq.num_computed_tokens += 1
        # detokenize, check stop strings and emit the previous step's tokens while the GPU runs
        self._process_text()
        parents = [i for i, s in enumerate(seqs) if s.forks and s.finish_reason is None]
        if parents:
            logits, seqs = self._fork(logits, seqs, parents)
        sampled = self.sampler.step(logits, seqs)
        now = time.monotonic()
        for seq, tok, lp in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
            if seq.finish_reason is None:  # not ended by a stop string found just above
                self._append(seq, tok, now, lp)
        self.num_steps += 1
        return True

    def _fork(
        self, logits: torch.Tensor, seqs: list[Sequence], parents: list[int]
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """The siblings of n > 1 requests whose prompt was just computed start from its KV: they
        share its full blocks (a copy of the partial last one each) and sample their first token
        from its logits row. -> logits and sequences with a row added per sibling."""
        rows = list(range(len(seqs)))
        seqs = list(seqs)
        copies: list[tuple[int, int]] = []
        for i in parents:
            parent = seqs[i]
            for child in parent.forks:
                child.admitted_time = parent.admitted_time
                if self.blocks.can_fork(parent) and self._admit_fork(parent, child):
                    copy = self.blocks.fork(parent, child)
                    if copy is not None:
                        copies.append(copy)
                    self.scheduler.add_forked(child)
                else:  # no block (or adapter) for it now: it computes its prompt itself later
                    child.status = SequenceStatus.WAITING
                    self.scheduler.waiting.appendleft(child)
                rows.append(i)
                seqs.append(child)
            parent.forks = []
        if copies:
            self.runner.copy_blocks([c[0] for c in copies], [c[1] for c in copies])
        return logits[torch.tensor(rows, device=logits.device)], seqs

    def _admit_fork(self, parent: Sequence, child: Sequence) -> bool:
        """Hold the adapter for `child`; False (holding nothing) unless it gets the parent's slot."""
        if not self.policy.can_admit(child):
            return False
        if (child.lora_slot, child.adapter_digest) != (parent.lora_slot, parent.adapter_digest):
            self.policy.on_finished(child)  # another adapter version now: the shared KV is not its own
            return False
        return True

    def _append(self, seq: Sequence, tok: int, now: float, logprob: TokenLogprob | None = None) -> None:
        """Token bookkeeping right after sampling; text and its delta follow in the next step."""
        p = seq.params
        if seq.first_token_time is None:
            seq.first_token_time = now
        if tok in p.stop_token_ids:
            return self._finish(seq, FinishReason.STOP)
        if tok in seq.eos_token_ids and not p.ignore_eos:
            return self._finish(seq, FinishReason.EOS)
        seq.output_token_ids.append(tok)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return self._finish(seq, FinishReason.LENGTH)
        self._text_pending.append(seq)

    @staticmethod
    def _advance_text(seq: Sequence) -> bool:
        """Feed the sequence's new tokens to its text stream; True when a stop string matched."""
        stream = seq.text_stream
        while (n := len(stream.token_ids)) < len(seq.output_token_ids):  # n: tokens already fed
            if stream.append(seq.output_token_ids[n]):
                del seq.output_token_ids[n + 1 :]
                return True
        return False

    def _process_text(self) -> None:
        pending, self._text_pending = self._text_pending, []
        for seq in pending:
            if seq.finish_reason is not None:
                continue
            if self._advance_text(seq):
                self._finish(seq, FinishReason.STOP)
                continue
            start, end = seq.sent_token_count, len(seq.output_token_ids)
            seq.sent_token_count = end
            self._emit(
                seq,
                RequestOutput(
                    seq.request_id,
                    seq.output_token_ids[start:end],
                    seq.text_stream.take(final=False),
                    index=seq.index,
                    logprobs=seq.output_logprobs[start:end],
                ),
            )

    def _finish(self, seq: Sequence, reason: FinishReason, error: Exception | None = None) -> None:
        if seq.finish_reason is not None:
            return
        if reason in (FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS) and self._advance_text(seq):
            reason = FinishReason.STOP  # the last tokens completed a stop string
        self.scheduler.remove(seq)
        self.sampler.release(seq)
        seq.finish_reason = reason
        group = seq.group
        assert group is not None
        group.num_finished += 1
        if group.done:
            self._by_request.pop(seq.request_id, None)
        start, end = seq.sent_token_count, len(seq.output_token_ids)
        seq.sent_token_count = end
        self._emit(
            seq,
            RequestOutput(
                seq.request_id,
                seq.output_token_ids[start:end],
                seq.text_stream.take(final=True),
                finish_reason=reason,
                usage=group.usage(time.monotonic()) if group.done else None,
                error=error,
                adapter_id=seq.adapter_id,
                adapter_digest=seq.adapter_digest,
                index=seq.index,
                logprobs=seq.output_logprobs[start:end],
            ),
        )
        forks, seq.forks = seq.forks, []
        for child in forks:  # ended before its prompt was computed: so do the siblings
            self._finish(child, reason, error)

    def _emit(self, seq: Sequence, out: RequestOutput) -> None:
        if self.output_dispatcher is not None:
            self._pending.append((seq.on_output, out))
            return
        try:
            seq.on_output(out)
        except Exception:
            log.debug("dropped output of %s", seq.request_id, exc_info=True)

    def _flush(self) -> None:
        if not self._pending or self.output_dispatcher is None:
            return
        items, self._pending = self._pending, []
        try:
            self.output_dispatcher(items)
        except Exception:
            log.debug("dropped %d outputs", len(items), exc_info=True)


def run_request(engine: LLMEngine, seq: Sequence, outs: list[RequestOutput]) -> list[RequestOutput]:
    """Submit a sequence from make_sequence(..., on_output=outs.append) and step the engine on the
    calling thread until the request is done (tests, benchmarks); -> outs."""
    engine.submit(seq)
    while not (outs and outs[-1].last):
        engine.step()
    if outs[-1].error is not None and not isinstance(outs[-1].error, WorkerError):
        raise outs[-1].error
    return outs


def completions(outs: list[RequestOutput]) -> list[list[int]]:
    """The token ids of each completion index of a request's outputs."""
    n = max(o.index for o in outs) + 1
    tokens: list[list[int]] = [[] for _ in range(n)]
    for o in outs:
        tokens[o.index].extend(o.token_ids)
    return tokens


def generate(
    engine: LLMEngine, prompt_token_ids: list[int], params: SamplingParams, request_id: str = "local"
) -> list[int]:
    """Run one request to completion on the calling thread (tests, benchmarks); -> output token ids."""
    outs: list[RequestOutput] = []
    seq = engine.make_sequence(request_id, "", prompt_token_ids, params, outs.append)
    return completions(run_request(engine, seq, outs))[0]
