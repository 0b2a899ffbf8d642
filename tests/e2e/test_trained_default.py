"""What `make up` serves: with no --model, a gateway and a prefill and a decode worker
(real processes and sockets) answer "Tell me about the sea." with the trained built-in
model's readable English, token for token the single-process engine's greedy answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tokenizer import Tokenizer
from pdserve.builtin.story_corpus import vocabulary
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.e2e.cluster import DTYPE, Cluster, http

QUESTION = [{"role": "user", "content": "Tell me about the sea."}]


def test_default_model_answers_readable_english(
    log_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.builtin.default_model import default_model_dir

    env = {"PDSERVE_HOME": str(tmp_path / "home"), "PDSERVE_BUILTIN_WEIGHTS": "trained"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model = default_model_dir()  # assembled once here, before the processes look for it
    tok = Tokenizer.from_model_dir(model)
    engine = LLMEngine(EngineConfig(model_dir=str(model), dtype=DTYPE, cache=CacheConfig(num_blocks=64)))
    (want,) = engine.generate([tok.encode_chat(QUESTION)], SamplingParams(max_tokens=96, temperature=0.0))

    c = Cluster(log_dir)
    try:
        c.start_gateway(env=env)
        c.add_worker("prefill", env=env)
        c.add_worker("decode", env=env)
        c.wait_roles(prefill=1, decode=1)
        body = {"model": "pdserve-tiny-llama", "messages": QUESTION, "max_tokens": 96, "temperature": 0}
        status, out = http("POST", f"{c.url}/v1/chat/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", out  # the model ends its turn by itself
        assert text == tok.decode(want.token_ids, skip_special_tokens=True)
        words = [w.strip(".,!?\"'").lower() for w in text.split()]
        assert len(words) >= 8, text
        assert "\ufffd" not in text
        assert sum(w in vocabulary("train") for w in words) >= 0.9 * len(words), text
        c.wait_idle()
    finally:
        c.stop()
