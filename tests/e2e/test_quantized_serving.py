"""Greedy output under weight quantization: disaggregated (1 prefill + 1 decode) equals
colocated equals the single-process engine, token for token, for int8 (its LM head int8 by
default) and int4 with `--lm-head-quantization none`; the workers' registration
(/v1/workers, /v1/models) and metrics say which scheme and which head they run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.cluster import DTYPE, Cluster, http, running_cluster, worker_metrics
from tests.e2e.conftest import Reference

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived"]
MAX_TOKENS = 12


def _served(c: Cluster, model: str) -> list[list[str]]:
    """Per prompt, the generated tokens' strings (from logprobs: one per token id)."""
    out = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
        status, resp = http("POST", f"{c.url}/v1/completions", body)
        assert status == 200, resp
        out.append(list(resp["choices"][0]["logprobs"]["tokens"]))
    return out


def _says(c: Cluster, model: str, scheme: str, head: str) -> None:
    status, models = http("GET", f"{c.url}/v1/models")
    assert status == 200 and models["data"][0]["quantization"] == scheme, models
    assert models["data"][0]["kv_cache_dtype"] == DTYPE and models["data"][0]["lm_head_quantization"] == head
    for w in c.worker_list():
        assert w["quantization"] == scheme and w["lm_head_quantization"] == head
        info = [ln for ln in worker_metrics(w).splitlines() if ln.startswith("llm_worker_info{")]
        assert len(info) == 1 and f'quantization="{scheme}"' in info[0] and info[0].endswith(" 1.0"), info
        assert f'lm_head_quantization="{head}"' in info[0], info


# (scheme, --lm-head-quantization, the head it serves): the default, and the opt-out.
CASES = [("int8", "auto", "int8"), ("int4", "none", "none")]


@pytest.mark.parametrize(("scheme", "head_flag", "head"), CASES)
def test_disaggregated_equals_colocated_equals_engine(
    tmp_path: Path, model_dir: Path, reference: Reference, scheme: str, head_flag: str, head: str
) -> None:
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype=DTYPE, num_threads=1, quantization=scheme,
                                    lm_head_quantization=head_flag, cache=CacheConfig(num_blocks=64)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    want = [[reference.tokenizer.decode([t], skip_special_tokens=False)
             for t in engine.generate([reference.completion_ids(p)], params)[0].token_ids] for p in PROMPTS]
    model = reference.model_name
    (tmp_path / "pd").mkdir()
    (tmp_path / "co").mkdir()
    flags = ("--quantization", scheme, "--lm-head-quantization", head_flag)
    with running_cluster(tmp_path / "pd", {"prefill": 1, "decode": 1}, *flags) as c:
        disaggregated = _served(c, model)
        _says(c, model, scheme, head)
        c.wait_idle()
    with running_cluster(tmp_path / "co", {"worker": 1}, *flags) as c:
        colocated = _served(c, model)
        c.wait_idle()
    assert disaggregated == colocated == want
