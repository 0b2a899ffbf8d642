"""The soak's client side: closed-loop streaming completions with random client
aborts, a share of them sampled, each request named by its own `x-request-id`.

Greedy requests and sampled ones (temperature 0.9 with frequency and presence
penalties; half of them with a client seed, half relying on the seed the
gateway assigns) are mixed. Every stream that completes is kept by request id
(its body, text and finish reason), so the recovered ones can be compared with
an undisturbed twin afterwards (`bench/soak_twins.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.soak_verdict import ErrorEvent
from pdserve.loadgen.client import sse_events

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
         "quietly", "hex", "jovial", "bankers", "near", "old", "stone", "bridges", "under", "cold", "rain")
MAX_TOKENS_CHOICES = (4, 8, 16, 32, 64, 96)
REQUEST_TIMEOUT_S = 120.0
MAX_REQUESTS = 1_000_000
SAMPLED_TEMPERATURE = 0.9
PENALTIES = ({"frequency_penalty": 0.5, "presence_penalty": 0.6}, {"frequency_penalty": 1.0},
             {"presence_penalty": 0.3})


@dataclass(frozen=True)
class Completed:
    """A stream that ended with a finish reason and `[DONE]`: what the client saw."""

    body: dict[str, Any]
    text: str
    finish_reason: str


class Traffic:
    """`concurrency` closed loops of requests for a number of seconds.

    `sampled_fraction` of the requests are sampled; request ids are
    `<id_prefix>-<n>`, so the gateway's log names them."""

    def __init__(self, url: str, model: str, abort_fraction: float, seed: int, t0: float,
                 sampled_fraction: float = 0.0, id_prefix: str = "soak") -> None:
        self.url = url + "/v1/completions"
        self.model = model
        self.abort_fraction = abort_fraction
        self.sampled_fraction = sampled_fraction
        self.id_prefix = id_prefix
        self.rng = random.Random(seed)
        self.t0 = t0
        self.counts = {"sent": 0, "completed": 0, "aborted": 0, "errors": 0}
        self.errors: list[ErrorEvent] = []
        self.completed: dict[str, Completed] = {}
        self.tokens = 0

    def body(self) -> dict[str, Any]:
        r = self.rng
        n_words = r.choice((1, 4, 16, 48, 120, 250))
        prompt = " ".join(r.choice(WORDS) for _ in range(n_words))
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "stream": True,
                                "max_tokens": r.choice(MAX_TOKENS_CHOICES), "temperature": 0.0,
                                "ignore_eos": r.random() < 0.5}
        if r.random() < self.sampled_fraction:
            body.update(temperature=SAMPLED_TEMPERATURE, **r.choice(PENALTIES))
            if r.random() < 0.5:  # the rest get the gateway's seed, rebuilt from the request id
                body["seed"] = r.randrange(1 << 30)
        return body

    def error(self, kind: str, detail: str) -> None:
        self.counts["errors"] += 1
        self.errors.append(ErrorEvent(round(time.monotonic() - self.t0, 2), kind, detail[:300]))

    async def one(self, session: aiohttp.ClientSession) -> None:
        self.counts["sent"] += 1
        rid = f"{self.id_prefix}-{self.counts['sent']}"
        abort_after = None
        if self.rng.random() < self.abort_fraction:  # mostly early (queued/prefill), some mid-decode
            abort_after = min(3.0, self.rng.expovariate(1 / 0.4))
        task = asyncio.ensure_future(self._send(session, rid, self.body()))
        if abort_after is None:
            await task
            return
        done, _ = await asyncio.wait({task}, timeout=abort_after)
        if done:
            task.result()
            return
        task.cancel()  # closes the connection: the client walked away
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.counts["aborted"] += 1

    async def _send(self, session: aiohttp.ClientSession, rid: str, body: dict[str, Any]) -> None:
        done, finish, text = False, "", []
        try:
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            async with session.post(self.url, json=body, timeout=timeout, headers={"x-request-id": rid}) as resp:
                if resp.status != 200:
                    raw = (await resp.text())[:300]
                    code = ""
                    with contextlib.suppress(ValueError, TypeError, AttributeError):
                        code = json.loads(raw)["error"]["code"] or ""
                    self.error(f"http_{resp.status}" + (f":{code}" if code else ""), raw)
                    return
                async for data in sse_events(resp.content):
                    if data.strip() == "[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        err = ev["error"] if isinstance(ev["error"], dict) else {"message": ev["error"]}
                        code = err.get("code") or err.get("type") or "error"
                        self.error(f"stream_error:{code}", f"{rid}: {err.get('message', '')}")
                        return
                    for ch in ev.get("choices") or []:
                        if ch.get("text"):
                            self.tokens += 1
                            text.append(ch["text"])
                        finish = ch.get("finish_reason") or finish
        except asyncio.TimeoutError:
            self.error("timeout", f"{rid}: no end within {REQUEST_TIMEOUT_S}s")
            return
        except aiohttp.ClientError as e:
            self.error("connection_error", f"{rid}: {e!r}")
            return
        except ValueError as e:
            self.error("unparsable_stream", f"{rid}: {e!r}")
            return
        if done and finish:
            self.counts["completed"] += 1
            self.completed[rid] = Completed(body, "".join(text), finish)
        else:
            self.error("incomplete_stream", f"{rid}: [DONE]={done} finish_reason={finish or None}")

    async def run(self, concurrency: int, seconds: float, hold: Callable[[], bool] = lambda: False) -> None:
        """Send for `seconds`, and after that for as long as `hold()` is true (a fault
        still playing out needs traffic to hang on or recover)."""
        deadline = time.monotonic() + seconds
        conn = aiohttp.TCPConnector(limit=concurrency * 2)
        async with aiohttp.ClientSession(connector=conn) as session:

            async def loop() -> None:
                while (time.monotonic() < deadline or hold()) and self.counts["sent"] < MAX_REQUESTS:
                    await self.one(session)

            await asyncio.gather(*(loop() for _ in range(concurrency)))
