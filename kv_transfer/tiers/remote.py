"""The remote tier: records in a Redis shared by the servers of several hosts
(`--kv-remote-url redis://HOST:PORT/DB`), as LMCache's Redis backend does.

Keys are `pdserve:kv:<64 hex>`, values whole records (tiers/record.py), so whatever
Redis returns is checked like any other tier's bytes. The bound is Redis's own
(`maxmemory` with an LRU policy on the server); every record is also written with a
TTL so an unbounded server does not keep blocks forever.

Redis down, slow or answering garbage is a miss: commands run with short timeouts,
and after a failure the tier stays off for `retry_s` (no request waits on a dead
server twice in a row), then tries again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kv_transfer.tiers.base import TierStats
from kv_transfer.tiers.record import MissReason

PREFIX = b"pdserve:kv:"


def server_name(url: str) -> str:
    """`url` without its credentials: redis://user:secret@h:6379/0 -> redis://h:6379/0."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{scheme}{sep}{netloc.rpartition('@')[2]}{slash}{path}"


class RedisTier:
    """Blocks in the Redis at `url` (needs the `redis` package: pip install pdserve[redis])."""

    name = "remote"

    def __init__(self, url: str, *, timeout_s: float = 0.5, retry_s: float = 5.0,
                 ttl_s: int = 7 * 24 * 3600) -> None:
        try:
            import redis
        except ImportError as e:  # the CLI checks this before a worker starts
            raise RuntimeError("--kv-remote-url needs the redis package (pip install 'pdserve[redis]')") from e
        self.url = url
        self.location = server_name(url)
        self.capacity = 0  # Redis's maxmemory
        self.stats = TierStats(self.name)
        self.retry_s = retry_s
        self.ttl_s = ttl_s
        self._client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                                 socket_connect_timeout=timeout_s)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._down_until = 0.0
        self._lock = threading.Lock()

    def _up(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def _failed(self) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_s

    def get(self, key: bytes, into: memoryview | None = None) -> bytes | None:
        # `into` is not used: the client hands back its own bytes.
        if not self._up():
            self.stats.miss(MissReason.UNAVAILABLE)
            return None
        try:
            value = self._client.get(PREFIX + key.hex().encode())
        except self._errors as e:
            self._failed()
            self.stats.miss(MissReason.UNAVAILABLE, f"{self.url}: {e}")
            return None
        if value is None:
            self.stats.miss(MissReason.ABSENT)
            return None
        if not isinstance(value, bytes):
            self.stats.miss(MissReason.CORRUPT, f"{self.url} returned {type(value).__name__}")
            return None
        return value

    def contains(self, key: bytes) -> bool:
        if not self._up():
            return False
        try:
            return bool(self._client.exists(PREFIX + key.hex().encode()))
        except self._errors:
            self._failed()
            return False

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """One pipelined round trip of EXISTS for all `keys` (the step loop waits on it)."""
        if not keys:
            return []
        if not self._up():
            self.stats.miss(MissReason.UNAVAILABLE)
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(PREFIX + key.hex().encode())
            answers = pipe.execute()
        except self._errors as e:
            self._failed()
            self.stats.miss(MissReason.UNAVAILABLE, f"{self.url}: {e}")
            return [False] * len(keys)
        if len(answers) != len(keys):  # a server answering garbage: none of them
            self.stats.miss(MissReason.UNAVAILABLE, f"{self.url}: {len(answers)} answers to {len(keys)} EXISTS")
            return [False] * len(keys)
        return [a == 1 for a in answers]

    def discard(self, key: bytes) -> None:
        if self._up():
            try:
                self._client.delete(PREFIX + key.hex().encode())
            except self._errors:
                self._failed()

    def put(self, key: bytes, record: bytes) -> bool:
        if not self._up():
            self.stats.write_failed(f"{self.url} is unavailable")
            return False
        try:
            self._client.set(PREFIX + key.hex().encode(), record, ex=self.ttl_s)
        except self._errors as e:
            self._failed()
            self.stats.write_failed(f"{self.url}: {e}")
            return False
        self.stats.wrote(len(record))
        return True

    def watch_evictions(self, sink: Callable[[list[bytes]], None]) -> bool:
        return False  # Redis evicts (maxmemory, TTL) on its own: this process never sees it

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self._client.close()
