"""The engine: requests in, token/text deltas out, one step at a time on a dedicated thread.

`submit()` and `abort()` may be called from any thread (the gRPC handlers call them on the asyncio
loop); they only touch an inbox under a lock. The step thread drains the inbox, schedules, runs the
model, samples, and hands each request's `RequestOutput` to its `on_output` callback (the service
forwards it to the loop with `call_soon_threadsafe`). A cancelled request or an expired deadline is
removed before the next step and its KV blocks return to the pool at once.

With asynchronous scheduling (CUDA) step N + 1 is launched before step N is read back: README item 6.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tokenizers import Tokenizer

from loraserve.inference_worker.engine import kernel_warmup
from loraserve.inference_worker.engine.adapter_hooks import AdmissionPolicy, BaseOnlyPolicy, EngineAdapters
from loraserve.inference_worker.engine.block_manager import BlockManager
from loraserve.inference_worker.engine.config import EngineConfig
from loraserve.inference_worker.engine.device_timing import DeviceTiming
from loraserve.inference_worker.engine.forking import SiblingForker
from loraserve.inference_worker.engine.model_runner import ModelRunner
from loraserve.inference_worker.engine.output_queue import OutputCallback, OutputDispatcher, OutputQueue
from loraserve.inference_worker.engine.request_builder import RequestBuilder
from loraserve.inference_worker.engine.sampler import LaunchedSample, Sampler
from loraserve.inference_worker.engine.scheduler import AdmissionOutcome, Scheduler
from loraserve.inference_worker.engine.sequence import (
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceGroup,
    TokenLogprob,
)
from loraserve.inference_worker.errors import DeadlineExceeded, InvalidRequest, QueueFull, WorkerError
from loraserve.inference_worker.model.chat_template import ChatMessage, ChatTemplate
from loraserve.inference_worker.model.llama import LlamaModel

__all__ = ["EngineConfig", "LLMEngine"]

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        config: EngineConfig,
        adapters: EngineAdapters | None = None,
        chat: ChatTemplate | None = None,
        runner_type: Callable[..., ModelRunner] = ModelRunner,
    ) -> None:
        """`runner_type` builds the model runner (a tensor-parallel worker's rank 0 passes its
        leader runner, which sends each step to the other ranks)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.chat = chat  # the model's chat template; None when it has none
        self.adapters = adapters
        self.policy: AdmissionPolicy = adapters if adapters is not None else BaseOnlyPolicy()
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.blocks, self.policy, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.runner = runner_type(
            model,
            config.num_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_model_len,
            config.use_cuda_graphs,
            adapters,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.sampler = Sampler()
        self.forker = SiblingForker(self.blocks, self.scheduler, self.policy, self.runner)
        eos_token_ids = frozenset(model.config.eos_token_ids) | (
            chat.generation_eos_token_ids if chat is not None else frozenset()
        )
        self.requests = RequestBuilder(
            config, tokenizer, model.config.vocab_size, eos_token_ids, chat, self.blocks, self.policy
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
        self.outputs = OutputQueue()
        # called after every step that ran the model (the worker's metrics): step_observer(kind,
        # seconds, sequences, tokens, admission, adapters) with kind "prefill" (a prefill chunk in
        # the step) or "decode", admission what ended the step's admission pass
        # (scheduler.ADMISSION_OUTCOMES), adapters the distinct adapters (GPU slots) of its rows
        self.step_observer: Callable[[str, float, int, int, AdmissionOutcome, int], None] | None = None
        self._text_pending: list[Sequence] = []  # sampled last step, text not yet processed
        cfg_async = config.async_scheduling
        on_cuda = self.runner.device.type == "cuda"
        self.async_scheduling = not self.runner.sharded and (on_cuda if cfg_async is None else cfg_async)
        self._inflight: LaunchedSample | None = None  # the launched step not yet read back
        self.timing = DeviceTiming(on_cuda)  # how long steps waited for the device (metrics)

    # --------------------------------------------------------------------- any thread
    @property
    def output_dispatcher(self) -> OutputDispatcher | None:
        """Receives all (callback, output) pairs of one step at once (see OutputQueue)."""
        return self.outputs.dispatcher

    @output_dispatcher.setter
    def output_dispatcher(self, dispatcher: OutputDispatcher | None) -> None:
        self.outputs.dispatcher = dispatcher

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
        on_output: OutputCallback,
        adapter_id: str = "",
        deadline: float | None = None,
        messages: list[ChatMessage] | None = None,
        add_generation_prompt: bool = True,
    ) -> Sequence:
        """Validate a request and build its sequence (raises InvalidRequest and friends); see
        RequestBuilder.build. Chat `messages` are rendered here: call it off the event loop."""
        return self.requests.build(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            on_output,
            adapter_id,
            deadline,
            messages,
            add_generation_prompt,
        )

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

    def set_async_scheduling(self, on: bool) -> None:
        """Turn asynchronous scheduling on or off between steps (on the thread that steps the
        engine, or before `start`); the step in flight is read back first. A tensor-parallel
        leader stays synchronous."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            self._complete(launched)
            self._process_text()
            self.outputs.flush()
        self.async_scheduling = on and not self.runner.sharded

    def start(self) -> None:
        # before serving, so no request waits for a kernel compile or a graph capture
        kernel_warmup.before_serving(self.runner, self.config)
        self.runner.capture_graphs()
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._thread is None or not self._thread.is_alive():  # never beside a running step
            self.runner.close()

    # ------------------------------------------------------------------ step thread
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (
                    self._stop or self._inbox or self._aborts or self.scheduler.has_work or self._inflight
                ):
                    self._wake.wait()
                if self._stop:
                    break
            ran = True
            try:
                ran = self.step()
            except Exception as exc:
                # an expected failure (a tensor-parallel rank died) is told to each request it ends
                if isinstance(exc, WorkerError):
                    log.info("engine step failed: %s", exc)
                else:
                    log.exception("engine step failed")
                self._inflight = None  # what it sampled is not trusted: its sequences end here
                for seq in list(self.scheduler.running):
                    self._finish(seq, FinishReason.ERROR, error=exc)
                self.outputs.flush()
            if not ran:  # everything waits (e.g. for an adapter load): sleep until woken, not spin
                with self._lock:
                    if not self._stop and not self._inbox and not self._aborts:
                        self._wake.wait(timeout=0.01)
        for group in list(self._by_request.values()):
            for seq in group.seqs:
                self._finish(seq, FinishReason.CANCELLED)
        self.outputs.flush()

    def _drain_inbox(self) -> None:
        with self._lock:
            new, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
            groups = list(self._by_request.values())  # submit() adds to it from other threads
        for seq in new:
            self.scheduler.add(seq)
        for rid in aborts:
            aborted = self._by_request.get(rid)
            for seq in aborted.seqs if aborted is not None else ():
                self._finish(seq, FinishReason.CANCELLED)
        now = time.monotonic()
        for group in [g for g in groups if (d := g.seqs[0].deadline) is not None and d <= now]:
            for seq in group.seqs:
                self._finish(seq, FinishReason.CANCELLED, error=DeadlineExceeded("deadline exceeded"))

    def step(self) -> bool:
        """One scheduling round and model call; False when there was nothing to run."""
        try:
            return self._step()
        finally:
            self.outputs.flush()

    def _step(self) -> bool:
        t0 = time.perf_counter()
        self._drain_inbox()
        sched = self.scheduler.schedule()
        for seq in sched.failed:
            self._finish(seq, FinishReason.ERROR, error=seq.error)
        prev = self._inflight
        if sched.empty:
            if prev is None:
                self._process_text()
                return False
            # nothing runs next (the sequences of the step in flight end with it): read it back
            self._inflight = None
            self._complete(prev)
            self._process_text()
            return True
        # asynchronous on CUDA; decode rows with a token still on the device read it there
        started = self.timing.begin()
        logits, seqs = self.runner.execute(sched, prev.tokens if prev is not None else None)
        for seq, n in sched.prefills:
            seq.num_computed_tokens += n
            self.num_prefill_tokens += n
        for seq in sched.decodes:
            seq.num_computed_tokens += 1
        if not self.async_scheduling:
            # detokenize, check stop strings and emit the previous step's tokens while the GPU runs
            self._process_text()
        logits, seqs = self.forker.fork(logits, seqs)
        launched = self.sampler.launch(logits, seqs, started, *self.runner.token_buffer(logits, len(seqs)))
        for i, seq in enumerate(seqs):
            seq.num_pending += 1
            seq.pending_row = i
        if self.async_scheduling:
            # this step is queued behind the previous one: read that one back, then process its
            # text, while the device runs this one
            self._inflight = launched
            if prev is not None:
                self._complete(prev)
            self._process_text()
        else:
            self._complete(launched)
        self.num_steps += 1
        if self.step_observer is not None:
            tokens = sum(n for _, n in sched.prefills) + len(sched.decodes)
            kind = "prefill" if sched.prefills else "decode"
            rows = len(sched.prefills) + len(sched.decodes)
            slots = {s.lora_slot for s in sched.decodes}
            slots.update(s.lora_slot for s, _ in sched.prefills)
            slots.discard(-1)  # the base model's rows
            seconds = time.perf_counter() - t0
            self.step_observer(kind, seconds, rows, tokens, sched.admission, len(slots))
        return True

    def _complete(self, launched: LaunchedSample) -> None:
        """Read a launched step's tokens back (waits for the device) and append them."""
        sampled = self.sampler.finish(launched)
        self.timing.observe(launched)
        now = time.monotonic()
        for seq, tok, lp in zip(launched.seqs, sampled.token_ids, sampled.logprobs, strict=True):
            seq.num_pending -= 1
            if seq.finish_reason is None:  # not ended meanwhile (a stop string, an abort)
                self._append(seq, tok, now, lp)

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
        known = seq.num_prompt_tokens + len(seq.output_token_ids)  # not a later step's pending token
        if len(seq.output_token_ids) >= p.max_tokens or known >= self.config.max_model_len:
            return self._finish(seq, FinishReason.LENGTH)
        self._text_pending.append(seq)

    def _process_text(self) -> None:
        """Detokenize the tokens appended since the last call, end sequences on stop strings, and
        emit a running sequence's unsent tokens when it has its first token or `every` (its stream
        interval, the engine's where the request set none: RequestBuilder) unsent: outputs of 1,
        every, every, ... tokens, then whatever is left with the ending (`_finish`)."""
        pending, self._text_pending = self._text_pending, []
        for seq in pending:
            if seq.finish_reason is not None:
                continue
            if seq.text_stream.feed(seq.output_token_ids):  # a stop string matched
                self._finish(seq, FinishReason.STOP)
                continue
            sent, every = seq.sent_token_count, seq.params.stream_interval
            if every == 1 or not sent or len(seq.output_token_ids) - sent >= every:
                self.outputs.emit(seq, seq.take_unsent())

    def _finish(self, seq: Sequence, reason: FinishReason, error: Exception | None = None) -> None:
        if seq.finish_reason is not None:
            return
        done = (FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS)
        if reason in done and seq.text_stream.feed(seq.output_token_ids):
            reason = FinishReason.STOP  # the last tokens completed a stop string
        self.scheduler.remove(seq)
        self.sampler.release(seq)
        seq.finish_reason = reason
        group = seq.group
        assert group is not None
        group.finished_one()
        if group.done:
            self._by_request.pop(seq.request_id, None)
        self.outputs.emit(
            seq, seq.take_unsent(reason, group.usage(time.monotonic()) if group.done else None, error)
        )
        forks, seq.forks = seq.forks, []
        for child in forks:  # ended before its prompt was computed: so do the siblings
            self._finish(child, reason, error)
