"""A follower rank (1..N-1) of a tensor-parallel worker: `python -m` this module, as rank 0 does
(launcher.py). It loads its shard of the model, sizes its slots and KV cache as rank 0 does, then
runs whatever rank 0 sends (step_channel.py) until STOP, or until rank 0 is gone.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import torch

from loraserve.inference_worker.builder import engine_config_for, resolve_device
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.engine.model_runner import ModelRunner
from loraserve.inference_worker.lora.layer import worker_launch_options
from loraserve.inference_worker.lora.row_parallel import attach_sharded_lora
from loraserve.inference_worker.lora.slots import LoRASlots
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.inference_worker.model.loader import load_model
from loraserve.inference_worker.parallel.group import TensorParallelGroup
from loraserve.inference_worker.parallel.launcher import LEADER_PID, join_as_follower
from loraserve.inference_worker.parallel.step_channel import Kind, StepChannel
from loraserve.kernels import LoRABatch
from loraserve.serving.logs import configure_logging

log = logging.getLogger("loraserve.worker")


class FollowerLoRA:
    """The step's LoRA batch metadata on a follower (WorkerAdapters.lora_batch's twin)."""

    def __init__(self, slots: LoRASlots, max_tokens: int) -> None:
        self._batch = LoRABatch.allocate(
            max_tokens, slots.max_loras, slots.device, max_slices=3, max_rank=slots.max_rank
        )

    def lora_batch(self, token_slots: torch.Tensor) -> LoRABatch:
        self._batch.prepare(token_slots)
        return self._batch


def build_runner(
    config: WorkerConfig, tp: TensorParallelGroup, model: LlamaModel
) -> tuple[ModelRunner, LoRASlots | None]:
    """The follower's slots and runner over its shard of the model, built in the order of rank 0's
    `builder.build_leader` so the set-up collectives pair up: has-adapters flag, then the KV block
    count (the least of all ranks)."""
    dtype = model.dtype
    slots, lora = None, None
    if tp.broadcast_int(0):
        slots = LoRASlots(
            model.config.raw, config.max_loras, config.max_lora_rank, dtype, tp.device, tp.shard
        )
        attach_sharded_lora(model, slots, tp.all_reduce, worker_launch_options(tp.device))
        lora = FollowerLoRA(slots, max(config.max_num_batched_tokens, config.max_num_seqs))
    ec = engine_config_for(config, model)
    num_blocks = tp.min_over_ranks(ec.num_blocks)
    runner = ModelRunner(
        model, num_blocks, ec.block_size, ec.max_num_seqs, ec.max_model_len, ec.use_cuda_graphs, lora
    )
    runner.unified = False  # it runs rank 0's plans, which keep decode rows apart
    return runner, slots


def follow(runner: ModelRunner, slots: LoRASlots | None, channel: StepChannel) -> None:
    """Run rank 0's messages until STOP."""
    while True:
        msg = channel.receive()
        if msg.kind == Kind.STEP:
            assert msg.plan is not None
            runner.run(msg.plan)  # the logits are rank 0's to sample
        elif msg.kind == Kind.LOAD:
            assert slots is not None and msg.payload is not None
            slots.load(msg.slot, msg.payload)
        elif msg.kind == Kind.CLEAR:
            assert slots is not None
            slots.clear(msg.slot)
        elif msg.kind == Kind.COPY:
            assert msg.copies is not None
            runner.copy_blocks(*msg.copies)
        elif msg.kind == Kind.CAPTURE:
            runner.capture_graphs()
        elif msg.kind == Kind.STOP:
            return


def exit_with_leader(leader_pid: int) -> None:
    """Exit at once when rank 0 is gone (this process re-parented), whatever the main thread does."""

    def watch() -> None:
        while os.getppid() == leader_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="leader-watch", daemon=True).start()


def main() -> int:
    config = WorkerConfig(**json.loads(sys.stdin.read()))
    rank = int(os.environ["RANK"])
    configure_logging(config.log_level)
    exit_with_leader(int(os.environ[LEADER_PID]))
    device, dtype = resolve_device(config, rank)
    tp = join_as_follower(config, rank, device)
    try:
        runner, slots = build_runner(config, tp, load_model(config.model, dtype, tp.device, tp=tp))
        follow(runner, slots, StepChannel(tp.cpu_group))
    except Exception:
        log.exception("tensor-parallel rank %d failed; exiting", rank)
        return 1
    tp.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
