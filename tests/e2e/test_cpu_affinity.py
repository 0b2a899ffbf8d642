"""Real worker processes pinned with --cpu-cores: every thread of the prefill worker runs
on its core, and the decode worker runs on both workers' cores while the prefill worker
is idle (it borrows them through --core-share), serving requests meanwhile."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.worker.core_sharing import create_share_file
from pdserve.worker.cpu_cores import format_cpu_list, parse_cpu_list
from tests.e2e.cluster import Cluster, http, wait_for, worker_metrics
from tests.e2e.conftest import Reference


def threads_allowed(pid: int) -> list[set[int]]:
    """Cpus_allowed_list of every thread of `pid`, as /proc reports it."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        out.append(set(parse_cpu_list(line.split(":", 1)[1].strip())))
    return out


def torch_threads(text: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith("llm_torch_threads{"))
    return float(line.rsplit(" ", 1)[1])


def wait_allowed(pid: int, want: set[int], timeout: float = 60.0) -> None:
    def on_want() -> bool:
        seen = threads_allowed(pid)
        return bool(seen) and all(s == want for s in seen)

    wait_for(on_want, lambda: f"threads of {pid} all on {want}, not {threads_allowed(pid)}", timeout, 0.05)


def test_pinned_workers_and_a_decode_worker_borrowing_idle_prefill_cores(
    tmp_path: Path, reference: Reference
) -> None:
    host = sorted(os.sched_getaffinity(0))
    lend, own = {host[0]}, {host[-1]}  # one core each; the same one on a 1-core host
    share = str(tmp_path / "cores")
    create_share_file(share)
    c = Cluster(tmp_path)
    try:
        c.start_gateway()
        prefill = c.add_worker("prefill", "--cpu-cores", format_cpu_list(lend), "--core-share", share)
        decode = c.add_worker("decode", "--cpu-cores", format_cpu_list(own), "--core-share", share,
                              "--borrow-cores", format_cpu_list(lend))
        c.wait_roles(prefill=1, decode=1)
        wait_allowed(prefill.popen.pid, lend)
        wait_allowed(decode.popen.pid, own | lend)  # prefill idle: decode runs on both
        status, out = http("POST", f"{c.url}/v1/completions",
                           {"model": reference.model_name, "prompt": "The quick brown fox",
                            "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 8
        c.wait_idle()
        wait_allowed(prefill.popen.pid, lend)  # threads the prefill made since inherit its core
        wait_allowed(decode.popen.pid, own | lend)  # prefill idle again: borrowed again
        assert prefill.alive() and decode.alive()
        # the decode worker widens, so its thread policy defaults to adaptive: it exports
        # the threads its steps ran with (1, or the 2 of the grant) and its switch counter
        metrics = {w["role"]: worker_metrics(w) for w in c.worker_list()}
        assert torch_threads(metrics["decode"]) in (1.0, 2.0)
        assert "# TYPE llm_thread_switches_total counter" in metrics["decode"]
        assert torch_threads(metrics["prefill"]) == 1.0  # fixed: its --threads
    finally:
        c.stop()
