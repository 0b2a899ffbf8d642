"""`pdserve up`: a gateway plus N prefill + M decode workers (or colocated workers)
as separate processes on this machine. Prints the URL once ready; Ctrl-C or
SIGTERM stops the workers (they drain and deregister), then the gateway.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ap = sub.add_parser("up", help="start a gateway and workers on this machine")
    ap.add_argument("--model", default=None, help="model dir (default: built-in)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers")
    ap.add_argument("--decode", type=int, default=1, help="decode workers")
    ap.add_argument("--colocated", action="store_true", help="colocated workers instead of P/D")
    ap.add_argument("--workers", type=int, default=1, help="colocated workers (with --colocated)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per worker (default: cores split among workers)")
    ap.add_argument("--prefill-threads", type=int, default=None,
                    help="torch threads per prefill worker (default: --threads)")
    ap.add_argument("--decode-threads", type=int, default=None,
                    help="torch threads per decode worker (default: --threads)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="workers' weight and KV dtype")
    ap.add_argument("--kv-transport", default="auto", choices=("auto", "tcp", "shm"))
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="per-worker token budget per step")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=None,
                    help="per-worker cap on one sequence's prefill tokens per step")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="per-worker running sequences")
    ap.add_argument("--no-prefix-caching", action="store_true", help="disable the workers' prefix cache")
    ap.add_argument("--max-recoveries", type=int, default=3)
    ap.add_argument("--stall-timeout", type=float, default=30.0,
                    help="gateway: seconds a worker may hold work without an engine step (0: off)")
    ap.add_argument("--api-key", action="append", default=[], help="gateway: require this API key (repeatable)")
    ap.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                    help="gateway: file of API keys, one per line, '#' comments")
    ap.add_argument("--ready-timeout", type=float, default=120.0)
    ap.set_defaults(func=run)


def _pdserve() -> list[str]:
    return [sys.executable, "-m", "pdserve"]


def _worker_cmds(args: argparse.Namespace, control: str) -> list[list[str]]:
    roles = ["worker"] * args.workers if args.colocated else ["prefill"] * args.prefill + ["decode"] * args.decode
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(len(roles), 1))
    cmds = []
    per_role = {"prefill": args.prefill_threads, "decode": args.decode_threads}
    counts = [per_role.get(role) or threads for role in roles]
    # Threads that fit the cores may spin between parallel regions (see workers.py).
    spin = sum(counts) <= (os.cpu_count() or 1)
    for role, n in zip(roles, counts, strict=True):
        cmd = [*_pdserve(), role, "--gateway", control, "--threads", str(n), "--device", args.device,
               "--dtype", args.dtype]
        cmd += ["--colocated"] if role == "worker" else ["--kv-transport", args.kv_transport]
        cmd += ["--spin-wait"] if spin else []
        if args.model:
            cmd += ["--model", args.model]
        if args.kv_cache_memory:
            cmd += ["--kv-cache-memory", args.kv_cache_memory]
        if args.num_blocks:
            cmd += ["--num-blocks", str(args.num_blocks)]
        if args.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.long_prefill_token_threshold:
            cmd += ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
        if args.max_num_seqs:
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        if args.no_prefix_caching:
            cmd += ["--no-prefix-caching"]
        cmds.append(cmd)
    return cmds


def _gateway_cmd(args: argparse.Namespace, control_port: int) -> list[str]:
    cmd = [*_pdserve(), "gateway", "--host", args.host, "--port", str(args.port),
           "--control-port", str(control_port), "--max-recoveries", str(args.max_recoveries),
           "--stall-timeout", str(args.stall_timeout)]
    if args.model:
        cmd += ["--model", str(Path(args.model))]
    for key in args.api_key:
        cmd += ["--api-key", key]
    for path in args.api_key_file:
        cmd += ["--api-key-file", str(Path(path).resolve())]
    return cmd


def _wait_ready(url: str, procs: list[subprocess.Popen[bytes]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=1) as r:
                if json.load(r).get("ready"):
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def _stop(procs: list[subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(args: argparse.Namespace) -> int:
    from common.transport import free_port

    control_port = free_port()
    control = f"tcp://127.0.0.1:{control_port}"
    gw_cmd = _gateway_cmd(args, control_port)
    stop = {"now": False}

    def on_signal(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    gateway = subprocess.Popen(gw_cmd, stdout=subprocess.DEVNULL)
    workers = [subprocess.Popen(cmd) for cmd in _worker_cmds(args, control)]
    url = f"http://{args.host}:{args.port}"
    try:
        if not _wait_ready(url, [gateway, *workers], args.ready_timeout):
            print("pdserve up: the cluster did not become ready", file=sys.stderr)
            return 1
        print(f"pdserve ready at {url}/v1", flush=True)
        while not stop["now"]:
            if any(p.poll() is not None for p in [gateway, *workers]):
                print("pdserve up: a process exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop(workers)
        _stop([gateway])
