"""Client connections: none holds a slot, a socket or memory it does not use.

`GatewayRunner` is the aiohttp `AppRunner` of the gateway; its `GuardedServer` enforces,
per gateway process (`ConnectionLimits`):

1. at most `max_connections` open connections: a request on one past it gets a 503
   with Retry-After (OpenAI's error shape), and the connection is closed;
2. a request head must arrive within `header_timeout_s` of connecting or of the previous
   response, or the connection is closed (aiohttp's keep-alive timer, which also covers a
   connection that never sends anything); the body within `body_timeout_s` of the head
   (`read_body`, gateway/body.py: a 408);
3. the idle-write watchdog: a connection whose unsent output has not drained at all for
   `idle_write_timeout_s` (its client stopped reading) is aborted. The abort is a
   disconnect: aiohttp cancels the handler, which closes the generation, which aborts
   the request in the backend and frees its KV (the path of any client disconnect).

Output waits in the transport only once the kernel's send buffer is full, so a non-empty
buffer that never shrinks means the peer reads nothing. The watchdog samples every
connection's buffer a few times per timeout; any shrink (or an empty buffer) restarts
that connection's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gateway.config import ConnectionLimits

log = logging.getLogger("pdserve.gateway")

# How long a handler that leaves the body unread keeps reading it before closing (aiohttp's
# "lingering close"); bounds what a slow body can hold after an early answer (401, 404).
LINGER_S = 2.0

OnDrop = Callable[[str], None]  # reason: "refused" | "write_stall"


@dataclass
class _Stall:
    since: float  # loop time the buffer was last seen to shrink (or to fill)
    low: int  # the smallest buffer size seen since then


class GuardedServer(web.Server):
    """aiohttp's connection manager with the connection cap and the idle-write watchdog."""

    def __init__(self, *args: Any, limits: ConnectionLimits, retry_after_s: int = 1,
                 on_drop: OnDrop | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._retry_after_s = max(1, retry_after_s)
        self._on_drop = on_drop
        self._open: dict[RequestHandler, asyncio.Transport] = {}
        self._stalls: dict[RequestHandler, _Stall] = {}
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(handler, transport)
        if len(self._open) >= self._limits.max_connections:
            # Answered, not reset: the request is read (so closing sends no RST) and gets the
            # 503; the header timeout bounds how long this connection may take to send it.
            handler._request_handler = self._refuse
            self._dropped("refused")
            return
        self._open[handler] = transport
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None) -> None:  # type: ignore[override]
        self._open.pop(handler, None)
        self._stalls.pop(handler, None)
        super().connection_lost(handler, exc)

    async def shutdown(self, timeout: float | None = None) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await super().shutdown(timeout)

    async def _refuse(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request on a connection past the cap: a 503 in OpenAI's shape, then close."""
        body = json.dumps({"error": {
            "message": "server overloaded: too many open connections; retry later",
            "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
        resp = web.Response(status=503, body=body, content_type="application/json",
                            headers={"Retry-After": str(self._retry_after_s)})
        resp.force_close()
        return resp

    async def _sweep(self) -> None:
        interval = min(1.0, self._limits.idle_write_timeout_s / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            self.check_stalls(loop.time())

    def check_stalls(self, now: float) -> None:
        """Abort every connection whose output has not drained for the idle-write timeout."""
        for handler, transport in list(self._open.items()):
            size = transport.get_write_buffer_size()
            stall = self._stalls.get(handler)
            if size == 0:
                self._stalls.pop(handler, None)
            elif stall is None or size < stall.low:
                self._stalls[handler] = _Stall(now, size)
            elif now - stall.since >= self._limits.idle_write_timeout_s:
                log.info(json.dumps({"event": "connection_cut", "reason": "write_stall",
                                     "unsent_bytes": size, "stalled_s": round(now - stall.since, 3)}))
                self._stalls.pop(handler, None)
                transport.abort()  # connection_lost follows: the handler is cancelled
                self._dropped("write_stall")

    def _dropped(self, reason: str) -> None:
        if self._on_drop is not None:
            self._on_drop(reason)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose server is a `GuardedServer`, with the header timeout as aiohttp's
    keep-alive timeout."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, *, retry_after_s: int = 1,
                 on_drop: OnDrop | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", limits.header_timeout_s)
        kwargs.setdefault("lingering_time", LINGER_S)
        super().__init__(app, **kwargs)
        self._limits = limits
        self._retry_after_s = retry_after_s
        self._on_drop = on_drop

    async def _make_server(self) -> web.Server:
        # AppRunner._make_server and Application._make_handler, with our Server class.
        loop = asyncio.get_running_loop()
        app = self._app
        app._set_loop(loop)
        app.on_startup.freeze()
        await app.startup()
        app.freeze()
        kwargs = {**self._kwargs, "debug": app._debug, **(app._handler_args or {})}
        return GuardedServer(
            app._handle, request_factory=app._make_request, loop=loop,
            limits=self._limits, retry_after_s=self._retry_after_s, on_drop=self._on_drop, **kwargs,
        )

    @property
    def guarded(self) -> GuardedServer:
        server = self.server
        assert isinstance(server, GuardedServer)
        return server
