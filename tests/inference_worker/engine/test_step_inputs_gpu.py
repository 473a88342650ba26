"""A step's host tensors reach the device intact through the pinned ring (transfer.StepInputs),
and sampled tokens come back through theirs (sampler.TokenReadback):
mixed dtypes and shapes, sizes that grow and shrink, more steps than the ring is deep, and copies
queued while the device is busy."""

from __future__ import annotations

import pytest
import torch

from loraserve.inference_worker.engine.transfer import StepInputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_ring_delivers_every_step_intact() -> None:
    dev = torch.device("cuda")
    ring = StepInputs(dev)
    g = torch.Generator().manual_seed(0)
    kept = []
    busy = torch.randn(2048, 2048, device=dev)
    for step in range(4 * StepInputs.DEPTH + 3):
        n = int(torch.randint(1, 3000, (1,), generator=g)) * (1 + step % 3)
        host = (
            torch.randint(-(2**40), 2**40, (n,), generator=g, dtype=torch.int64),
            torch.randint(-(2**30), 2**30, (n + 3,), generator=g, dtype=torch.int32),
            torch.randint(0, 100, (2, n // 2 + 1), generator=g, dtype=torch.int64),
        )
        busy = busy @ busy  # the copies queue behind device work
        got = ring.to_device(*host)
        assert [t.shape for t in got] == [t.shape for t in host]
        assert [t.dtype for t in got] == [t.dtype for t in host]
        assert all(t.device.type == "cuda" for t in got)
        # read before the ring comes back to this buffer: what a step's kernels see
        kept.append(([t.clone() for t in got], host))
    torch.cuda.synchronize()
    for got, host in kept:
        for a, b in zip(got, host, strict=True):
            assert torch.equal(a.cpu(), b)


def test_token_readback_ring_returns_each_steps_tokens_and_refuses_a_reused_buffer() -> None:
    from loraserve.inference_worker.engine.sampler import TokenReadback

    ring = TokenReadback()
    steps = [torch.arange(n, device="cuda") * (n + 1) for n in (3, 300, 7, 1, 64)]
    copies = [ring.copy(t) for t in steps[: TokenReadback.DEPTH]]
    torch.cuda.synchronize()
    for (host, turn), t in zip(copies, steps[: TokenReadback.DEPTH], strict=True):
        ring.check(turn)
        assert host.tolist() == t.tolist() and not host.is_cuda and host.is_pinned()
    ring.copy(steps[-1])  # the first buffer again
    with pytest.raises(RuntimeError, match="reused"):
        ring.check(copies[0][1])
    ring.check(copies[1][1])


def test_done_copies_are_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ring buffer whose copy has run, and a step read back after its tokens arrived, are not
    synchronized on: an event's synchronize hands the interpreter to other threads, its query
    does not, and the step thread pays for every hand-over while the event loop is busy."""
    from loraserve.inference_worker.engine.sampler import LaunchedSample, TokenReadback

    dev = torch.device("cuda")
    calls = []
    real = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: calls.append(1) or real(self))
    ring = StepInputs(dev)
    for step in range(3 * StepInputs.DEPTH):
        host = (torch.arange(step + 5, dtype=torch.int64), torch.arange(7, dtype=torch.int32))
        got = ring.to_device(*host)
        torch.cuda.synchronize()  # the device keeps up: every earlier copy has run
        assert [t.cpu().tolist() for t in got] == [t.tolist() for t in host]
    launched = LaunchedSample(torch.arange(9, device=dev), [], [], [])
    launched.start_readback(TokenReadback())
    torch.cuda.synchronize()
    assert launched.read()[0].tolist() == list(range(9)) and launched.waited == 0.0
    assert calls == []
    # a copy still queued is waited for
    busy = torch.randn(4096, 4096, device=dev)
    for _ in range(8):
        busy = busy @ busy
    pending = LaunchedSample(torch.arange(5, device=dev), [], [], [])
    pending.start_readback(TokenReadback())
    assert pending.read()[0].tolist() == list(range(5))
    assert calls == [1]
