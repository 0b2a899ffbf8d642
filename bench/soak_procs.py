"""What the soak samples from its processes: RSS and open fds per process group
(from /proc), and each worker's KV usage as the gateway and the worker's own
/metrics see it."""

from __future__ import annotations

import contextlib
import os
import urllib.request
from pathlib import Path
from typing import Any

from bench.soak_verdict import MIB, ProcSample, rss_bound
from tests.e2e.cluster import Cluster, Proc, metric_value


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            pids.append(int(d.name))
    return pids


def proc_sample(pgid: int) -> ProcSample | None:
    """RSS (VmRSS) and open fds summed over the process group led by `pgid`."""
    rss = fds = 0
    pids = _group_pids(pgid)
    if not pids:
        return None
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
            fds += len(os.listdir(f"/proc/{pid}/fd"))
    return ProcSample(rss, fds)


def sample_all(procs: dict[str, Proc]) -> dict[str, ProcSample]:
    out = {}
    for name, p in procs.items():
        if p.alive():
            s = proc_sample(p.popen.pid)
            if s is not None:
                out[name] = s
    return out


def kv_usage(cluster: Cluster, names_by_pid: dict[int, str]) -> dict[str, dict[str, Any]]:
    """Per registered worker: /v1/workers view and the worker's own /metrics gauge."""
    out: dict[str, dict[str, Any]] = {}
    for w in cluster.worker_list():
        name = names_by_pid.get(int(w["pid"]), w["id"])
        gauge: float | None = None
        with contextlib.suppress(OSError, ValueError):
            url = f"http://127.0.0.1:{w['metrics_port']}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                gauge = metric_value(r.read().decode(), "llm_kv_cache_usage_ratio")
        used = 1.0 - w["free_blocks"] / max(1, w["total_blocks"])
        out[name] = {"kv_usage_metrics": gauge, "kv_usage_registry": round(used, 4),
                     "free_blocks": w["free_blocks"], "total_blocks": w["total_blocks"],
                     "running_seqs": w["running_seqs"], "inflight_requests": w["inflight_requests"],
                     "stalled": w.get("stalled", False)}
    return out


def print_table(start: dict[str, ProcSample], end: dict[str, ProcSample]) -> None:
    print(f"{'process':<12} {'RSS start':>10} {'RSS end':>10} {'growth':>9} {'bound':>8} {'fds start':>9} {'fds end':>8}")
    for name in sorted(set(start) | set(end)):
        s, e = start.get(name), end.get(name)
        rs = f"{s.rss_bytes / MIB:.1f}M" if s else "-"
        re_ = f"{e.rss_bytes / MIB:.1f}M" if e else "-"
        gr = f"{(e.rss_bytes - s.rss_bytes) / MIB:+.1f}M" if s and e else "-"
        bd = f"{rss_bound(s.rss_bytes) / MIB:.0f}M" if s else "-"
        print(f"{name:<12} {rs:>10} {re_:>10} {gr:>9} {bd:>8} {s.fds if s else '-':>9} {e.fds if e else '-':>8}")
