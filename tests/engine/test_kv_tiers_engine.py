"""KV tiers below the pool, through the real engine on a tiny Llama (float32): a hit
from the host or disk tier equals a miss token for token, in a pool too small to keep
the working set, across engines (another worker) and across a restart (a new cache on
the same directory); a corrupt, truncated or foreign block, or an unwritable
directory, is a counted miss and the text is still exact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.files import FileTier
from kv_transfer.tiers.record import HEADER_BYTES
from pdserve.common.block_hash import ROOT_DIGEST, block_hash
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BS = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def make_engine(model_dir: Path, num_blocks: int = 64, *, weights: Path | None = None) -> LLMEngine:
    cfg = EngineConfig(model_dir=str(weights or model_dir), dtype="float32",
                       cache=CacheConfig(block_size=BS, num_blocks=num_blocks),
                       scheduler=SchedulerConfig(max_num_batched_tokens=512))
    return LLMEngine(cfg)


def with_tiers(engine: LLMEngine, *tiers: FileTier) -> TieredKVCache:
    cache = TieredKVCache(engine.runner.layout, list(tiers))
    engine.attach_tiers(cache)
    return cache


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (length,), generator=g).tolist() for _ in range(n)]


def run(engine: LLMEngine, ps: list[list[int]]) -> list[tuple[tuple[int, ...], int]]:
    """(tokens, cached tokens) of each prompt, run one after the other."""
    out = []
    for p in ps:
        res = engine.generate([p], GREEDY)[0]
        out.append((res.choices[0].token_ids, res.num_cached_tokens))
    return out


def tokens(results: list[tuple[tuple[int, ...], int]]) -> list[tuple[int, ...]]:
    return [t for t, _ in results]


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.stats().kv_usage == 0.0
    assert engine.block_manager.check_integrity()


def first_key(cache: TieredKVCache, prompt: list[int]) -> bytes:
    return cache.key(block_hash(ROOT_DIGEST, prompt[:BS]))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Callable[[list[list[int]]], list[tuple[int, ...]]]:
    engine = make_engine(model_dir)
    engine.block_manager.enable_prefix_caching = False
    return lambda ps: tokens(run(engine, ps))


def test_host_tier_hit_equals_miss_when_the_pool_cannot_hold_the_working_set(
        model_dir: Path, tmp_path: Path, reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    ps = prompts(6, 5 * BS + 3, seed=1)  # 6 blocks each, 36 blocks in all
    engine = make_engine(model_dir, num_blocks=16)  # room for two prompts' blocks
    cache = with_tiers(engine, FileTier("host", tmp_path / "host", 1 << 26))
    first = run(engine, ps)
    assert cache.flush()
    again = run(engine, ps)  # every prompt's blocks left the pool long ago
    expected = reference(ps)
    assert tokens(first) == tokens(again) == expected
    assert all(cached == 5 * BS for _, cached in again)  # all 5 full blocks, from the tier
    snap = cache.snapshot()
    assert snap.tiers[0].hits == 6 * 5 and snap.loaded_blocks == 30
    assert snap.tiers[0].bytes_read > 0 and snap.tiers[0].bytes_written > 0
    assert engine.stats().num_cached_tokens_hit >= 6 * 5 * BS
    assert engine.scheduler.num_tier_tokens_hit == 6 * 5 * BS
    assert_idle(engine)
    cache.close()


def test_a_second_engine_and_a_restart_hit_what_the_first_wrote(
        model_dir: Path, tmp_path: Path, reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    ps = prompts(3, 4 * BS + 1, seed=2)
    writer = make_engine(model_dir)
    cache = with_tiers(writer, FileTier("disk", tmp_path / "disk", 1 << 26))
    run(writer, ps)
    cache.close()  # the writer flushes, as a worker does on shutdown
    # A new engine and a new cache on the same directory: another worker, or a restart.
    reader = make_engine(model_dir)
    cache2 = with_tiers(reader, FileTier("disk", tmp_path / "disk", 1 << 26))
    got = run(reader, ps)
    assert tokens(got) == reference(ps)
    assert [c for _, c in got] == [4 * BS] * 3
    assert cache2.snapshot().tiers[0].hits == 12
    assert_idle(reader)
    cache2.close()


def test_a_disk_hit_is_promoted_to_the_host_tier(model_dir: Path, tmp_path: Path) -> None:
    ps = prompts(1, 3 * BS + 1, seed=3)
    writer = make_engine(model_dir)
    c1 = with_tiers(writer, FileTier("disk", tmp_path / "disk", 1 << 26))
    run(writer, ps)
    c1.close()
    reader = make_engine(model_dir)
    host = FileTier("host", tmp_path / "host", 1 << 26)
    c2 = with_tiers(reader, host, FileTier("disk", tmp_path / "disk", 1 << 26))
    run(reader, ps)
    assert c2.flush()
    snap = {t.name: t for t in c2.snapshot().tiers}
    assert snap["disk"].hits == 3 and snap["host"].hits == 0
    parent, digests = ROOT_DIGEST, []
    for i in range(3):
        parent = block_hash(parent, ps[0][i * BS:(i + 1) * BS])
        digests.append(parent)
    assert all(host.contains(c2.key(d)) for d in digests)
    assert snap["host"].writes == 3  # promoted copies


def test_another_model_never_hits_the_same_directory(model_dir: Path, tmp_path: Path) -> None:
    from tests.helpers.tiny_models import copy_with_one_weight_changed

    other = copy_with_one_weight_changed(model_dir, tmp_path / "finetune")
    ps = prompts(1, 3 * BS + 1, seed=4)
    a = make_engine(model_dir)
    ca = with_tiers(a, FileTier("host", tmp_path / "host", 1 << 26))
    run(a, ps)
    ca.close()
    b = make_engine(model_dir, weights=other)
    cb = with_tiers(b, FileTier("host", tmp_path / "host", 1 << 26))
    (_, cached), = run(b, ps)
    assert cached == 0 and cb.snapshot().tiers[0].hits == 0
    assert ca.namespace != cb.namespace


def _damage(tier: FileTier, key: bytes, how: str, other: bytes = b"") -> None:
    path = tier.path(key)
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[HEADER_BYTES + len(data) // 3] ^= 0x40  # one flipped bit in the KV bytes
    elif how == "truncated":
        data = data[: len(data) - 100]
    elif how == "foreign":
        data = bytearray(tier.path(other).read_bytes())  # a sound record of another block
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["corrupt", "truncated", "foreign"])
def test_a_damaged_block_is_a_counted_miss_and_the_text_stays_exact(
        model_dir: Path, tmp_path: Path, how: str,
        reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    ps = prompts(2, 4 * BS + 1, seed=5)
    writer = make_engine(model_dir)
    tier = FileTier("host", tmp_path / "host", 1 << 26)
    c1 = with_tiers(writer, tier)
    run(writer, ps)
    c1.close()
    # Damage the second block of prompt 0: blocks 0 is still served, the rest recomputed.
    d0 = block_hash(ROOT_DIGEST, ps[0][:BS])
    key1 = c1.key(block_hash(d0, ps[0][BS:2 * BS]))
    _damage(tier, key1, how, other=first_key(c1, ps[1]))
    reader = make_engine(model_dir)
    c2 = with_tiers(reader, FileTier("host", tmp_path / "host", 1 << 26))
    got = run(reader, ps)
    assert tokens(got) == reference(ps)
    assert [c for _, c in got] == [BS, 4 * BS]
    snap = c2.snapshot().tiers[0]
    assert snap.misses.get(how) == 1
    assert_idle(reader)
    c2.flush()
    # The recomputed block was written back over the damaged one: the next reader hits it.
    third = make_engine(model_dir)
    c3 = with_tiers(third, FileTier("host", tmp_path / "host", 1 << 26))
    assert [c for _, c in run(third, ps[:1])] == [4 * BS]
    assert c3.snapshot().tiers[0].misses.get(how) is None


def test_an_unwritable_directory_misses_and_counts_failed_writes(
        model_dir: Path, tmp_path: Path, reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    ps = prompts(2, 3 * BS + 1, seed=6)
    engine = make_engine(model_dir, num_blocks=8)
    cache = with_tiers(engine, FileTier("disk", blocker / "kv", 1 << 26))
    got = run(engine, ps + ps)
    assert cache.flush()
    assert tokens(got) == reference(ps + ps)
    snap = cache.snapshot().tiers[0]
    assert snap.write_failures >= 6 and snap.writes == 0 and snap.hits == 0
    assert_idle(engine)


def test_a_full_file_system_is_a_counted_write_failure_and_the_text_stays_exact(
        model_dir: Path, tmp_path: Path, reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    """In a process whose files may not grow past 4 KiB (RLIMIT_FSIZE: the kernel refuses
    the write, EFBIG, as a full disk refuses it with ENOSPC), smaller than one block."""
    import json
    import subprocess
    import sys
    import textwrap

    ps = prompts(2, 3 * BS + 1, seed=7)
    code = textwrap.dedent(f"""
        import json, resource, signal, torch
        torch.set_num_threads(1)
        from tests.engine.test_kv_tiers_engine import make_engine, run, with_tiers
        from kv_transfer.tiers.files import FileTier
        from pathlib import Path
        engine = make_engine(Path({str(model_dir)!r}), num_blocks=8)
        cache = with_tiers(engine, FileTier("disk", {str(tmp_path / "kv")!r}, 1 << 26))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        got = run(engine, {ps!r} * 2)
        cache.flush()
        s = cache.snapshot().tiers[0]
        print(json.dumps({{"tokens": [list(t) for t, _ in got], "cached": [c for _, c in got],
                          "failures": s.write_failures, "writes": s.writes, "hits": s.hits}}))
    """)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [tuple(t) for t in out["tokens"]] == reference(ps * 2)
    assert out["failures"] >= 6 and out["writes"] == 0 and out["hits"] == 0
    assert not list((tmp_path / "kv").rglob("*.tmp"))


def test_a_tier_hit_followed_by_a_chunked_prefill_and_a_batch_stays_exact(
        model_dir: Path, tmp_path: Path, reference: Callable[[list[list[int]]], list[tuple[int, ...]]]) -> None:
    """Blocks from the tier, then the rest of the prompt in 24-token chunks, beside other
    prompts in the same steps (some hit, some not)."""
    shared = prompts(1, 3 * BS, seed=8)[0]
    tails = prompts(4, 3 * BS + 5, seed=9)
    ps = [shared + t for t in tails]
    writer = make_engine(model_dir)
    c1 = with_tiers(writer, FileTier("host", tmp_path / "host", 1 << 26))
    run(writer, [shared + [1]])
    c1.close()
    cfg = EngineConfig(model_dir=str(model_dir), dtype="float32", cache=CacheConfig(block_size=BS, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_batched_tokens=24))
    engine = LLMEngine(cfg)
    c2 = with_tiers(engine, FileTier("host", tmp_path / "host", 1 << 26))
    results = engine.generate(ps + [tails[0]], GREEDY)  # all admitted together, chunked
    assert [r.choices[0].token_ids for r in results] == reference(ps + [tails[0]])
    # The first prompt admitted loads the shared blocks from the tier; the others, admitted
    # once those are registered, or in the same step, hit the pool or the tier.
    assert all(r.num_cached_tokens == 3 * BS for r in results[:4]) and results[4].num_cached_tokens == 0
    assert c2.snapshot().tiers[0].hits >= 3
    assert_idle(engine)
    c2.close()
