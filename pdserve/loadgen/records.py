"""What one request is (`RequestSpec`) and what was measured for it
(`RequestRecord`). Records hold raw client-side timestamps only; every derived
number is computed by the pure functions in `metrics.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request to send.

    `prompt` is used by /v1/completions; `messages` by /v1/chat/completions
    (built from `prompt` as one user message when absent). `prompt_tokens_est`
    is the client's own count: exact when a tokenizer was given, otherwise a
    word-count estimate; the server's `usage.prompt_tokens` wins when reported.
    """

    prompt: str
    max_tokens: int
    tag: str = "default"
    messages: tuple[dict[str, str], ...] | None = None
    prompt_tokens_est: int | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]


@dataclasses.dataclass
class RequestRecord:
    """Client-side measurements of one request.

    Times are `time.perf_counter()` seconds. `chunk_times` has one entry per
    SSE chunk that carried non-empty content text, in arrival order, and
    `chunk_chars` the length of that text. `end_time` is when the stream ended
    (`data: [DONE]` or the connection closed), so e2e includes the usage chunk.
    """

    tag: str
    send_time: float
    max_tokens: int
    prompt_tokens_est: int | None = None
    # Sent as `x-request-id`, so server logs and metrics can be matched to records.
    request_id: str | None = None
    response_id: str | None = None  # the `id` field of the stream's events
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_chars: list[int] = dataclasses.field(default_factory=list)
    # Tokens per chunk estimated by a client tokenizer; None without one.
    chunk_token_est: list[int] | None = None
    end_time: float | None = None
    prompt_tokens: int | None = None  # from server usage
    completion_tokens: int | None = None  # from server usage
    finish_reason: str | None = None
    error: str | None = None  # failure key, e.g. "http_503", "timeout"
    error_detail: str | None = None
    cancelled: bool = False  # stopped by the run's deadline: neither success nor failure

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.end_time is not None

    @property
    def usage_reported(self) -> bool:
        return self.completion_tokens is not None

    @property
    def output_tokens(self) -> int:
        """Server-reported completion tokens; else one token per content chunk."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def input_tokens(self) -> int | None:
        """Server-reported prompt tokens; else the client's estimate."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_tokens_est

    def to_dict(self, origin: float) -> dict[str, Any]:
        """JSON-ready form with times in seconds relative to `origin`."""

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - origin, 6)

        return {
            "tag": self.tag,
            "request_id": self.request_id,
            "response_id": self.response_id,
            "ok": self.ok,
            "error": self.error,
            "error_detail": self.error_detail,
            "cancelled": self.cancelled,
            "send_time": rel(self.send_time),
            "end_time": rel(self.end_time),
            "chunk_times": [round(t - self.send_time, 6) for t in self.chunk_times],
            "chunk_chars": list(self.chunk_chars),
            "chunk_token_est": self.chunk_token_est,
            "max_tokens": self.max_tokens,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_est": self.prompt_tokens_est,
            "completion_tokens": self.completion_tokens,
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
        }
