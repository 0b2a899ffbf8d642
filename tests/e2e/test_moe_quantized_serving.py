"""A weight-quantized MoE model (Qwen3-MoE, int4 experts and attention) served as real
processes: 1 prefill + 1 decode equals a colocated worker equals the single-process
engine on a float checkpoint holding the int4-dequantized weights (experts included),
token for token, at several prompt lengths; every KV block comes back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
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
    """(model, a 1P+1D cluster, a colocated one), started side by side."""
    tmp = tmp_path_factory.mktemp("moe-quant")
    d = _servable(tiny_model_dir("qwen3_moe"), model_dir, tmp / "qwen3_moe")
    pd, co = Cluster(tmp / "pd"), Cluster(tmp / "co")
    (tmp / "pd").mkdir()
    (tmp / "co").mkdir()
    try:
        for c in (pd, co):
            c.start_gateway("--model", str(d))
        pd.add_worker("prefill", "--model", str(d), "--quantization", SCHEME)
        pd.add_worker("decode", "--model", str(d), "--quantization", SCHEME)
        co.add_worker("worker", "--model", str(d), "--quantization", SCHEME)
        pd.wait_roles(prefill=1, decode=1)
        co.wait_roles(colocated=1)
        yield d, pd, co
    finally:
        pd.stop()
        co.stop()


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
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from gateway.tokenizer import Tokenizer

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
