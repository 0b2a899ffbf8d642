"""A serving stack for benchmarks: a gateway and one prefill + one decode worker, each in
its own process group, started with the commands `pdserve up` runs and stopped on exit."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

from pdserve.loadgen.launch import free_port, log_tail, pdserve_command, stop_group


@dataclasses.dataclass(frozen=True)
class StackConfig:
    model_dir: str
    device: str
    dtype: str
    threads: int
    kv_cache_memory: str | None  # per worker; None: the worker's default
    max_num_batched_tokens: int
    ready_timeout_s: float
    extra_args: tuple[str, ...] = ()  # appended to every process's command line


def stack_commands(cfg: StackConfig, port: int, control_port: int) -> list[list[str]]:
    """Gateway, prefill worker, decode worker: the commands `pdserve up` runs."""
    gateway = [*pdserve_command(), "gateway", "--port", str(port), "--control-port", str(control_port),
               "--model", cfg.model_dir, *cfg.extra_args]
    workers = []
    for role in ("prefill", "decode"):
        cmd = [*pdserve_command(), role, "--gateway", f"tcp://127.0.0.1:{control_port}",
               "--model", cfg.model_dir, "--device", cfg.device, "--dtype", cfg.dtype,
               "--threads", str(cfg.threads), "--kv-transport", "auto",
               "--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
        cmd += ["--kv-cache-memory", cfg.kv_cache_memory] if cfg.kv_cache_memory else []
        workers.append([*cmd, *cfg.extra_args])
    return [gateway, *workers]


def _wait_ready(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a serving process exited during start-up; log {log}:\n{log_tail(log, 40)}")
        with (
            contextlib.suppress(OSError, ValueError),  # 503 while not ready is an OSError
            urllib.request.urlopen(f"{url}/ready", timeout=2) as r,
        ):
            if json.load(r).get("ready"):
                return
        time.sleep(0.5)
    raise SystemExit(f"the stack was not ready after {timeout_s:.0f} s; log {log}:\n{log_tail(log, 40)}")


@contextlib.contextmanager
def serving_stack(cfg: StackConfig) -> Iterator[str]:
    """Start the gateway and both workers; yield the base URL once ready; stop them all."""
    port, control_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.NamedTemporaryFile(prefix="pdserve-gpu-serve-", suffix=".log", delete=False) as log:
        print(f"[gpu_serve] starting the stack (log {log.name})", file=sys.stderr, flush=True)
        try:
            for cmd in stack_commands(cfg, port, control_port):
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            _wait_ready(url, procs, cfg.ready_timeout_s, log.name)
            yield url
        finally:
            stop_group(*procs[1:], grace_s=20.0)  # workers first: they drain and deregister
            stop_group(*procs[:1], grace_s=20.0)
