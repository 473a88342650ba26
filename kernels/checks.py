"""Argument checks of the public ops (kernels.ops), run once before either backend; they raise
before any launch.

ValueError for shapes, devices, layout and metadata mismatches; TypeError for wrong types and dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from loraserve.kernels.batch import LoRABatch, _same_device

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _placed(name: str, t: torch.Tensor, batch: LoRABatch) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    if not _same_device(t.device, batch.device):
        raise ValueError(f"{name} is on {t.device}, the batch metadata on {batch.device}")


def _float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def check_batch(batch: object) -> LoRABatch:
    if not isinstance(batch, LoRABatch):
        raise TypeError(f"batch must be a LoRABatch, got {type(batch).__name__}")
    return batch


def _check_slots(name: str, num_loras: int, ranks: object, batch: LoRABatch) -> None:
    if num_loras < batch.max_loras:
        raise ValueError(f"{name} has {num_loras} slots, fewer than the batch's max_loras={batch.max_loras}")
    ranks = _tensor("ranks", ranks)
    if ranks.dtype != torch.int32:
        raise TypeError(f"ranks must be int32, got {ranks.dtype}")
    if ranks.shape != (num_loras,):
        raise ValueError(f"ranks must have shape [L]=({num_loras},), got {tuple(ranks.shape)}")
    _placed("ranks", ranks, batch)


def check_shrink_inputs(x: object, lora_a: object, ranks: object, batch: object) -> tuple[int, int, int]:
    """x [T, in]; lora_a [L, S, R, in] (x's dtype); ranks [L] int32. Returns (T, S, R)."""
    batch = check_batch(batch)
    x, lora_a = _tensor("x", x), _tensor("lora_a", lora_a)
    _float("x", x)
    if lora_a.dtype != x.dtype:
        raise TypeError(f"lora_a dtype {lora_a.dtype} differs from x dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, in], got shape {tuple(x.shape)}")
    if lora_a.dim() != 4:
        raise ValueError(f"lora_a must be 4-D [L, S, R, in], got shape {tuple(lora_a.shape)}")
    num_tokens, in_features = x.shape
    num_loras, num_slices, max_rank, a_in = lora_a.shape
    if num_tokens != batch.num_tokens:
        raise ValueError(f"x has {num_tokens} rows, the batch was prepared for {batch.num_tokens}")
    if a_in != in_features:
        raise ValueError(f"lora_a in_features {a_in} != x in_features {in_features}")
    if min(num_slices, max_rank, in_features) < 1:
        raise ValueError(f"empty dimension in x {tuple(x.shape)} or lora_a {tuple(lora_a.shape)}")
    _check_slots("lora_a", num_loras, ranks, batch)
    _placed("x", x, batch)
    _placed("lora_a", lora_a, batch)
    return num_tokens, num_slices, max_rank


def check_s(name: str, s: object, shape: tuple[int, int, int], batch: LoRABatch) -> None:
    """s [S, T, R] fp32 (the shrink output / expand input)."""
    s = _tensor(name, s)
    if s.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {s.dtype}")
    if tuple(s.shape) != shape:
        raise ValueError(f"{name} must have shape [S, T, R]={shape}, got {tuple(s.shape)}")
    _placed(name, s, batch)


def check_expand_inputs(
    lora_b: object,
    ranks: object,
    batch: object,
    slice_offsets: object,
    y: object,
    num_slices: int,
    max_rank: int,
) -> list[int]:
    """lora_b [L, N, R] (y's dtype); ranks [L]; y [T, N]; slice_offsets S+1 ints. Returns the offsets."""
    batch = check_batch(batch)
    lora_b, y = _tensor("lora_b", lora_b), _tensor("y", y)
    _float("y", y)
    if lora_b.dtype != y.dtype:
        raise TypeError(f"lora_b dtype {lora_b.dtype} differs from y dtype {y.dtype}")
    if lora_b.dim() != 3:
        raise ValueError(f"lora_b must be 3-D [L, N, R], got shape {tuple(lora_b.shape)}")
    if y.dim() != 2:
        raise ValueError(f"y must be 2-D [T, N], got shape {tuple(y.shape)}")
    num_loras, out_features, b_rank = lora_b.shape
    if y.shape[0] != batch.num_tokens:
        raise ValueError(f"y has {y.shape[0]} rows, the batch was prepared for {batch.num_tokens}")
    if b_rank != max_rank:
        raise ValueError(f"lora_b rank dimension {b_rank} != the shrink rank dimension {max_rank}")
    if y.shape[1] != out_features:
        raise ValueError(f"y has {y.shape[1]} columns, lora_b has {out_features} rows")
    _check_slots("lora_b", num_loras, ranks, batch)
    offsets = check_offsets(slice_offsets, num_slices, out_features)
    _placed("lora_b", lora_b, batch)
    _placed("y", y, batch)
    return offsets


def check_offsets(slice_offsets: object, num_slices: int, out_features: int) -> list[int]:
    if not isinstance(slice_offsets, Sequence) or isinstance(slice_offsets, (str, bytes)):
        raise TypeError(f"slice_offsets must be a sequence of ints, got {type(slice_offsets).__name__}")
    offsets = [int(o) for o in slice_offsets]
    if len(offsets) != num_slices + 1:
        raise ValueError(f"slice_offsets needs S+1={num_slices + 1} entries, got {len(offsets)}")
    if offsets[0] != 0 or offsets[-1] != out_features:
        raise ValueError(f"slice_offsets must start at 0 and end at N={out_features}, got {offsets}")
    if any(b <= a for a, b in pairwise(offsets)):
        raise ValueError(f"slice_offsets must be strictly increasing, got {offsets}")
    return offsets


def check_add_lora(
    y: object,
    x: object,
    lora_a: object,
    lora_b: object,
    ranks: object,
    batch: object,
    slice_offsets: object,
) -> tuple[int, int, int, list[int]]:
    """Both halves of add_lora; returns (T, S, R, offsets)."""
    num_tokens, num_slices, max_rank = check_shrink_inputs(x, lora_a, ranks, batch)
    offsets = check_expand_inputs(lora_b, ranks, batch, slice_offsets, y, num_slices, max_rank)
    assert isinstance(lora_a, torch.Tensor) and isinstance(lora_b, torch.Tensor)
    if lora_a.shape[0] != lora_b.shape[0]:
        raise ValueError(f"lora_a has {lora_a.shape[0]} slots, lora_b {lora_b.shape[0]}")
    return num_tokens, num_slices, max_rank, offsets


def check_shrink(
    x: object, lora_a: object, ranks: object, batch: object, out: object
) -> tuple[int, int, int]:
    """lora_shrink's arguments; out [S, T, R] fp32. Returns (T, S, R)."""
    num_tokens, num_slices, max_rank = check_shrink_inputs(x, lora_a, ranks, batch)
    assert isinstance(batch, LoRABatch)
    check_s("out", out, (num_slices, num_tokens, max_rank), batch)
    return num_tokens, num_slices, max_rank


def check_expand(
    s: object, lora_b: object, ranks: object, batch: object, slice_offsets: object, y: object
) -> list[int]:
    """lora_expand's arguments; s [S, T, R] fp32. Returns the offsets."""
    if not isinstance(s, torch.Tensor) or s.dim() != 3:
        raise ValueError(f"s must be a 3-D [S, T, R] tensor, got {getattr(s, 'shape', type(s).__name__)}")
    offsets = check_expand_inputs(lora_b, ranks, batch, slice_offsets, y, s.shape[0], s.shape[2])
    assert isinstance(batch, LoRABatch)
    check_s("s", s, (s.shape[0], batch.num_tokens, s.shape[2]), batch)
    return offsets


def check_silu_mul_out(y: object, out: object) -> int:
    """add_lora_silu_mul's y [T, 2I] and out [T, I] of y's dtype, on y's device; returns I."""
    y, out = _tensor("y", y), _tensor("out", out)
    if y.dim() != 2 or y.shape[1] % 2:
        raise ValueError(f"y must be [T, 2I] (gate | up), got shape {tuple(y.shape)}")
    inter = y.shape[1] // 2
    if tuple(out.shape) != (y.shape[0], inter):
        raise ValueError(f"out must have shape [T, I]={(y.shape[0], inter)}, got {tuple(out.shape)}")
    if out.dtype != y.dtype:
        raise TypeError(f"out dtype {out.dtype} differs from y dtype {y.dtype}")
    if not out.is_contiguous() or out.device != y.device:
        raise ValueError("out must be contiguous and on y's device")
    return inter


def check_slice_limit(num_slices: int, max_slices: int) -> None:
    """The Triton expand handles at most `max_slices` slices per module group."""
    if num_slices > max_slices:
        raise ValueError(f"the triton expand supports up to {max_slices} slices, got {num_slices}")
