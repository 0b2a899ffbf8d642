"""`pdserve up --decode 2` keeps serving through a kill -9 of a decode worker (real
processes): requests are served by the workers left, `up` removes the shared-memory KV
pool the dead one could not unlink (killed with its helper processes) and then starts it
again with the same command line,
the replacement registers, and the cluster ends with every worker's KV idle."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.e2e import peers
from tests.e2e.cluster import ADMIN, DTYPE, http, sse, wait_for
from tests.e2e.conftest import Reference
from tests.e2e.up_process import pdserve_up


def _workers(url: str) -> list[dict]:
    status, body = http("GET", f"{url}/workers", headers=ADMIN, timeout=5)
    assert status == 200, body
    return list(body["data"])


SHM = Path("/dev/shm")


def _segments(pid: int) -> list[Path]:
    """The shared-memory KV pools and liveness locks process `pid` created."""
    return sorted(SHM.glob(f"pdkv_{pid}_*")) + sorted(SHM.glob(f"pdkvlive_{pid}_*"))


@pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")
def test_a_killed_decode_worker_is_restarted_and_serving_goes_on(tmp_path: Path, reference: Reference) -> None:
    log = tmp_path / "up.log"
    with pdserve_up(log, "--decode", "2", "--num-blocks", "128", "--threads", "1", "--dtype", DTYPE) as served:
        wait_for(lambda: sorted(w["role"] for w in _workers(served.url)) == ["decode", "decode", "prefill"],
                 "three workers registered", 90)
        before = {w["pid"] for w in _workers(served.url) if w["role"] == "decode"}
        processes = set(peers.children(served.pid))
        victim = next(pid for pid in processes if pid in before)
        assert _segments(victim), "the decode worker has no shared-memory pool: the test proves nothing"
        # The worker and all it started (multiprocessing's resource tracker, which would
        # unlink the pool once the worker is gone), helpers first, as a cgroup OOM kill
        # takes them: nothing of the worker is left to unlink its pool.
        for pid in [*peers.children(victim), victim]:
            os.kill(pid, signal.SIGKILL)

        def replacement() -> list[int]:
            return [p for p in peers.children(served.pid) if p not in processes and "decode" in peers.cmdline(p)]

        # `up` removes the dead worker's pool before it starts the replacement (whose own
        # start would sweep it too, later): once the replacement exists, the pool is gone.
        wait_for(replacement, "the replacement decode worker started", 90, 0.01, tolerate=(OSError,))
        assert _segments(victim) == [], "the killed worker's pool outlived its restart"
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
