"""`--kv-events-config`: vLLM's `KVEventsConfig` JSON, parsed into a frozen dataclass.

    {"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557",
     "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv-events"}

The keys and their meaning are vLLM's (vllm/config/kv_events.py); unknown keys are
errors. Two differences, both for safety:

- the default endpoint is `tcp://127.0.0.1:5557` (vLLM's is `tcp://*:5557`): the events
  carry the token ids of users' prompts, so they stay on this host unless asked;
- where vLLM binds only a wildcard or ipc endpoint and *connects* to any other host,
  pdserve also binds a loopback one (`tcp://127.0.0.1:PORT`: a consumer on this host
  connects to it). Any other host is connected to, as vLLM does.

An endpoint off loopback (a wildcard, another host) needs the worker's `--insecure`
(docs/security.md): the stream has no CURVE, since vLLM's consumers speak none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from pdserve.common.hosts import is_loopback
from pdserve.common.json_flags import json_object, to_json

PUBLISHERS = ("null", "zmq")
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
_TCP = re.compile(r"tcp://(\[[^\]]*\]|[^:/]+):(\d+)")
_WILDCARDS = ("*", "0.0.0.0", "[::]", "::")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (vLLM's rule)
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None  # a ROUTER that resends buffered batches on request
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: a slower subscriber loses batches
    max_queue_size: int = 100_000  # batches queued for the publisher thread; more are dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None:
                endpoint_host(endpoint)  # refuses what is neither tcp://HOST:PORT nor ipc://PATH

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def exposed(self) -> list[str]:
        """The endpoints a peer off this host could reach (they need `--insecure`)."""
        if not self.enabled:
            return []
        return [e for e in (self.endpoint, self.replay_endpoint) if e is not None and not is_local(e)]

    def for_worker(self, index: int) -> KVEventsConfig:
        """The config of the `index`-th worker of `pdserve up`: its ports offset by
        `index` (vLLM's rule for data-parallel ranks), an ipc path suffixed."""
        if index == 0:
            return self
        return replace(self, endpoint=offset_endpoint(self.endpoint, index),
                       replay_endpoint=None if self.replay_endpoint is None
                       else offset_endpoint(self.replay_endpoint, index))

    def to_json(self) -> str:
        """The JSON `from_json` reads back (for handing the config to a child process)."""
        return to_json(self)

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse `--kv-events-config`; ValueError with one line naming what is wrong."""
        raw = json_object(text, cls)
        for key, value in raw.items():
            want: type = bool if key == "enable_kv_cache_events" else (
                int if key in ("buffer_steps", "hwm", "max_queue_size") else str)
            if value is None and key in ("publisher", "replay_endpoint"):
                continue
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"{key} must be a{'n integer' if want is int else ' ' + want.__name__}")
        return cls(**raw)


def endpoint_host(endpoint: str) -> str:
    """The host of `tcp://HOST:PORT` ('' for `ipc://PATH`); ValueError for anything else."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return ""
    m = _TCP.fullmatch(endpoint)
    if m is None or not 0 <= int(m.group(2)) <= 65535:
        raise ValueError(f"endpoint must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    return m.group(1)


def is_local(endpoint: str) -> bool:
    """An ipc path or a loopback tcp address: only this host's users can connect."""
    host = endpoint_host(endpoint)
    return host == "" or is_loopback(host)  # a wildcard or another name may reach off-host


def binds(endpoint: str) -> bool:
    """Whether the PUB (or ROUTER) binds `endpoint` (else it connects to a subscriber
    that bound it): ipc, a wildcard or a loopback address bind."""
    host = endpoint_host(endpoint)
    return host == "" or host in _WILDCARDS or is_local(endpoint)


def offset_endpoint(endpoint: str, index: int) -> str:
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-{index}"
    m = _TCP.fullmatch(endpoint)
    assert m is not None  # checked by KVEventsConfig
    port = int(m.group(2))
    return f"tcp://{m.group(1)}:{port + index}" if port else endpoint
