"""Admission control: bounded queues per priority class, 503 + Retry-After past the limits,
interactive before batch, aging for batch, and nothing hangs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.admission import AdmissionController
from gateway.config import AdmissionConfig, GatewayConfig, QueueLimits
from gateway.errors import APIError
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw


def _config(in_flight: int = 1, depth: int = 10, wait: float = 10.0, aging: float | None = None) -> AdmissionConfig:
    q = QueueLimits(max_depth=depth, max_wait_s=wait)
    return AdmissionConfig(max_in_flight=in_flight, interactive=q, batch=q, batch_aging_s=aging, retry_after_s=2)


async def _hold(ac: AdmissionController, prio: str, name: str, order: list[str], hold: asyncio.Event) -> None:
    async with ac.slot(prio):
        order.append(name)
        await hold.wait()


def test_interactive_is_admitted_before_queued_batch() -> None:
    async def go() -> list[str]:
        ac, order, hold = AdmissionController(_config()), list[str](), asyncio.Event()
        tasks = [asyncio.create_task(_hold(ac, "batch", "b0", order, hold))]
        await asyncio.sleep(0)
        for name, prio in [("b1", "batch"), ("b2", "batch"), ("i1", "interactive"), ("b3", "batch"), ("i2", "interactive")]:
            tasks.append(asyncio.create_task(_hold(ac, prio, name, order, hold)))
            await asyncio.sleep(0)
        assert (ac.depth("batch"), ac.depth("interactive"), ac.in_flight) == (3, 2, 1)
        hold.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert ac.in_flight == 0
        return order

    assert asyncio.run(go()) == ["b0", "i1", "i2", "b1", "b2", "b3"]


def test_aged_batch_waiter_goes_first() -> None:
    now = [0.0]
    async def go() -> list[str]:
        ac, order, hold = AdmissionController(_config(aging=5.0), clock=lambda: now[0]), list[str](), asyncio.Event()
        first = asyncio.create_task(_hold(ac, "interactive", "i0", order, hold))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(_hold(ac, "batch", "b1", order, hold))]
        await asyncio.sleep(0)
        now[0] = 6.0  # b1 has waited past the aging threshold
        tasks.append(asyncio.create_task(_hold(ac, "interactive", "i1", order, hold)))
        await asyncio.sleep(0)
        hold.set()
        await asyncio.wait_for(asyncio.gather(first, *tasks), 5)
        return order

    assert asyncio.run(go()) == ["i0", "b1", "i1"]


def test_full_queue_and_wait_timeout_reject_with_retry_after() -> None:
    async def go() -> None:
        ac, order, hold = AdmissionController(_config(depth=1, wait=0.05)), list[str](), asyncio.Event()
        running = asyncio.create_task(_hold(ac, "interactive", "r", order, hold))
        await asyncio.sleep(0)
        queued = asyncio.create_task(ac.acquire("interactive"))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as full:
            await ac.acquire("interactive")
        assert (full.value.status, full.value.code, full.value.reason) == (503, "overloaded", "queue_full")
        assert full.value.headers["Retry-After"] == "2"
        with pytest.raises(APIError) as late:
            await queued
        assert late.value.reason == "queue_timeout"
        assert ac.depth("interactive") == 0
        hold.set()
        await running
        assert ac.in_flight == 0

    asyncio.run(go())


def test_cancelled_waiter_leaves_no_trace_and_draining_rejects() -> None:
    async def go() -> None:
        ac, order, hold = AdmissionController(_config()), list[str](), asyncio.Event()
        running = asyncio.create_task(_hold(ac, "batch", "r", order, hold))
        await asyncio.sleep(0)
        gone = asyncio.create_task(ac.acquire("batch"))
        await asyncio.sleep(0)
        gone.cancel()  # a client disconnect while queued
        await asyncio.sleep(0)
        assert ac.depth("batch") == 0
        ac.start_draining()
        with pytest.raises(APIError) as e:
            await ac.acquire("interactive")
        assert e.value.code == "draining"
        hold.set()
        await running
        assert ac.in_flight == 0

    asyncio.run(go())


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d: Path = write_default_model(tmp_path_factory.mktemp("gw-model"))
    return Tokenizer.from_model_dir(d)


@pytest.fixture
def slow(tok: Tokenizer) -> Iterator[tuple[GatewayThread, LocalBackend]]:
    backend = LocalBackend(tok, token_delay=0.04)
    q = QueueLimits(max_depth=2, max_wait_s=10.0)
    config = GatewayConfig(model_name="m", admission=AdmissionConfig(max_in_flight=2, interactive=q, batch=q, retry_after_s=3))
    with GatewayThread(config, backend, tok) as g:
        yield g, backend


def test_burst_of_20_with_queue_depth_2(slow: tuple[GatewayThread, LocalBackend], tok: Tokenizer) -> None:
    g, backend = slow

    async def one(s: aiohttp.ClientSession, i: int, stream: bool) -> tuple[int, str, dict[str, object]]:
        async with s.post(g.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10, "stream": stream}) as r:
            body = await r.read()
            return r.status, r.headers.get("Retry-After", ""), (await r.json() if not stream or r.status != 200 else {"raw": body})

    async def burst() -> list[tuple[int, str, dict[str, object]]]:
        async with aiohttp.ClientSession() as s:
            return await asyncio.wait_for(asyncio.gather(*(one(s, i, i % 2 == 0) for i in range(20))), 30)

    t0 = time.monotonic()
    results = asyncio.run(burst())
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 503]
    assert len(ok) + len(rejected) == 20
    assert len(ok) >= 4 and len(rejected) >= 10  # 2 running + 2 queued; the rest shed
    for _, retry_after, body in rejected:
        assert retry_after == "3"
        assert body["error"]["code"] == "overloaded" and body["error"]["type"] == "server_error"  # type: ignore[index]
    expected = tok.decode(backend.expected_tokens(10))
    for _, _, body in ok:  # every admitted request completed in full
        if "raw" in body:
            assert body["raw"].endswith(b"data: [DONE]\n\n")  # type: ignore[attr-defined]
        else:
            assert body["choices"][0]["text"] == expected  # type: ignore[index]
    assert backend.peak_active <= 2
    assert len(backend.finished) == len(ok) and backend.aborted == []
    assert time.monotonic() - t0 < 20
    metrics = raw(g.url, "GET", "/metrics").body.decode()
    assert f'llm_requests_rejected_total{{reason="queue_full"}} {float(len(rejected))}' in metrics


def test_interactive_starts_before_batch_backlog_over_http(slow: tuple[GatewayThread, LocalBackend]) -> None:
    g, backend = slow

    async def post(s: aiohttp.ClientSession, rid: str, prio: str) -> int:
        async with s.post(g.url + "/v1/completions", headers={"x-request-id": rid, "x-pdserve-priority": prio},
                          json={"prompt": "x", "max_tokens": 10}) as r:
            await r.read()
            return r.status

    async def go() -> list[int]:
        async with aiohttp.ClientSession() as s:
            tasks = []
            for rid, prio in [("b0", "batch"), ("b1", "batch"), ("b2", "batch"), ("b3", "batch"), ("i0", "interactive")]:
                tasks.append(asyncio.create_task(post(s, rid, prio)))
                await asyncio.sleep(0.03)  # arrive in this order
            return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    statuses = asyncio.run(go())
    assert statuses == [200] * 5
    # b0, b1 run at once; b2, b3 queue; i0 arrives last but starts before the queued batch.
    assert backend.started[:2] == ["b0", "b1"] and backend.started[2] == "i0"
