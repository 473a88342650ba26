"""`loraserve openai`: serve the OpenAI-compatible API with uvicorn on a socket bound up front, so
`--port 0` knows its port before serving and prints the URL; `BackgroundGateway` runs it in a thread
(the `up` launcher, tests)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Sequence

import uvicorn

from loraserve.gateway.app import create_app
from loraserve.gateway.config import GatewayConfig
from loraserve.serving.logs import configure_logging
from loraserve.serving.ports import PortUnavailable, listen_socket

log = logging.getLogger("loraserve.gateway")


def url_of(host: str, sock: socket.socket) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{sock.getsockname()[1]}"


def make_server(config: GatewayConfig) -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            log_level=config.log_level.lower(),
            access_log=config.log_level.upper() == "DEBUG",
            timeout_graceful_shutdown=5,
            # clients keep pools of connections; uvicorn's 5 s default closes them under their
            # requests (75 s is nginx's default)
            timeout_keep_alive=int(config.keep_alive_s),
            server_header=False,
            log_config=None,  # the JSON logs of configure_logging
        )
    )


class BackgroundGateway:
    """The gateway serving on its own event loop in a daemon thread; `.url`, `.stop()`."""

    def __init__(self, config: GatewayConfig) -> None:
        self.sock = listen_socket(config.host, config.port)
        self.url = url_of(config.host, self.sock)
        self.server = make_server(config)
        self._thread = threading.Thread(target=self._run, name="openai-gateway", daemon=True)
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            self._thread.join(0.01)
        if not self.server.started:
            raise RuntimeError("the gateway did not start (see its log)")

    @property
    def app(self):
        return self.server.config.app

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    config = GatewayConfig.from_args(argv)
    configure_logging(config.log_level)
    try:
        sock = listen_socket(config.host, config.port)
    except PortUnavailable as exc:  # one line, no traceback
        log.error("%s", exc)
        return 1
    target = f"the fleet in {config.redis_url}" if config.redis_url else f"worker {config.worker}"
    print(f"OpenAI-compatible API on {url_of(config.host, sock)}/v1 (in front of {target})", flush=True)
    server = make_server(config)
    asyncio.run(server.serve(sockets=[sock]))
    return 0
