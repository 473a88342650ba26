"""Random LoRA adapters on a model config, and their optimized payloads as the worker receives
them (through the store's own optimize step), for the tests of the worker's slots."""

from __future__ import annotations

import torch

from loraserve.adapter_store.optimize import optimize
from loraserve.adapter_store.validate import LoraAdapter, LoraModule, scale_of
from loraserve.contract.adapter_layout import module_shapes
from loraserve.contract.payload import PayloadTensor
from loraserve.inference_worker.lora import AdapterPayload


def random_adapter(
    config: dict, targets: dict[str, int], seed: int, layers=(0, 1), rslora=False
) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    mods = {}
    for layer in layers:
        for m, r in targets.items():
            n_in, n_out = shapes[m]
            mods[(layer, m)] = LoraModule(
                layer,
                m,
                r,
                2.0 * r,
                scale_of(2.0 * r, r, rslora),
                torch.randn(r, n_in, generator=g),
                torch.randn(n_out, r, generator=g),
            )
    return LoraAdapter(mods, max(targets.values()), 16.0, rslora)


def payload_of(adapter: LoraAdapter, config: dict, name: str, dtype: str = "float32") -> AdapterPayload:
    opt = optimize(adapter, config, dtype)
    return AdapterPayload(
        name,
        opt.digest,
        opt.rank,
        opt.payload,
        [PayloadTensor(t.name, t.shape, t.dtype, t.offset, t.nbytes) for t in opt.tensors],
    )
