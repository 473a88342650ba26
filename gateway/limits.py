"""The request body limit: an ASGI middleware that reads a body up to `max_bytes` before the app
sees it and answers 413 in OpenAI's error shape past that, so no request makes the gateway buffer
more (the per-field limits are the request models' and the handler's). FastAPI's own `max_body_size`
answers a declared oversize body in plain text, not in OpenAI's shape."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraserve.gateway.errors import APIError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"the request body is over this server's limit of {self.max_bytes} bytes",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            # the whole body once, then the connection's own messages (its disconnect)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
