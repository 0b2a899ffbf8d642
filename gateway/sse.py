"""Server-sent events framing for OpenAI streams: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Reverse proxies (nginx) must not buffer the stream.
    "X-Accel-Buffering": "no",
}


def event(payload: Any) -> bytes:
    """One SSE data event carrying a JSON payload (compact, no newlines inside)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
