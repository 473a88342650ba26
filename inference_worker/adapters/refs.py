"""Adapter references as requests name them: "id" (whatever version the store serves now) or
"id@digest" (exactly that version, a 64-hex sha256 of its optimized payload). Versions are keyed
"id@digest" in every tier."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from loraserve.contract.adapter_layout import ADAPTER_ID_RE
from loraserve.inference_worker.errors import InvalidRequest

DIGEST_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class AdapterRef:
    adapter_id: str
    digest: str = ""  # "" = the version the store serves now

    @staticmethod
    def parse(ref: str) -> AdapterRef:
        """ "id" or "id@digest"; InvalidRequest (naming the part) for anything else. The step
        thread asks again for every queued request each step: well-formed references are kept
        (the last PARSED_KEPT of them; refusals are not kept)."""
        return _parse(ref)

    def __str__(self) -> str:
        return f"{self.adapter_id}@{self.digest}" if self.digest else self.adapter_id


PARSED_KEPT = 4096


@functools.lru_cache(maxsize=PARSED_KEPT)
def _parse(ref: str) -> AdapterRef:
    adapter_id, at, digest = ref.partition("@")
    if ADAPTER_ID_RE.fullmatch(adapter_id) is None:
        raise InvalidRequest(f"adapter id {adapter_id!r} must match {ADAPTER_ID_RE.pattern}")
    if at and DIGEST_RE.fullmatch(digest) is None:
        raise InvalidRequest(f"adapter digest {digest!r} must be 64 lowercase hex characters (sha256)")
    return AdapterRef(adapter_id, digest)


def version_key(adapter_id: str, digest: str) -> str:
    return f"{adapter_id}@{digest}"


def split_key(key: str) -> tuple[str, str]:
    """ "id@digest" -> (id, digest)."""
    adapter_id, _, digest = key.partition("@")
    return adapter_id, digest
