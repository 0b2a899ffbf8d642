"""An in-process `GenerationBackend` for testing the gateway's HTTP layer in isolation.

`LocalBackend` streams a deterministic token sequence drawn from the tokenizer's
vocabulary (`expected_tokens` tells a test what it will be), with a configurable delay
per token, optional EOS, logprobs, cached-token counts, stage timings, and failures on
demand. It records what happened (started order, aborts, peak concurrency) so tests can
assert on it.

`GatewayThread` serves a gateway app on a free loopback port from a background thread,
so tests can drive it with the synchronous `openai` client and with aiohttp.

`python -m tests.gateway.local_backend --model-dir DIR` runs a whole gateway process on
this backend (used by the SIGTERM test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway.backend import (
    BackendError,
    BackendErrorKind,
    FleetSample,
    GenerateRequest,
    Logprob,
    ReadyState,
    TokenDelta,
    TopLogprob,
)
from gateway.config import GatewayConfig
from gateway.logs import configure_logging
from gateway.server import build_app, make_runner, run_gateway
from gateway.tokenizer import Tokenizer

# Plain ASCII words: every token decodes to text, so expected outputs are easy to state.
SOURCE_TEXT = (
    " the quick brown fox jumps over the lazy dog and then runs away into the green forest"
)


@dataclass
class LocalBackend:
    tokenizer: Tokenizer
    token_delay: float = 0.0  # seconds before each token (the first included)
    eos_at: int | None = None  # emit EOS as output token number eos_at (0-based), unless ignore_eos
    fail_after: int | None = None  # raise BackendError(FAILED) after this many tokens
    fail_before_first: BackendErrorKind | None = None
    cached_tokens: int = 0
    is_ready: bool = True
    # Observations.
    started: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    requests: list[GenerateRequest] = field(default_factory=list)
    active: int = 0
    peak_active: int = 0
    running: bool = False

    def __post_init__(self) -> None:
        self.pool = self.tokenizer.encode(SOURCE_TEXT, add_special_tokens=False)
        self.eos_id = self.tokenizer.eos_token_ids[0] if self.tokenizer.eos_token_ids else 0

    def expected_tokens(self, count: int, index: int = 0) -> list[int]:
        """The first `count` output tokens of choice `index` (before any EOS)."""
        return [self.pool[(index * 3 + i) % len(self.pool)] for i in range(count)]

    async def start(self) -> None:
        self.running = True

    async def close(self) -> None:
        self.running = False

    def ready(self) -> ReadyState:
        if not self.is_ready:
            return ReadyState(False, "no decode worker registered", {"prefill": 1, "decode": 0})
        return ReadyState(True, "", {"prefill": 1, "decode": 1})

    def workers(self) -> Sequence[Mapping[str, Any]]:
        return [{"id": "local-0", "role": "colocated", "running": self.active}]

    def fleet_metrics(self) -> Sequence[FleetSample]:
        labels = {"role": "colocated", "worker": "local-0"}
        return [
            FleetSample(
                "llm_current_batch_size",
                "Running sequences per worker.",
                labels,
                float(self.active),
            ),
            FleetSample(
                "llm_kv_cache_usage_ratio", "Used KV blocks / total.", labels, self.active / 16
            ),
        ]

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self._generate(req)

    async def _generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.requests.append(req)
        self.started.append(req.request_id)
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        done = False
        try:
            if self.fail_before_first is not None:
                raise BackendError(
                    self.fail_before_first, f"local backend: {self.fail_before_first.value}"
                )
            p = req.params
            counts = [0] * p.n
            waited = 0.0
            for i in range(p.max_tokens):
                for c in range(p.n):
                    waited += await self._sleep()
                    if self.fail_after is not None and counts[c] >= self.fail_after:
                        raise BackendError(
                            BackendErrorKind.FAILED, "local backend: injected failure"
                        )
                    eos = self.eos_at is not None and i == self.eos_at and not p.ignore_eos
                    tok = self.eos_id if eos else self.expected_tokens(i + 1, c)[-1]
                    counts[c] += 1
                    finish = (
                        "stop"
                        if eos or tok in p.stop_token_ids
                        else ("length" if i == p.max_tokens - 1 else None)
                    )
                    # Closing the iterator after the last event is not an abort.
                    done = all(self._finished(req, k, counts) for k in range(p.n))
                    yield self._delta(req, c, tok, finish, first=(i == 0), waited=waited)
                if done:
                    break
        finally:
            self.active -= 1
            (self.finished if done else self.aborted).append(req.request_id)

    def _finished(self, req: GenerateRequest, c: int, counts: list[int]) -> bool:
        p = req.params
        eos = self.eos_at is not None and not p.ignore_eos and counts[c] > self.eos_at
        stop_tok = counts[c] > 0 and self.expected_tokens(counts[c], c)[-1] in p.stop_token_ids
        return counts[c] >= p.max_tokens or eos or stop_tok

    async def _sleep(self) -> float:
        t0 = time.perf_counter()
        await asyncio.sleep(self.token_delay)
        return time.perf_counter() - t0

    def _delta(
        self, req: GenerateRequest, c: int, tok: int, finish: str | None, first: bool, waited: float
    ) -> TokenDelta:
        lp = None
        if req.params.logprobs is not None:
            top = tuple(TopLogprob(self.pool[j], -1.0 - j) for j in range(req.params.logprobs))
            lp = [Logprob(tok, -0.5, top)]
        timings = None
        if finish is not None:
            # Stage split of the time this backend really waited, so stages add up to e2e.
            timings = {
                "prefill_queue": 0.0,
                "prefill_compute": waited * 0.1,
                "kv_transfer": 0.0,
                "decode_queue": 0.0,
                "decode": waited * 0.9,
            }
        return TokenDelta(c, [tok], lp, finish, self.cached_tokens if first else 0, timings)


class GatewayThread:
    """Serve `build_app(config, backend, tokenizer)` on 127.0.0.1:<free port> in a thread."""

    def __init__(self, config: GatewayConfig, backend: Any, tokenizer: Tokenizer) -> None:
        self.config, self.backend, self.tokenizer = config, backend, tokenizer
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0
        self.app: web.Application | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("gateway did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the server's loop (the backend and state live there)."""

        async def wrapper() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()
        self.loop.close()

    async def _start(self) -> None:
        self.app = build_app(self.config, self.backend, self.tokenizer)
        self._runner = make_runner(self.app, self.config)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def sse_data(self) -> list[str]:
        """The `data:` payloads of an SSE body, in order."""
        return [
            line[len("data: ") :]
            for line in self.body.decode().split("\n")
            if line.startswith("data: ")
        ]


async def araw(
    url: str,
    method: str,
    path: str,
    *,
    json_body: Any = None,
    data: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> RawResponse:
    """One HTTP request with aiohttp, the body read to the end."""
    async with aiohttp.ClientSession() as session, session.request(
        method, url + path, json=json_body, data=data, headers=headers
    ) as r:
        return RawResponse(r.status, CIMultiDict(r.headers), await r.read())


def raw(url: str, method: str, path: str, **kwargs: Any) -> RawResponse:
    return asyncio.run(araw(url, method, path, **kwargs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a gateway process on the local test backend")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    args = ap.parse_args(argv)
    configure_logging()
    tok = Tokenizer.from_model_dir(args.model_dir)
    config = GatewayConfig(
        host="127.0.0.1",
        port=args.port,
        model_name="local",
        model_dir=args.model_dir,
        drain_timeout_s=args.drain_timeout,
    )
    code = run_gateway(config, LocalBackend(tok, token_delay=args.token_delay), tok)
    print(f"exit {code}; torch imported: {'torch' in sys.modules}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
