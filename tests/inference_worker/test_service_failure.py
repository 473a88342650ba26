"""A failed worker refuses each new generation with a copy of its failure: the one error it keeps
gathers no traceback from the requests it refuses (raised as it is, every refusal would add its
frames to it, and with them the request's)."""

from __future__ import annotations

import asyncio
import types

import pytest

from loraserve.inference_worker.engine.device_timing import DeviceTiming
from loraserve.inference_worker.errors import DependencyUnavailable
from loraserve.inference_worker.metrics import WorkerMetrics
from loraserve.inference_worker.model.tiny import word_tokenizer
from loraserve.inference_worker.service import InferenceWorkerServicer
from loraserve.v1 import worker_pb2


class _IdleEngine:
    num_waiting = num_running = num_free_blocks = 0
    timing = DeviceTiming(on_cuda=False)
    tokenizer = word_tokenizer(64)


def test_a_failed_worker_refuses_with_copies_of_its_failure() -> None:
    engine = _IdleEngine()
    servicer = InferenceWorkerServicer(engine, None, WorkerMetrics(engine))  # type: ignore[arg-type]
    failure = DependencyUnavailable("the accelerator went away (test)")
    servicer.fail(failure)
    context = types.SimpleNamespace(time_remaining=lambda: None)
    request = worker_pb2.GenerateRequest(prompt_token_ids=[3, 4, 5])

    async def refused() -> BaseException:
        with pytest.raises(DependencyUnavailable) as err:
            await anext(servicer._outputs(request, context, "Generate"))  # type: ignore[arg-type]
        return err.value

    errors = [asyncio.run(refused()) for _ in range(3)]
    assert all(e is not failure and str(e) == str(failure) for e in errors)
    assert failure.__traceback__ is None
