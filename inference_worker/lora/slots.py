"""GPU slot buffers: for every decoder layer and module group, stacked per-slot LoRA weights
sized once at start-up, plus each slot's rank per (layer, group).

    a_all[group]  [num_layers, max_loras, num_slices, max_rank, in_features]
    b_all[group]  [num_layers, max_loras, out_total, max_rank]
    a[layer][group] = a_all[group][layer]   [max_loras, num_slices, max_rank, in]  (what kernels read)
    b[layer][group] = b_all[group][layer]   [max_loras, out_total, max_rank]
    ranks         [num_layers, num_groups, max_loras] int32 (0 = group not targeted / slot empty)

Filling a slot copies an optimized payload (loraserve/contract/adapter_layout.py) with no transform. On CUDA:
the whole pinned payload is uploaded into a staging buffer, on a copy stream beside the steps
already queued (lora/uploads.py), then a few device-side strided copies on the caller's stream —
one per (group, A|B) for the usual adapter whose tensors repeat with a fixed stride across
consecutive layers, since buffers of one group are stacked over layers — so the step that first
reads the slot is ordered after the load, and the steps queued before it still read the old
weights. The copies' views (per slot, staging buffer and payload layout) are made once and reused,
so a load is a few calls on the step thread, whatever the number of tensors.
Entries past a slot's rank are never read by the kernels, so nothing is cleared on eviction.

Under tensor parallelism (`shard`), each rank's buffers hold its shard as S-LoRA lays it out:
column-parallel groups (qkv, gate_up) keep A whole and the rank's rows of B, row-parallel ones
(o, down) the rank's input columns of A and B whole (parallel/shard.py). The payload stays the
store's one layout for every TP size: the copy reads the rank's part through strided views of the
staged payload, once, into the slot.

A payload should arrive in the slots' dtype (the store's --serving-dtype equal to the worker's
--dtype). Otherwise the copy converts it, explicitly and with a warning naming both dtypes, where
it cannot overflow: from float32 (the store folds the scale in float32, so this rounds exactly as
the store would have) or into float32 / bfloat16. Into float16 from a wider range it is refused.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from loraserve.contract.adapter_layout import GROUPS, group_dims
from loraserve.contract.payload import PayloadTensor
from loraserve.inference_worker.lora.payload import AdapterPayload, parse_name, torch_dtype
from loraserve.inference_worker.lora.uploads import KEPT, Staging, Uploads
from loraserve.inference_worker.model.config import ModelConfig
from loraserve.inference_worker.parallel.shard import Range, TensorShard

log = logging.getLogger(__name__)
GROUP_INDEX = {g.name: i for i, g in enumerate(GROUPS)}
VIEW_CACHE_SIZE = 1024  # payload layouts whose copy plans (and ranks) are kept


class SlotLoadError(ValueError):
    """A payload that does not fit this model's slot buffers (shape, rank or name)."""


@dataclass(frozen=True)
class CopyRun:
    """Tensors of one (group, A|B) and shape at consecutive layers first_layer.. and payload
    offsets offset, offset + stride, ...: one strided copy."""

    group: str
    which: str  # "lora_a" | "lora_b"
    first_layer: int
    num_layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes
    stride: int  # bytes between consecutive layers' tensors


class LoRASlots:
    def __init__(
        self,
        hf_config: dict,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: TensorShard | None = None,
        copy_stream: bool = True,
    ) -> None:
        """`copy_stream` False: uploads run on the caller's stream, in line with its steps (for
        measuring the difference; lora/uploads.py)."""
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.num_layers = n = int(hf_config["num_hidden_layers"])
        self.in_features: dict[str, int] = {}
        self.out_sizes: dict[str, list[int]] = {}
        self.a_all: dict[str, torch.Tensor] = {}
        self.b_all: dict[str, torch.Tensor] = {}
        # a payload's dims (the whole model's); in_features / out_sizes: this process's buffers
        self.payload_in: dict[str, int] = {}
        self.payload_out: dict[str, int] = {}
        # group -> (B rows per slice, A input columns) of this rank, in the payload's tensors
        self.shard_ranges: dict[str, tuple[list[Range], Range]] | None = None
        if shard is not None:
            cfg = ModelConfig.from_dict(hf_config)
            self.shard_ranges = {
                g.name: (shard.out_ranges(cfg, g.name), shard.in_range(cfg, g.name)) for g in GROUPS
            }
        for g in GROUPS:
            n_in, outs = group_dims(hf_config, g)
            self.payload_in[g.name], self.payload_out[g.name] = n_in, sum(outs)
            if self.shard_ranges is not None:
                rows, (_, n_in) = self.shard_ranges[g.name]
                outs = [n for _, n in rows]
            self.in_features[g.name], self.out_sizes[g.name] = n_in, outs
            self.a_all[g.name] = torch.zeros(
                n, max_loras, len(outs), max_rank, n_in, dtype=dtype, device=self.device
            )
            self.b_all[g.name] = torch.zeros(
                n, max_loras, sum(outs), max_rank, dtype=dtype, device=self.device
            )
        self.a = [{g.name: self.a_all[g.name][layer] for g in GROUPS} for layer in range(n)]
        self.b = [{g.name: self.b_all[g.name][layer] for g in GROUPS} for layer in range(n)]
        self.ranks = torch.zeros(n, len(GROUPS), max_loras, dtype=torch.int32, device=self.device)
        # CUDA loads: staging buffers and the copy stream; a shard's loads copy in line (load)
        self.uploads = (
            Uploads(self.device, copy_stream and shard is None) if self.device.type == "cuda" else None
        )
        self._staging_lock = threading.Lock()
        self._rank_cache: dict[tuple[tuple[int, ...], ...], torch.Tensor] = {}
        self._plan_cache: dict[tuple, tuple[list[CopyRun], tuple[tuple[int, ...], ...]]] = {}
        self._rank_rows = [self.ranks[:, :, slot] for slot in range(max_loras)]

    @staticmethod
    def bytes_needed(hf_config: dict, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
        """Device bytes of the slot buffers for this model (to budget before the KV cache)."""
        per_layer = 0
        for g in GROUPS:
            n_in, outs = group_dims(hf_config, g)
            per_layer += max_loras * max_rank * (len(outs) * n_in + sum(outs))
        return int(hf_config["num_hidden_layers"]) * per_layer * dtype.itemsize

    def slot_bytes(self) -> int:
        """Bytes of one slot across all layers and groups."""
        return sum((t[0, 0].nbytes * self.num_layers) for t in (*self.a_all.values(), *self.b_all.values()))

    def check(self, payload: AdapterPayload) -> None:
        """Raise SlotLoadError unless every tensor of `payload` fits these buffers. Runs where the
        payload arrives (the event loop), so what a load needs is ready before the step thread's turn."""
        self._plan(payload)
        if self.device.type == "cuda":
            _ = payload.pinned  # asked here once, not on the step thread

    def _plan(self, payload: AdapterPayload) -> tuple[list[CopyRun], tuple[tuple[int, ...], ...]]:
        """(copy runs, ranks [num_layers][num_groups]) of a payload, validated; cached on it. Plain
        Python: it runs on the event loop for each fetched adapter, beside the step thread."""
        if payload.copy_plan is not None:
            return payload.copy_plan  # type: ignore[return-value]
        # adapters of one rank and module set share a layout: planned once for all of them
        layout = (payload.rank, payload.nbytes, tuple(payload.tensors))
        known = self._plan_cache.get(layout)
        if known is not None:
            payload.copy_plan = list(known)
            return known
        plan = self._plan_layout(payload)
        if len(self._plan_cache) >= VIEW_CACHE_SIZE:
            self._plan_cache.clear()
        self._plan_cache[layout] = plan
        payload.copy_plan = list(plan)
        return plan

    def _plan_layout(self, payload: AdapterPayload) -> tuple[list[CopyRun], tuple[tuple[int, ...], ...]]:
        if payload.rank > self.max_rank:
            raise SlotLoadError(
                f"adapter {payload.adapter_id} has rank {payload.rank}, "
                f"over this worker's max_lora_rank {self.max_rank}"
            )
        ranks = [[0] * len(GROUPS) for _ in range(self.num_layers)]
        parsed: list[tuple[str, str, tuple[int, ...], int, PayloadTensor]] = []
        for t in payload.tensors:
            try:
                layer, group, which = parse_name(t)
                dtype = torch_dtype(t)
            except ValueError as exc:
                raise SlotLoadError(str(exc)) from None
            if layer >= self.num_layers:
                raise SlotLoadError(f"tensor {t.name} names layer {layer}; the model has {self.num_layers}")
            n_slices, n_in = len(self.out_sizes[group]), self.payload_in[group]
            n_out = self.payload_out[group]
            ok = (
                (len(t.shape) == 3 and t.shape[0] == n_slices and t.shape[2] == n_in)
                if which == "lora_a"
                else (len(t.shape) == 2 and t.shape[0] == n_out)
            )
            rank = t.shape[1] if ok else 0
            if not ok or not 1 <= rank <= self.max_rank:
                raise SlotLoadError(
                    f"tensor {t.name} has shape {list(t.shape)}, which does not fit "
                    f"[{n_slices}, r, {n_in}] / [{n_out}, r] with r <= {self.max_rank}"
                )
            size = dtype.itemsize
            for d in t.shape:
                size *= d
            if (
                t.nbytes != size
                or t.offset < 0
                or t.offset % dtype.itemsize
                or t.offset + t.nbytes > payload.nbytes
            ):
                raise SlotLoadError(f"tensor {t.name} lies outside the payload or is misaligned")
            if which == "lora_a":
                ranks[layer][GROUP_INDEX[group]] = rank
            parsed.append((group, which, tuple(t.shape), layer, t))
        self._check_dtypes(payload)
        runs: list[CopyRun] = []
        parsed.sort(key=lambda p: (p[0], p[1], p[2], str(p[4].dtype), p[3]))
        for group, which, shape, layer, t in parsed:
            last = runs[-1] if runs else None
            if (
                last is not None
                and (last.group, last.which, last.shape, last.dtype) == (group, which, shape, torch_dtype(t))
                and layer == last.first_layer + last.num_layers
                and (last.num_layers == 1 or t.offset == last.offset + last.num_layers * last.stride)
                and t.offset > last.offset
            ):
                stride = t.offset - last.offset if last.num_layers == 1 else last.stride
                runs[-1] = CopyRun(
                    group,
                    which,
                    last.first_layer,
                    last.num_layers + 1,
                    shape,
                    last.dtype,
                    last.offset,
                    stride,
                )
            else:
                runs.append(CopyRun(group, which, layer, 1, shape, torch_dtype(t), t.offset, 0))
        return runs, tuple(tuple(row) for row in ranks)

    def _ranks_on_device(self, ranks: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        """[num_layers, num_groups] int32 on the device for a plan's ranks: adapters of one rank and
        module set share it, so a load copies device to device (no host buffer to pin or sync on)."""
        got = self._rank_cache.get(ranks)
        if got is None:
            if len(self._rank_cache) >= VIEW_CACHE_SIZE:
                self._rank_cache.clear()
            got = self._rank_cache[ranks] = torch.tensor(ranks, dtype=torch.int32).to(self.device)
        return got

    def _check_dtypes(self, payload: AdapterPayload) -> None:
        """Refuse a conversion that could overflow; warn (once per layout: plans are cached) of
        any other."""
        others = sorted(
            {str(torch_dtype(t)).removeprefix("torch.") for t in payload.tensors} - {self._dtype_name}
        )
        if not others:
            return
        fix = f"set the store's --serving-dtype {self._dtype_name} (or this worker's --dtype {others[0]})"
        if self.dtype == torch.float16:
            raise SlotLoadError(
                f"adapter {payload.adapter_id} was optimized as {', '.join(others)} but this worker computes "
                f"in float16, which cannot hold its range; {fix}"
            )
        log.warning(
            "adapter %s was optimized as %s; converting it to this worker's %s (%s)",
            payload.adapter_id,
            ", ".join(others),
            self._dtype_name,
            fix,
        )

    @property
    def _dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def load(self, slot: int, payload: AdapterPayload) -> None:
        """Copy `payload` into `slot` (asynchronously on CUDA: work queued on the current stream
        after this call sees the new weights, work queued before it the old ones)."""
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} out of range [0, {self.max_loras})")
        runs, ranks = self._plan(payload)
        data = payload.data
        if self.device.type == "cuda" and data.device.type != "cuda":
            if self.shard_ranges is None and all(run.dtype == self.dtype for run in runs):
                # a handful of calls, each a point where the step thread may lose the interpreter
                # to another thread: staging buffers and the copies' views, reused
                assert self.uploads is not None
                with self._staging_lock:
                    staging, stream = self.uploads.upload(data, payload.pinned)
                    dsts, srcs = self._views(slot, runs, staging)
                    # the slot's ranks ride along: one call for every device-side copy
                    torch._foreach_copy_(
                        [*dsts, self._rank_rows[slot]],
                        [*srcs, self._ranks_on_device(ranks)],
                        non_blocking=True,
                    )
                    self.uploads.copied_out(staging, stream)
                return
            staged = torch.empty(payload.nbytes, dtype=torch.uint8, device=self.device)
            staged.copy_(data, non_blocking=payload.pinned)
            data = staged
        for run in runs:
            src = self._source(run, data)
            layers = slice(run.first_layer, run.first_layer + run.num_layers)
            if self.shard_ranges is not None:
                self._copy_shard(run, src, layers, slot)
            else:
                self._destination(run, slot).copy_(src, non_blocking=True)
        self.ranks[:, :, slot].copy_(self._ranks_on_device(ranks), non_blocking=True)

    @staticmethod
    def _source(run: CopyRun, data: torch.Tensor) -> torch.Tensor:
        """The run's tensors in the payload bytes `data`: [layers, *shape]."""
        size = run.dtype.itemsize
        elems = (
            data.view(run.dtype)
            if data.numel() % size == 0
            else data[: data.numel() // size * size].view(run.dtype)
        )
        inner = [1]
        for d in reversed(run.shape[1:]):
            inner.insert(0, inner[0] * d)
        return elems.as_strided(
            (run.num_layers, *run.shape),
            (run.stride // size, *inner),
            elems.storage_offset() + run.offset // size,
        )

    def _destination(self, run: CopyRun, slot: int) -> torch.Tensor:
        r, layers = run.shape[1], slice(run.first_layer, run.first_layer + run.num_layers)
        if run.which == "lora_a":
            return self.a_all[run.group][layers, slot, :, :r, :]
        return self.b_all[run.group][layers, slot, :, :r]

    def _views(
        self, slot: int, runs: list[CopyRun], staging: Staging
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations, sources) of a payload layout's copies into `slot`; adapters of one rank
        and module set share a layout, so these are made once per (slot, layout) and staging
        buffer, and kept on it (they go with it)."""
        key = (slot, tuple(runs))
        got = staging.views.get(key)
        if got is None:
            if len(staging.views) >= KEPT:
                staging.views.clear()
            got = staging.views[key] = (
                [self._destination(run, slot) for run in runs],
                [self._source(run, staging.buffer) for run in runs],
            )
        return got

    def _copy_shard(self, run: CopyRun, src: torch.Tensor, layers: slice, slot: int) -> None:
        # src: a run's whole tensors, [layers, slices, r, in] (A) or [layers, out, r] (B)
        assert self.shard_ranges is not None
        rows, (c0, nc) = self.shard_ranges[run.group]
        r = run.shape[1]
        if run.which == "lora_a":
            self.a_all[run.group][layers, slot, :, :r, :].copy_(src[..., c0 : c0 + nc], non_blocking=True)
            return
        dst = self.b_all[run.group][layers, slot]  # [layers, out on this rank, R]
        off = 0
        for r0, n in rows:
            dst[:, off : off + n, :r].copy_(src[:, r0 : r0 + n], non_blocking=True)
            off += n

    def clear(self, slot: int) -> None:
        """Mark `slot` empty (rank 0 everywhere): rows pointing at it get no delta."""
        self.ranks[:, :, slot] = 0

    def group_ranks(self, layer: int, group: str) -> torch.Tensor:
        """[max_loras] int32 view of the ranks of one (layer, group)."""
        return self.ranks[layer, GROUP_INDEX[group]]
