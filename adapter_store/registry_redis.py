"""The registry in Redis, under one key prefix:

    {prefix}adapter:{id}       string, the record as JSON
    {prefix}adapters           sorted set of ids (all score 0, so ZRANGE BYLEX pages in id order)
    {prefix}events             stream of invalidations (an adapter replaced or deleted) for workers
    {prefix}call:{token}       the answer of one write, kept a minute for redis-py's re-sends of it
    {prefix}epoch              a random id of this keyspace's life: created when absent (by the
                               store or a worker's coordinator), so a Redis that lost its data
                               (restarted with no persistence, flushed) has none or another one
    {prefix}registry:version   integer, bumped by every registry write (a restore's too)
    {prefix}registry:restored  hash: the epoch of a copy put back -> the highest copy version put
                               back from it, so that a store whose copy knows no more puts back
                               nothing (not the adapters deleted since: registry_mirror.py)

Each multi-key update is one Lua script, so the record, the index, the version and the event
change together; each script and each read runs only while the epoch is the one this registry
knows, so a registry that Redis lost never reads as every adapter deleted: `RegistryLost` is
raised instead, and the store restores the registry from its copy (registry_mirror.py).

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
# (an fsync, a fork) may have run it already: each write records its answer ("version|JSON") under
# a key of the call's own token for CALL_TTL_S seconds, and a script sent again finds it there and
# answers the same, instead of finding its own write (ALREADY_EXISTS for a registration, NOT_FOUND
# for a delete).
CALL_TTL_S = 60
RESTORE_BATCH = 100  # records put back per script call

# KEYS[1] - record key, KEYS[2] - id index, KEYS[3] - event stream, KEYS[4] - this call's answer,
# KEYS[5] - epoch, KEYS[6] - registry version
# ARGV[1] - adapter id, ARGV[2] - record JSON, ARGV[3] - "1" to overwrite, ARGV[4] - new digest,
# ARGV[5] - seconds to keep this call's answer, ARGV[6] - the epoch the caller knows
# returns {1, version, previous JSON or ""} when stored (or stored by this call already),
# {0, 0, existing JSON} when taken and not overwriting, {-1, 0, ""} when the epoch is not ARGV[6]
PUT_SCRIPT = """
local done = redis.call('GET', KEYS[4])
if done then
  local bar = string.find(done, '|', 1, true)
  return {1, tonumber(string.sub(done, 1, bar - 1)), string.sub(done, bar + 1)}
end
if redis.call('GET', KEYS[5]) ~= ARGV[6] then return {-1, 0, ''} end
local old = redis.call('GET', KEYS[1])
if old and ARGV[3] ~= '1' then return {0, 0, old} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], 0, ARGV[1])
if old then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', 10000, '*', 'event', 'replaced', 'adapter_id', ARGV[1], 'digest', ARGV[4])
end
local version = redis.call('INCR', KEYS[6])
redis.call('SET', KEYS[4], version .. '|' .. (old or ''), 'EX', ARGV[5])
return {1, version, old or ''}
"""

# KEYS[1] - record key, KEYS[2] - id index, KEYS[3] - event stream, KEYS[4] - this call's answer,
# KEYS[5] - epoch, KEYS[6] - registry version
# ARGV[1] - adapter id, ARGV[2] - seconds to keep this call's answer, ARGV[3] - the epoch the
# caller knows
# returns {1, version, deleted JSON} (also when this call deleted it already), {0, 0, ""} when there
# was none, {-1, 0, ""} when the epoch is not ARGV[3]
DELETE_SCRIPT = """
local done = redis.call('GET', KEYS[4])
if done then
  local bar = string.find(done, '|', 1, true)
  return {1, tonumber(string.sub(done, 1, bar - 1)), string.sub(done, bar + 1)}
end
if redis.call('GET', KEYS[5]) ~= ARGV[3] then return {-1, 0, ''} end
local old = redis.call('GET', KEYS[1])
if not old then return {0, 0, ''} end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 10000, '*', 'event', 'deleted', 'adapter_id', ARGV[1])
local version = redis.call('INCR', KEYS[6])
redis.call('SET', KEYS[4], version .. '|' .. old, 'EX', ARGV[2])
return {1, version, old}
"""

# KEYS[1] - id index, KEYS[2] - registry version, KEYS[3..n+2] - record keys
# ARGV[1..n] - the adapter ids of KEYS[3..n+2], in that order, ARGV[n+1..2n] - their record JSON
# returns how many records were absent and were put back (a record present is left as it is); the
# version is bumped when any was, as by every registry write: stores in step with Redis follow
RESTORE_SCRIPT = """
local n, restored = #KEYS - 2, 0
for i = 1, n do
  if redis.call('SET', KEYS[i + 2], ARGV[n + i], 'NX') then restored = restored + 1 end
  redis.call('ZADD', KEYS[1], 0, ARGV[i])
end
if restored > 0 then redis.call('INCR', KEYS[2]) end
return restored
"""

# KEYS[1] - epoch, KEYS[2] - registry version, KEYS[3] - the copies put back (epoch -> version)
# ARGV[1] - the epoch to create when there is none, ARGV[2] - the least version to leave, ARGV[3] -
# the epoch of the copy just put back ("" for none: ARGV[2] is then not recorded for it)
# returns {epoch, version} as they are now
CLAIM_SCRIPT = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  redis.call('SET', KEYS[1], ARGV[1])
  epoch = ARGV[1]
end
local version = tonumber(redis.call('GET', KEYS[2]) or '0')
if version < tonumber(ARGV[2]) then
  version = tonumber(ARGV[2])
  redis.call('SET', KEYS[2], version)
end
if ARGV[3] ~= '' and tonumber(redis.call('HGET', KEYS[3], ARGV[3]) or '-1') < tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[3], ARGV[3], ARGV[2])
end
return {epoch, version}
"""


class RegistryLost(Unavailable):
    """Redis no longer holds the registry this process knew (its epoch is gone or another): it was
    restarted empty or flushed. Nothing read now says what is registered; the registry is to be
    restored (registry_mirror.py) and the call made again."""


class RedisRegistry:
    def __init__(
        self, url: str, prefix: str = "loraserve:", client: Any = None, *, adopt: bool = True
    ) -> None:
        """`adopt`: on first use, take the epoch found in Redis (creating one when there is none) as
        this registry's; else `epoch` is set by the owner (registry_mirror.py), and until then every
        call raises RegistryLost."""
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
        self._restore = self._redis.register_script(RESTORE_SCRIPT)
        self._claim = self._redis.register_script(CLAIM_SCRIPT)
        self.index_key = f"{prefix}adapters"
        self.events_key = f"{prefix}events"
        self.epoch_key = f"{prefix}epoch"
        self.version_key = f"{prefix}registry:version"
        self.restored_key = f"{prefix}registry:restored"
        self.epoch: str | None = None  # the epoch every call checks
        self.adopt = adopt

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

    def _known_epoch(self) -> str:
        if self.epoch is None and self.adopt:
            self.epoch, _ = self.claim(uuid.uuid4().hex, 0)
        if self.epoch is None:
            raise RegistryLost("registry (Redis) not yet checked against its copy; retry")
        return self.epoch

    def _check(self, epoch: str | bytes | None, known: str) -> None:
        """RegistryLost unless `epoch`, read with what a call read, is the one this registry knows."""
        if _text(epoch) != known:
            raise self._lost(known)

    def _lost(self, known: str) -> RegistryLost:
        return RegistryLost(
            f"registry (Redis) lost: its epoch is no longer {known!r} (Redis restarted empty or was "
            "flushed); retry once it is restored"
        )

    # -- the epoch and the version -----------------------------------------------------------
    def state(self) -> tuple[str | None, int]:
        """(epoch, version) as Redis holds them now; (None, 0) when it lost them."""

        def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.get(self.epoch_key)
            pipe.get(self.version_key)
            return list(pipe.execute())

        epoch, version = self._call(read)
        return _text(epoch), int(version or 0)

    def claim(self, epoch: str, min_version: int, restored_from: str = "") -> tuple[str, int]:
        """Create the epoch (as `epoch`) when Redis has none and raise the version to at least
        `min_version`; `restored_from`: the epoch of a copy, at `min_version`, just put back
        (`restored`); -> (epoch, version) as they are now."""
        found, version = self._call(
            self._claim,
            keys=[self.epoch_key, self.version_key, self.restored_key],
            args=[epoch, min_version, restored_from],
        )
        return _text(found), int(version)

    def restored(self, epoch: str) -> int:
        """The highest version of a copy of registry epoch `epoch` put back into this one; -1: none."""
        found = self._call(self._redis.hget, self.restored_key, epoch)
        return int(found) if found is not None else -1

    def restore(self, records: list[AdapterRecord]) -> int:
        """Put back each of `records` that Redis does not hold (whatever the epoch), bumping the
        version when any was; -> how many."""
        restored = 0
        for i in range(0, len(records), RESTORE_BATCH):
            batch = records[i : i + RESTORE_BATCH]
            keys = [self.index_key, self.version_key, *(self.record_key(r.adapter_id) for r in batch)]
            args = [*(r.adapter_id for r in batch), *(r.to_json() for r in batch)]
            restored += int(self._call(self._restore, keys=keys, args=args))
        return restored

    # -- Registry ----------------------------------------------------------------------------
    def write(self, record: AdapterRecord, overwrite: bool) -> tuple[AdapterRecord | None, int]:
        """`put`, and the registry version this write made."""
        epoch = self._known_epoch()
        keys = self._write_keys(record.adapter_id)
        args = [
            record.adapter_id,
            record.to_json(),
            "1" if overwrite else "0",
            record.digest,
            CALL_TTL_S,
            epoch,
        ]
        ok, version, old = self._call(self._put, keys=keys, args=args)
        if int(ok) < 0:
            raise self._lost(epoch)
        if not int(ok):
            raise AlreadyExists(f"adapter {record.adapter_id!r} already exists (set overwrite to replace it)")
        return (AdapterRecord.from_json(old) if old else None), int(version)

    def put(self, record: AdapterRecord, overwrite: bool) -> AdapterRecord | None:
        return self.write(record, overwrite)[0]

    def _write_keys(self, adapter_id: str) -> list[str]:
        """KEYS of PUT_SCRIPT and DELETE_SCRIPT for `adapter_id`."""
        return [
            self.record_key(adapter_id),
            self.index_key,
            self.events_key,
            self.call_key(),
            self.epoch_key,
            self.version_key,
        ]

    def get(self, adapter_id: str) -> AdapterRecord | None:
        epoch = self._known_epoch()

        def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.get(self.epoch_key)
            pipe.get(self.record_key(adapter_id))
            return list(pipe.execute())

        found, raw = self._call(read)
        self._check(found, epoch)
        return AdapterRecord.from_json(raw) if raw else None

    def remove(self, adapter_id: str) -> tuple[AdapterRecord | None, int]:
        """`delete`, and the registry version this deletion made (0 when there was nothing)."""
        epoch = self._known_epoch()
        keys = self._write_keys(adapter_id)
        ok, version, old = self._call(self._delete, keys=keys, args=[adapter_id, CALL_TTL_S, epoch])
        if int(ok) < 0:
            raise self._lost(epoch)
        return (AdapterRecord.from_json(old) if int(ok) else None), int(version)

    def delete(self, adapter_id: str) -> AdapterRecord | None:
        return self.remove(adapter_id)[0]

    def _read_records(self, ids: list[str], epoch: str) -> list[Any]:
        def read() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.mget([self.record_key(i) for i in ids])
            pipe.get(self.epoch_key)
            return list(pipe.execute())

        raws, found = self._call(read)
        self._check(found, epoch)
        return list(raws)

    def list(self, after: str, limit: int) -> tuple[list[AdapterRecord], str, int]:
        epoch = self._known_epoch()
        start = f"({after}" if after else "-"

        def read_ids() -> list[Any]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.get(self.epoch_key)
            pipe.zrangebylex(self.index_key, start, "+", start=0, num=limit)
            pipe.zcard(self.index_key)
            return list(pipe.execute())

        found, raw_ids, total = self._call(read_ids)
        self._check(found, epoch)
        if not raw_ids:
            return [], "", int(total)
        ids = [_text(i) for i in raw_ids]
        # an id deleted between the two reads has no record left: skipped, the cursor passes it;
        # a registry lost between them is told by the epoch read with the records
        raws = self._read_records(ids, epoch)
        cursor = ids[-1] if len(ids) == limit else ""
        return [AdapterRecord.from_json(r) for r in raws if r], cursor, int(total)

    def close(self) -> None:
        self._redis.close()


def _text(value: Any) -> Any:
    """A reply of this client (which answers bytes) as text; None and numbers as they are."""
    return value.decode() if isinstance(value, bytes) else value
