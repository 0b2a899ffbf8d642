"""Exact recovery of sampled streams, with real processes: a decode worker killed
with SIGKILL, and one that hangs while its heartbeats go on.

Every stream is compared with the single-process engine run with the same seed.
Unseeded streams get their seed from the gateway, which never reveals it; the
gateway here runs with a known seed key (`PDSERVE_GATEWAY_SEED_KEY`, a test hook)
and each request names its id (`x-request-id`), so the test derives the seed the
gateway assigned, `assigned_seed(key, id)`, and runs the reference with it. A
gateway that assigned no seed (each worker then draws its own) or a different one
per attempt fails the comparison."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.cluster import assigned_seed
from tests.e2e.cluster import Cluster, Proc, http
from tests.e2e.conftest import Reference

KEY = bytes(range(100, 132))
MAX_TOKENS = 40
KILL_AFTER = 3  # chunks every choice has received before the kill
SAMPLED = {"temperature": 0.9}
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.6}


@dataclass
class Stream:
    """One streaming completion read on its own thread; progress is observable."""

    url: str
    rid: str
    body: dict[str, Any]
    chunks: dict[int, int] = field(default_factory=dict)  # choice -> chunks received
    texts: dict[int, list[str]] = field(default_factory=dict)
    finishes: dict[int, str] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    progressed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.progressed = threading.Condition(self.lock)
        self.thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        try:
            req = urllib.request.Request(
                f"{self.url}/v1/completions", data=json.dumps({**self.body, "stream": True}).encode(),
                headers={"Content-Type": "application/json", "x-request-id": self.rid})
            with urllib.request.urlopen(req, timeout=180) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        self._record(json.loads(line[6:]))
        except BaseException as e:  # re-raised by the test thread in `result`
            self.error = e
        finally:
            with self.progressed:
                self.progressed.notify_all()

    def _record(self, ev: dict[str, Any]) -> None:
        with self.progressed:
            self.events.append(ev)
            for ch in ev.get("choices", []):
                i = ch["index"]
                self.chunks[i] = self.chunks.get(i, 0) + 1
                self.texts.setdefault(i, []).append(ch["text"])
                if ch["finish_reason"]:
                    self.finishes[i] = ch["finish_reason"]
            self.progressed.notify_all()

    def wait_chunks(self, k: int, timeout: float = 120.0) -> None:
        """Until every choice has received at least k chunks (or the stream ended)."""
        n = self.body.get("n", 1)
        with self.progressed:
            ok = self.progressed.wait_for(
                lambda: not self.thread.is_alive() or all(self.chunks.get(i, 0) >= k for i in range(n)), timeout)
        assert ok and self.thread.is_alive(), f"{self.rid}: {self.chunks} {self.error!r}"

    def result(self) -> tuple[list[str], list[str]]:
        self.thread.join(180)
        assert not self.thread.is_alive() and self.error is None, f"{self.rid}: {self.error!r}"
        assert not any("error" in ev for ev in self.events), self.events[-1]
        assert all(ev["id"] == f"cmpl-{self.rid}" for ev in self.events)  # the id the seed was keyed on
        wire = json.dumps(self.events)
        assert "seed" not in wire and str(assigned_seed(KEY, self.rid)) not in wire  # never echoed
        n = self.body.get("n", 1)
        return ["".join(self.texts.get(i, [])) for i in range(n)], [self.finishes.get(i, "") for i in range(n)]


def _stop_after(reference: Reference, ids: list[int], after_tokens: int) -> str:
    """A short stop string whose first occurrence in the text of `ids` starts past the
    text of the first `after_tokens` tokens (so it ends the stream after the failure)."""
    full, head = reference.text(ids), reference.text(ids[:after_tokens])
    assert full.startswith(head)
    for start in range(len(head), len(full) - 4):
        stop = full[start:start + 4]
        if stop.strip() and full.find(stop) >= len(head):
            return stop
    raise AssertionError(f"no stop string candidate in {full!r}")


def _expected(reference: Reference, rid: str, prompt: str, params: dict[str, Any], stop: str | None) -> tuple[list[str], list[str]]:
    """Text and finish reason of each choice in the single-process engine, with the seed
    the gateway gives `rid` when the request has none."""
    knobs = {k: v for k, v in params.items() if k not in ("model", "prompt", "stop")}
    knobs.setdefault("seed", assigned_seed(KEY, rid))
    texts, finishes = [], []
    for ids in reference.generate(reference.completion_ids(prompt), **knobs):
        text = reference.text(ids)
        cut = text.find(stop) if stop else -1
        texts.append(text if cut < 0 else text[:cut])
        finishes.append("length" if cut < 0 else "stop")
    return texts, finishes


def _mixed_bodies(reference: Reference) -> list[dict[str, Any]]:
    """Greedy, seeded and unseeded temperature 0.9 (with penalties), stop strings, n=2."""
    specs: list[dict[str, Any]] = [
        {"temperature": 0},
        {"temperature": 0, "stop": True},
        {**SAMPLED, **PENALTIES, "seed": 11},
        {**SAMPLED, **PENALTIES, "seed": 12, "stop": True},
        {**SAMPLED},
        {**SAMPLED, **PENALTIES, "n": 2},
        {**SAMPLED, **PENALTIES, "seed": 13, "n": 2},
        {**SAMPLED, "stop": True},
    ]
    bodies = []
    for i, spec in enumerate(specs):
        body = {"model": reference.model_name, "prompt": f"Stream {i} goes on and on", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, **spec}
        if spec.get("stop"):
            knobs = {k: v for k, v in body.items() if k not in ("model", "prompt", "stop")}
            knobs.setdefault("seed", assigned_seed(KEY, f"exact-{i}"))
            ids = reference.generate(reference.completion_ids(body["prompt"]), **knobs)[0]
            body["stop"] = _stop_after(reference, ids, 16)
        bodies.append(body)
    return bodies


def _cluster(log_dir: Path, victim_faults: str, *gateway_args: str) -> tuple[Cluster, Proc]:
    """A gateway, a prefill worker, a victim decode worker with four times the KV of the
    other (so the gateway routes every request to it) and the other decode worker."""
    c = Cluster(log_dir)
    # least-loaded: decode placement by most free KV (kv-aware would spread by running count).
    c.start_gateway("--heartbeat-timeout", "1.5", "--router", "least-loaded", *gateway_args,
                    env={"PDSERVE_GATEWAY_SEED_KEY": KEY.hex()})
    c.add_worker("prefill")
    victim = c.add_worker("decode", "--num-blocks", "1024", "--enable-fault-injection",
                          env={"PDSERVE_FAULTS": victim_faults})
    c.add_worker("decode")
    c.wait_roles(prefill=1, decode=2)
    return c, victim


def _check(reference: Reference, streams: list[Stream]) -> None:
    for s in streams:
        stop = s.body.get("stop")
        assert s.result() == _expected(reference, s.rid, s.body["prompt"], s.body, stop), s.rid


def test_kill_decode_under_mixed_sampled_streams_every_stream_resumes_exactly(
    log_dir: Path, reference: Reference,
) -> None:
    # The victim is slowed down (0.1 s a step) so the kill lands mid-stream for every choice.
    c, victim = _cluster(log_dir, "step_delay_s=0.1")
    try:
        streams = [Stream(c.url, f"exact-{i}", body) for i, body in enumerate(_mixed_bodies(reference))]
        for s in streams:
            s.thread.start()
        for s in streams:
            s.wait_chunks(KILL_AFTER)
        held = {w["pid"]: w["inflight_requests"] for w in c.worker_list() if w["role"] == "decode"}
        assert held[victim.popen.pid] == len(streams), held  # every stream decodes on the victim
        victim.signal(signal.SIGKILL)
        with_progress = [(s.rid, dict(s.chunks), dict(s.finishes)) for s in streams]
        assert all(not fin for _, _, fin in with_progress), with_progress  # all cut mid-stream
        _check(reference, streams)
        assert victim.popen.wait(10) == -signal.SIGKILL
        gateway_log = c.gateway.log_path.read_text() if c.gateway else ""
        for s in streams:  # each was interrupted and continued on the surviving decode worker
            assert f"recovering {s.rid} " in gateway_log, s.rid
        c.wait_roles(prefill=1, decode=1)
        c.wait_idle(timeout=50)
    finally:
        c.stop()


def test_hung_decode_worker_is_marked_stalled_and_its_streams_recover_exactly(
    log_dir: Path, reference: Reference,
) -> None:
    # The victim's main loop blocks after 6 engine steps; its heartbeat thread goes on.
    c, victim = _cluster(log_dir, "hang_after_steps=6", "--stall-timeout", "2")
    try:
        bodies = [b for i, b in enumerate(_mixed_bodies(reference)) if i in (0, 3, 5)]
        streams = [Stream(c.url, f"exact-{i}", body) for i, body in zip((0, 3, 5), bodies, strict=True)]
        for s in streams:
            s.thread.start()
        _check(reference, streams)
        assert victim.alive()
        listed = {w["pid"]: w for w in c.worker_list()}
        hung = listed[victim.popen.pid]
        # Still registered and heartbeating (so not expired), but marked stalled and unrouted.
        assert hung["stalled"] is True and hung["last_heartbeat_age_s"] < 1.5, hung
        assert hung["running_seqs"] > 0 and hung["inflight_requests"] == 0, hung
        status, ready = http("GET", f"{c.url}/ready")
        assert status == 200 and ready["stalled"] == [hung["id"]] and ready["decode"] == 1, ready
        assert c.gateway is not None and f"worker {hung['id']} (decode) stalled" in c.gateway.log_path.read_text()
        victim.signal(signal.SIGKILL)
        c.wait_roles(prefill=1, decode=1)
        c.wait_idle(timeout=50)
    finally:
        c.stop()
