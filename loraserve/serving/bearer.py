"""The bearer-token check shared by the services: `authorization: Bearer <token>` call metadata
compared in constant time against the configured token."""

from __future__ import annotations

import hmac
from collections.abc import Collection, Iterable


def check_bearer(
    metadata: Iterable[tuple[str, str | bytes]] | None,
    token: str | Collection[str],
    call: str | None = None,
) -> tuple[str, str] | None:
    """None when the call carries the token (or one of the tokens); otherwise (gRPC status-code
    name, message). `call` (e.g. the method name) is named in the message when given."""
    header = dict(metadata or ()).get("authorization")
    if not header:
        return "UNAUTHENTICATED", f"{call or 'this call'} needs 'authorization: Bearer <token>' metadata"
    scheme, _, given = str(header).partition(" ")
    accepted = (token,) if isinstance(token, str) else tuple(token)
    # every token is compared, so the time taken does not tell which one came closest
    matches = [hmac.compare_digest(given.strip().encode(), t.encode()) for t in accepted]
    if scheme.lower() != "bearer" or not any(matches):
        return "PERMISSION_DENIED", (f"{call}: " if call else "") + "the bearer token is not valid"
    return None
