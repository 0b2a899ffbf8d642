"""`--dtype auto` end to end: workers started with it serve in what `auto` resolves to
on this host (bfloat16 on a CPU with AVX-512 BF16 or AMX, float32 otherwise),
register that dtype's compatibility hash, ship their KV in it over either transport,
and their greedy output equals the single-process engine run explicitly in that
dtype. One short stream at a time: token-exact equality across batch compositions
holds in float32 only (tests/e2e/cluster.py, DTYPE)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.engine.core.config import CacheConfig, EngineConfig
from tests.e2e.cluster import AUTO_DTYPE, Cluster, http, running_cluster
from tests.e2e.conftest import Reference

TRANSPORTS = ("tcp", "shm")
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "1 2 3 4 5 6"]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir: Path = tmp_path_factory.mktemp(f"auto-{request.param}")
    with running_cluster(log_dir, {"prefill": 1, "decode": 1}, "--kv-transport", request.param,
                         "--dtype", "auto") as c:
        yield c


@pytest.fixture(scope="module")
def auto_reference(model_dir: Path) -> Reference:
    from gateway.tokenizer import Tokenizer
    from pdserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model_dir=str(model_dir), dtype=AUTO_DTYPE, num_threads=1, cache=CacheConfig(num_blocks=256))
    return Reference(LLMEngine(cfg), Tokenizer.from_model_dir(model_dir), model_dir.name)


def test_workers_register_the_resolved_dtypes_layout(cluster: Cluster, model_dir: Path) -> None:
    from pdserve.engine.runner.model_runner import ModelRunner

    def compat(dtype: str) -> str:
        return ModelRunner.layout_for(EngineConfig(model_dir=str(model_dir), dtype=dtype)).compat_hash

    hashes = {w["compat_hash"] for w in cluster.worker_list()}
    assert hashes == {compat(AUTO_DTYPE)}
    assert AUTO_DTYPE == "float32" or compat("float32") not in hashes


def test_greedy_completions_equal_the_engine_in_the_resolved_dtype(
    cluster: Cluster, auto_reference: Reference
) -> None:
    ref = auto_reference
    for prompt in PROMPTS:
        want = ref.generate(ref.completion_ids(prompt), max_tokens=MAX_TOKENS, temperature=0.0)[0]
        status, out = http("POST", f"{cluster.url}/v1/completions",
                           {"model": ref.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert status == 200, out
        assert out["choices"][0]["text"] == ref.text(want)
    cluster.wait_idle()
