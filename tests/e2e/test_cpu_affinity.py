"""Real worker processes pinned with --cpu-cores: every thread of each worker runs on its
own core while idle; the decode worker runs on both cores while it decodes a request the
prefill worker never saw (prefilled locally), the prefill worker on both while it
prefills one the decode worker only holds a reservation for (they share cores through
--core-share); each answer equals the engine's."""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.worker.core_sharing import create_share_dir
from pdserve.worker.cpu_cores import format_cpu_list, parse_cpu_list
from tests.e2e.cluster import Cluster, metric_value, wait_for, worker_metrics
from tests.e2e.conftest import Reference
from tests.e2e.test_kv_routing import MAX_TOKENS, TEXT, complete


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


def test_pinned_workers_each_running_on_the_others_idle_core(tmp_path: Path, reference: Reference) -> None:
    host = sorted(os.sched_getaffinity(0))
    prefill_core, decode_core = {host[0]}, {host[-1]}  # the same one on a 1-core host
    share = str(tmp_path / "cores")
    create_share_dir(share)
    short, long = "The capital of France is", TEXT
    assert len(reference.completion_ids(short)) <= 24 < len(reference.completion_ids(long))
    c = Cluster(tmp_path)
    try:
        c.start_gateway("--local-prefill-threshold", "24")  # the short prompt runs on decode alone
        prefill = c.add_worker("prefill", "--cpu-cores", format_cpu_list(prefill_core), "--core-share", share,
                               "--borrow-cores", format_cpu_list(decode_core))
        decode = c.add_worker("decode", "--cpu-cores", format_cpu_list(decode_core), "--core-share", share,
                              "--borrow-cores", format_cpu_list(prefill_core))
        workers = {w["role"]: w for w in c.wait_roles(prefill=1, decode=1)}
        wait_allowed(prefill.popen.pid, prefill_core)  # idle: each on its own core
        wait_allowed(decode.popen.pid, decode_core)

        def borrows(role: str) -> float:
            return metric_value(worker_metrics(workers[role]), "llm_core_borrows_total")

        assert borrows("prefill") == borrows("decode") == 0
        for prompt, borrower in ((short, "decode"), (long, "prefill")):
            out = complete(c, reference.model_name, prompt)
            ids = reference.completion_ids(prompt)
            assert out["choices"][0]["text"] == reference.text(reference.generate(ids, max_tokens=MAX_TOKENS,
                                                                                   temperature=0.0)[0])
            assert borrows(borrower) >= 1, f"the {borrower} worker never ran on the other's core"
        assert borrows("decode") >= 1  # the second request did not take it away
        c.wait_idle()
        wait_allowed(prefill.popen.pid, prefill_core)  # idle again: each back on its own core, and
        wait_allowed(decode.popen.pid, decode_core)  # threads made while widened are narrowed too
        assert prefill.alive() and decode.alive()
        # both widen, so both thread policies default to adaptive: each exports the threads
        # its steps ran with (1, or the 2 of a grant) and its switch counter
        for role in ("prefill", "decode"):
            text = worker_metrics(workers[role])
            assert torch_threads(text) in (1.0, 2.0)
            assert "# TYPE llm_thread_switches_total counter" in text
    finally:
        c.stop()
