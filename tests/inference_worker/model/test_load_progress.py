"""Loading a model reports its progress tensor by tensor, ending at all of them."""

from __future__ import annotations

import torch

from loraserve.inference_worker.model.loader import load_model


def test_load_reports_every_tensor(tiny_model_dir) -> None:
    calls: list[tuple[int, int]] = []
    load_model(tiny_model_dir, torch.float32, "cpu", lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1]
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len({t for _, t in calls}) == 1
