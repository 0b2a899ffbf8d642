"""Helpers for the observability acceptance tests: scraping and parsing Prometheus
text, polling with a bound, reading SSE streams with timestamps, and finding JSON
payloads in process logs."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.e2e.cluster import wait_for

MODEL = "pdserve-tiny-llama"


def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.status == 200
        return str(r.read().decode())


def families(text: str) -> dict[str, Any]:
    """Metric families of a text exposition by name (the parser strips `_total`)."""
    return {fam.name: fam for fam in text_string_to_metric_families(text)}


def samples(text: str, name: str, **labels: str) -> list[Sample]:
    """Every sample called `name` whose labels include `labels`."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out.append(s)
    return out


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the matching samples (0.0 when there are none)."""
    return sum(s.value for s in samples(text, name, **labels))


def bucket_bounds(text: str, name: str) -> list[float]:
    """The finite `le` bounds of histogram `name`, in exposition order."""
    bounds = [s.labels["le"] for s in samples(text, f"{name}_bucket")]
    assert bounds and bounds[-1] == "+Inf", bounds
    return [float(b) for b in bounds[:-1]]


def wait_until(cond: Callable[[], Any], what: str, timeout: float = 20.0, interval: float = 0.1) -> Any:
    """`wait_for` (tests/e2e/cluster.py) through an endpoint that may not answer yet."""
    return wait_for(cond, what, timeout, interval, tolerate=(OSError, AssertionError, ValueError))


@dataclass
class Stream:
    """One SSE response read to the end: its events, when each arrived, and the status."""

    status: int = 0
    events: list[Any] = field(default_factory=list)
    first_at: float | None = None
    done_at: float | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(ch.get("text", "") for e in self.events if isinstance(e, dict) for ch in e.get("choices", []))

    @property
    def completion_tokens(self) -> int | None:
        for e in self.events:
            if isinstance(e, dict) and e.get("usage"):
                return int(e["usage"]["completion_tokens"])
        return None

    @property
    def finish_reasons(self) -> list[str]:
        return [ch["finish_reason"] for e in self.events if isinstance(e, dict)
                for ch in e.get("choices", []) if ch.get("finish_reason")]


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 60.0) -> Any:
    data = json.dumps(body).encode()
    return urllib.request.Request(url, data=data, method="POST",
                                  headers={"Content-Type": "application/json", **(headers or {})})


def stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 120.0,
           started: Callable[[], None] | None = None) -> Stream:
    """POST a streaming request and read it to the end; `started` runs after the first event."""
    out = Stream()
    with urllib.request.urlopen(post(url, body, headers), timeout=timeout) as r:
        out.status = r.status
        out.headers = {k.lower(): v for k, v in r.headers.items()}
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].decode()
            if payload == "[DONE]":
                out.done_at = time.monotonic()
                out.events.append(payload)
                continue
            out.events.append(json.loads(payload))
            if out.first_at is None:
                out.first_at = time.monotonic()
                if started is not None:
                    started()
    return out


@contextlib.contextmanager
def held_stream(url: str, body: dict[str, Any], timeout: float = 120.0) -> Iterator[int]:
    """POST a streaming request, read until its first token event, and hold the stream
    open for the body of the `with`; leaving it disconnects (the gateway aborts the
    request). Yields the number of events read so far."""
    with urllib.request.urlopen(post(url, body), timeout=timeout) as r:
        assert r.status == 200
        for raw in r:
            if raw.startswith(b"data: ") and raw.strip() != b"data: [DONE]":
                break
        else:
            raise AssertionError("the stream ended before its first token")
        yield 1


def json_payloads(log_text: str) -> list[dict[str, Any]]:
    """Every JSON object found in a log, one per line: a whole-line JSON record (the
    gateway's JsonFormatter) or a JSON message after a plain-text prefix."""
    out = []
    for line in log_text.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            obj = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out
