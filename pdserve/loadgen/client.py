"""Streaming client for OpenAI-compatible servers (aiohttp + SSE).

One `time.perf_counter()` timestamp is taken per SSE event that carries
non-empty content text (`choices[0].text` for completions,
`choices[0].delta.content` for chat). Role-only and usage-only events get no
timestamp. Token counts come from the final usage event
(`stream_options.include_usage`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from pdserve.loadgen.config import Endpoint, EndpointConfig
from pdserve.loadgen.prompts import TokenCounter
from pdserve.loadgen.records import RequestRecord, RequestSpec

MAX_ERROR_BODY = 2000
REQUEST_ID_HEADER = "X-Request-Id"


class EndpointError(RuntimeError):
    """The endpoint could not be used at all (e.g. GET /v1/models failed)."""


def auth_headers(cfg: EndpointConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def resolve_model(session: aiohttp.ClientSession, cfg: EndpointConfig) -> str:
    """`cfg.models` joined by commas, `cfg.model`, or else the first model listed by
    GET /v1/models."""
    if cfg.models:
        return ",".join(cfg.models)
    if cfg.model:
        return cfg.model
    url = cfg.base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=auth_headers(cfg)) as resp:
            if resp.status != 200:
                raise EndpointError(f"GET {url} -> HTTP {resp.status}")
            data = (await resp.json()).get("data") or []
    except aiohttp.ClientError as e:
        raise EndpointError(f"GET {url} failed: {e}") from e
    if not data:
        raise EndpointError(f"GET {url} listed no models; pass --model")
    return str(data[0]["id"])


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The `data:` payload of each server-sent event, multi-line data joined."""
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" ") if line[5:6] == " " else line[5:])
        # event:, id:, retry: and comments (":") carry nothing we measure.
    if data:
        yield "\n".join(data)


class StreamingClient:
    """Sends one `RequestSpec` and fills its `RequestRecord`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        cfg: EndpointConfig,
        model: str,
        counter: TokenCounter | None = None,
    ) -> None:
        self.session = session
        self.cfg = cfg
        self.model = model
        # `cfg.models` in turn, one a request (warm-up requests included), else `model`.
        self.models = cfg.models or (model,)
        self._turn = 0
        self.counter = counter
        self.url = cfg.base_url.rstrip("/") + cfg.endpoint.path
        self._run_id = uuid.uuid4().hex[:8]
        self._sent = 0

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        model = self.models[self._turn % len(self.models)]
        self._turn += 1
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.cfg.temperature,
        }
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        if self.cfg.extra_body:
            body.update(json.loads(self.cfg.extra_body))
        if self.cfg.endpoint is Endpoint.CHAT:
            body["messages"] = spec.chat_messages()
        else:
            body["prompt"] = spec.prompt
        return body

    def new_record(self, spec: RequestSpec) -> RequestRecord:
        self._sent += 1
        return RequestRecord(
            tag=spec.tag,
            send_time=time.perf_counter(),
            max_tokens=spec.max_tokens,
            prompt_tokens_est=spec.prompt_tokens_est,
            request_id=f"bench-{self._run_id}-{self._sent}",
        )

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
        """Run the request to its end, recording into `rec` (errors are recorded, not raised)."""
        texts: list[str] = []
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        headers = auth_headers(self.cfg)
        if rec.request_id:
            headers[REQUEST_ID_HEADER] = rec.request_id
        rec.send_time = time.perf_counter()
        try:
            async with self.session.post(
                self.url, json=self.payload(spec), headers=headers, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    body = (await resp.text())[:MAX_ERROR_BODY]
                    _fail(rec, f"http_{resp.status}", _error_message(body))
                else:
                    await self._read_stream(resp, rec, texts)
        except asyncio.TimeoutError:
            _fail(rec, "timeout", f"no end within {self.cfg.request_timeout_s}s")
        except aiohttp.ClientPayloadError as e:
            _fail(rec, "incomplete_stream", str(e))
        except aiohttp.ClientError as e:
            _fail(rec, "incomplete_stream" if rec.chunk_times else "connection_error", str(e))
        except (ValueError, UnicodeDecodeError) as e:
            _fail(rec, "stream_error", f"unparsable stream: {e}")
        if rec.end_time is None:
            rec.end_time = time.perf_counter()
        if self.counter is not None and texts:
            rec.chunk_token_est = [max(1, self.counter.count(t)) for t in texts]
        return rec

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, rec: RequestRecord, texts: list[str]
    ) -> None:
        done = False
        async for data in sse_events(resp.content):
            now = time.perf_counter()
            if data.strip() == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                err = (
                    event["error"]
                    if isinstance(event["error"], dict)
                    else {"message": event["error"]}
                )
                code = err.get("code") or err.get("type") or "error"
                _fail(rec, f"stream_error:{code}", str(err.get("message", ""))[:MAX_ERROR_BODY])
                return
            self._take_event(event, rec, texts, now)
        rec.end_time = time.perf_counter()
        if not done and rec.finish_reason is None:
            _fail(rec, "incomplete_stream", "stream ended without [DONE] or finish_reason")
        elif not rec.chunk_times:
            _fail(rec, "no_content", "stream carried no content text")

    def _take_event(
        self, event: dict[str, Any], rec: RequestRecord, texts: list[str], now: float
    ) -> None:
        if rec.response_id is None and event.get("id"):
            rec.response_id = str(event["id"])
        usage = event.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
            rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)
        for choice in event.get("choices") or []:
            if self.cfg.endpoint is Endpoint.CHAT:
                text = (choice.get("delta") or {}).get("content") or ""
            else:
                text = choice.get("text") or ""
            if text:
                rec.chunk_times.append(now)
                rec.chunk_chars.append(len(text))
                texts.append(text)
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]


def _fail(rec: RequestRecord, key: str, detail: str) -> None:
    rec.error = key
    rec.error_detail = detail
    rec.end_time = time.perf_counter()


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message", body) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return body
