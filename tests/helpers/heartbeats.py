"""Workers announced in Redis as their heartbeats announce them (inference_worker/coordination:
the set `{prefix}workers` of ids and, per id, `{prefix}worker:{id}` = JSON {"address", ...} with a
TTL), for gateway tests whose workers are stand-ins that send none."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

TTL_S = 60


def announce(redis_url: str, prefix: str, addresses: Sequence[str]) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        for i, address in enumerate(addresses):
            body = {"address": address, "info": {}, "expires_at": time.time() + TTL_S}
            r.sadd(prefix + "workers", f"w{i}")
            r.set(f"{prefix}worker:w{i}", json.dumps(body), ex=TTL_S)
    finally:
        r.close()
