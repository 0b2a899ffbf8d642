"""Recovery at every point of a request's life, driven deterministically.

The cluster backend runs in-process against real worker processes; the test
declares the request's workers lost at a sweep of moments (reserving,
prefilling, transferring, decoding) and checks that the token ids the backend
yields equal the undisturbed run exactly, and that all KV comes back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from gateway.backend import GenerateRequest
from gateway.cluster import ClusterBackend, ClusterConfig
from gateway.flights import WorkerLost
from pdserve.common.sampling_params import SamplingParams
from tests.e2e.cluster import WORKER_BLOCKS, Proc, remove_leaked_shm, start, wait_for_async
from tests.e2e.conftest import Reference

DELAYS = (0.0, 0.001, 0.003, 0.006, 0.01, 0.02, 0.04, 0.08)


async def _run(be: ClusterBackend, rid: str, ids: list[int], sp: SamplingParams, lose_after: float | None) -> list[list[int]]:
    out: dict[int, list[int]] = {}

    async def lose() -> None:
        assert lose_after is not None
        await asyncio.sleep(lose_after)
        for flight in be.flights.flights():
            for w in list(flight.attempt.workers):
                flight.attempt.events.put_nowait(WorkerLost(w))

    task = asyncio.create_task(lose()) if lose_after is not None else None
    async for d in be.generate(GenerateRequest(rid, ids, sp)):
        out.setdefault(d.index, []).extend(d.token_ids)
    if task is not None:
        await task
    return [out[i] for i in sorted(out)]


async def _scenario(log_dir: Path, reference: Reference) -> None:
    be = ClusterBackend(ClusterConfig(heartbeat_timeout_s=5.0, max_recoveries=2))
    resumed: list[tuple[str, int, int]] = []  # (request id, output offset, choice) of resumed attempts
    attempt_inputs = be._attempt_inputs

    def spy(request: Any) -> Any:
        payload, choices = attempt_inputs(request)
        if payload.resume is not None:
            resumed.append((request.req.request_id, len(payload.resume.output_token_ids), payload.choice_index))
        return payload, choices

    be._attempt_inputs = spy  # type: ignore[method-assign]
    await be.start()
    procs: list[Proc] = []
    try:
        for role in ("prefill", "decode"):
            procs.append(start(role, [role, "--gateway", be.control_address, "--threads", "1",
                                      "--num-blocks", WORKER_BLOCKS], log_dir))
        await wait_for_async(lambda: be.ready().ready, lambda: [p.log() for p in procs], 90, 0.05)
        ids = reference.completion_ids("Recovery at every point of the request")
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        want = reference.generate(ids, max_tokens=40, temperature=0.0, ignore_eos=True)
        assert await _run(be, "base", ids, greedy, None) == want
        for i, delay in enumerate(DELAYS):
            assert await _run(be, f"g{i}", ids, greedy, delay) == want, f"lost after {delay}s"

        # Seeded sampling with penalties: the streamed tokens are resumed as *output*, so
        # seeds (seed, choice, index) and presence/frequency penalties continue exactly.
        knobs = dict(temperature=0.8, seed=77, presence_penalty=0.7, frequency_penalty=0.4, ignore_eos=True)
        seeded = SamplingParams(max_tokens=40, **knobs)  # type: ignore[arg-type]
        want_seeded = reference.generate(ids, max_tokens=40, **knobs)
        assert await _run(be, "seeded", ids, seeded, None) == want_seeded
        for i, delay in enumerate(DELAYS):
            assert await _run(be, f"p{i}", ids, seeded, delay) == want_seeded, f"lost after {delay}s"
        assert any(rid.startswith("p") for rid, _, _ in resumed), "no seeded stream was lost mid-way"

        # n > 1: before the first token it is simply resent; afterwards each unfinished
        # choice resumes on its own with its own seeds.
        sampled = SamplingParams(max_tokens=10, temperature=0.9, seed=1234, n=3, presence_penalty=0.5)
        want3 = reference.generate(ids, max_tokens=10, temperature=0.9, seed=1234, n=3, presence_penalty=0.5)
        for i, delay in enumerate(DELAYS):
            assert await _run(be, f"s{i}", ids, sampled, delay) == want3, f"lost after {delay}s"
        assert {c for rid, _, c in resumed if rid.startswith("s")} == {0, 1, 2}, resumed

        # A transfer cancelled mid-write frees its blocks only when it is terminal (at
        # worst its 30 s lease), never while a writer may still be active.
        await wait_for_async(
            lambda: all(w["free_blocks"] == w["total_blocks"] and w["inflight_requests"] == 0 for w in be.workers()),
            lambda: [(w["id"], w["free_blocks"], w["total_blocks"], w["inflight_requests"]) for w in be.workers()], 45)
    finally:
        for p in procs:
            p.stop()
            remove_leaked_shm(p.popen.pid)
        await be.close()


def test_recovery_at_every_point_yields_identical_tokens(log_dir: Path, reference: Reference) -> None:
    asyncio.run(_scenario(log_dir, reference))
