"""Run requests through an engine on the calling thread, without the step thread."""

from __future__ import annotations

from loraserve.inference_worker.engine.engine import LLMEngine
from loraserve.inference_worker.engine.sequence import RequestOutput, SamplingParams, Sequence
from loraserve.inference_worker.errors import WorkerError


def run_request(engine: LLMEngine, seq: Sequence, outs: list[RequestOutput]) -> list[RequestOutput]:
    """Submit a sequence from make_sequence(..., on_output=outs.append) and step the engine on the
    calling thread until the request is done; -> outs."""
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
    """Run one request to completion on the calling thread; -> output token ids."""
    outs: list[RequestOutput] = []
    seq = engine.make_sequence(request_id, "", prompt_token_ids, params, outs.append)
    return completions(run_request(engine, seq, outs))[0]
