"""Worker deaths mid-request: streams continue on the survivors with nothing lost
or repeated, and greedy text equals the undisturbed run."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
from pathlib import Path

from tests.e2e.cluster import Cluster, CountedStreams, http, sse
from tests.e2e.conftest import Reference

LONG = 160


def _cluster(log_dir: Path, prefill: int, decode: int) -> Cluster:
    c = Cluster(log_dir)
    c.start_gateway("--heartbeat-timeout", "1.5")
    for _ in range(prefill):
        c.add_worker("prefill")
    for _ in range(decode):
        c.add_worker("decode")
    c.wait_roles(prefill=prefill, decode=decode)
    return c


def test_kill_decode_mid_stream_all_streams_complete_identically(log_dir: Path, reference: Reference) -> None:
    c = _cluster(log_dir, prefill=1, decode=2)
    try:
        prompts = [f"Stream {i} keeps going and going" for i in range(8)]
        streams = CountedStreams(c.url, reference.model_name, prompts, LONG)
        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(streams.run, i) for i in range(8)]
            streams.wait_under_way()
            decodes = [w for w in c.worker_list() if w["role"] == "decode"]
            victim_info = max(decodes, key=lambda w: w["inflight_requests"])
            victim = next(p for p in c.workers if p.popen.pid == victim_info["pid"])
            victim.signal(signal.SIGKILL)
            killed_at = streams.least()
            texts = [f.result(timeout=120) for f in futures]
        assert killed_at < LONG, "streams finished before the kill: the test proved nothing"
        for i, text in enumerate(texts):
            want = reference.generate(reference.completion_ids(prompts[i]), max_tokens=LONG, temperature=0.0, ignore_eos=True)[0]
            assert text == reference.text(want), f"stream {i}"
        c.wait_roles(prefill=1, decode=1)
        c.wait_idle(timeout=50)
    finally:
        c.stop()


def test_prefill_dying_with_queued_requests_they_are_resent(log_dir: Path, reference: Reference) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway("--heartbeat-timeout", "1.5")
        doomed = c.add_worker("prefill", "--enable-fault-injection", env={"PDSERVE_FAULTS": "exit_on_prefill=3"})  # dies holding work
        c.add_worker("prefill")
        c.add_worker("decode")
        c.wait_roles(prefill=2, decode=1)
        prompt = "queued " * 200

        def run(i: int) -> str:
            body = {"model": reference.model_name, "prompt": f"{i} {prompt}", "max_tokens": 4, "temperature": 0}
            events = sse(f"{c.url}/v1/completions", {**body, "stream": True}, timeout=120)
            assert events[-1] == "[DONE]"
            assert not any("error" in e for e in events[:-1] if isinstance(e, dict)), events
            return "".join(ch["text"] for e in events[:-1] for ch in e.get("choices", []))

        with cf.ThreadPoolExecutor(12) as pool:
            texts = list(pool.map(run, range(12)))
        assert doomed.popen.wait(10) == 137
        assert "fault injection is ON" in doomed.log()  # armed only by the flag, and says so
        for i in (0, 5, 11):
            want = reference.generate(reference.completion_ids(f"{i} {prompt}"), max_tokens=4, temperature=0.0)[0]
            assert texts[i] == reference.text(want)
        c.wait_roles(prefill=1, decode=1)
        status, _ = http("GET", f"{c.url}/ready")
        assert status == 200
        # Blocks a dead sender may have been writing (shared memory) come back only when
        # the transfer lease (30 s) runs out: never while a writer could still be active.
        c.wait_idle(timeout=50)
    finally:
        c.stop()


def test_corrupted_kv_frame_is_never_decoded_and_request_recovers(log_dir: Path, reference: Reference) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway()
        # The prefill worker flips a byte in its first KV data chunk (tcp: checksummed frames).
        c.add_worker("prefill", "--enable-fault-injection", env={"PDSERVE_KV_FAULTS": "corrupt_chunk=0"})
        c.add_worker("decode", "--kv-transport", "tcp")
        c.wait_roles(prefill=1, decode=1)
        prompt = "Corruption must never reach the decoder"
        want = reference.generate(reference.completion_ids(prompt), max_tokens=10, temperature=0.0)[0]
        status, out = http("POST", f"{c.url}/v1/completions",
                           {"model": reference.model_name, "prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert status == 200, out
        assert out["choices"][0]["text"] == reference.text(want)
        from tests.e2e.cluster import metric_value, worker_metrics

        failures = sum(metric_value(worker_metrics(w), "llm_kv_transfer_failures_total") for w in c.worker_list())
        assert failures >= 1  # the bad transfer was detected (and the retry succeeded)
        c.wait_idle()
    finally:
        c.stop()


def test_sigterm_decode_drains_active_streams_then_exits_0(log_dir: Path, reference: Reference) -> None:
    c = _cluster(log_dir, prefill=1, decode=1)
    try:
        prompts = [f"Drain {i} before leaving" for i in range(4)]
        started = threading.Event()

        def run(i: int) -> tuple[str, list[str]]:
            body = {"model": reference.model_name, "prompt": prompts[i], "max_tokens": LONG, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            import json
            import urllib.request

            req = urllib.request.Request(f"{c.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            text, finishes = [], []
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        ev = json.loads(line[6:])
                        assert "error" not in ev, ev
                        for ch in ev.get("choices", []):
                            text.append(ch["text"])
                            if ch["finish_reason"]:
                                finishes.append(ch["finish_reason"])
                        started.set()
            return "".join(text), finishes

        decode = c.workers[1]
        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(run, i) for i in range(4)]
            assert started.wait(60)
            decode.signal(signal.SIGTERM)
            results = [f.result(timeout=120) for f in futures]
        assert decode.popen.wait(30) == 0
        for i, (text, finishes) in enumerate(results):
            want = reference.generate(reference.completion_ids(prompts[i]), max_tokens=LONG, temperature=0.0, ignore_eos=True)[0]
            assert finishes == ["length"] and text == reference.text(want)
        c.wait_roles(prefill=1, decode=0)
        status, _ = http("POST", f"{c.url}/v1/completions", {"model": reference.model_name, "prompt": "x", "max_tokens": 2})
        assert status == 503  # no decode worker left: refused, not hung
    finally:
        c.stop()
