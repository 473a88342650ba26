"""LoRA in the worker's model: stacked per-slot A/B buffers for every grouped projection
(`slots`) and the layer objects attached to those projections (`layer`); the per-step batch
metadata shared by every layer is a `kernels.LoRABatch`."""

from loraserve.inference_worker.lora.layer import LoRALayer
from loraserve.inference_worker.lora.payload import AdapterPayload
from loraserve.inference_worker.lora.slots import LoRASlots

__all__ = ["AdapterPayload", "LoRALayer", "LoRASlots"]
