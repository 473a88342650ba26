"""Rank 0's messages to the other ranks of a tensor-parallel worker, over the gloo CPU group.

Every message is a broadcast from rank 0 of a fixed header `[kind, args...]` (int64 [HEADER]),
followed by a body whose size the header gives. Rank 0 sends, at each step boundary and in this
order, the slot changes since the last step, then the step itself, so a follower has an adapter's
weights in a slot before the first step that reads that slot:

    STEP     [n_tok, n_seq, n_log, width, n_prefills, n_prefill_tokens, bucket, n_sampled, S]
             body int64: h64 | h32 | query_start [S + 1] | context_lens [S] | seq_slots [S]
    LOAD     [slot, manifest bytes, payload bytes]   body: manifest JSON, then the payload bytes
    CLEAR    [slot]
    COPY     [n]     body int64: source blocks [n] | destination blocks [n]   (KV block copies)
    CAPTURE  []      capture the decode CUDA graphs now (their collectives pair up across ranks)
    STOP     []      leave the loop and exit

Rank 0 waits for each message to be taken at most `send_timeout` (a follower that hangs fails the
step instead of holding rank 0 forever); a follower waits for the next header for as long as the
worker is idle.

Adapter payloads travel whole (the store's layout, the same for every TP size); each follower
copies its shard into the slot as rank 0 does (lora/slots.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from loraserve.contract.payload import PayloadTensor
from loraserve.inference_worker.engine.step_plan import StepPlan
from loraserve.inference_worker.lora.payload import AdapterPayload

HEADER = 12


class Kind(IntEnum):
    STEP = 1
    LOAD = 2
    CLEAR = 3
    COPY = 4
    CAPTURE = 5
    STOP = 6


@dataclass
class Message:
    kind: Kind
    plan: StepPlan | None = None
    slot: int = -1
    payload: AdapterPayload | None = None
    copies: tuple[list[int], list[int]] | None = None


class StepChannel:
    def __init__(self, group: dist.ProcessGroup, send_timeout: timedelta | None = None) -> None:
        self.group, self.send_timeout = group, send_timeout

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        work = dist.broadcast(t, src=0, group=self.group, async_op=True)
        if self.send_timeout is None:
            work.wait()
        else:
            work.wait(timeout=self.send_timeout)
        return t

    def _header(self, kind: Kind, *args: int) -> None:
        h = torch.zeros(HEADER, dtype=torch.int64)
        h[0] = int(kind)
        h[1 : 1 + len(args)] = torch.tensor(args, dtype=torch.int64)
        self._bcast(h)

    # ---------------------------------------------------------------- rank 0
    def send_step(self, plan: StepPlan) -> None:
        s = len(plan.context_lens_cpu)
        self._header(
            Kind.STEP,
            plan.num_tokens,
            plan.num_seqs,
            plan.num_logits,
            plan.width,
            plan.num_prefills,
            plan.num_prefill_tokens,
            plan.bucket,
            plan.num_sampled,
            s,
        )
        lists = torch.tensor(plan.query_start + plan.context_lens_cpu + plan.seq_slots, dtype=torch.int64)
        self._bcast(torch.cat([plan.h64, plan.h32.to(torch.int64), lists]))

    def send_load(self, slot: int, payload: AdapterPayload) -> None:
        manifest = json.dumps(
            {
                "adapter_id": payload.adapter_id,
                "digest": payload.digest,
                "rank": payload.rank,
                "tensors": [[t.name, list(t.shape), t.dtype, t.offset, t.nbytes] for t in payload.tensors],
            }
        ).encode()
        self._header(Kind.LOAD, slot, len(manifest), payload.nbytes)
        self._bcast(torch.frombuffer(bytearray(manifest), dtype=torch.uint8))
        data = payload.data if payload.data.device.type == "cpu" else payload.data.cpu()
        self._bcast(data.contiguous())

    def send_clear(self, slot: int) -> None:
        self._header(Kind.CLEAR, slot)

    def send_copy(self, src: list[int], dst: list[int]) -> None:
        self._header(Kind.COPY, len(src))
        self._bcast(torch.tensor(src + dst, dtype=torch.int64))

    def send(self, kind: Kind) -> None:
        """A message without arguments (CAPTURE, STOP)."""
        self._header(kind)

    # ---------------------------------------------------------------- other ranks
    def receive(self) -> Message:
        h = self._bcast(torch.zeros(HEADER, dtype=torch.int64)).tolist()
        kind = Kind(h[0])
        if kind == Kind.STEP:
            return Message(kind, plan=self._receive_plan(h[1:10]))
        if kind == Kind.LOAD:
            slot, manifest_len, nbytes = h[1:4]
            manifest = json.loads(bytes(self._bcast(torch.empty(manifest_len, dtype=torch.uint8)).numpy()))
            data = self._bcast(torch.empty(nbytes, dtype=torch.uint8))
            tensors = [
                PayloadTensor(n, tuple(shape), dt, off, nb) for n, shape, dt, off, nb in manifest["tensors"]
            ]
            payload = AdapterPayload(
                manifest["adapter_id"], manifest["digest"], manifest["rank"], data, tensors
            )
            return Message(kind, slot=slot, payload=payload)
        if kind == Kind.CLEAR:
            return Message(kind, slot=h[1])
        if kind == Kind.COPY:
            n = h[1]
            body = self._bcast(torch.empty(2 * n, dtype=torch.int64)).tolist()
            return Message(kind, copies=(body[:n], body[n:]))
        return Message(kind)

    def _receive_plan(self, h: list[int]) -> StepPlan:
        n_tok, n_seq, n_log, width, n_pre, n_pre_tok, bucket, n_sampled, s = h
        n64 = StepPlan.h64_numel(n_tok, n_log)
        n32 = StepPlan.h32_numel(n_tok, n_seq, n_pre, width)
        body = self._bcast(torch.empty(n64 + n32 + 3 * s + 1, dtype=torch.int64))
        lists = body[n64 + n32 :].tolist()
        return StepPlan(
            h64=body[:n64],
            h32=body[n64 : n64 + n32].to(torch.int32),
            num_tokens=n_tok,
            num_seqs=n_seq,
            num_logits=n_log,
            width=width,
            num_prefills=n_pre,
            num_prefill_tokens=n_pre_tok,
            bucket=bucket,
            num_sampled=n_sampled,
            query_start=lists[: s + 1],
            context_lens_cpu=lists[s + 1 : 2 * s + 1],
            seq_slots=lists[2 * s + 1 :],
        )
