"""Start a `pdserve up` configuration for a benchmark driver and wait until it serves.

The server runs in its own process group on a free loopback port, its output
goes to a log file, and leaving the context stops exactly that process group
(SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

from pdserve.common.hosts import free_port

# The admin token of the servers this process starts (`GET /v1/workers` needs it); a
# PDSERVE_ADMIN_TOKEN already set is used as it is.
ADMIN_TOKEN = os.environ.get("PDSERVE_ADMIN_TOKEN") or secrets.token_hex(16)


def list_workers(base_url: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """`GET /v1/workers` of a server started here (with its admin token)."""
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/workers",
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return list(json.load(r)["data"])


@dataclasses.dataclass(frozen=True)
class ServerHandle:
    name: str
    base_url: str
    pid: int
    log_path: str


def pdserve_command() -> list[str]:
    """`pdserve` run by the current interpreter, so a venv needs no activation."""
    return [sys.executable, "-m", "pdserve"]


def default_tokenizer() -> str | None:
    """The built-in model's directory (it holds `tokenizer.json`), or None."""
    try:
        from pdserve.builtin.default_model import default_model_dir  # torch-free module

        return str(default_model_dir())
    except Exception as e:  # a missing engine must not stop a run against a server
        print(f"no built-in tokenizer ({e}); prompt sizes are approximate", file=sys.stderr)
        return None


def _ready(base_url: str) -> bool:
    """Serving means: a model is listed and a 1-token completion succeeds."""
    try:
        with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as resp:
            models = json.load(resp).get("data") or []
        if not models:
            return False
        body = json.dumps({"model": models[0]["id"], "prompt": "hello", "max_tokens": 1})
        req = urllib.request.Request(
            base_url + "/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop_group(*procs: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the process groups `procs` lead, all at once (each exit is mostly waiting),
    then SIGKILL the groups that outlive `grace_s`."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # a group its starter created
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)


def log_tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def child_env(env: dict[str, str], unset: Sequence[str] = ()) -> dict[str, str]:
    """A started server's environment: this process's, the admin token, `env`, less `unset`."""
    out = {**os.environ, "PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN, **env}
    for key in unset:
        out.pop(key, None)
    return out


@contextlib.contextmanager
def pdserve_up(
    name: str, up_args: Sequence[str], ready_timeout_s: float = 600.0
) -> Iterator[ServerHandle]:
    """`pdserve up <up_args> --port P` on 127.0.0.1; yields once it serves."""
    port = free_port()
    cmd = [*pdserve_command(), "up", *up_args, "--port", str(port)]
    with serve_command(name, cmd, port, ready_timeout_s=ready_timeout_s) as server:
        yield server


@contextlib.contextmanager
def serve_command(
    name: str, cmd: Sequence[str], port: int, env: dict[str, str] | None = None,
    ready_timeout_s: float = 600.0, unset: Sequence[str] = (),
) -> Iterator[ServerHandle]:
    """Any OpenAI-compatible server started by `cmd` (listening on 127.0.0.1:`port`) in
    its own process group, in this process's environment plus `env` and less the
    variables `unset`; yields once it serves, stops the group on exit."""
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(
        prefix=f"pdserve-{name}-", suffix=".log", delete=False
    ) as log:  # kept after the run for post-mortems
        print(f"[{name}] starting: {' '.join(cmd)} (log {log.name})", file=sys.stderr, flush=True)
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=child_env(env or {}, unset))
        try:
            deadline = time.monotonic() + ready_timeout_s
            while not _ready(base_url):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"[{name}] exited with {proc.returncode}:\n{log_tail(log.name)}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"[{name}] not serving after {ready_timeout_s}s")
                time.sleep(1.0)
            print(f"[{name}] serving at {base_url}", file=sys.stderr, flush=True)
            yield ServerHandle(name, base_url, proc.pid, log.name)
        finally:
            stop_group(proc)
