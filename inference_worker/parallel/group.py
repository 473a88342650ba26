"""The process groups of one tensor-parallel worker and the collectives its forward pass uses.

`device_group` carries the forward's collectives (NCCL on CUDA, gloo on CPU): all-reduce of the
row-parallel outputs and of the vocab-parallel embedding, all-gather of the vocab-parallel logits.
`cpu_group` (gloo) carries rank 0's step plans and adapter payloads to the followers, so the
control plane never waits behind GPU work.

Timeouts (each rank applies its own to the collectives it waits in):
- `device_group`: the step timeout (`tensor_parallel_timeout_s`, 5 minutes by default). Inside a
  step the ranks run the same work in lockstep, so one waits on another only for the skew between
  them: a first-step kernel compile or a graph capture, which every rank does at the same step,
  differs by seconds. The timeout bounds a rank that hangs; a rank that dies closes its sockets,
  which fails the collective at once.
- `cpu_group`: no practical timeout, because a follower waits there for rank 0's next message for
  as long as the worker is idle. The waits that must end are bounded one by one instead: each
  message rank 0 sends by the step timeout (a send completes only once the receiver takes it;
  step_channel.py), the set-up collectives, where ranks wait for the slowest to load its shard, by
  START_TIMEOUT.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from loraserve.inference_worker.parallel.shard import TensorShard

IDLE_TIMEOUT = timedelta(days=365)
STEP_TIMEOUT = timedelta(minutes=5)
START_TIMEOUT = timedelta(minutes=10)
# the gather into one tensor; named all_gather_into_tensor before torch 2.13
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TensorParallelGroup:
    shard: TensorShard
    device: torch.device
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    step_timeout: timedelta = STEP_TIMEOUT

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    @classmethod
    def initialize(
        cls,
        rank: int,
        size: int,
        device: torch.device,
        store: dist.Store,
        step_timeout: timedelta = STEP_TIMEOUT,
    ) -> TensorParallelGroup:
        """Join the `size`-rank group through `store` (rank 0 hosts it); NCCL on CUDA, else gloo.
        `step_timeout` bounds the forward's collectives (see the module's timeouts)."""
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=store,
            rank=rank,
            world_size=size,
            timeout=step_timeout,
            device_id=device if cuda else None,
        )
        world = dist.group.WORLD
        assert world is not None
        cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        return cls(TensorShard(rank, size), device, world, cpu_group, step_timeout)

    def all_reduce(self, t: torch.Tensor) -> None:
        """t summed over the ranks, in place (t contiguous)."""
        dist.all_reduce(t, group=self.device_group)

    def all_gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """t [n, c] on every rank -> [n, size * c], rank r's columns at [r * c, (r + 1) * c)."""
        n, c = t.shape
        out = torch.empty((self.size * n, c), dtype=t.dtype, device=t.device)  # [size * n, c]
        _all_gather_single(out, t.contiguous(), group=self.device_group)
        return out.view(self.size, n, c).permute(1, 0, 2).reshape(n, self.size * c)

    def broadcast_int(self, value: int) -> int:
        """rank 0's `value` on every rank."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.cpu_group, async_op=True).wait(timeout=START_TIMEOUT)
        return int(t.item())

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group, async_op=True)
        work.wait(timeout=START_TIMEOUT)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
