"""Fixed-size KV blocks handed to sequences on demand, so memory follows actual lengths.

Block 0 is reserved (padding rows of CUDA-graph batches write there); blocks 1..num_blocks-1
are free at start. A sequence holding n tokens owns ceil(n / block_size) blocks.
"""

from __future__ import annotations

from collections import deque

from inference_worker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must add to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.num_new_blocks(seq, num_tokens)
        if n > len(self._free):
            raise RuntimeError("allocate() without can_allocate()")
        seq.block_table.extend(self._free.popleft() for _ in range(n))

    def deallocate(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
