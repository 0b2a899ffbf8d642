"""The gateway's seed for unseeded requests, driven through `ClusterBackend` without
processes: the messages it would send are captured, worker events are delivered by hand."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from gateway.backend import GenerateRequest
from gateway.cluster import ClusterBackend, ClusterConfig, assigned_seed
from pdserve.common import protocol as p
from pdserve.common.sampling_params import SamplingParams

KEY = bytes(range(32))


def _backend(key: bytes | None = KEY) -> tuple[ClusterBackend, list[tuple[str, p.Message]]]:
    be = ClusterBackend(ClusterConfig(seed_key=key))
    sent: list[tuple[str, p.Message]] = []
    be._send = lambda wid, msg: sent.append((wid, msg))  # type: ignore[method-assign]
    for wid, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):
        be.registry.register(p.RegisterWorker(wid, role, "h", "", "", "c", 100, 16, 0, 1), 0.0)
    return be, sent


async def _until(cond: Any) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def _sent_params(sent: list[tuple[str, p.Message]]) -> list[tuple[type, int, SamplingParams]]:
    """(kind, tokens already produced, params) of every request message sent."""
    return [(type(m), len(m.payload.output_token_ids), m.payload.params)
            for _, m in sent if isinstance(m, (p.PrefillRequest, p.DecodeReserve))]


async def _first_token_then_lose_decode(params: SamplingParams,
                                        key: bytes | None = KEY) -> list[tuple[type, int, SamplingParams]]:
    """One attempt streams a token, its decode worker is lost, the recovery attempt starts."""
    be, sent = _backend(key)
    stream = be.generate(GenerateRequest("req-1", [1, 2, 3], params))
    first = asyncio.ensure_future(stream.__anext__())
    await _until(lambda: len(_sent_params(sent)) == 2)
    reserve = next(m for _, m in sent if isinstance(m, p.DecodeReserve))
    decode = next(w for w, m in sent if isinstance(m, p.DecodeReserve))
    be.flights.deliver(decode, reserve.request_id, p.ReserveResult(reserve.request_id, reserve.transfer_id, [4]))
    be.flights.deliver("p1", reserve.request_id, p.FirstToken(reserve.request_id, reserve.transfer_id, [42], [None], [None]))
    assert (await first).token_ids == [42]
    resumed = asyncio.ensure_future(stream.__anext__())
    be.flights.lost(be.registry.remove(decode))
    await _until(lambda: len(_sent_params(sent)) == 4)
    resumed.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await resumed  # cancelling the iteration aborts the request
    return _sent_params(sent)


def test_unseeded_request_gets_a_keyed_seed_kept_across_recovery() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.9)
    attempts = asyncio.run(_first_token_then_lose_decode(params))
    want = assigned_seed(KEY, "req-1")
    assert [(kind, offset, sp.seed) for kind, offset, sp in attempts] == [
        (p.DecodeReserve, 0, want), (p.PrefillRequest, 0, want),  # the first attempt
        (p.DecodeReserve, 1, want), (p.PrefillRequest, 1, want),  # the resumed one: same seed
    ]
    assert params.seed is None  # the caller's (HTTP layer's) params are untouched: nothing to echo


def test_explicit_seed_is_kept() -> None:
    attempts = asyncio.run(_first_token_then_lose_decode(SamplingParams(max_tokens=8, temperature=0.9, seed=-5)))
    assert [sp.seed for _, _, sp in attempts] == [-5] * 4


def test_assigned_seed_depends_on_key_and_id() -> None:
    seeds = {assigned_seed(k, rid) for k in (KEY, b"other key") for rid in ("a", "b")}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert assigned_seed(KEY, "a") == assigned_seed(KEY, "a")


def test_without_a_key_each_request_draws_a_fresh_seed_kept_across_its_recovery() -> None:
    """Production: a client resending the same request id still gets a new sample."""
    params = SamplingParams(max_tokens=8, temperature=0.9)
    runs = [asyncio.run(_first_token_then_lose_decode(params, key=None)) for _ in range(2)]
    seeds = [{sp.seed for _, _, sp in attempts} for attempts in runs]
    assert all(len(s) == 1 and None not in s for s in seeds), seeds  # one seed per request, every attempt
    assert seeds[0] != seeds[1]
