"""`--kv-cache-dtype fp8|int8` through real processes: 1 prefill + 1 decode worker
give the same greedy completions as a colocated worker, and the prefill worker's
`llm_kv_transfer_bytes_total` shows half the bf16 bytes per request (plus the
scales: 4 bytes per block, layer, K/V and KV head). A worker of another KV dtype is
refused at registration (in the fp8 case, beside the fp8 workers). Workers compute in bfloat16; one stream at a time, so
batch composition cannot part the streams (tests/e2e/cluster.py, DTYPE)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.kv_layout import KVLayout
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.runner.model_runner import ModelRunner
from tests.e2e.cluster import Cluster, http, metric_value, running_cluster, worker_metrics

PROMPTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps.",
           "Once upon a time, in a land far away, there lived a king who had three daughters.",
           "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
MAX_TOKENS = 16
DTYPE = ("--dtype", "bfloat16")
BYTES = "llm_kv_transfer_bytes_total"


def _complete(c: Cluster, prompt: str) -> tuple[str, int]:
    status, out = http("POST", f"{c.url}/v1/completions",
                       {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, out
    return out["choices"][0]["text"], int(out["usage"]["prompt_tokens"])


def _layout(model_dir: Path, kv: str) -> KVLayout:
    return ModelRunner.layout_for(EngineConfig(model_dir=str(model_dir), dtype="bfloat16",
                                               kv_cache_dtype=kv, cache=CacheConfig()))


def _block_bytes(model_dir: Path, kv: str) -> int:
    layout = _layout(model_dir, kv)
    return layout.block_bytes_per_layer * layout.num_layers


def _shipped(c: Cluster, want: int) -> int:
    """The prefill worker's KV bytes, once every transfer is accounted (`want`)."""
    prefill = next(w for w in c.worker_list() if w["role"] == "prefill")
    c._wait(lambda: metric_value(worker_metrics(prefill), BYTES) >= want, f"{want} KV bytes shipped")
    return int(metric_value(worker_metrics(prefill), BYTES))


def _blocks(prompt_tokens: list[int]) -> int:
    return sum(-(-n // 16) for n in prompt_tokens)


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[int], int]:
    """Prompt lengths and bytes shipped with the bf16 KV cache (its cluster then stops)."""
    with running_cluster(tmp_path_factory.mktemp("bf16"), {"prefill": 1, "decode": 1}, *DTYPE) as c:
        lengths = [_complete(c, p)[1] for p in PROMPTS]
        c.wait_idle()
        return lengths, _shipped(c, 1)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_disaggregated_equals_colocated_and_ships_half_the_bytes(
    log_dir: Path, model_dir: Path, bf16_run: tuple[list[int], int], kv: str
) -> None:
    lengths, bf16_bytes = bf16_run
    assert bf16_bytes == _blocks(lengths) * _block_bytes(model_dir, "auto")
    c = Cluster(log_dir)
    try:
        c.start_gateway(wait=False)
        c.add_worker("worker", *DTYPE, "--kv-cache-dtype", kv)
        c.wait_roles(colocated=1)
        colocated = [_complete(c, p) for p in PROMPTS]
        for role in ("prefill", "decode"):
            c.add_worker(role, *DTYPE, "--kv-cache-dtype", kv)
        c.wait_roles(colocated=1, prefill=1, decode=1)  # the gateway now disaggregates
        disaggregated = [_complete(c, p) for p in PROMPTS]
        assert disaggregated == colocated
        assert [n for _, n in colocated] == lengths
        c.wait_idle()
        want = _blocks(lengths) * _block_bytes(model_dir, kv)
        shipped = _shipped(c, want)
        assert shipped == want  # every prompt block went over the KV plane, scales included
        # Exactly half of bf16, plus one float32 scale per (block, layer, K/V, KV head):
        # 2 / (block_size x head_dim) of the bf16 bytes (0.4% at head_dim 32).
        layout = _layout(model_dir, kv)
        scales = _blocks(lengths) * layout.num_layers * 2 * layout.num_kv_heads * 4
        assert shipped == bf16_bytes // 2 + scales
        assert shipped / bf16_bytes <= 0.5 + 2 / (16 * layout.head_dim)
        if kv == "fp8":
            _a_worker_of_another_kv_dtype_is_refused(c)
    finally:
        c.stop()


def _a_worker_of_another_kv_dtype_is_refused(c: Cluster) -> None:
    """A decode worker with the bf16 KV cache next to the fp8 ones is refused."""
    registered = sorted(w["id"] for w in c.worker_list())
    proc = c.add_worker("decode", *DTYPE, "--worker-id", "bf16")
    assert c.gateway is not None
    log = c.gateway.log_path
    c._wait(lambda: "refused worker bf16: compat_hash" in log.read_text(errors="replace"),
            "the gateway refusing the bf16-KV decode worker")
    assert "KV-cache dtype" in log.read_text(errors="replace")  # the refusal says what to match
    assert sorted(w["id"] for w in c.worker_list()) == registered and proc.alive()
