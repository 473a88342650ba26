"""Workers announced in Redis by the heartbeat a worker sends (RedisCoordinator.heartbeat), for
gateway tests whose workers are stand-ins that send none."""

from __future__ import annotations

from collections.abc import Sequence

TTL_S = 60


def announce(redis_url: str, prefix: str, addresses: Sequence[str]) -> None:
    from loraserve.inference_worker.coordination.redis_coordinator import RedisCoordinator

    coordinator = RedisCoordinator(redis_url, prefix)
    try:
        for i, address in enumerate(addresses):
            coordinator.heartbeat(f"w{i}", address, TTL_S, {})
    finally:
        coordinator.close()
