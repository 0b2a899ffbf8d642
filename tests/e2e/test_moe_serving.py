"""MoE models (Mixtral, Qwen3-MoE) served through 1P+1D as real processes: greedy output
equals Hugging Face `transformers` for 64 tokens at several prompt lengths."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.tokenizer import Tokenizer
from tests.e2e.cluster import Cluster, http
from tests.engine.test_hf_equivalence import NEW_TOKENS, hf_greedy, prompt_of

LENGTHS = (5, 16, 37)


def _servable(tiny: Path, model_dir: Path, out: Path) -> Path:
    """The tiny checkpoint plus a tokenizer for the gateway (the built-in model's: its ids
    cover the tiny vocabulary, and prompts are sent as token ids)."""
    shutil.copytree(tiny, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_greedy_through_1p1d_equals_hf(
    tiny_model_dir: Callable[..., Path], model_dir: Path, tmp_path: Path, family: str
) -> None:
    d = _servable(tiny_model_dir(family), model_dir, tmp_path / family)
    tokenizer = Tokenizer.from_model_dir(d)
    c = Cluster(tmp_path)
    try:
        c.start_gateway("--model", str(d))
        c.add_worker("prefill", "--model", str(d))
        c.add_worker("decode", "--model", str(d))
        c.wait_roles(prefill=1, decode=1)
        for length in LENGTHS:
            prompt = prompt_of(length, 384)
            want, _ = hf_greedy(d, prompt)
            status, body = http("POST", f"{c.url}/v1/completions", {
                "model": d.name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == NEW_TOKENS, body
            assert body["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True), (family, length)
        for w in c.wait_idle():  # every KV block came back on both workers
            assert w["free_blocks"] == w["total_blocks"]
    finally:
        c.stop()
