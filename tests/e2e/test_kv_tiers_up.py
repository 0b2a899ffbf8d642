"""KV tiers through a real `pdserve up` (gateway and workers as processes, float32):
conversations that outgrow the workers' pools come back as tier hits, token for token
equal to the single-process reference, colocated and 1P+1D; a restart on the same
--kv-offload-dir hits the disk; a server killed with SIGKILL, a corrupt block file and
a Redis that is down each still give the right text, with the metric to show it."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import ADMIN, DTYPE, http, wait_for
from tests.e2e.conftest import Reference
from tests.e2e.up_process import pdserve_up
from tests.helpers.redis_server import redis_server

BLOCK = 8
POOL_BLOCKS = "24"  # 192 tokens: two of the prompts below at most
MAX_TOKENS = 8
WORDS = ("river", "stone", "lantern", "copper", "meadow", "harbor", "violet", "engine", "quiet", "orbit")


def prompt(i: int) -> str:
    """~90 tokens, distinct from the first word on."""
    return " ".join(f"{WORDS[(i * 7 + j * 3) % len(WORDS)]}{i}" for j in range(45))


@contextlib.contextmanager
def up(log: Path, *extra: str, kill: bool = False) -> Iterator[str]:
    """`pdserve up` with small pools; its URL. `kill`: end it with SIGKILL (no flush)."""
    with pdserve_up(log, "--num-blocks", POOL_BLOCKS, "--threads", "1", "--block-size", str(BLOCK), "--dtype", DTYPE,
                    "--max-model-len", "512", *extra, kill=kill) as served:
        yield served.url


def complete(url: str, text: str) -> tuple[str, int]:
    """(text, usage.prompt_tokens_details.cached_tokens) of a greedy completion."""
    status, body = http("POST", f"{url}/completions", {
        "model": MODEL[0], "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"], int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def tier_metric(url: str, name: str, **labels: str) -> float:
    """Sum over the workers of `name` samples carrying `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    base = url.removesuffix("/v1")
    status, body = http("GET", f"{base}/v1/workers", timeout=5, headers=ADMIN)
    assert status == 200, body
    total = 0.0
    for w in body["data"]:
        with urllib.request.urlopen(f"http://127.0.0.1:{w['metrics_port']}/metrics", timeout=5) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
    return total


def written_down(url: str, tier: str) -> bool:
    """The tier took writes and the worker's write queue is empty."""
    return (tier_metric(url, "llm_kv_tier_written_bytes_total", tier=tier) > 0
            and tier_metric(url, "llm_kv_tier_queued_writes") == 0)


@pytest.fixture()
def shm_dir() -> Iterator[Path]:
    d = Path("/dev/shm") / f"pdserve-kv-test-{os.getpid()}-{secrets.token_hex(4)}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


MODEL = [""]  # the served model's name (the reference's)


@pytest.fixture(scope="module")
def expected(reference: Reference) -> dict[int, str]:
    MODEL[0] = reference.model_name
    return {i: reference.text(reference.generate(reference.completion_ids(prompt(i)), max_tokens=MAX_TOKENS,
                                                 temperature=0.0)[0]) for i in range(6)}


def test_colocated_host_tier_then_a_restart_on_the_disk_tier(
        tmp_path: Path, shm_dir: Path, expected: dict[int, str]) -> None:
    disk = tmp_path / "kv"
    tiers = ("--kv-offload-memory", "64MiB", "--kv-offload-memory-dir", str(shm_dir), "--kv-offload-dir", str(disk))
    with up(tmp_path / "up1.log", "--colocated", *tiers) as url:
        for i in range(6):  # ~70 blocks through a 24-block pool
            assert complete(url, prompt(i)) == (expected[i], 0)
        wait_for(lambda: written_down(url, "disk"), "write-down")
        text, cached = complete(url, prompt(0))  # its blocks left the pool long ago
        assert text == expected[0] and cached >= 10 * BLOCK
        assert tier_metric(url, "llm_kv_tier_hits_total", tier="host") >= cached // BLOCK
    shutil.rmtree(shm_dir)  # the host tier is gone (a reboot): only the disk remains
    with up(tmp_path / "up2.log", "--colocated", *tiers) as url:
        for i in (3, 1):
            text, cached = complete(url, prompt(i))
            assert text == expected[i] and cached >= 10 * BLOCK
        assert tier_metric(url, "llm_kv_tier_hits_total", tier="disk") >= 20


def test_1p1d_hits_the_tiers_a_colocated_server_wrote_after_a_kill_9(
        tmp_path: Path, shm_dir: Path, expected: dict[int, str]) -> None:
    disk = tmp_path / "kv"
    tiers = ("--kv-offload-memory", "64MiB", "--kv-offload-memory-dir", str(shm_dir), "--kv-offload-dir", str(disk))
    with up(tmp_path / "up1.log", "--colocated", *tiers, kill=True) as url:
        for i in (0, 1, 2):
            assert complete(url, prompt(i))[0] == expected[i]
        wait_for(lambda: written_down(url, "disk"), "write-down")
    # SIGKILLed: whatever it was writing is a temporary file nobody reads.
    with up(tmp_path / "up2.log", "--prefill", "1", "--decode", "1", *tiers) as url:
        got = [complete(url, prompt(i)) for i in (0, 1, 2, 4)]
        assert [t for t, _ in got] == [expected[i] for i in (0, 1, 2, 4)]
        assert got[3][1] == 0  # never seen: a miss
        assert all(c >= 10 * BLOCK for _, c in got[:3])  # from the tiers the killed server wrote
        assert tier_metric(url, "llm_kv_tier_hits_total") >= 30


def test_a_corrupt_block_file_and_a_dead_redis_are_counted_misses(
        tmp_path: Path, expected: dict[int, str]) -> None:
    disk = tmp_path / "kv"
    with redis_server(tmp_path) as (redis_url, redis_proc):
        tiers = ("--kv-offload-dir", str(disk), "--kv-remote-url", redis_url)
        with up(tmp_path / "up1.log", "--colocated", *tiers) as url:
            assert complete(url, prompt(5))[0] == expected[5]
            wait_for(lambda: written_down(url, "remote") and written_down(url, "disk"), "write-down")
        redis_proc.kill()
        redis_proc.wait()
        files = sorted(disk.rglob("*.kv"))
        assert files
        for f in files:  # every block on disk damaged; Redis is gone
            data = bytearray(f.read_bytes())
            data[-5] ^= 0xFF
            f.write_bytes(bytes(data))
        with up(tmp_path / "up2.log", "--colocated", *tiers) as url:
            assert complete(url, prompt(5)) == (expected[5], 0)
            assert tier_metric(url, "llm_kv_tier_misses_total", tier="disk", reason="corrupt") == 1
            assert tier_metric(url, "llm_kv_tier_misses_total", tier="remote", reason="unavailable") >= 1


def test_1p1d_decode_worker_takes_a_returning_prompt_from_the_host_tier(
        tmp_path: Path, shm_dir: Path, expected: dict[int, str]) -> None:
    tiers = ("--kv-offload-memory", "64MiB", "--kv-offload-memory-dir", str(shm_dir))
    with up(tmp_path / "up1.log", "--prefill", "1", "--decode", "1", *tiers) as url:
        for i in range(6):  # both pools (24 blocks each) evict the first prompts
            assert complete(url, prompt(i)) == (expected[i], 0)
        wait_for(lambda: written_down(url, "host"), "write-down")
        assert tier_metric(url, "llm_kv_tier_hits_total", role="decode") == 0
        tiered, cached = complete(url, prompt(0))
        assert tiered == expected[0] and cached >= 10 * BLOCK  # the prefill worker's hit
        # The decode worker reserved only the suffix: its reused prefix came from the host tier.
        assert tier_metric(url, "llm_kv_tier_hits_total", tier="host", role="decode") >= cached // BLOCK
    with up(tmp_path / "up2.log", "--prefill", "1", "--decode", "1") as url:  # no tiers
        assert complete(url, prompt(0)) == (tiered, 0)
