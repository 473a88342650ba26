"""GPU slot buffers: for every decoder layer and module group, stacked per-slot LoRA weights
sized once at start-up, plus each slot's rank per (layer, group).

    a_all[group]  [num_layers, max_loras, num_slices, max_rank, in_features]
    b_all[group]  [num_layers, max_loras, out_total, max_rank]
    a[layer][group] = a_all[group][layer]   [max_loras, num_slices, max_rank, in]  (what kernels read)
    b[layer][group] = b_all[group][layer]   [max_loras, out_total, max_rank]
    ranks         [num_layers, num_groups, max_loras] int32 (0 = group not targeted / slot empty)

Filling a slot copies a payload packed for the slots (`pack`, lora/packed.py: per group the A of
every layer, then the B of every layer, padded to the group's largest rank, in the slots' dtype,
then the ranks), built once per fetched payload off the step thread. On CUDA: one async
host-to-device copy of the whole pinned packed payload into a staging buffer, then one
device-side strided copy per (group, A|B) whatever the ranks of the layers, and one of the ranks,
all on the caller's current stream, so the step that first reads the slot is ordered after it; an
event recorded after the host-to-device copy tells the payload's (pooled) host buffer when it is
read. Entries past a slot's rank are never read by the kernels, so nothing is cleared on eviction.

Under tensor parallelism (`shard`), each rank's buffers hold its shard as S-LoRA lays it out:
column-parallel groups (qkv, gate_up) keep A whole and the rank's rows of B, row-parallel ones
(o, down) the rank's input columns of A and B whole (parallel/shard.py). The packed payload is the same
for every TP size: the copy reads the rank's part through strided views of the staged payload,
once, into the slot (B rows of one size at one spacing, such as gate|up, in one copy).

A payload should arrive in the slots' dtype (the store's --serving-dtype equal to the worker's
--dtype). Otherwise packing converts it, explicitly and with a warning naming both dtypes, where
it cannot overflow: from float32 (the store folds the scale in float32, so this rounds exactly as
the store would have) or into float32 / bfloat16. Into float16 from a wider range it is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraserve.contract.adapter_layout import GROUPS, group_dims
from loraserve.contract.payload import PayloadTensor
from loraserve.inference_worker.lora.packed import PackedLayout
from loraserve.inference_worker.lora.payload import AdapterPayload, parse_name, torch_dtype
from loraserve.inference_worker.model.config import ModelConfig
from loraserve.inference_worker.parallel.shard import Range, TensorShard

log = logging.getLogger(__name__)
GROUP_INDEX = {g.name: i for i, g in enumerate(GROUPS)}


class SlotLoadError(ValueError):
    """A payload that does not fit this model's slot buffers (shape, rank or name)."""


@dataclass(frozen=True)
class ParsedTensor:
    layer: int
    group: str
    which: str  # "lora_a" | "lora_b"
    rank: int
    entry: PayloadTensor


class LoRASlots:
    def __init__(
        self,
        hf_config: dict,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: TensorShard | None = None,
    ) -> None:
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
        # group -> (slices, in, out) of a payload's tensors (the whole model's)
        self._payload_dims = {
            g.name: (len(self.out_sizes[g.name]), self.payload_in[g.name], self.payload_out[g.name])
            for g in GROUPS
        }

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
        """Raise SlotLoadError unless every tensor of `payload` fits these buffers."""
        if payload.packed is not None:
            self._check_packed(payload)
        else:
            self._parse(payload)
            self._check_dtypes(payload, warn=False)

    def _parse(self, payload: AdapterPayload) -> list[ParsedTensor]:
        """The payload's tensors, validated against these buffers (store layout)."""
        if payload.rank > self.max_rank:
            raise SlotLoadError(
                f"adapter {payload.adapter_id} has rank {payload.rank}, "
                f"over this worker's max_lora_rank {self.max_rank}"
            )
        parsed: list[ParsedTensor] = []
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
            parsed.append(ParsedTensor(layer, group, which, rank, t))
        return parsed

    def _check_packed(self, payload: AdapterPayload) -> None:
        layout = payload.packed
        assert layout is not None
        dims = self._payload_dims
        if (
            layout.dtype != self.dtype
            or layout.num_layers != self.num_layers
            or payload.nbytes < layout.nbytes
            or any(
                (b.num_slices, b.in_features, b.out_total) != dims[b.group]
                or not 1 <= b.rank <= self.max_rank
                for b in layout.blocks
            )
        ):
            raise SlotLoadError(f"adapter {payload.adapter_id} was packed for other slot buffers")

    def pack(
        self, payload: AdapterPayload, allocate: Callable[[int], torch.Tensor] | None = None
    ) -> AdapterPayload:
        """The payload in the slot-shaped layout (lora/packed.py), in these buffers' dtype, in
        memory from `allocate(nbytes)` (default: new, pinned on CUDA hosts); validated first
        (SlotLoadError). A payload already packed is returned as it is."""
        if payload.packed is not None:
            self._check_packed(payload)
            return payload
        parsed = self._parse(payload)
        self._check_dtypes(payload)
        group_ranks: dict[str, int] = {}
        for p in parsed:
            group_ranks[p.group] = max(group_ranks.get(p.group, 0), p.rank)
        layout = PackedLayout.plan(self.dtype, self.num_layers, self._payload_dims, group_ranks)
        if allocate is None:
            data = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        else:
            data = allocate(layout.nbytes)
        ranks = layout.ranks_view(data)
        ranks.zero_()
        full: dict[tuple[str, str], int] = {}  # (group, which) -> layers written at the group's rank
        for p in parsed:
            full[p.group, p.which] = full.get((p.group, p.which), 0) + (p.rank == group_ranks[p.group])
        for blk in layout.blocks:
            for which, view in (("lora_a", layout.a_view), ("lora_b", layout.b_view)):
                if full.get((blk.group, which), 0) < self.num_layers:  # padding or absent layers
                    view(data, blk).zero_()
        views = {b.group: (layout.a_view(data, b), layout.b_view(data, b)) for b in layout.blocks}
        for p in parsed:
            src = payload.view(p.entry)
            a, b = views[p.group]
            if p.which == "lora_a":
                a[p.layer, :, : p.rank].copy_(src)
                ranks[p.layer, GROUP_INDEX[p.group]] = p.rank
            else:
                b[p.layer, :, : p.rank].copy_(src)
        return AdapterPayload(
            payload.adapter_id, payload.digest, payload.rank, data, payload.tensors, packed=layout
        )

    def _check_dtypes(self, payload: AdapterPayload, warn: bool = True) -> None:
        """Refuse a conversion that could overflow; warn (when packing: once per payload) of any
        other."""
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
        if warn:
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
        """Copy `payload` into `slot` (asynchronously on CUDA, on the current stream). A payload in
        the store's layout is packed first, once (the packed form is kept on it)."""
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} out of range [0, {self.max_loras})")
        if payload.packed is None:
            if payload.slot_form is None:
                payload.slot_form = self.pack(payload)
            payload = payload.slot_form
        else:
            self._check_packed(payload)
        layout = payload.packed
        assert layout is not None
        data = payload.data
        if self.device.type == "cuda" and data.device.type != "cuda":
            staged = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            pinned = data.is_pinned()
            staged.copy_(data[: layout.nbytes], non_blocking=pinned)
            if pinned:  # the host buffer may be reused only once this copy has read it
                payload.reads[:] = [e for e in payload.reads if not e.query()]
                event = torch.cuda.Event()
                event.record()
                payload.reads.append(event)
            data = staged
        for blk in layout.blocks:
            r = blk.rank
            a, b = layout.a_view(data, blk), layout.b_view(data, blk)
            if self.shard_ranges is None:
                self.a_all[blk.group][:, slot, :, :r].copy_(a, non_blocking=True)
                self.b_all[blk.group][:, slot, :, :r].copy_(b, non_blocking=True)
            else:
                self._copy_shard(blk.group, a, b, slot)
        self.ranks[:, :, slot].copy_(layout.ranks_view(data), non_blocking=True)

    def _copy_shard(self, group: str, a: torch.Tensor, b: torch.Tensor, slot: int) -> None:
        # a: [layers, slices, r, in], b: [layers, out, r] of the whole model: this rank's part of each
        assert self.shard_ranges is not None
        rows, (c0, nc) = self.shard_ranges[group]
        r = a.shape[2]
        self.a_all[group][:, slot, :, :r].copy_(a[..., c0 : c0 + nc], non_blocking=True)
        dst = self.b_all[group][:, slot, :, :r]  # [layers, out on this rank, r]
        off = 0
        for r0, n, k, step in row_runs(rows):  # k ranges of n rows, `step` rows apart: one copy
            src = b.as_strided(
                (b.shape[0], k, n, r), (b.stride(0), step * r, r, 1), b.storage_offset() + r0 * r
            )
            dst[:, off : off + k * n].unflatten(1, (k, n)).copy_(src, non_blocking=True)
            off += k * n

    def clear(self, slot: int) -> None:
        """Mark `slot` empty (rank 0 everywhere): rows pointing at it get no delta."""
        self.ranks[:, :, slot] = 0

    def group_ranks(self, layer: int, group: str) -> torch.Tensor:
        """[max_loras] int32 view of the ranks of one (layer, group)."""
        return self.ranks[layer, GROUP_INDEX[group]]


def row_runs(rows: list[Range]) -> list[tuple[int, int, int, int]]:
    """(first row, rows per range, ranges, step between starts) of consecutive row ranges of one
    size at one spacing, e.g. the gate and up rows of a TP rank: one strided copy each."""
    runs: list[tuple[int, int, int, int]] = []
    for r0, n in rows:
        if runs:
            f, m, k, step = runs[-1]
            if m == n and (k == 1 or r0 == f + k * step) and r0 > f:
                runs[-1] = (f, m, k + 1, r0 - f if k == 1 else step)
                continue
        runs.append((r0, n, 1, 0))
    return runs
