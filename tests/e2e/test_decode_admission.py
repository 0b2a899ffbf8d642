"""Decode admission through real worker processes: under KV pressure a new request
waits for room instead of evicting a running stream, and a refused reservation
does not cost a prefill (it is cancelled at once; the retry reserves first)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from pathlib import Path

from gateway.backend import GenerateRequest
from gateway.cluster import ClusterBackend, ClusterConfig
from pdserve.common import protocol as p
from pdserve.common.sampling_params import SamplingParams
from tests.e2e.cluster import (
    DTYPE,
    WORKER_BLOCKS,
    Cluster,
    Proc,
    metric_value,
    remove_leaked_shm,
    sse,
    start,
    wait_for_async,
    worker_metrics,
)
from tests.e2e.conftest import Reference


def test_streams_under_kv_pressure_are_never_preempted(log_dir: Path, reference: Reference) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway()
        c.add_worker("prefill")
        # 7 usable blocks of 16 tokens; each stream grows to 44 tokens (3 blocks): 6 need 18.
        c.add_worker("decode", "--num-blocks", "8")
        c.wait_roles(prefill=1, decode=1)
        prompts = [f"Stream {i} under pressure" for i in range(6)]
        ids = [reference.completion_ids(pr) for pr in prompts]
        max_tokens = [44 - len(x) for x in ids]  # 44 tokens = 3 blocks: the pool holds two streams, not six

        def run(i: int) -> str:
            body = {"model": reference.model_name, "prompt": prompts[i], "max_tokens": max_tokens[i],
                    "temperature": 0, "stream": True, "ignore_eos": True}
            events = sse(f"{c.url}/v1/completions", body, timeout=120)
            assert events[-1] == "[DONE]"
            return "".join(ch["text"] for e in events[:-1] for ch in e.get("choices", []))

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(run, range(len(prompts))))
        for i, text in enumerate(texts):
            want = reference.generate(ids[i], max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)[0]
            assert text == reference.text(want)
        for w in c.wait_idle():
            if w["role"] == "decode":
                assert metric_value(worker_metrics(w), "llm_preemptions_total") == 0
                assert metric_value(worker_metrics(w), "llm_decode_tokens_total") > 0
    finally:
        c.stop()


async def _refused_then_reserved(log_dir: Path, reference: Reference) -> None:
    # The long stream's growth covers the whole decode pool, so the second request is
    # refused until it ends; the test waits on that, so the reservation may take long.
    be = ClusterBackend(ClusterConfig(heartbeat_timeout_s=5.0, reserve_timeout_s=120.0))
    sent: list[tuple[str, p.Message]] = []
    send, deliver = be._send, be.flights.deliver
    held: list[tuple[str, str, object]] = []
    answered = False

    def spy_send(worker_id: str, msg: p.Message) -> None:
        sent.append((worker_id, msg))
        send(worker_id, msg)

    def slow_first_prefill(sender: str, wid: str, event: object) -> None:
        """The first attempt's prefill 'finishes' only after decode answered: its
        FirstToken is held until the ReserveResult has been delivered."""
        nonlocal answered
        if wid == "b#1" and isinstance(event, p.FirstToken) and not answered:
            held.append((sender, wid, event))
            return
        deliver(sender, wid, event)
        if wid == "b#1" and isinstance(event, p.ReserveResult):
            answered = True
            for h in held:
                deliver(*h)

    be._send = spy_send  # type: ignore[method-assign]
    be.flights.deliver = slow_first_prefill  # type: ignore[method-assign]
    await be.start()
    procs: list[Proc] = []
    try:
        procs.append(start("prefill", ["prefill", "--gateway", be.control_address, "--threads", "1",
                                       "--num-blocks", WORKER_BLOCKS, "--dtype", DTYPE], log_dir))
        # 5 usable blocks of 16 tokens = 80 tokens.
        procs.append(start("decode", ["decode", "--gateway", be.control_address, "--threads", "1",
                                      "--num-blocks", "6", "--dtype", DTYPE], log_dir))
        await wait_for_async(lambda: be.ready().ready, lambda: [pr.log() for pr in procs], 90, 0.05)
        roles = {w["role"]: w for w in be.workers()}
        ids_a = reference.completion_ids("A long stream that fills the decode pool")
        ids_b = reference.completion_ids("A short one")
        max_a = 72 - len(ids_a)  # 72 tokens = 5 blocks: all of the pool
        sp_a = SamplingParams(max_tokens=max_a, temperature=0.0, ignore_eos=True)
        sp_b = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        decoding = asyncio.Event()

        async def collect(rid: str, ids: list[int], sp: SamplingParams) -> list[int]:
            out: list[int] = []
            async for d in be.generate(GenerateRequest(rid, ids, sp)):
                out.extend(d.token_ids)
                if len(out) >= 2:
                    decoding.set()  # a token from decode: the stream runs there
            return out

        task_a = asyncio.create_task(collect("a", ids_a, sp_a))
        await decoding.wait()
        got_b = await collect("b", ids_b, sp_b)
        got_a = await task_a
        assert got_a == reference.generate(ids_a, max_tokens=max_a, temperature=0.0, ignore_eos=True)[0]
        assert got_b == reference.generate(ids_b, max_tokens=20, temperature=0.0, ignore_eos=True)[0]

        prefill_id, decode_id = roles["prefill"]["id"], roles["decode"]["id"]
        role = {prefill_id: "prefill", decode_id: "decode"}
        b_msgs = [(role[w], type(m).__name__, getattr(m, "request_id", "") or ",".join(getattr(m, "request_ids", [])))
                  for w, m in sent if "b#" in (getattr(m, "request_id", "") or ",".join(getattr(m, "request_ids", [])))]
        # Refused while prefilling: the prefill is cancelled at once ...
        assert b_msgs[:3] == [("decode", "DecodeReserve", "b#1"), ("prefill", "PrefillRequest", "b#1"),
                              ("prefill", "Abort", "b#1")], b_msgs
        # ... and the next attempt reserves (retrying while refused) before any prefill.
        assert b_msgs[-3:] == [("prefill", "PrefillRequest", "b#2"), ("prefill", "TransferTarget", "b#2"),
                               ("decode", "StartDecode", "b#2")], b_msgs
        middle = b_msgs[3:-3]
        assert middle and set(middle) == {("decode", "DecodeReserve", "b#2")}, b_msgs

        await wait_for_async(lambda: all(w["free_blocks"] == w["total_blocks"] and w["inflight_requests"] == 0
                                         for w in be.workers()), be.workers, 30)
        decode_metrics = worker_metrics(roles["decode"])
        assert metric_value(decode_metrics, "llm_preemptions_total") == 0
        refusals = sum(1 for w, m in sent if isinstance(m, p.DecodeReserve) and m.request_id.startswith("b#")) - 1
        assert metric_value(decode_metrics, "llm_decode_reservations_refused_total") == refusals >= 1
    finally:
        for pr in procs:
            pr.stop()
            remove_leaked_shm(pr.popen.pid)
        await be.close()


def test_refused_reservation_cancels_the_prefill_and_retries_reserving_first(
        log_dir: Path, reference: Reference) -> None:
    asyncio.run(_refused_then_reserved(log_dir, reference))
