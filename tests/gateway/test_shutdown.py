"""Graceful shutdown of a real gateway process (`run_gateway` on the local test backend):
SIGTERM during active streams lets them finish, answers new requests and /ready with 503,
and exits 0; past the drain timeout the remaining streams are cut and it still exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from pdserve.builtin.default_model import write_default_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("gw-model"))


class GatewayProcess:
    def __init__(self, model_dir: Path, token_delay: float, drain_timeout: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.gateway.local_backend", "--model-dir", str(model_dir),
             "--token-delay", str(token_delay), "--drain-timeout", str(drain_timeout)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "pdserve gateway listening on http://host:port"
        assert "listening on" in line, line + (self.proc.stderr.read() if self.proc.stderr else "")
        self.url = line.strip().rsplit(" ", 1)[-1]

    def finish(self, timeout: float) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def launch(model_dir: Path) -> Iterator[type[GatewayProcess]]:
    started: list[GatewayProcess] = []

    def make(token_delay: float, drain_timeout: float) -> GatewayProcess:
        p = GatewayProcess(model_dir, token_delay, drain_timeout)
        started.append(p)
        return p

    yield make  # type: ignore[misc]
    for p in started:
        p.kill()


async def _stream(s: aiohttp.ClientSession, url: str, started: asyncio.Event, max_tokens: int) -> tuple[int, bytes]:
    async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": max_tokens, "stream": True}) as r:
        body = await r.content.readline()
        started.set()
        with contextlib.suppress(aiohttp.ClientPayloadError):  # cut by the drain timeout
            body += await r.content.read()
        return r.status, body


def test_sigterm_drains_active_streams_and_exits_0(launch: type[GatewayProcess]) -> None:
    gw = launch(token_delay=0.05, drain_timeout=20.0)  # type: ignore[call-arg]

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            events = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(_stream(s, gw.url, e, 30)) for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 10)
            os.kill(gw.proc.pid, signal.SIGTERM)
            await asyncio.sleep(0.2)
            async with s.get(gw.url + "/ready") as r:
                assert r.status == 503 and (await r.json())["reason"] == "draining"
            async with s.get(gw.url + "/health") as r:
                assert r.status == 200
            async with s.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "draining" and "Retry-After" in r.headers
            for status, body in await asyncio.wait_for(asyncio.gather(*streams), 20):
                assert status == 200
                assert body.endswith(b"data: [DONE]\n\n")
                assert body.count(b'"text_completion"') == 30  # every token arrived

    asyncio.run(go())
    code, out, err = gw.finish(timeout=15)
    assert code == 0, err[-2000:]
    assert "torch imported: False" in out  # the gateway process never imports torch
    assert '"event":"drained"' in err


def test_drain_timeout_cuts_remaining_streams_and_exits_0(launch: type[GatewayProcess]) -> None:
    gw = launch(token_delay=0.05, drain_timeout=0.5)  # type: ignore[call-arg]

    async def go() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as s:
            started = asyncio.Event()
            task = asyncio.create_task(_stream(s, gw.url, started, 400))  # ~20 s of tokens
            await asyncio.wait_for(started.wait(), 10)
            os.kill(gw.proc.pid, signal.SIGTERM)
            return await asyncio.wait_for(task, 15)

    status, body = asyncio.run(go())
    code, _, err = gw.finish(timeout=15)
    assert code == 0, err[-2000:]
    assert status == 200 and not body.endswith(b"data: [DONE]\n\n")
    assert '"event":"drain_timeout"' in err
