"""Fixed-size KV blocks handed to sequences on demand, so memory follows actual lengths.

Block 0 is reserved (padding rows of CUDA-graph batches write there); blocks 1..num_blocks-1
are free at start. A sequence holding n tokens owns ceil(n / block_size) blocks. Blocks are
reference-counted: the completions of an n > 1 request share their prompt's full blocks (`fork`);
only the last, partly filled block is copied, so no shared block is ever written again.
"""

from __future__ import annotations

from collections import deque

from loraserve.inference_worker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._refs = [0] * num_blocks  # sequences holding each block

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

    def _take(self) -> int:
        b = self._free.popleft()
        self._refs[b] = 1
        return b

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.num_new_blocks(seq, num_tokens)
        if n > len(self._free):
            raise RuntimeError("allocate() without can_allocate()")
        seq.block_table.extend(self._take() for _ in range(n))

    def can_fork(self, parent: Sequence) -> bool:
        return parent.num_computed_tokens % self.block_size == 0 or bool(self._free)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` the KV of `parent`'s computed tokens: the full blocks shared, the partial
        last block a fresh one; -> (source, destination) of the KV copy to make, or None."""
        if not self.can_fork(parent):
            raise RuntimeError("fork() without can_fork()")
        full, partial = divmod(parent.num_computed_tokens, self.block_size)
        shared = parent.block_table[:full]
        for b in shared:
            self._refs[b] += 1
        child.block_table = list(shared)
        child.num_computed_tokens = parent.num_computed_tokens
        if not partial:
            return None
        dst = self._take()
        child.block_table.append(dst)
        return parent.block_table[full], dst

    def deallocate(self, seq: Sequence) -> None:
        for b in seq.block_table:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
        seq.block_table = []
        seq.num_computed_tokens = 0
