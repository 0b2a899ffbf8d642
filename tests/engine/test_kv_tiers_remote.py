"""The remote tier against a real Redis (Debian's redis-server, started here): a block
one engine wrote is a hit for another engine that shares only the Redis (another
host), token for token; Redis returning garbage or going down is a counted miss and
the text stays exact, and a dead server does not make every request wait."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.remote import PREFIX, RedisTier
from pdserve.common.block_hash import ROOT_DIGEST, block_hash
from tests.engine.test_kv_tiers_engine import (
    BS,
    GREEDY,
    assert_idle,
    make_engine,
    prompts,
    run,
    tokens,
)
from tests.helpers.redis_server import redis_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as (url, _):
        yield url


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Callable[[list[list[int]]], list[tuple[int, ...]]]:
    engine = make_engine(model_dir)
    engine.block_manager.enable_prefix_caching = False
    return lambda ps: tokens(run(engine, ps))


def remote_engine(model_dir: Path, url: str) -> tuple[object, TieredKVCache]:
    engine = make_engine(model_dir)
    cache = TieredKVCache(engine.runner.layout, [RedisTier(url, retry_s=60.0)])
    engine.attach_tiers(cache)
    return engine, cache


def test_a_block_written_by_one_engine_is_a_remote_hit_for_another(
        model_dir: Path, redis_url: str, reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    ps = prompts(2, 4 * BS + 5, seed=11)
    a, ca = remote_engine(model_dir, redis_url)
    run(a, ps)  # type: ignore[arg-type]
    ca.close()
    b, cb = remote_engine(model_dir, redis_url)
    got = run(b, ps)  # type: ignore[arg-type]
    assert tokens(got) == reference(ps)
    assert [c for _, c in got] == [4 * BS, 4 * BS]
    snap = cb.snapshot().tiers[0]
    assert snap.name == "remote" and snap.hits == 8 and snap.bytes_read > 0
    assert_idle(b)  # type: ignore[arg-type]
    cb.close()


def test_garbage_from_redis_is_a_corrupt_miss(
        model_dir: Path, redis_url: str, reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    import redis

    ps = prompts(1, 3 * BS + 2, seed=12)
    a, ca = remote_engine(model_dir, redis_url)
    run(a, ps)  # type: ignore[arg-type]
    ca.close()
    first = ca.key(block_hash(ROOT_DIGEST, ps[0][:BS]))
    redis.Redis.from_url(redis_url).set(PREFIX + first.hex().encode(), b"\x00garbage" * 50)
    b, cb = remote_engine(model_dir, redis_url)
    got = run(b, ps)  # type: ignore[arg-type]
    assert tokens(got) == reference(ps) and got[0][1] == 0
    assert cb.snapshot().tiers[0].misses.get("corrupt") == 1
    cb.close()


def test_redis_down_is_a_miss_counted_once_per_retry_window(
        model_dir: Path, tmp_path: Path, reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    with redis_server(tmp_path) as (url, proc):
        b, cb = remote_engine(model_dir, url)
        proc.kill()
        proc.wait()
    ps = prompts(3, 3 * BS + 2, seed=13)
    t0 = time.monotonic()
    got = run(b, ps)  # type: ignore[arg-type]
    assert tokens(got) == reference(ps) and all(c == 0 for _, c in got)
    snap = cb.snapshot().tiers[0]
    assert snap.misses.get("unavailable", 0) >= 1 and snap.hits == 0
    # One failed connection opens the retry window; later lookups do not wait on it.
    assert time.monotonic() - t0 < 30
    assert cb.flush()
    assert cb.snapshot().tiers[0].write_failures >= 1
    cb.close()


def test_redis_going_down_while_a_read_waits_is_an_unavailable_miss_and_a_recompute(
        model_dir: Path, tmp_path: Path, reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    """The blocks exist when the prompt is admitted (the existence check passes), the
    server dies while the read is held off the loop: the read finds nothing, the prompt
    is recomputed whole, exact, and the miss is counted."""
    from tests.engine.test_kv_tiers_async import GATE_S, GatedTier

    ps = prompts(1, 3 * BS + 2, seed=14)
    with redis_server(tmp_path) as (url, proc):
        a, ca = remote_engine(model_dir, url)
        run(a, ps)  # type: ignore[arg-type]
        ca.close()
        b = make_engine(model_dir)
        tier = GatedTier(RedisTier(url, retry_s=60.0))
        cb = TieredKVCache(b.runner.layout, [tier])
        b.attach_tiers(cb)
        b.add_request("r", ps[0], GREEDY)
        b.step()  # parked: the read waits at the gate
        assert tier.reading.wait(GATE_S)
        proc.kill()
        proc.wait()
        tier.gate.set()
        got = []
        while b.has_unfinished():
            outs = b.step()
            if not outs and b.tier_reads is not None:
                b.tier_reads.wait_any(GATE_S)
            for out in outs:
                got += out.outputs[0].token_ids
                cached = out.num_cached_tokens
    assert tuple(got) == reference(ps)[0] and cached == 0
    snap = cb.snapshot().tiers[0]
    assert snap.misses.get("unavailable") == 1 and snap.hits == 0
    assert_idle(b)
    cb.close()


class CountingProxy:
    """A TCP proxy in front of the Redis that counts the client's writes it forwards:
    a request sent and its answer awaited before the next is one write per command, a
    pipeline is one (or a few) writes for all of them."""

    def __init__(self, port: int) -> None:
        import socket
        import threading

        self.writes = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: object, dst: object, count: bool) -> None:
        import socket

        assert isinstance(src, socket.socket) and isinstance(dst, socket.socket)
        try:
            while chunk := src.recv(1 << 16):
                if count:
                    with self._lock:
                        self.writes += 1
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def test_the_existence_check_asks_redis_once_for_the_whole_prefix(redis_url: str, tmp_path: Path) -> None:
    """`present` runs on the step loop: a prefix of 64 blocks that only Redis holds is
    one pipelined round trip, not 64 (through a proxy that counts the client's writes;
    64 single checks through it count 64, so the count measures round trips)."""
    import redis

    from kv_transfer.tiers.files import FileTier
    from pdserve.common.kv_layout import KVLayout

    layout = KVLayout("cfg", 2, 2, 8, 4, "float32", weights="w")
    digests = [bytes([i]) * 32 for i in range(64)]
    host = FileTier("host", tmp_path / "host", 1 << 30)
    direct = TieredKVCache(layout, [RedisTier(redis_url)])
    for d in digests[:60]:  # the first 60 in Redis, of which block 5 in the host tier too
        assert direct.offer(d, np.full(direct.payload_bytes, 1, np.uint8))
    assert direct.flush()
    direct.close()
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = CountingProxy(port)
    remote = RedisTier(f"redis://127.0.0.1:{proxy.port}/0")
    cache = TieredKVCache(layout, [host, remote])
    try:
        assert host.put(cache.key(digests[5]), redis.Redis.from_url(redis_url).get(
            PREFIX + cache.key(digests[5]).hex().encode()))
        assert remote.contains(cache.key(digests[0]))  # connected: the connection's own setup is not counted
        before = proxy.writes
        assert cache.present(digests) == 60
        pipelined = proxy.writes - before
        before = proxy.writes
        assert all(remote.contains(cache.key(d)) for d in digests[:60])
        single = proxy.writes - before
        assert single == 60 and pipelined <= 3, (pipelined, single)
        assert cache.present(digests[60:]) == 0 and cache.present([]) == 0
        assert remote.stats.snapshot().misses == {}  # absent blocks are not misses of the check
    finally:
        cache.close()
        proxy.close()
