"""The plain HTTP client of the bench scripts that time single requests against a server
themselves (bench/multiturn.py, bench/simulate_check.py) rather than through the load
generator: which model it serves, one greedy streamed completion as the client saw it, and
clients run at once, a thread each.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


def served_model(url: str) -> str:
    """The model a server at `url` serves (its first in /v1/models)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


class Streamed(NamedTuple):
    """One streamed completion as its client saw it."""

    first_s: float  # from the request to the first text
    last_s: float  # to the last text
    text: str
    usage: dict[str, Any]  # the server's (include_usage); {} without one


def stream_completion(url: str, model: str, prompt: str | list[int], max_tokens: int) -> Streamed:
    """A greedy streamed completion of `max_tokens` (ignore_eos) from `url`; an HTTP error
    or a stream without text raises RuntimeError."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start, first, last, text = time.perf_counter(), None, 0.0, []
    usage: dict[str, Any] = {}
    try:
        r = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:300]!r}") from None
    with r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if chunk := "".join(c.get("text") or "" for c in event.get("choices") or []):
                last = time.perf_counter() - start
                first = last if first is None else first
                text.append(chunk)
    if first is None:
        raise RuntimeError("a completion streamed no text")
    return Streamed(first, last, "".join(text), usage)


def at_once(fn: Callable[[T], object], items: Iterable[T]) -> None:
    """`fn(item)` for every item at once, each in a thread of its own; once all are done,
    the first exception any of them raised is raised here."""
    errors: list[BaseException] = []

    def run(item: T) -> None:
        try:
            fn(item)
        except BaseException as e:  # raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
