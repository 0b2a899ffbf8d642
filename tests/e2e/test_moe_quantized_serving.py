"""A weight-quantized MoE model (Qwen3-MoE, int4 experts and attention) served as real
processes: 1 prefill + 1 decode equals a colocated worker equals the single-process
engine on a float checkpoint holding the int4-dequantized weights (experts included),
token for token, at several prompt lengths; every KV block comes back."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.common.sampling_params import SamplingParams
from tests.e2e.cluster import DTYPE, Cluster, http
from tests.e2e.test_moe_serving import _servable
from tests.engine.test_hf_equivalence import prompt_of
from tests.helpers.quant_checkpoints import write_dequantized

SCHEME = "int4"
LENGTHS = (5, 16, 37)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: Callable[..., Path], model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Cluster, Cluster]]:
    """(model, a 1P+1D cluster, a colocated one), started side by side and stopped together."""
    tmp = tmp_path_factory.mktemp("moe-quant")
    d = _servable(tiny_model_dir("qwen3_moe"), model_dir, tmp / "qwen3_moe")
    roles = {"pd": ("prefill", "decode"), "co": ("worker",)}
    for name in roles:
        (tmp / name).mkdir()
    clusters = {name: Cluster(tmp / name) for name in roles}

    def start(name: str) -> None:
        clusters[name].start_gateway("--model", str(d))
        for role in roles[name]:
            clusters[name].add_worker(role, "--model", str(d), "--quantization", SCHEME)

    try:
        with ThreadPoolExecutor(len(roles)) as pool:
            list(pool.map(start, roles))
        clusters["pd"].wait_roles(prefill=1, decode=1)
        clusters["co"].wait_roles(colocated=1)
        yield d, clusters["pd"], clusters["co"]
    finally:
        for c in clusters.values():  # every process shuts down at once, then each is reaped
            for proc in [*c.workers, *([c.gateway] if c.gateway else [])]:
                proc.signal(signal.SIGTERM)
        for c in clusters.values():
            c.stop()


def _greedy(c: Cluster, model: str, prompt: list[int]) -> tuple[str, list[str]]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    status, resp = http("POST", f"{c.url}/v1/completions", body)
    assert status == 200, resp
    assert resp["usage"]["completion_tokens"] == MAX_TOKENS, resp
    choice = resp["choices"][0]
    return choice["text"], list(choice["logprobs"]["tokens"])


def test_quantized_moe_disaggregated_equals_colocated_equals_dequantized_engine(
    served: tuple[Path, Cluster, Cluster], tmp_path: Path
) -> None:
    from gateway.tokenizer import Tokenizer
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    d, pd, co = served
    for w in [*pd.worker_list(), *co.worker_list()]:
        assert w["quantization"] == SCHEME, w
    dequantized = write_dequantized(d, tmp_path / "dequantized", SCHEME)
    engine = LLMEngine(EngineConfig(model_dir=str(dequantized), dtype=DTYPE, num_threads=1,
                                    cache=CacheConfig(num_blocks=64)))
    tokenizer = Tokenizer.from_model_dir(d)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for length in LENGTHS:
        prompt = prompt_of(length, 384)
        ids = engine.generate([prompt], params)[0].token_ids
        want = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        disaggregated, colocated = _greedy(pd, d.name, prompt), _greedy(co, d.name, prompt)
        assert disaggregated == colocated, length
        assert disaggregated[1] == want, length
    for c in (pd, co):
        for w in c.wait_idle():  # every KV block came back
            assert w["free_blocks"] == w["total_blocks"]
