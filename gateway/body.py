"""Reading a request body: bounded in size and in time."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.validation import check_content_type, decode_body, too_large


async def json_body(request: web.Request, config: GatewayConfig) -> dict[str, Any]:
    """An OpenAI endpoint's body as an object: content type, size, arrival time and JSON checked."""
    check_content_type(request.headers.get("Content-Type", ""))
    return await json_object(request, config.limits.max_body_bytes, config.connections.body_timeout_s)


async def json_object(request: web.Request, limit: int, timeout_s: float) -> dict[str, Any]:
    """The body as a JSON object, at most `limit` bytes arriving within `timeout_s` (any
    content type: the admin and LoRA endpoints take what vLLM's clients send)."""
    return decode_body(await read_body(request, limit, timeout_s), limit)


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refused with a 413 as soon as it passes `limit` bytes, and with a
    408 (the connection closed) unless all of it arrives within `timeout_s`."""
    length = request.content_length
    if length is not None and length > limit:
        raise too_large(limit)
    try:
        return await asyncio.wait_for(_read(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g}s", code="body_timeout",
                       reason="body_timeout", close=True) from None


async def _read(request: web.Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
