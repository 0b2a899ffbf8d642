"""Fixtures for the multi-host tests: the shared model, the single-process
reference engine, and a pdserve deployment spread over network namespaces
(see tests/multihost/netns.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.sampling_params import SamplingParams
from tests.e2e.cluster import ADMIN, ADMIN_TOKEN, suite_keys
from tests.multihost.netns import NetnsUnavailable, VirtualNetwork, check_available

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("gw", "pf", "d1", "d2")
HTTP_PORT = 8000  # every host is its own namespace: fixed ports cannot collide
CONTROL_PORT = 8100
METRICS_PORT = 9100
WORKER_BLOCKS = "256"
HEARTBEAT_TIMEOUT_S = "3.0"  # the default; generous for 2 shared cores


# --- model and reference -------------------------------------------------------


@pytest.fixture(scope="session")
def mh_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model, built once per session under a private PDSERVE_HOME."""
    from pdserve.builtin.default_model import default_model_dir

    home = tmp_path_factory.mktemp("pdserve-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_HOME", str(home))
        return Path(default_model_dir())


@dataclass
class Reference:
    engine: Any
    tokenizer: Any
    model_name: str

    def completion_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def greedy_text(self, prompt: str, **params: Any) -> str:
        sp = SamplingParams(temperature=0.0, **params)
        result = self.engine.generate([self.completion_ids(prompt)], sp)[0]
        return str(
            self.tokenizer.decode(list(result.choices[0].token_ids), skip_special_tokens=True)
        )

    def greedy_texts(self, prompts: list[str], **params: Any) -> list[str]:
        """Greedy texts of several prompts, batched in one engine call."""
        sp = SamplingParams(temperature=0.0, **params)
        results = self.engine.generate([self.completion_ids(p) for p in prompts], sp)
        return [
            str(self.tokenizer.decode(list(r.choices[0].token_ids), skip_special_tokens=True))
            for r in results
        ]


@pytest.fixture(scope="session")
def mh_reference(mh_model_dir: Path) -> Reference:
    from gateway.tokenizer import Tokenizer
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    # float32 on both sides, as in tests/e2e/cluster.py (DTYPE): exact equality under
    # recovery holds in float32 only.
    cfg = EngineConfig(
        model_dir=str(mh_model_dir), dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=256)
    )
    return Reference(LLMEngine(cfg), Tokenizer.from_model_dir(mh_model_dir), mh_model_dir.name)


# --- HTTP helpers ------------------------------------------------------------


def http(method: str, url: str, body: Any = None, timeout: float = 30.0,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def metric_value(text: str, name: str) -> float:
    """Sum of every sample of `name` in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    )


# --- processes -----------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PDSERVE_LOG_LEVEL="INFO",
        PDSERVE_ADMIN_TOKEN=ADMIN_TOKEN,
    )
    return env


@dataclass
class Deployment:
    """gateway, prefill and two decode workers, each in its own namespace, over TCP."""

    net: VirtualNetwork
    model_dir: Path
    log_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.net.addr('gw')}:{HTTP_PORT}"

    @property
    def control(self) -> str:
        return f"tcp://{self.net.addr('gw')}:{CONTROL_PORT}"

    def worker_id(self, host: str) -> str:
        return f"{host}-{self.net.tag}"

    def start(self, host: str, args: list[str]) -> Proc:
        log_path = self.log_dir / f"{host}.log"
        cmd = [*self.net.exec_prefix(host), sys.executable, "-m", "pdserve", *args]
        with open(log_path, "wb") as out:
            popen = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        proc = Proc(host, popen, log_path)
        self.procs[host] = proc
        return proc

    def start_all(self) -> None:
        gw = self.net.addr("gw")
        self.start("gw", ["gateway", "--host", gw, "--port", str(HTTP_PORT), "--control-host", gw,
                          "--control-port", str(CONTROL_PORT), "--model", str(self.model_dir),
                          "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S, *suite_keys().gateway_flags()])
        for host, role in (("pf", "prefill"), ("d1", "decode"), ("d2", "decode")):
            addr = self.net.addr(host)
            self.start(host, [role, "--gateway", self.control, "--model", str(self.model_dir),
                              "--worker-id", self.worker_id(host), "--threads", "1",
                              "--num-blocks", WORKER_BLOCKS, "--heartbeat", "0.25",
                              "--metrics-host", addr, "--metrics-port", str(METRICS_PORT),
                              "--kv-host", addr, "--kv-transport", "tcp", "--dtype", "float32",
                              *suite_keys().worker_flags()])
        wanted = {self.worker_id(h) for h in ("pf", "d1", "d2")}
        self.wait(
            lambda: wanted <= {w["id"] for w in self.workers()}, "all three workers registered", 120
        )
        self.wait(lambda: http("GET", f"{self.url}/ready", timeout=2)[0] == 200, "gateway /ready")

    def workers(self) -> list[dict[str, Any]]:
        status, body = http("GET", f"{self.url}/v1/workers", timeout=5, headers=ADMIN)
        assert status == 200, body
        return list(body["data"])

    def worker(self, host: str) -> dict[str, Any] | None:
        return next((w for w in self.workers() if w["id"] == self.worker_id(host)), None)

    def metrics(self, host: str) -> str:
        url = f"http://{self.net.addr(host)}:{METRICS_PORT}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())

    def wait(self, cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p.name for p in self.procs.values() if not p.alive()]
            if dead:
                raise AssertionError(
                    f"process(es) {dead} exited while waiting for {what}\n{self.logs()}"
                )
            with contextlib.suppress(OSError, AssertionError, ValueError):
                if cond():
                    return
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log_path})\n{p.log()}" for p in self.procs.values())

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM every worker at once, then the gateway; SIGKILL what outlives `timeout`."""
        workers = [p for h, p in self.procs.items() if h != "gw"]
        for proc in workers:
            proc.kill(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            proc.stop(0.1)
        if "gw" in self.procs:
            self.procs["gw"].stop(timeout)


@pytest.fixture(scope="session")
def netns_available() -> None:
    try:
        check_available()
    except NetnsUnavailable as e:
        pytest.skip(f"multi-host test needs network namespaces: {e}")


@pytest.fixture(scope="module")
def deployment(netns_available: None, mh_model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    net = VirtualNetwork(HOSTS)
    net.create()
    dep = Deployment(net, mh_model_dir, tmp_path_factory.mktemp("multihost-logs"))
    try:
        dep.start_all()
        yield dep
    finally:
        try:
            dep.stop()
        finally:
            net.remove()
        left = net.leftovers()
        assert not left, f"namespaces/links left behind: {left}"
