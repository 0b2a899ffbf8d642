"""Issue 5 acceptance: a real Prometheus server scrapes the gateway.

The test starts its own `prometheus` (Debian package `prometheus`, binary
/usr/bin/prometheus) on a free loopback port with a generated config (1 s scrape
interval, the gateway's /metrics as the only target) and storage in a temp dir,
sends traffic, and polls the query API until `llm_time_to_first_token_seconds_count`
is > 0 and equals the gateway's own count. Skipped, saying so, when the package is
not installed (CI installs it with `apt-get install -y prometheus`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.hosts import free_port
from tests.e2e.cluster import Cluster, http
from tests.observability.obs import MODEL, scrape, value, wait_until

PROMETHEUS = "/usr/bin/prometheus"
TTFT_COUNT = "llm_time_to_first_token_seconds_count"


def _binary() -> str:
    if os.path.exists(PROMETHEUS):
        return PROMETHEUS
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip(f"Prometheus is not installed ({PROMETHEUS} missing; the Debian package 'prometheus' "
                    "provides it: apt-get install -y prometheus)")
    return found


class Prometheus:
    def __init__(self, binary: str, target: str, work: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = work / "prometheus.yml"
        # JSON is valid YAML: no YAML library needed to write the config.
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "pdserve-gateway", "metrics_path": "/metrics",
                                "static_configs": [{"targets": [target]}]}],
        }))
        self.log_path = work / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def api(self, path: str, **params: str) -> Any:
        assert self.popen.poll() is None, f"prometheus exited {self.popen.returncode}:\n{self.log()}"
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> float | None:
        result = self.api("/api/v1/query", query=expr)["result"]
        return sum(float(r["value"][1]) for r in result) if result else None

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)


@pytest.fixture()
def prometheus(pd_cluster: Cluster, tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(_binary(), f"127.0.0.1:{pd_cluster.port}", tmp_path)
    try:
        wait_until(lambda: urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2).status == 200
                   or prom.popen.poll() is not None, "prometheus /-/ready", timeout=30)
        assert prom.popen.poll() is None, f"prometheus exited {prom.popen.returncode}:\n{prom.log()}"
        yield prom
    finally:
        prom.stop()


def test_prometheus_scrapes_gateway(pd_cluster: Cluster, prometheus: Prometheus) -> None:
    for i in range(3):
        status, body = http("POST", f"{pd_cluster.url}/v1/completions",
                            {"model": MODEL, "prompt": f"scraped {i}", "max_tokens": 4})
        assert status == 200, body
    gateway_count = value(scrape(f"{pd_cluster.url}/metrics"), TTFT_COUNT)
    assert gateway_count >= 3

    def target_up() -> bool:
        targets = prometheus.api("/api/v1/targets")["activeTargets"]
        return any(t["health"] == "up" for t in targets)

    wait_until(target_up, f"the gateway target to be up in prometheus\n{prometheus.log()}", timeout=30, interval=0.5)
    got = wait_until(lambda: prometheus.query(TTFT_COUNT) == gateway_count and prometheus.query(TTFT_COUNT),
                     f"{TTFT_COUNT} == {gateway_count} in prometheus", timeout=30, interval=0.5)
    assert got > 0
    # The re-exported fleet gauges arrive through the same scrape.
    assert prometheus.query('count(llm_kv_cache_usage_ratio{role="decode"})') == 1
