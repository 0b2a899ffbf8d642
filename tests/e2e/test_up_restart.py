"""`pdserve up --decode 2` keeps serving through a kill -9 of a decode worker (real
processes): requests are served by the workers left, `up` starts
the dead one again with the same command line, the replacement registers, and the
cluster ends with every worker's KV idle."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.e2e import peers
from tests.e2e.cluster import ADMIN, DTYPE, http, sse, wait_for
from tests.e2e.conftest import Reference
from tests.e2e.up_process import pdserve_up


def _workers(url: str) -> list[dict]:
    status, body = http("GET", f"{url}/workers", headers=ADMIN, timeout=5)
    assert status == 200, body
    return list(body["data"])


def test_a_killed_decode_worker_is_restarted_and_serving_goes_on(tmp_path: Path, reference: Reference) -> None:
    log = tmp_path / "up.log"
    with pdserve_up(log, "--decode", "2", "--num-blocks", "128", "--threads", "1", "--dtype", DTYPE) as served:
        wait_for(lambda: sorted(w["role"] for w in _workers(served.url)) == ["decode", "decode", "prefill"],
                 "three workers registered", 90)
        before = {w["pid"] for w in _workers(served.url) if w["role"] == "decode"}
        victim = next(pid for pid in peers.children(served.pid) if pid in before)
        os.kill(victim, signal.SIGKILL)
        body = {"model": reference.model_name, "prompt": "after the kill", "max_tokens": 8, "stream": True}
        events = sse(f"{served.url}/completions", body)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if isinstance(e, dict))

        def replaced() -> bool:
            pids = {w["pid"] for w in _workers(served.url) if w["role"] == "decode"}
            return len(pids) == 2 and victim not in pids

        wait_for(replaced, "the killed decode worker replaced", 90)
        wait_for(lambda: all(w["free_blocks"] == w["total_blocks"] for w in _workers(served.url)), "idle KV", 90)
    text = log.read_text()
    assert "was killed by signal 9" in text and "restarting it" in text, text[-2000:]
