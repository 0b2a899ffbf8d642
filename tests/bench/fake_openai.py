"""A small OpenAI-compatible SSE server for load-generator tests.

It streams `max_tokens` tokens with known timing: the first content chunk
`ttft_s` after the request arrives, then one chunk per `tokens_per_chunk`
tokens, each token taking `itl_s`, so a chunk of k tokens comes k*itl_s after
the previous one. Markers in the prompt inject failures: `FAIL503` answers
HTTP 503, `ERRSTREAM` sends an error event after the first chunk, `CLOSEEARLY`
ends the stream after the first chunk without `[DONE]`.
Runs on its own event loop in a thread, bound to 127.0.0.1 on a free port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time
from typing import Any

from aiohttp import web


@dataclasses.dataclass
class FakeBehaviour:
    ttft_s: float = 0.05
    itl_s: float = 0.02
    tokens_per_chunk: int = 1
    report_usage: bool = True
    api_key: str | None = None
    model: str = "fake-model"
    # (drafts, draft tokens, accepted tokens) each request adds to a pdserve-style
    # /metrics; None: no /metrics (404), like a server without speculation counters.
    spec_per_request: tuple[int, int, int] | None = None


class FakeOpenAIServer:
    def __init__(self) -> None:
        self.behaviour = FakeBehaviour()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def reset(self) -> None:
        self.behaviour = FakeBehaviour()
        self.requests.clear()
        self.headers.clear()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.behaviour.model}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        per = self.behaviour.spec_per_request
        if per is None:
            raise web.HTTPNotFound()
        n = len(self.requests)
        names = ("llm_spec_decode_num_drafts_count", "llm_spec_decode_num_draft_tokens_count",
                 "llm_spec_decode_num_accepted_tokens_count")
        lines = []
        for name, value in zip(names, per, strict=True):
            lines += [f"# TYPE {name} gauge", f'{name}{{role="decode",worker="d1"}} {float(value * n)}']
        return web.Response(text="\n".join(lines) + "\n")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        b = self.behaviour
        arrived = time.perf_counter()
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if b.api_key and request.headers.get("Authorization") != f"Bearer {b.api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        chat = request.path.endswith("/chat/completions")
        prompt = " ".join(m["content"] for m in body["messages"]) if chat else str(body["prompt"])
        if m := re.search(r"FAIL(\d{3})", prompt):
            return web.json_response({"error": {"message": "injected"}}, status=int(m.group(1)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            return {"id": "x", "object": "chunk", "model": b.model, "choices": [choice]}

        if chat:  # role-only first event: must not count as a token
            await send({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        n = int(body["max_tokens"])
        sent = 0
        next_at = arrived + b.ttft_s
        while sent < n:
            k = 1 if sent == 0 else min(b.tokens_per_chunk, n - sent)
            if sent > 0:
                next_at += b.itl_s * k
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            sent += k
            await send(chunk(" w" * k, "length" if sent == n else None))
            if sent == 1 and "ERRSTREAM" in prompt:
                await send({"error": {"message": "boom", "type": "server_error", "code": 500}})
                return resp
            if sent == 1 and "CLOSEEARLY" in prompt:
                return resp
        if b.report_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
            usage["total_tokens"] = usage["prompt_tokens"] + n
            await send({"id": "x", "choices": [], "usage": usage})
        await send("[DONE]")
        return resp
