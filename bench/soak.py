"""Soak test: N minutes of mixed traffic with random client aborts and one
decode-worker restart (kill -9 + replacement) against a cluster this script
starts itself; prints RSS / fd / KV samples, errors by kind and a verdict.

    python -m bench.soak --minutes 10 --concurrency 8 [--prefill 1 --decode 2]
        [--abort-fraction 0.3] [--restart-at-minute M] [--json out.json]

Not in CI. Traffic goes to 127.0.0.1 only; every process started is in its
own process group and is killed on exit (Ctrl-C included). The verdict rules
are in `bench/soak_verdict.py` and printed with the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen.client import sse_events
from bench.soak_verdict import (
    EXPLAINABLE_CODES,
    FD_BOUND,
    MIB,
    RSS_ABS_BOUND,
    RSS_REL_BOUND,
    ErrorEvent,
    ProcSample,
    judge,
)
from tests.e2e.cluster import Cluster, Proc, metric_value, remove_leaked_shm

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
         "quietly", "hex", "jovial", "bankers", "near", "old", "stone", "bridges", "under", "cold", "rain")
MAX_TOKENS_CHOICES = (4, 8, 16, 32, 64, 96)
REQUEST_TIMEOUT_S = 120.0
MAX_REQUESTS = 1_000_000


# ---------------------------------------------------------------- sampling


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
                     "running_seqs": w["running_seqs"], "inflight_requests": w["inflight_requests"]}
    return out


# ---------------------------------------------------------------- traffic


class Traffic:
    def __init__(self, url: str, model: str, abort_fraction: float, seed: int, t0: float) -> None:
        self.url = url + "/v1/completions"
        self.model = model
        self.abort_fraction = abort_fraction
        self.rng = random.Random(seed)
        self.t0 = t0
        self.counts = {"sent": 0, "completed": 0, "aborted": 0, "errors": 0}
        self.errors: list[ErrorEvent] = []
        self.tokens = 0

    def body(self) -> dict[str, Any]:
        r = self.rng
        n_words = r.choice((1, 4, 16, 48, 120, 250))
        prompt = " ".join(r.choice(WORDS) for _ in range(n_words))
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "stream": True,
                                "max_tokens": r.choice(MAX_TOKENS_CHOICES),
                                "temperature": r.choice((0.0, 0.0, 0.8)), "ignore_eos": r.random() < 0.5}
        if body["temperature"]:
            body["seed"] = r.randrange(1 << 30)
        return body

    def error(self, kind: str, detail: str) -> None:
        self.counts["errors"] += 1
        self.errors.append(ErrorEvent(round(time.monotonic() - self.t0, 2), kind, detail[:300]))

    async def one(self, session: aiohttp.ClientSession) -> None:
        self.counts["sent"] += 1
        abort_after = None
        if self.rng.random() < self.abort_fraction:  # mostly early (queued/prefill), some mid-decode
            abort_after = min(3.0, self.rng.expovariate(1 / 0.4))
        task = asyncio.ensure_future(self._send(session, self.body()))
        if abort_after is None:
            await task
            return
        done, _ = await asyncio.wait({task}, timeout=abort_after)
        if done:
            task.result()
            return
        task.cancel()  # closes the connection: the client walked away
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.counts["aborted"] += 1

    async def _send(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        finished = done = False
        try:
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            async with session.post(self.url, json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    code = ""
                    with contextlib.suppress(ValueError, TypeError, AttributeError):
                        code = json.loads(text)["error"]["code"] or ""
                    self.error(f"http_{resp.status}" + (f":{code}" if code else ""), text)
                    return
                async for data in sse_events(resp.content):
                    if data.strip() == "[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        err = ev["error"] if isinstance(ev["error"], dict) else {"message": ev["error"]}
                        code = err.get("code") or err.get("type") or "error"
                        self.error(f"stream_error:{code}", str(err.get("message", "")))
                        return
                    for ch in ev.get("choices") or []:
                        if ch.get("text"):
                            self.tokens += 1
                        if ch.get("finish_reason"):
                            finished = True
        except asyncio.TimeoutError:
            self.error("timeout", f"no end within {REQUEST_TIMEOUT_S}s")
            return
        except aiohttp.ClientError as e:
            self.error("connection_error", repr(e))
            return
        except ValueError as e:
            self.error("unparsable_stream", repr(e))
            return
        if done and finished:
            self.counts["completed"] += 1
        else:
            self.error("incomplete_stream", f"[DONE]={done} finish_reason={finished}")

    async def run(self, concurrency: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        conn = aiohttp.TCPConnector(limit=concurrency * 2)
        async with aiohttp.ClientSession(connector=conn) as session:

            async def loop() -> None:
                while time.monotonic() < deadline and self.counts["sent"] < MAX_REQUESTS:
                    await self.one(session)

            await asyncio.gather(*(loop() for _ in range(concurrency)))


# ---------------------------------------------------------------- orchestration


def gateway_counters(cluster: Cluster) -> dict[str, Any]:
    """Recovered attempts (the gateway logs each at WARNING) and its request counters."""
    out: dict[str, Any] = {}
    if cluster.gateway is not None:
        text = cluster.gateway.log_path.read_text(errors="replace")
        out["recovery_attempts_logged"] = text.count("recovering ")
    for p in [*([cluster.gateway] if cluster.gateway else []), *cluster.workers]:
        lines = [ln for ln in p.log_path.read_text(errors="replace").splitlines()
                 if '"level":"error"' in ln or "Traceback" in ln[:20]]
        if lines:
            msgs: dict[str, int] = {}
            for ln in lines:
                with contextlib.suppress(ValueError, TypeError):
                    ln = str(json.loads(ln).get("message", ln)).splitlines()[0]
                msgs[ln[:100]] = msgs.get(ln[:100], 0) + 1
            out[f"log_errors[{p.name}]"] = msgs
    with contextlib.suppress(OSError, ValueError):
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=5) as r:
            for fam in text_string_to_metric_families(r.read().decode()):
                for smp in fam.samples:
                    if smp.name in ("llm_requests_total", "llm_requests_rejected_total"):
                        key = smp.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items())) + "}"
                        out[key] = int(smp.value)
    return out


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def get_model(cluster: Cluster) -> str:
    with urllib.request.urlopen(f"{cluster.url}/v1/models", timeout=10) as r:
        return str(json.loads(r.read())["data"][0]["id"])


async def restart_task(cluster: Cluster, procs: dict[str, Proc], at_s: float, n_decode: int,
                       t0: float, info: dict[str, Any]) -> None:
    await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
    victim_name = next(n for n in procs if n.startswith("decode"))
    victim = procs[victim_name]
    info["killed"] = victim_name
    info["kill_t"] = round(time.monotonic() - t0, 2)
    log(f"kill -9 {victim_name} (pid {victim.popen.pid}) at t={info['kill_t']}s")
    victim.signal(signal.SIGKILL)
    await asyncio.to_thread(victim.popen.wait, 10)
    remove_leaked_shm(victim.popen.pid)
    new = cluster.add_worker("decode")
    procs[new.name] = new
    info["replacement"] = new.name

    def replaced() -> bool:
        ws = cluster.worker_list()
        pids = {int(w["pid"]) for w in ws}
        if victim.popen.pid not in pids and "victim_gone_t" not in info:
            info["victim_gone_t"] = round(time.monotonic() - t0, 2)  # gateway noticed the death
        decodes = [w for w in ws if w["role"] == "decode"]
        return victim.popen.pid not in pids and new.popen.pid in pids and len(decodes) == n_decode

    try:
        await asyncio.to_thread(cluster._wait, replaced, "replacement decode worker registered", 120.0)
    except AssertionError as e:
        info["replacement_error"] = str(e)[-2000:]
        log(f"replacement {new.name} did not register: {str(e)[-1500:]}")
        return
    info["replacement_ready_t"] = round(time.monotonic() - t0, 2)
    log(f"replacement {new.name} (pid {new.popen.pid}) registered at t={info['replacement_ready_t']}s")


def print_table(start: dict[str, ProcSample], end: dict[str, ProcSample]) -> None:
    print(f"{'process':<12} {'RSS start':>10} {'RSS end':>10} {'growth':>9} {'bound':>8} {'fds start':>9} {'fds end':>8}")
    for name in sorted(set(start) | set(end)):
        s, e = start.get(name), end.get(name)
        rs = f"{s.rss_bytes / MIB:.1f}M" if s else "-"
        re_ = f"{e.rss_bytes / MIB:.1f}M" if e else "-"
        gr = f"{(e.rss_bytes - s.rss_bytes) / MIB:+.1f}M" if s and e else "-"
        bd = f"{max(RSS_ABS_BOUND, RSS_REL_BOUND * s.rss_bytes) / MIB:.0f}M" if s else "-"
        print(f"{name:<12} {rs:>10} {re_:>10} {gr:>9} {bd:>8} {s.fds if s else '-':>9} {e.fds if e else '-':>8}")


async def soak(args: argparse.Namespace, cluster: Cluster, procs: dict[str, Proc]) -> int:
    model = get_model(cluster)
    run_s = args.minutes * 60.0
    restart_at = (args.restart_at_minute if args.restart_at_minute is not None else args.minutes / 2) * 60.0
    t_boot = time.monotonic()
    log(f"warm-up {args.warmup_s:.0f}s at concurrency {args.concurrency}")
    warm = Traffic(cluster.url, model, args.abort_fraction, args.seed + 1, t_boot)
    await warm.run(args.concurrency, args.warmup_s)
    await asyncio.to_thread(cluster.wait_idle, 60.0)
    names_by_pid = {p.popen.pid: n for n, p in procs.items()}
    start = sample_all(procs)
    kv_start = kv_usage(cluster, names_by_pid)
    log(f"start sample taken; warm-up: {warm.counts} errors={[e.kind for e in warm.errors]}")

    t0 = time.monotonic()
    traffic = Traffic(cluster.url, model, args.abort_fraction, args.seed, t0)
    info: dict[str, Any] = {}
    tasks = [asyncio.ensure_future(traffic.run(args.concurrency, run_s))]
    if not args.no_restart:
        tasks.append(asyncio.ensure_future(restart_task(cluster, procs, restart_at, args.decode, t0, info)))

    async def progress() -> None:
        while True:
            await asyncio.sleep(60)
            log(f"t={time.monotonic() - t0:.0f}s {traffic.counts} tokens={traffic.tokens}")

    prog = asyncio.ensure_future(progress())
    try:
        await asyncio.gather(*tasks)
    finally:
        prog.cancel()
    log(f"load done after {time.monotonic() - t0:.0f}s; draining")
    drained = True
    try:
        await asyncio.to_thread(cluster.wait_idle, args.drain_s)
    except AssertionError:
        drained = False
    names_by_pid = {p.popen.pid: n for n, p in procs.items()}
    end = sample_all(procs)
    kv_end = kv_usage(cluster, names_by_pid)
    alive = {n: p.alive() for n, p in procs.items()}
    killed = frozenset({info["killed"]}) if "killed" in info else frozenset()
    window = None
    if "kill_t" in info:
        window = (info["kill_t"], info.get("replacement_ready_t", run_s) + args.heartbeat_grace_s)
    kv_final = {n: max(v["kv_usage_registry"], v["kv_usage_metrics"] or 0.0) for n, v in kv_end.items()}
    verdict = judge(start, end, kv_final, alive, traffic.errors, window, killed)

    print("\n================ soak report ================")
    print(f"cluster: gateway + {args.prefill} prefill + {args.decode} decode; concurrency {args.concurrency}; "
          f"{args.minutes} min after {args.warmup_s:.0f}s warm-up; abort fraction {args.abort_fraction}")
    print(f"restart: {info or 'none'}")
    print(f"requests: {traffic.counts}  streamed content events: {traffic.tokens}")
    print(f"drained to idle within {args.drain_s:.0f}s: {drained}")
    print(f"gateway: {gateway_counters(cluster)}")
    print("\nprocess samples (RSS/fds summed over each process group; start = after warm-up, idle):")
    print_table(start, end)
    print("\nKV at start:", json.dumps(kv_start))
    print("KV at end:  ", json.dumps(kv_end))
    print("alive at end:", alive)
    kinds: dict[str, int] = {}
    for e in traffic.errors:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    print(f"\nerrors by kind: {kinds or 'none'}")
    print(f"explained: {len(verdict.explained)}  unexplained: {len(verdict.unexplained)}")
    for e in verdict.unexplained[:20]:
        print(f"  unexplained t={e.t}s {e.kind}: {e.detail}")
    print(f"\nrules: RSS growth per process <= max({RSS_ABS_BOUND // MIB} MiB, {RSS_REL_BOUND:.0%} of start); "
          f"|fd change| <= {FD_BOUND}; KV usage 0 on every worker after drain; every process except the killed "
          f"one alive; zero unexplained errors. An error is explained only if its code is in "
          f"{sorted(EXPLAINABLE_CODES)} (pool empty) and it occurred in the restart window "
          f"[kill, replacement registered + {args.heartbeat_grace_s:.0f}s]; recovered streams and client aborts "
          "are not errors.")
    print(f"restart window: {window}")
    print("\nVERDICT:", "PASS" if verdict.passed else "FAIL")
    for r in verdict.reasons:
        print(f"  - {r}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "restart": info, "counts": traffic.counts, "drained": drained,
            "start": {k: asdict(v) for k, v in start.items()}, "end": {k: asdict(v) for k, v in end.items()},
            "kv_start": kv_start, "kv_end": kv_end, "alive": alive,
            "errors": [asdict(e) for e in traffic.errors], "passed": verdict.passed, "reasons": verdict.reasons,
        }, indent=2))
    return 0 if verdict.passed else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--abort-fraction", type=float, default=0.3)
    ap.add_argument("--restart-at-minute", type=float, default=None, help="default: half way")
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--drain-s", type=float, default=60.0)
    ap.add_argument("--heartbeat-grace-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None, help="process logs (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.decode < 1 or args.prefill < 1 or args.concurrency < 1:
        ap.error("--prefill, --decode and --concurrency must be >= 1")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdsoak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs in {log_dir}")
    cluster = Cluster(log_dir)
    procs: dict[str, Proc] = {}

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        cluster.start_gateway()
        assert cluster.gateway is not None
        procs["gateway"] = cluster.gateway
        for role, n in (("prefill", args.prefill), ("decode", args.decode)):
            for _ in range(n):
                p = cluster.add_worker(role)
                procs[p.name] = p
        cluster.wait_roles(120.0, prefill=args.prefill, decode=args.decode)
        log(f"cluster up at {cluster.url}: {sorted(procs)}")
        return asyncio.run(soak(args, cluster, procs))
    except KeyboardInterrupt:
        log("interrupted; stopping cluster")
        return 130
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
