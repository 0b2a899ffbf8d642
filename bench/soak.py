"""Soak test: N minutes of mixed greedy and sampled traffic with random client
aborts, one decode worker killed (kill -9 + replacement) and one decode worker
that hangs while still heartbeating, against a cluster this script starts
itself; prints RSS / fd / KV samples, errors by kind, the recovered streams
checked against their undisturbed twins, and a verdict.

    python -m bench.soak --minutes 10 --concurrency 8 [--prefill 1 --decode 2]
        [--abort-fraction 0.3] [--sampled-fraction 0.5] [--restart-at-minute M]
        [--hang-at-minute H] [--stall-timeout 3] [--json out.json]

The traffic lasts `--minutes`, and longer if a fault has not played out yet (the
replacement not registered, the hung worker not yet marked stalled). Not in CI;
tests/bench/test_soak.py runs a very short one. Traffic goes to 127.0.0.1 only;
every process started is in its own process group and is killed on exit (Ctrl-C
included). The gateway runs
with a fixed `PDSERVE_GATEWAY_SEED_KEY`, so the seed it gives an unseeded
request can be rebuilt for the twin (`bench/soak_twins.py`). The verdict rules
are in `bench/soak_verdict.py` and printed with the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.client import served_model
from bench.harness import model_dir
from bench.soak_faults import end_hang, hang_task, log, restart_task
from bench.soak_procs import kv_usage, print_table, sample_all
from bench.soak_traffic import Traffic
from bench.soak_twins import ReferenceTwins, check_twins, recovered_ids
from bench.soak_verdict import (
    EXPLAINABLE_CODES,
    FD_BOUND,
    MIB,
    RSS_ABS_BOUND,
    RSS_REL_BOUND,
    HungWorker,
    ProcSample,
    TwinCheck,
    Verdict,
    judge,
)
from tests.e2e.cluster import Cluster, Proc

SEED_KEY = bytes.fromhex("5eed50a4" * 8)  # the gateway's seed key: assigned seeds can be rebuilt


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


@dataclass(frozen=True)
class EndState:
    """The cluster after the load and the drain."""

    samples: dict[str, ProcSample]
    kv: dict[str, dict[str, Any]]
    alive: dict[str, bool]
    drained: bool
    gateway: dict[str, Any]
    recovered: frozenset[str]  # request ids the gateway recovered at least once


def worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--dtype", args.dtype)


async def warm_up(args: argparse.Namespace, cluster: Cluster, model: str) -> None:
    log(f"warm-up {args.warmup_s:.0f}s at concurrency {args.concurrency}")
    warm = Traffic(cluster.url, model, args.abort_fraction, args.seed + 1, time.monotonic(),
                   args.sampled_fraction, id_prefix="warm")
    await warm.run(args.concurrency, args.warmup_s)
    await asyncio.to_thread(cluster.wait_idle, 60.0)
    log(f"warm-up: {warm.counts} errors={[e.kind for e in warm.errors]}")


async def load(args: argparse.Namespace, cluster: Cluster, procs: dict[str, Proc], model: str,
               info: dict[str, Any]) -> Traffic:
    """The measured run: traffic for `--minutes`, the kill and the hang at their times."""
    t0 = time.monotonic()
    traffic = Traffic(cluster.url, model, args.abort_fraction, args.seed, t0, args.sampled_fraction)
    faults = []
    if not args.no_restart:
        faults.append(asyncio.ensure_future(restart_task(
            cluster, procs, args.restart_at_minute * 60.0, args.decode, t0, info, worker_args(args))))
    if not args.no_hang:
        faults.append(asyncio.ensure_future(hang_task(
            cluster, procs, args.hang_at_minute * 60.0, args.hang_after_steps, t0, info, worker_args(args))))
    tasks = [asyncio.ensure_future(traffic.run(args.concurrency, args.minutes * 60.0,
                                               hold=lambda: not all(f.done() for f in faults))), *faults]

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
    return traffic


async def settle(args: argparse.Namespace, cluster: Cluster, procs: dict[str, Proc],
                 info: dict[str, Any]) -> EndState:
    """Kill the hung worker, drain, and sample every process, the KV and the gateway."""
    await end_hang(cluster, procs, info)
    drained = True
    try:
        await asyncio.to_thread(cluster.wait_idle, args.drain_s)
    except AssertionError:
        drained = False
    names_by_pid = {p.popen.pid: n for n, p in procs.items()}
    gateway_log = cluster.gateway.log_path.read_text(errors="replace") if cluster.gateway else ""
    return EndState(sample_all(procs), kv_usage(cluster, names_by_pid), {n: p.alive() for n, p in procs.items()},
                    drained, gateway_counters(cluster), frozenset(recovered_ids(gateway_log)))


def twin_check(args: argparse.Namespace, info: dict[str, Any], traffic: Traffic,
               recovered: frozenset[str]) -> TwinCheck | None:
    """Recovered, completed streams against the single-process engine (None: no fault injected)."""
    if "killed" not in info and "hung" not in info:
        return None
    todo = len(recovered & set(traffic.completed))
    log(f"running the undisturbed twins of {todo} recovered, completed stream(s)")
    return check_twins(recovered, traffic.completed, ReferenceTwins(model_dir(None), args.dtype, os.cpu_count() or 1),
                       SEED_KEY)


async def soak(args: argparse.Namespace, cluster: Cluster, procs: dict[str, Proc]) -> int:
    model = served_model(cluster.url)
    await warm_up(args, cluster, model)
    names_by_pid = {p.popen.pid: n for n, p in procs.items()}
    start = sample_all(procs)
    kv_start = kv_usage(cluster, names_by_pid)
    log("start sample taken")
    info: dict[str, Any] = {}
    traffic = await load(args, cluster, procs, model, info)
    state = await settle(args, cluster, procs, info)
    cluster.stop()  # the twins get the cores to themselves
    twins = twin_check(args, info, traffic, state.recovered)
    killed = frozenset({info["killed"]}) if "killed" in info else frozenset()
    hung = HungWorker(info["hung"], info.get("stalled_t"), info["hung_alive_at_end"]) if "hung" in info else None
    window = None
    if "kill_t" in info:
        window = (info["kill_t"], info.get("replacement_ready_t", args.minutes * 60.0) + args.heartbeat_grace_s)
    kv_final = {n: max(v["kv_usage_registry"], v["kv_usage_metrics"] or 0.0) for n, v in state.kv.items()}
    verdict = judge(start, state.samples, kv_final, state.alive, traffic.errors, window, killed,
                    hung=hung, twins=twins)
    report(args, info, traffic, start, kv_start, state, twins, window, verdict)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "faults": info, "counts": traffic.counts, "drained": state.drained,
            "start": {k: asdict(v) for k, v in start.items()}, "end": {k: asdict(v) for k, v in state.samples.items()},
            "kv_start": kv_start, "kv_end": state.kv, "alive": state.alive, "twins": asdict(twins) if twins else None,
            "errors": [asdict(e) for e in traffic.errors], "passed": verdict.passed, "reasons": verdict.reasons,
        }, indent=2))
    return 0 if verdict.passed else 1


def report(args: argparse.Namespace, info: dict[str, Any], traffic: Traffic, start: dict[str, ProcSample],
           kv_start: dict[str, dict[str, Any]], state: EndState, twins: TwinCheck | None,
           window: tuple[float, float] | None, verdict: Verdict) -> None:
    print("\n================ soak report ================")
    print(f"cluster: gateway + {args.prefill} prefill + {args.decode} decode; concurrency {args.concurrency}; "
          f"{args.minutes} min after {args.warmup_s:.0f}s warm-up; abort fraction {args.abort_fraction}; "
          f"sampled fraction {args.sampled_fraction}; stall timeout {args.stall_timeout}s")
    print(f"faults: {info or 'none'}")
    print(f"requests: {traffic.counts}  streamed content events: {traffic.tokens}")
    print(f"drained to idle within {args.drain_s:.0f}s: {state.drained}")
    print(f"gateway: {state.gateway}")
    print("\nprocess samples (RSS/fds summed over each process group; start = after warm-up, idle):")
    print_table(start, state.samples)
    print("\nKV at start:", json.dumps(kv_start))
    print("KV at end:  ", json.dumps(state.kv))
    print("alive at end:", state.alive)
    kinds: dict[str, int] = {}
    for e in traffic.errors:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    print(f"\nerrors by kind: {kinds or 'none'}")
    print(f"explained: {len(verdict.explained)}  unexplained: {len(verdict.unexplained)}")
    for e in verdict.unexplained[:20]:
        print(f"  unexplained t={e.t}s {e.kind}: {e.detail}")
    if twins is None:
        print("\ntwins: no fault injected, no recovered stream to check")
    else:
        print(f"\ntwins: {len(state.recovered)} request(s) recovered; {twins.checked} recovered and completed "
              f"checked against their undisturbed twin, {twins.sampled} of them sampled; "
              f"{len(twins.mismatches)} differ")
    print(f"\nrules: RSS growth per process <= max({RSS_ABS_BOUND // MIB} MiB, {RSS_REL_BOUND:.0%} of start); "
          f"|fd change| <= {FD_BOUND}; KV usage 0 on every worker after drain; every process except the killed "
          "and the hung one alive; the hung one marked stalled; zero unexplained errors. An error is explained "
          f"only if its code is in {sorted(EXPLAINABLE_CODES)} (pool empty) and it occurred in the restart window "
          f"[kill, replacement registered + {args.heartbeat_grace_s:.0f}s]; recovered streams and client aborts "
          "are not errors. Every recovered stream that completed equals its twin (text and finish reason), and "
          "at least one of them is sampled.")
    print(f"restart window: {window}")
    print("\nVERDICT:", "PASS" if verdict.passed else "FAIL")
    for r in verdict.reasons:
        print(f"  - {r}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="of the workers and of the twins' engine")
    ap.add_argument("--abort-fraction", type=float, default=0.3)
    ap.add_argument("--sampled-fraction", type=float, default=0.5,
                    help="share of requests at temperature 0.9 with penalties (half of them seeded)")
    ap.add_argument("--restart-at-minute", type=float, default=None, help="the decode kill; default: half way")
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument("--hang-at-minute", type=float, default=None,
                    help="start the decode worker that hangs; default: a quarter of the way")
    ap.add_argument("--hang-after-steps", type=int, default=50, help="engine steps the hung worker takes first")
    ap.add_argument("--no-hang", action="store_true")
    ap.add_argument("--stall-timeout", type=float, default=3.0, help="the gateway's --stall-timeout (seconds)")
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--drain-s", type=float, default=60.0)
    ap.add_argument("--heartbeat-grace-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None, help="process logs (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.decode < 1 or args.prefill < 1 or args.concurrency < 1:
        ap.error("--prefill, --decode and --concurrency must be >= 1")
    if args.minutes <= 0:
        ap.error("--minutes must be > 0")
    for name in ("abort_fraction", "sampled_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            ap.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.restart_at_minute is None:
        args.restart_at_minute = args.minutes / 2
    if args.hang_at_minute is None:
        args.hang_at_minute = args.minutes / 4
    for name in ("restart_at_minute", "hang_at_minute"):
        if not 0.0 <= getattr(args, name) < args.minutes:
            ap.error(f"--{name.replace('_', '-')} must be in [0, --minutes)")
    if args.hang_after_steps < 1 or args.stall_timeout <= 0:
        ap.error("--hang-after-steps and --stall-timeout must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdsoak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs in {log_dir}")
    cluster = Cluster(log_dir)
    procs: dict[str, Proc] = {}

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        cluster.start_gateway("--stall-timeout", str(args.stall_timeout),
                              env={"PDSERVE_GATEWAY_SEED_KEY": SEED_KEY.hex()})
        assert cluster.gateway is not None
        procs["gateway"] = cluster.gateway
        for role, n in (("prefill", args.prefill), ("decode", args.decode)):
            for _ in range(n):
                p = cluster.add_worker(role, *worker_args(args))
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
