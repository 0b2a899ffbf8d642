"""LoRA with the engine's other features: speculative decoding (n-gram drafts and a
draft model, which runs the base model: the target verifies under the adapter) gives
exactly the tokens decoding without it gives under the adapter, and a grammar
constraint holds on an adapter's output."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from pdserve.common.lora import lora_ref
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import json_schema
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora.config import LoraConfig
from pdserve.engine.spec.config import SpeculativeConfig
from tests.engine.test_lora_peft import PROMPTS, run_all
from tests.helpers.lora_adapters import AdapterSpec, make_peft_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model: Path, spec: SpeculativeConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model), dtype="float32", num_threads=1,
                                  cache=CacheConfig(block_size=4, num_blocks=256), speculative=spec,
                                  lora=LoraConfig(max_loras=3, max_lora_rank=16)))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_under_adapters_is_exact(lora_model, method: str) -> None:
    base, adapters = lora_model
    refs = [lora_ref(n, p) for n, p in adapters.items()]
    spec = (SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2) if method == "ngram"
            else SpeculativeConfig("draft_model", 3, model=str(base)))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for engine in (_engine(base), _engine(base, spec)):
        for r in refs:
            for i, p in enumerate(PROMPTS):
                engine.add_request(f"{r.name}-{i}", p, params, lora=r)
        engine.add_request("base", PROMPTS[0], params)
        outs.append(run_all(engine))
        stats = engine.stats().spec
    assert outs[0] == outs[1]
    assert stats is not None and stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def test_a_grammar_holds_under_an_adapter(tmp_path: Path) -> None:
    from gateway.tokenizer import Tokenizer
    from pdserve.builtin.default_model import write_default_model

    model = write_default_model(tmp_path / "model")
    adapter = make_peft_adapter(model, tmp_path / "adapter",
                                AdapterSpec("mlp", 8, 16.0, ("gate_proj", "up_proj", "down_proj"), seed=5))
    tok = Tokenizer.from_model_dir(model)
    engine = _engine(model)
    ref = lora_ref("mlp", adapter)
    structured = json_schema(SCHEMA, "response_format")
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured=structured) for s in range(4)]
    prompt = tok.encode("json please:")
    texts: dict[str, list[str]] = {"lora": [], "base": []}
    for which, lora in (("lora", ref), ("base", None)):
        for s, p in enumerate(params):
            engine.add_request(f"{which}-{s}", prompt, p, lora=lora)
        got = run_all(engine)
        for s in range(len(params)):
            ids = [t for t in got[f"{which}-{s}"] if t not in tok.eos_token_ids]
            text = tok.decode(ids, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), SCHEMA)
            texts[which].append(text)
    assert texts["lora"] != texts["base"]  # the adapter's distribution, not the base's
