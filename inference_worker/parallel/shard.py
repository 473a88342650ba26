"""Which part of the model one tensor-parallel rank holds (Megatron-style sharding of a Llama).

Rank r of N holds:
- q heads [r * nh/N, (r + 1) * nh/N) and the KV heads they read: nkv/N of them when N divides nkv,
  else (N a multiple of nkv) the one KV head r * nkv // N, replicated on N/nkv ranks;
- intermediate columns [r * I/N, (r + 1) * I/N) of gate, up (rows) and down (input columns);
- vocabulary rows [r * ceil(V/N), ...) of the embedding and the LM head (the last shard is padded
  with zero rows past V).

Column-parallel projections (q|k|v, gate|up) keep the rows of the rank's heads / columns;
row-parallel ones (o, down) keep the matching input columns and all-reduce their output. LoRA
follows (S-LoRA): A of column-parallel groups and B of row-parallel groups are replicated, B rows
and A input columns are sliced like the base weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.inference_worker.model.config import ModelConfig, ModelConfigError

Range = tuple[int, int]  # (start, count)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """ModelConfigError naming every dimension that does not split over `size` ranks."""
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads {cfg.num_heads} is not divisible by it")
    nkv = cfg.num_kv_heads
    if nkv % size and size % nkv:
        problems.append(f"num_key_value_heads {nkv} neither divides nor is a multiple of it")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size {cfg.intermediate_size} is not divisible by it")
    if problems:
        raise ModelConfigError(
            f"tensor_parallel_size {size} does not fit model {cfg.name}: " + "; ".join(problems)
        )


@dataclass(frozen=True)
class TensorShard:
    rank: int
    size: int

    def split(self, n: int) -> Range:
        """An even share of n (n divisible by size)."""
        per = n // self.size
        return self.rank * per, per

    def kv_heads(self, num_kv_heads: int) -> Range:
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    def vocab(self, vocab_size: int) -> Range:
        """(first row, rows held) of the vocabulary, rows padded to ceil(V / size)."""
        per = -(-vocab_size // self.size)
        return self.rank * per, per

    def vocab_loaded(self, vocab_size: int) -> int:
        """Rows of the vocabulary shard that exist in the checkpoint (the rest is padding)."""
        start, per = self.vocab(vocab_size)
        return max(0, min(per, vocab_size - start))

    # ---------------------------------------------------------------- per group (adapter layout)
    def out_ranges(self, cfg: ModelConfig, group: str) -> list[Range]:
        """Per slice of a group, the output rows this rank holds, in the full tensor's rows.

        qkv: q | k | v rows of the rank's heads; gate_up: gate | up columns; o, down: all rows."""
        d, h, i = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        if group == "qkv":
            q0, nq = self.split(cfg.num_heads)
            k0, nk = self.kv_heads(cfg.num_kv_heads)
            kv = cfg.num_kv_heads * d
            q = cfg.num_heads * d
            return [(q0 * d, nq * d), (q + k0 * d, nk * d), (q + kv + k0 * d, nk * d)]
        if group == "gate_up":
            s, n = self.split(i)
            return [(s, n), (i + s, n)]
        return [(0, h)]

    def in_range(self, cfg: ModelConfig, group: str) -> Range:
        """The input columns this rank holds of a group (all of them for column-parallel ones)."""
        if group == "o":
            s, n = self.split(cfg.num_heads)
            return s * cfg.head_dim, n * cfg.head_dim
        if group == "down":
            return self.split(cfg.intermediate_size)
        return 0, cfg.hidden_size

    # ---------------------------------------------------------------- checkpoint tensors
    def checkpoint_slice(self, cfg: ModelConfig, name: str) -> tuple[int, Range] | None:
        """(dimension, range) of an HF checkpoint tensor this rank reads; None: the whole tensor."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, _ = self.vocab(cfg.vocab_size)
            return 0, (start, self.vocab_loaded(cfg.vocab_size))
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        d = cfg.head_dim
        if module == "q_proj":
            s, n = self.split(cfg.num_heads)
            return 0, (s * d, n * d)
        if module in ("k_proj", "v_proj"):
            s, n = self.kv_heads(cfg.num_kv_heads)
            return 0, (s * d, n * d)
        if module in ("gate_proj", "up_proj"):
            return 0, self.split(cfg.intermediate_size)
        if module == "o_proj":
            return 1, self.in_range(cfg, "o")
        if module == "down_proj":
            return 1, self.in_range(cfg, "down")
        return None
