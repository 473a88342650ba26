"""Adapter ids as requests give them, and the page tokens of ListAdapters (the last id listed)."""

from __future__ import annotations

import base64
import binascii

from loraserve.adapter_store.errors import InvalidArgument
from loraserve.contract.adapter_layout import ADAPTER_ID_RE


def check_adapter_id(adapter_id: str) -> None:
    if not ADAPTER_ID_RE.fullmatch(adapter_id) or ".." in adapter_id:
        raise InvalidArgument(
            f"adapter id {adapter_id[:140]!r} is malformed: it must match "
            f"{ADAPTER_ID_RE.pattern} and not contain '..'"
        )


def encode_page_token(last_id: str) -> str:
    return base64.urlsafe_b64encode(last_id.encode()).decode()


def decode_page_token(token: str) -> str:
    if not token:
        return ""
    try:
        after = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
        check_adapter_id(after)
    except (binascii.Error, UnicodeDecodeError, ValueError, InvalidArgument):
        raise InvalidArgument("page_token is malformed (pass next_page_token of the previous page)") from None
    return after
