"""Real-process cluster for end-to-end tests: a gateway and workers started as
`pdserve ...` subprocesses on free loopback ports, each in its own process
group, all killed on teardown.

Authenticated like `pdserve up`: a gateway started here gets the suite's CURVE keys
(one key set per test process, pdserve/cli/cluster_keys.py), and so does every worker
whose gateways all hold them; a command that names its own `--curve-*` flags, and a
`Cluster(curve=False)`, get none. Every gateway has the admin token `ADMIN_TOKEN`
(unless the test's env sets another), which `GET /v1/workers` needs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pdserve.cli import cluster_keys
from pdserve.common.hosts import free_ports
from pdserve.engine.loading.dtype import host_cpu_flags, resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
WORKER_BLOCKS = "256"
# These tests hold the cluster to token-exact equality with the single-process
# reference (conftest.py) under concurrency, recovery by re-prefill and drain. That
# holds exactly in float32 only: in bfloat16 another batch composition or a
# re-prefill rounds the GEMMs differently and long streams part at near-ties. So
# workers and the reference run float32, explicitly; test_bf16_serving.py covers
# what `--dtype auto` serves on this host.
DTYPE = "float32"
# What `--dtype auto` gives a CPU worker on this host (on CPU the checkpoint's dtype
# plays no part).
WORKER_COMMANDS = ("prefill", "decode", "worker")
AUTO_DTYPE = resolve_dtype("auto", None, "cpu", host_cpu_flags())
ADMIN_TOKEN = "e2e-admin-token-0123456789abcdef"
_suite_keys: list[cluster_keys.ClusterKeys] = []
_keyed_control_ports: set[int] = set()  # gateways started with the suite's keys


def suite_keys() -> cluster_keys.ClusterKeys:
    """This test process's CURVE key set (created on first use, removed at exit)."""
    if not _suite_keys:
        import atexit

        _suite_keys.append(cluster_keys.create_private())
        atexit.register(cluster_keys.remove, _suite_keys[0])
    return _suite_keys[0]


def _names_curve(args: list[str]) -> bool:
    return any(a.startswith("--curve") or a == "--insecure" for a in args)


def _flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def with_suite_keys(args: list[str]) -> list[str]:
    """`args` plus the suite's CURVE flags where they apply (see the module docstring)."""
    if args[0] == "gateway":
        port = _flag_value(args, "--control-port")
        keyed = not _names_curve(args)
        if port is not None:  # a port the OS hands out again must not keep a past gateway's mark
            (_keyed_control_ports.add if keyed else _keyed_control_ports.discard)(int(port))
        return [*args, *suite_keys().gateway_flags()] if keyed else args
    if args[0] in WORKER_COMMANDS and not _names_curve(args):
        gateways = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--gateway"]
        ports = [int(g.rsplit(":", 1)[1]) for g in gateways]
        if ports and all(p in _keyed_control_ports for p in ports):
            return [*args, *suite_keys().worker_flags()]
    return args


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("PDSERVE_LOG_LEVEL", "WARNING")
    env.setdefault("PDSERVE_ADMIN_TOKEN", ADMIN_TOKEN)
    env.update(extra or {})
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    _terminated: bool = field(default=False, repr=False)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 15.0) -> int:
        self.terminate()
        return self.wait_stopped(timeout)

    def terminate(self) -> None:
        """SIGTERM, once, if still running (a worker drains and exits by itself)."""
        if self.alive() and not self._terminated:
            self.signal(signal.SIGTERM)
            self._terminated = True

    def wait_stopped(self, timeout: float = 15.0) -> int:
        """The exit status after `terminate`: SIGKILL (the whole group) if it has not
        exited within `timeout`, or at once if it was never terminated."""
        if self._terminated:
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)
        return self.popen.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start(name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
          curve: bool = True) -> Proc:
    """`python -m pdserve ARGS` in its own process group; a worker runs the suite's
    `DTYPE` unless `args` name another; with `curve`, the suite's keys where they apply."""
    if args and args[0] in WORKER_COMMANDS and "--dtype" not in args:
        args = [*args, "--dtype", DTYPE]
    if curve and args:
        args = with_suite_keys(args)
    elif args and args[0] == "gateway" and (port := _flag_value(args, "--control-port")) is not None:
        _keyed_control_ports.discard(int(port))
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args], cwd=ROOT, env=_env(env), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    return Proc(name, popen, log_path)


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
T = TypeVar("T")
# What a wait is for, in its failure: a string, or a callable giving the state when it gave up.
Detail = str | Callable[[], object]


def _give_up(deadline: float, timeout: float, what: Detail, last: object) -> None:
    if time.monotonic() >= deadline:
        detail = what() if callable(what) else what
        raise AssertionError(f"timed out after {timeout}s waiting for {detail} (last: {last!r})")


def wait_for(cond: Callable[[], T], what: Detail, timeout: float = 60.0, interval: float = 0.1,
             step: Callable[[], object] | None = None, tolerate: tuple[type[Exception], ...] = ()) -> T:
    """Poll `cond` until it gives something truthy, and return that: the process tests'
    one poll loop (they wait on a condition, never on a sleep). Between two polls, `step`
    (pump a socket, refresh a link) and a sleep of `interval` s; an exception of a
    `tolerate` type counts as "not yet". After `timeout` s, an AssertionError naming
    `what` and the last result."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last: object = (got := cond())
            if got:
                return got
        except tolerate as e:
            last = e
        _give_up(deadline, timeout, what, last)
        if step is not None:
            step()
        time.sleep(interval)


async def wait_for_async(cond: Callable[[], object], what: Detail, timeout: float = 60.0,
                         interval: float = 0.1) -> None:
    """`wait_for` inside an event loop: it sleeps with asyncio, so the loop runs meanwhile."""
    deadline = time.monotonic() + timeout
    while not cond():
        _give_up(deadline, timeout, what, False)
        await asyncio.sleep(interval)


def http(method: str, url: str, body: Any = None, timeout: float = 60.0,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def sse(url: str, body: dict[str, Any], timeout: float = 60.0) -> list[Any]:
    """POST a streaming request; the parsed `data:` events, "[DONE]" included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    events: list[Any] = []
    try:
        r = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"HTTP {e.code}: {e.read()[:500]!r}") from None
    with r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: "):
                payload = line[6:].decode()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


class CountedStreams:
    """Streams through /v1/completions that count the chunks each has received, so a
    test can kill a worker once every stream is under way (`run` in a thread each).
    Greedy, unless `params[i]` (e.g. temperature and seed) says otherwise for stream i."""

    def __init__(self, url: str, model: str, prompts: list[str], max_tokens: int,
                 params: list[dict[str, Any]] | None = None) -> None:
        self._url = url
        self._model = model
        self.prompts = prompts
        self._max_tokens = max_tokens
        self.params = params or [{} for _ in prompts]
        self.progress = [0] * len(prompts)
        self._lock = threading.Lock()

    def run(self, i: int) -> str:
        """Stream prompt i to the end; its text (no error event may arrive)."""
        body = {"model": self._model, "prompt": self.prompts[i], "max_tokens": self._max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True, **self.params[i]}
        req = urllib.request.Request(f"{self._url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        text = []
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    text += [ch["text"] for ch in ev.get("choices", [])]
                    with self._lock:
                        self.progress[i] += 1
        return "".join(text)

    def wait_under_way(self, chunks: int = 3, timeout: float = 60.0) -> None:
        """Until every stream has received `chunks` chunks (or `timeout`: a stream may end
        sooner, which the caller finds out)."""
        with contextlib.suppress(AssertionError):
            wait_for(lambda: self.least() >= chunks, "streams under way", timeout, 0.01)

    def least(self) -> int:
        with self._lock:
            return min(self.progress)


@dataclass
class Cluster:
    log_dir: Path
    port: int = 0  # 0: a free port (HTTP and control distinct, picked together)
    control_port: int = 0
    gateway: Proc | None = None
    workers: list[Proc] = field(default_factory=list)
    curve: bool = True  # the suite's CURVE keys on the gateway and its workers
    admin_token: str = ADMIN_TOKEN
    _n: int = 0

    def __post_init__(self) -> None:
        http_port, control_port = free_ports(2)
        self.port = self.port or http_port
        self.control_port = self.control_port or control_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control(self) -> str:
        return f"tcp://127.0.0.1:{self.control_port}"

    def start_gateway(self, *extra: str, env: dict[str, str] | None = None, wait: bool = True) -> None:
        """Start the gateway; with `wait`, until /health answers (else `wait_gateway`)."""
        env = {"PDSERVE_ADMIN_TOKEN": self.admin_token, **(env or {})}
        self.admin_token = env["PDSERVE_ADMIN_TOKEN"]
        self.gateway = start("gateway", ["gateway", "--port", str(self.port), "--control-port",
                                         str(self.control_port), "--heartbeat-timeout", "3.0", *extra],
                             self.log_dir, env, self.curve)
        if wait:
            self.wait_gateway()

    def wait_gateway(self) -> None:
        self._wait(lambda: http("GET", f"{self.url}/health", timeout=2)[0] == 200, "gateway /health")

    def add_worker(self, role: str, *extra: str, env: dict[str, str] | None = None) -> Proc:
        self._n += 1
        args = [role, "--gateway", self.control, "--threads", "1", "--num-blocks", WORKER_BLOCKS,
                "--heartbeat", "0.25", "--dtype", DTYPE, *extra]
        if role == "worker":
            args.append("--colocated")
        proc = start(f"{role}{self._n}", args, self.log_dir, env, self.curve)
        self.workers.append(proc)
        return proc

    def worker_list(self) -> list[dict[str, Any]]:
        status, body = http("GET", f"{self.url}/v1/workers", timeout=5,
                            headers={"Authorization": f"Bearer {self.admin_token}"})
        assert status == 200, body
        return list(body["data"])

    def wait_roles(self, timeout: float = 90.0, **counts: int) -> list[dict[str, Any]]:
        def ok() -> bool:
            roles = [w["role"] for w in self.worker_list()]
            return all(roles.count(r) == n for r, n in counts.items())

        self._wait(ok, f"workers {counts}", timeout)
        return self.worker_list()

    def wait_idle(self, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Until every worker reports all KV blocks free and nothing running."""

        def idle() -> bool:
            return all(w["free_blocks"] == w["total_blocks"] and w["running_seqs"] == 0
                       and w["inflight_requests"] == 0 for w in self.worker_list())

        self._wait(idle, "idle KV on every worker", timeout)
        return self.worker_list()

    def _wait(self, cond: Callable[[], object], what: str, timeout: float = 60.0) -> None:
        """`wait_for` that fails at once if the gateway exits, and with every log."""

        def detail() -> str:
            procs = [*self.workers, *([self.gateway] if self.gateway else [])]
            return "\n".join([what, *(f"--- {p.name}\n{p.log()}" for p in procs)])

        self._gateway_alive()
        wait_for(cond, detail, timeout, step=self._gateway_alive, tolerate=(OSError, AssertionError))

    def _gateway_alive(self) -> None:
        if self.gateway is not None and not self.gateway.alive():
            raise AssertionError(f"gateway exited:\n{self.gateway.log()}")

    def stop(self) -> None:
        """Every worker at once (each exit is mostly waiting: one after another, a
        cluster's teardown would wait them out in turn), then the gateway."""
        for w in self.workers:
            w.terminate()
        for w in self.workers:
            w.wait_stopped()
            remove_leaked_shm(w.popen.pid)
        if self.gateway is not None:
            self.gateway.stop()


def remove_leaked_shm(pid: int) -> None:
    """A worker killed with SIGKILL cannot unlink its shared-memory KV pool; the test does."""
    for seg in Path("/dev/shm").glob(f"pdkv_{pid}_*"):
        with contextlib.suppress(OSError):
            seg.unlink()


@contextlib.contextmanager
def running_cluster(log_dir: Path, roles: dict[str, int], *worker_extra: str) -> Iterator[Cluster]:
    c = Cluster(log_dir)
    try:
        # The workers start while the gateway does (they connect when it listens): its
        # start-up and theirs overlap instead of adding up.
        c.start_gateway(wait=False)
        for role, n in roles.items():
            for _ in range(n):
                c.add_worker(role, *worker_extra)
        c.wait_gateway()
        wanted = {("colocated" if r == "worker" else r): n for r, n in roles.items()}
        c.wait_roles(**wanted)
        yield c
    finally:
        c.stop()


def metric_value(text: str, name: str) -> float:
    """Sum of every sample of `name` in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


def worker_metrics(worker: dict[str, Any]) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker['metrics_port']}/metrics", timeout=5) as r:
        return str(r.read().decode())
