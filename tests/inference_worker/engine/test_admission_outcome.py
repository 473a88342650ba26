"""Each scheduling pass says what ended its admission: the queue's end, max_num_seqs, the token
budget, KV memory, adapters not resident yet, or a preemption. A batch below max_num_seqs with
requests waiting is then explained by the worker's metrics instead of guessed at."""

from __future__ import annotations

from collections.abc import Iterable

from loraserve.inference_worker.engine.block_manager import BlockManager
from loraserve.inference_worker.engine.scheduler import Scheduler
from loraserve.inference_worker.engine.sequence import SamplingParams, Sequence
from loraserve.inference_worker.engine.text_stream import NoText


class Policy:
    """Admits every sequence but those whose adapter id is in `cold` (a fetch still pending)."""

    def __init__(self, cold: Iterable[str] = ()) -> None:
        self.cold = set(cold)

    def validate(self, seq: Sequence) -> None:
        pass

    def can_admit(self, seq: Sequence) -> bool:
        return seq.adapter_id not in self.cold

    def look_ahead(self, waiting: Iterable[Sequence]) -> None:
        pass

    def on_finished(self, seq: Sequence) -> None:
        pass


def seq(prompt_len: int = 8, adapter: str = "") -> Sequence:
    return Sequence(
        request_id="r",
        prompt_token_ids=list(range(3, 3 + prompt_len)),
        params=SamplingParams(max_tokens=64),
        on_output=lambda out: None,
        text_stream=NoText(),
        adapter_id=adapter,
    )


def scheduler(num_blocks: int = 64, max_num_seqs: int = 4, budget: int = 256, cold=()) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 16), Policy(cold), max_num_seqs, budget)


def run_step(s: Scheduler):
    """One pass, with every scheduled token computed (as the engine does after the model call)."""
    out = s.schedule()
    for q, n in out.prefills:
        q.num_computed_tokens += n
        if q.num_computed_tokens == q.num_tokens:  # the prompt's last chunk samples a token
            q.output_token_ids.append(7)
    for q in out.decodes:
        q.num_computed_tokens += 1
        q.output_token_ids.append(7)
    return out


def test_each_outcome_names_what_held_the_queue_back() -> None:
    s = scheduler()
    assert run_step(s).admission == "queue_empty"  # nothing waited
    for _ in range(3):
        s.add(seq())
    out = run_step(s)
    assert out.admission == "queue_empty" and len(out.prefills) == 3  # all admitted
    for _ in range(3):
        s.add(seq())
    out = run_step(s)
    assert out.admission == "max_num_seqs" and len(s.running) == 4 and len(s.waiting) == 2

    s = scheduler(budget=20)
    for _ in range(3):
        s.add(seq(prompt_len=12))
    out = run_step(s)  # 12 + 8 of the budget's 20: the third never gets a token
    assert out.admission == "token_budget" and [n for _, n in out.prefills] == [12, 8]

    s = scheduler(num_blocks=4)  # 3 usable blocks of 16 tokens
    for _ in range(2):
        s.add(seq(prompt_len=40))  # 3 blocks each
    out = run_step(s)
    assert out.admission == "kv_memory" and len(out.prefills) == 1 and len(s.waiting) == 1

    s = scheduler(cold={"cold"})
    s.add(seq(adapter="cold"))
    s.add(seq(adapter="warm"))
    out = run_step(s)  # the scan went past the cold one: no head-of-line blocking
    assert out.admission == "adapter_wait" and [q.adapter_id for q, _ in out.prefills] == ["warm"]
    s.policy.cold.clear()  # type: ignore[attr-defined]
    assert run_step(s).admission == "queue_empty"


def test_a_preempting_pass_admits_nothing_and_says_so() -> None:
    s = scheduler(num_blocks=5, max_num_seqs=8)  # 4 usable blocks of 16 tokens
    first, second = seq(prompt_len=32), seq(prompt_len=31)  # 2 blocks each, the second's last not full
    s.add(first)
    s.add(second)
    run_step(s)
    s.add(seq())
    outcomes = [run_step(s).admission for _ in range(3)]  # the second needs a third block: none free
    # preempted, it waits at the queue's head for the two blocks the first one's growth left one of
    assert outcomes == ["preempted", "kv_memory", "kv_memory"] and second.num_preemptions == 1
    assert s.waiting[0] is second


def test_a_sequence_whose_last_token_is_on_the_device_holds_the_pass() -> None:
    s = scheduler()
    s.add(seq())
    run_step(s)
    late = seq()
    late.num_pending = 1  # preempted while its last token was still on the device
    s.add(late)
    out = run_step(s)
    assert out.admission == "pending_token" and len(s.waiting) == 1 and len(out.decodes) == 1
    late.num_pending = 0
    assert run_step(s).admission == "queue_empty" and not s.waiting
