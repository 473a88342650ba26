"""Which version of each adapter is current, as far as this worker knows.

`current[id]` is the digest the worker believes the store serves: a request for a plain id uses
it, a request for "id@digest" needs exactly that version. Every invalidation of an id (the store
re-registered or deleted it) bumps the id's generation, so a fetch that started before one can
tell that what it brings back may already be superseded. Not thread-safe: the adapters' state
lock guards it.
"""

from __future__ import annotations

from loraserve.inference_worker.adapters.refs import AdapterRef, version_key


class VersionBook:
    def __init__(self) -> None:
        self._current: dict[str, str] = {}  # adapter id -> digest believed current at the store
        self._generation: dict[str, int] = {}  # adapter id -> invalidations seen

    def resolve(self, ref: AdapterRef) -> str | None:
        """The version key a reference names now; None when a plain id has no known version."""
        digest = ref.digest or self._current.get(ref.adapter_id)
        return version_key(ref.adapter_id, digest) if digest else None

    def generation(self, adapter_id: str) -> int:
        return self._generation.get(adapter_id, 0)

    def current(self, adapter_id: str) -> str | None:
        return self._current.get(adapter_id)

    def accepts(self, adapter_id: str, digest: str, generation: int) -> bool:
        """Whether a version fetched while the id was at `generation` may be installed: yes unless
        an invalidation seen since then names another digest (the caller fetches again)."""
        return self.generation(adapter_id) == generation or self._current.get(adapter_id, "") == digest

    def learn(self, adapter_id: str, digest: str) -> bool:
        """A fetch saw the store serve `digest`; True when that supersedes what was current."""
        if self._current.get(adapter_id) == digest:
            return False
        self._current[adapter_id] = digest
        return True

    def invalidate(self, adapter_id: str, digest: str) -> None:
        """The store now serves `digest` for `adapter_id` ("" = deleted)."""
        self._generation[adapter_id] = self.generation(adapter_id) + 1
        if digest:
            self._current[adapter_id] = digest
        else:
            self._current.pop(adapter_id, None)

    def snapshot(self) -> dict[str, str]:
        return dict(self._current)
