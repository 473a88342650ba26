"""Per-step batch metadata shared by every LoRA layer of one forward pass.

`prepare` groups the rows of the batch by adapter slot (a stable counting order) and builds, for
each row-tile height the kernels use, a work list of (slot, first sorted row, segment end) items:
one item per BLOCK_M rows of one slot. Everything lives in device buffers allocated once for
`max_tokens` rows and `max_loras` slots, and `prepare` only runs fixed-shape, sync-free device ops,
so it can be captured in a CUDA graph and replayed with a different slot assignment.
"""

from __future__ import annotations

import torch

# Row-tile heights with a prebuilt work list: 16 for decode-like batches (few rows per adapter),
# 64 for prefill-like ones (long segments).
BLOCK_MS: tuple[int, ...] = (16, 64)

# The largest number of split-K partial sums the shrink of `add_lora` writes per row, and the
# row count up to which the workspace has room for all of them.
MAX_SPLIT_K = 8
SPLIT_K_ROWS = 512


def max_work_items(num_tokens: int, num_loras: int, block_m: int) -> int:
    """Upper bound of sum over slots of ceil(rows_of_slot / block_m) for `num_tokens` rows."""
    # sum ceil(c_s / m) <= sum (c_s / m + 1) <= T / m + (active slots), active <= min(T, L).
    return -(-num_tokens // block_m) + min(num_tokens, num_loras)


class WorkList:
    """Work items of one row-tile height: item w covers sorted rows [start[w], min(start[w]+m, end[w])).

    Items past `count` (up to max_work_items of the prepared row count) have slot -1."""

    def __init__(self, block_m: int, capacity: int, device: torch.device) -> None:
        self.block_m = block_m
        self.capacity = capacity
        self.slot = torch.full((capacity,), -1, dtype=torch.int32, device=device)  # [W]
        self.start = torch.zeros(capacity, dtype=torch.int32, device=device)  # [W]
        self.end = torch.zeros(capacity, dtype=torch.int32, device=device)  # [W]
        self.count = torch.zeros(1, dtype=torch.int32, device=device)  # [1] number of valid items
        self._item_ids = torch.arange(capacity, dtype=torch.int32, device=device)  # [W]


class LoRABatch:
    """Per-step batch metadata, built once per forward and shared by every layer.

    Buffers (int32, on `device`):
      sorted_rows [max_tokens]    row ids ordered by slot (stable); rows of slot -1 last
      slot_starts [max_loras + 1] first position in sorted_rows of each slot; [max_loras] = rows with a slot
      slot_counts [max_loras]     rows of each slot
      work[block_m]               WorkList per row-tile height in BLOCK_MS
      workspace                   fp32 scratch of `add_lora` (split-K partial sums of the shrink)
    """

    def __init__(
        self, max_tokens: int, max_loras: int, device: torch.device, max_slices: int, max_rank: int
    ) -> None:
        if max_tokens < 0 or max_loras < 1:
            raise ValueError(f"need max_tokens >= 0 and max_loras >= 1, got {max_tokens}, {max_loras}")
        if max_slices < 1 or max_rank < 1:
            raise ValueError(f"need max_slices >= 1 and max_rank >= 1, got {max_slices}, {max_rank}")
        self.max_tokens = max_tokens
        self.max_loras = max_loras
        self.device = device
        self.num_tokens = 0
        i32 = torch.int32
        self.sorted_rows = torch.zeros(max_tokens, dtype=i32, device=device)
        self.slot_starts = torch.zeros(max_loras + 1, dtype=i32, device=device)
        self.slot_counts = torch.zeros(max_loras, dtype=i32, device=device)
        self._slot_ids = torch.arange(max_loras + 1, dtype=i32, device=device)
        # the Triton prepare's scratch: rows and next position per bin, tile prefixes per work list
        self._bin_scratch = torch.zeros(2, max_loras + 1, dtype=i32, device=device)
        self._tile_ends = torch.zeros(len(BLOCK_MS), max_loras, dtype=i32, device=device)
        self.work = {
            m: WorkList(m, max(1, max_work_items(max_tokens, max_loras, m)), device) for m in BLOCK_MS
        }
        self.workspace = torch.empty(
            workspace_numel(max_tokens, max_slices, max_rank), dtype=torch.float32, device=device
        )

    @classmethod
    def allocate(
        cls,
        max_tokens: int,
        max_loras: int,
        device: torch.device | str,
        *,
        max_slices: int = 3,
        max_rank: int = 256,
    ) -> LoRABatch:
        """Buffers for up to `max_tokens` rows and `max_loras` slots; `max_slices`/`max_rank` size the
        workspace of `add_lora` (the largest module group's slices and buffer rank)."""
        return cls(max_tokens, max_loras, torch.device(device), max_slices, max_rank)

    def prepare(self, token_slots: torch.Tensor, *, use_triton: bool | None = None) -> None:
        """token_slots: [T] int32 on the device, slot of each row, -1 = base model (no LoRA).

        Slots must lie in [-1, max_loras); other values are undefined behaviour (checked on the
        host only when the tensor is on the CPU, since a device check would synchronize).
        On CUDA one Triton launch builds everything (`use_triton` forces either way)."""
        if token_slots.dim() != 1:
            raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
        if token_slots.dtype != torch.int32:
            raise TypeError(f"token_slots must be int32, got {token_slots.dtype}")
        if token_slots.device != self.device and not _same_device(token_slots.device, self.device):
            raise ValueError(f"token_slots on {token_slots.device}, batch buffers on {self.device}")
        num_tokens = token_slots.numel()
        if num_tokens > self.max_tokens:
            raise ValueError(f"{num_tokens} rows exceed max_tokens={self.max_tokens}")
        if token_slots.device.type == "cpu" and num_tokens:
            lo, hi = int(token_slots.min()), int(token_slots.max())
            if lo < -1 or hi >= self.max_loras:
                raise ValueError(f"token slots must lie in [-1, {self.max_loras}), got [{lo}, {hi}]")
        self.num_tokens = num_tokens
        if num_tokens == 0:
            self.slot_starts.zero_()
            self.slot_counts.zero_()
            for work in self.work.values():
                work.count.zero_()
            return
        if use_triton if use_triton is not None else token_slots.is_cuda:
            self._prepare_triton(token_slots)
            return
        # key: slot, with base-model rows (-1) mapped past the last slot so they sort last.
        key = torch.where(token_slots < 0, self.max_loras, token_slots)  # [T]
        sorted_key, order = torch.sort(key, stable=True)  # [T], [T]
        self.sorted_rows[:num_tokens].copy_(order)
        # slot_starts[s] = first sorted position with key >= s (s = 0..L); no atomics, no sync.
        torch.searchsorted(sorted_key, self._slot_ids, out_int32=True, out=self.slot_starts)
        torch.sub(self.slot_starts[1:], self.slot_starts[:-1], out=self.slot_counts)
        for work in self.work.values():
            self._build_work(work)

    def _prepare_triton(self, token_slots: torch.Tensor) -> None:
        from loraserve.kernels.batch_kernel import prepare_kernel

        num_tokens = token_slots.numel()
        w1, w2 = (self.work[m] for m in BLOCK_MS)
        prepare_kernel[(1,)](
            token_slots,
            num_tokens,
            self.max_loras,
            self.sorted_rows,
            self.slot_starts,
            self.slot_counts,
            self._bin_scratch[0],
            self._bin_scratch[1],
            self._tile_ends[0],
            self._tile_ends[1],
            w1.slot,
            w1.start,
            w1.end,
            w1.count,
            max_work_items(num_tokens, self.max_loras, w1.block_m),
            w2.slot,
            w2.start,
            w2.end,
            w2.count,
            max_work_items(num_tokens, self.max_loras, w2.block_m),
            BLOCK_T=64,
            BLOCK_L=min(1024, max(16, 1 << self.max_loras.bit_length())),  # >= max_loras + 1 up to 1023
            BLOCK_W=128,
            SEARCH_STEPS=self.max_loras.bit_length(),  # a search over max_loras + 1 answers
            BLOCK_M1=w1.block_m,
            BLOCK_M2=w2.block_m,
            num_warps=4,
        )

    def _build_work(self, work: WorkList) -> None:
        m = work.block_m
        tiles = torch.div(self.slot_counts + (m - 1), m, rounding_mode="floor")  # [L]
        tiles_end = torch.cumsum(tiles, 0, dtype=torch.int32)  # [L] inclusive prefix
        # Item w belongs to the first slot whose inclusive prefix exceeds w.
        slot = torch.searchsorted(tiles_end, work._item_ids, right=True, out_int32=True)  # [W]
        valid = slot < self.max_loras
        slot_c = slot.clamp(max=self.max_loras - 1).long()
        first_item = tiles_end[slot_c] - tiles[slot_c]  # [W]
        start = self.slot_starts[slot_c] + (work._item_ids - first_item) * m
        end = self.slot_starts[slot_c] + self.slot_counts[slot_c]
        work.slot.copy_(torch.where(valid, slot, -1))
        work.start.copy_(torch.where(valid, start, 0))
        work.end.copy_(torch.where(valid, end, 0))
        work.count.copy_(tiles_end[-1:])

    def rows_by_slot(self) -> dict[int, torch.Tensor]:
        """Host view {slot: row ids [n_s] (int64)} of the last prepare(); synchronizes (reference path)."""
        num_tokens = self.num_tokens
        if num_tokens == 0:
            return {}
        starts = self.slot_starts.tolist()
        rows = self.sorted_rows[:num_tokens].long()
        return {
            slot: rows[starts[slot] : starts[slot + 1]]
            for slot in range(self.max_loras)
            if starts[slot + 1] > starts[slot]
        }


def workspace_numel(max_tokens: int, num_slices: int, max_rank: int) -> int:
    """fp32 elements of the `add_lora` workspace: [split, S, T, R] shrink partial sums, with room for
    MAX_SPLIT_K partials up to SPLIT_K_ROWS rows and one partial up to max_tokens rows."""
    rows = max(max_tokens, MAX_SPLIT_K * min(max_tokens, SPLIT_K_ROWS), 1)
    return num_slices * max_rank * rows


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
