"""bf16 serving as each CPU kind this host can emulate (`PDSERVE_CPU_FEATURES`,
docs/determinism.md): a 1P+1D cluster whose workers run as that CPU serves the greedy
text of the single-process engine run as the same CPU (in its own process: a mask is set
at load), and seeded sampled requests give the same text sent at once as one by one (row
invariance: the batch a request lands in changes nothing). `-amx` is the AMD EPYC kind on
an AMX host; `avx2` runs bf16 on the emulated dot products."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.kernels import cpu_features
from tests.e2e.cluster import ROOT, Cluster, http

MASKS = [m for m in ("native", "-amx", "avx2") if cpu_features.effective(m) <= cpu_features.host()
         and (m != "-amx" or "amx_bf16" in cpu_features.host())]
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "1 2 3 4 5 6"]
MAX_TOKENS = 12
REFERENCE = """
import json, sys
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from gateway.tokenizer import Tokenizer
d, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tok = Tokenizer.from_model_dir(d)
engine = LLMEngine(EngineConfig(model_dir=d, dtype="bfloat16", num_threads=1, cache=CacheConfig(num_blocks=256)))
ids = [list(tok.encode(p, add_special_tokens=True)) for p in prompts]
outs = engine.generate(ids, SamplingParams(max_tokens=n, temperature=0.0))
print(json.dumps([tok.decode(list(o.choices[0].token_ids), skip_special_tokens=True) for o in outs]))
"""


def _env(mask: str) -> dict[str, str]:
    return {"PDSERVE_CPU_FEATURES": "" if mask == "native" else mask}


@pytest.fixture(scope="module", params=MASKS)
def masked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Cluster]]:
    c = Cluster(tmp_path_factory.mktemp(f"mask{request.param}"))
    try:
        c.start_gateway(wait=False)
        for role in ("prefill", "decode"):
            c.add_worker(role, "--kv-transport", "shm", "--dtype", "bfloat16", env=_env(request.param))
        c.wait_gateway()
        c.wait_roles(prefill=1, decode=1)
        yield request.param, c
    finally:
        c.stop()


def _complete(c: Cluster, model: str, prompt: str, **params: Any) -> str:
    status, out = http("POST", f"{c.url}/v1/completions", {"model": model, "prompt": prompt, **params})
    assert status == 200, out
    return str(out["choices"][0]["text"])


def test_greedy_text_equals_the_engine_run_as_the_same_cpu(masked: tuple[str, Cluster], model_dir: Path) -> None:
    mask, c = masked
    env = {**os.environ, **_env(mask), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", REFERENCE, str(model_dir), json.dumps(PROMPTS), str(MAX_TOKENS)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    want = json.loads(run.stdout.strip().splitlines()[-1])
    got = [_complete(c, model_dir.name, p, max_tokens=MAX_TOKENS, temperature=0) for p in PROMPTS]
    assert got == want
    c.wait_idle()


def test_seeded_sampling_is_the_same_sent_at_once_or_one_by_one(masked: tuple[str, Cluster], model_dir: Path) -> None:
    _, c = masked
    params = {"max_tokens": 48, "temperature": 0.9, "top_p": 0.95, "frequency_penalty": 0.3}
    jobs = [(p, seed) for seed in (1, 2, 3, 4) for p in PROMPTS]
    alone = [_complete(c, model_dir.name, p, seed=seed, **params) for p, seed in jobs]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda j: _complete(c, model_dir.name, j[0], seed=j[1], **params), jobs))
    assert together == alone
    assert len(set(alone)) > 1  # the seeds and prompts do sample different text
    c.wait_idle()
