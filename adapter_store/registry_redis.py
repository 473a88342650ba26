"""The registry in Redis, under one key prefix:

    {prefix}adapter:{id}   string, the record as JSON
    {prefix}adapters       sorted set of ids (all score 0, so ZRANGE BYLEX pages in id order)
    {prefix}events         stream of invalidations (an adapter replaced or deleted) for workers
    {prefix}call:{token}   the answer of one write, kept a minute for redis-py's re-sends of it

Each multi-key update is one Lua script, so the record, the index and the event change together.

A Redis that does not answer (hung, or a network that drops packets) costs a call two socket
timeouts of 1 s (and a reconnection's): a fetch of a cached adapter then streams under its last
known record (service.py), and an admin call answers UNAVAILABLE, within seconds, not tens.
"""

from __future__ import annotations

import uuid
from typing import Any

from loraserve.adapter_store.errors import AlreadyExists, Unavailable
from loraserve.adapter_store.registry import AdapterRecord

# redis-py sends a script again after a timeout, and a Redis that stalled past the socket timeout
# (an fsync, a fork) may have run it already: each write records its answer under a key of the
# call's own token for CALL_TTL_S seconds, and a script sent again finds it there and answers the
# same, instead of finding its own write (ALREADY_EXISTS for a registration, NOT_FOUND for a delete).
CALL_TTL_S = 60

# KEYS[1] - record key, KEYS[2] - id index, KEYS[3] - event stream, KEYS[4] - this call's answer
# ARGV[1] - adapter id, ARGV[2] - record JSON, ARGV[3] - "1" to overwrite, ARGV[4] - new digest,
# ARGV[5] - seconds to keep this call's answer
# returns {1, previous JSON or ""} when stored (or stored by this call already), {0, existing JSON}
# when taken and not overwriting
PUT_SCRIPT = """
local done = redis.call('GET', KEYS[4])
if done then return {1, done} end
local old = redis.call('GET', KEYS[1])
if old and ARGV[3] ~= '1' then return {0, old} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], 0, ARGV[1])
if old then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', 10000, '*', 'event', 'replaced', 'adapter_id', ARGV[1], 'digest', ARGV[4])
end
redis.call('SET', KEYS[4], old or '', 'EX', ARGV[5])
return {1, old or ''}
"""

# KEYS[1] - record key, KEYS[2] - id index, KEYS[3] - event stream, KEYS[4] - this call's answer
# ARGV[1] - adapter id, ARGV[2] - seconds to keep this call's answer
# returns the deleted record JSON (also when this call deleted it already), or false when there
# was none
DELETE_SCRIPT = """
local done = redis.call('GET', KEYS[4])
if done then return done end
local old = redis.call('GET', KEYS[1])
if not old then return false end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 10000, '*', 'event', 'deleted', 'adapter_id', ARGV[1])
redis.call('SET', KEYS[4], old, 'EX', ARGV[2])
return old
"""


class RedisRegistry:
    def __init__(self, url: str, prefix: str = "loraserve:", client: Any = None) -> None:
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        self.prefix = prefix
        # a call waits for Redis a second, and once more after a failure or a timeout (a pooled
        # connection Redis closed when it restarted; a reply lost in a stall: the scripts answer
        # a second send as they did the first); a hung Redis held every fetch ~20 s at 5 s and
        # three retries
        self._redis = client or redis.Redis.from_url(
            url,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            socket_connect_timeout=1,
            socket_timeout=1,
        )
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._put = self._redis.register_script(PUT_SCRIPT)
        self._delete = self._redis.register_script(DELETE_SCRIPT)
        self.index_key = f"{prefix}adapters"
        self.events_key = f"{prefix}events"

    def record_key(self, adapter_id: str) -> str:
        return f"{self.prefix}adapter:{adapter_id}"

    def call_key(self) -> str:
        """A fresh key for one write's answer (the same in every send of that write)."""
        return f"{self.prefix}call:{uuid.uuid4().hex}"

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            raise Unavailable(f"registry (Redis) unreachable: {exc}") from exc

    def put(self, record: AdapterRecord, overwrite: bool) -> AdapterRecord | None:
        keys = [self.record_key(record.adapter_id), self.index_key, self.events_key, self.call_key()]
        ok, old = self._call(
            self._put,
            keys=keys,
            args=[record.adapter_id, record.to_json(), "1" if overwrite else "0", record.digest, CALL_TTL_S],
        )
        if not int(ok):
            raise AlreadyExists(f"adapter {record.adapter_id!r} already exists (set overwrite to replace it)")
        return AdapterRecord.from_json(old) if old else None

    def get(self, adapter_id: str) -> AdapterRecord | None:
        raw = self._call(self._redis.get, self.record_key(adapter_id))
        return AdapterRecord.from_json(raw) if raw else None

    def delete(self, adapter_id: str) -> AdapterRecord | None:
        keys = [self.record_key(adapter_id), self.index_key, self.events_key, self.call_key()]
        old = self._call(self._delete, keys=keys, args=[adapter_id, CALL_TTL_S])
        return AdapterRecord.from_json(old) if old else None

    def list(self, after: str, limit: int) -> tuple[list[AdapterRecord], str, int]:
        start = f"({after}" if after else "-"
        raw_ids = self._call(self._redis.zrangebylex, self.index_key, start, "+", start=0, num=limit)
        total = self._call(self._redis.zcard, self.index_key)
        if not raw_ids:
            return [], "", int(total)
        ids = [i.decode() if isinstance(i, bytes) else i for i in raw_ids]
        # an id deleted between the two calls has no record left: skipped, the cursor passes it
        raws = self._call(self._redis.mget, [self.record_key(i) for i in ids])
        cursor = ids[-1] if len(ids) == limit else ""
        return [AdapterRecord.from_json(r) for r in raws if r], cursor, int(total)

    def close(self) -> None:
        self._redis.close()
