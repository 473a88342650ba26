"""The registry of adapters: what survives a restart of the store.

`SqliteRegistry` keeps it in a file of the data directory; `RedisRegistry` (registry_redis.py)
under a key prefix shared by the fleet, with a `SqliteRegistry` as its copy to restore it from
(registry_mirror.py). Both implement `Registry`; calls block, so the service runs them off the
event loop.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from loraserve.adapter_store.errors import AlreadyExists

log = logging.getLogger("loraserve.store")


@dataclass
class AdapterRecord:
    adapter_id: str
    source: str
    digest: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str]
    dtype: str
    size_bytes: int
    base_model: str
    layout_version: int
    num_tensors: int
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    state: str = "READY"  # AdapterState name without its prefix

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> AdapterRecord:
        return cls(**json.loads(text))

    def differences(self, other: AdapterRecord) -> list[str]:
        """The fields in which `other` differs, but created_at (when each was made)."""
        mine, theirs = asdict(self), asdict(other)
        return [k for k in mine if k != "created_at" and mine[k] != theirs[k]]


def same_registration(existing: AdapterRecord, record: AdapterRecord) -> AdapterRecord:
    """`existing` when `record`, just built, registers the same (source, digest and every other
    field but the time): the request was sent again, as a client does when a reply is lost, so
    it answers as the first did; else AlreadyExists naming what differs."""
    adapter_id = record.adapter_id
    if existing.source != record.source:
        raise AlreadyExists(
            f"adapter {adapter_id!r} already exists, registered from {existing.source!r} "
            "(set overwrite to replace it)"
        )
    if existing.digest != record.digest:
        raise AlreadyExists(
            f"adapter {adapter_id!r} already exists: {record.source} now optimizes to digest "
            f"{record.digest}, not the registered digest {existing.digest} (set overwrite to "
            "replace it)"
        )
    differ = existing.differences(record)
    if differ:
        changes = ", ".join(f"{k} {getattr(record, k)!r}, not {getattr(existing, k)!r}" for k in differ)
        raise AlreadyExists(
            f"adapter {adapter_id!r} already exists: {record.source} now reads as {changes} "
            "(set overwrite to replace it)"
        )
    log.info("adapter %s was registered from %s already: answered its record", adapter_id, record.source)
    return existing


class Registry(Protocol):
    def put(self, record: AdapterRecord, overwrite: bool) -> AdapterRecord | None:
        """Store record; returns the record it replaced. AlreadyExists when taken and not overwrite."""

    def get(self, adapter_id: str) -> AdapterRecord | None: ...

    def delete(self, adapter_id: str) -> AdapterRecord | None:
        """Remove and return the record; None when unknown."""

    def list(self, after: str, limit: int) -> tuple[list[AdapterRecord], str, int]:
        """(records, cursor, total): the records among the next `limit` ids after `after`, in id
        order; the last of those ids as the cursor to list on from, "" when they were the last; and
        the total count. Fewer records than ids come back where some were deleted meanwhile, so a
        caller pages on until the cursor is "", not until a short page."""

    def close(self) -> None: ...


class SqliteRegistry:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS adapters (adapter_id TEXT PRIMARY KEY, record TEXT NOT NULL)"
            )
            # what a copy of another registry knows of the one it copies (registry_mirror.py)
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")

    def put(
        self, record: AdapterRecord, overwrite: bool, meta: dict[str, str] | None = None
    ) -> AdapterRecord | None:
        """meta: also set in the same transaction (registry_mirror.py)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                old = self._get(record.adapter_id)
                if old is not None and not overwrite:
                    raise AlreadyExists(
                        f"adapter {record.adapter_id!r} already exists (set overwrite to replace it)"
                    )
                self._db.execute(
                    "INSERT OR REPLACE INTO adapters (adapter_id, record) VALUES (?, ?)",
                    (record.adapter_id, record.to_json()),
                )
                self._set_meta(meta or {})
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return old

    def _get(self, adapter_id: str) -> AdapterRecord | None:
        row = self._db.execute("SELECT record FROM adapters WHERE adapter_id = ?", (adapter_id,)).fetchone()
        return AdapterRecord.from_json(row[0]) if row else None

    def get(self, adapter_id: str) -> AdapterRecord | None:
        with self._lock:
            return self._get(adapter_id)

    def delete(self, adapter_id: str, meta: dict[str, str] | None = None) -> AdapterRecord | None:
        """meta: also set in the same transaction (registry_mirror.py)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                old = self._get(adapter_id)
                self._db.execute("DELETE FROM adapters WHERE adapter_id = ?", (adapter_id,))
                self._set_meta(meta or {})
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return old

    def records(self, skip_unreadable: bool = False) -> list[AdapterRecord]:
        """Every record, in id order. skip_unreadable: those that no longer parse (a file written
        by another version of the store) are left out and logged, not raised."""
        with self._lock:
            rows = self._db.execute("SELECT adapter_id, record FROM adapters ORDER BY adapter_id").fetchall()
        out = []
        for adapter_id, text in rows:
            try:
                out.append(AdapterRecord.from_json(text))
            except (ValueError, TypeError) as exc:
                if not skip_unreadable:
                    raise
                log.warning(
                    "registry file %s: the record of %r does not parse (%s): left out",
                    self.path,
                    adapter_id,
                    exc,
                )
        return out

    def meta(self) -> dict[str, str]:
        with self._lock:
            return dict(self._db.execute("SELECT name, value FROM meta").fetchall())

    def _set_meta(self, values: dict[str, str]) -> None:
        self._db.executemany("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)", values.items())

    def replace_all(self, records: list[AdapterRecord], meta: dict[str, str]) -> None:
        """Make the registry hold exactly `records`, and `meta`, in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM adapters")
                self._db.executemany(
                    "INSERT INTO adapters (adapter_id, record) VALUES (?, ?)",
                    [(r.adapter_id, r.to_json()) for r in records],
                )
                self._set_meta(meta)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def list(self, after: str, limit: int) -> tuple[list[AdapterRecord], str, int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT adapter_id, record FROM adapters WHERE adapter_id > ? ORDER BY adapter_id LIMIT ?",
                (after, limit),
            ).fetchall()
            total = self._db.execute("SELECT COUNT(*) FROM adapters").fetchone()[0]
        cursor = rows[-1][0] if rows and len(rows) == limit else ""
        return [AdapterRecord.from_json(r[1]) for r in rows], cursor, int(total)

    def close(self) -> None:
        with self._lock:
            self._db.close()
