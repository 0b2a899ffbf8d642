"""LoRA adapters in the engine compute what transformers + peft compute.

Three adapters made and saved by the real `peft` (tests/helpers/lora_adapters.py:
ranks 4, 8 and 16 with a per-module rank, attention-only, MLP-only with rslora, all
seven projections): greedy tokens at float32 equal `PeftModel.generate` for each
adapter alone, and still do when the three and the base model share one engine
batch (every step mixes rows of different adapters), prefix cache on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.lora import lora_ref
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora.config import LoraConfig
from tests.helpers.lora_adapters import THREE_ADAPTERS, peft_greedy, peft_model

NEW_TOKENS = 24
PROMPTS = ([1, 17, 42, 99, 5, 230, 8, 61, 77, 3, 12, 140, 201, 33, 9, 50, 71, 18],
           [1, 250, 3, 4, 5, 6, 7, 8, 9, 10])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def lora_engine(base: Path, max_loras: int = 3, max_rank: int = 16, **kw: object) -> LLMEngine:
    cfg = EngineConfig(model_dir=str(base), dtype="float32",
                       cache=CacheConfig(block_size=4, num_blocks=256),
                       lora=LoraConfig(max_loras=max_loras, max_lora_rank=max_rank, **kw))  # type: ignore[arg-type]
    return LLMEngine(cfg)


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def run_all(engine: LLMEngine, adapters_per_step: list[int] | None = None) -> dict[str, list[int]]:
    """Step `engine` until idle; each request's output tokens (and, into
    `adapters_per_step`, how many distinct adapters each step ran, base included)."""
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        batch = engine.schedule()
        if adapters_per_step is not None:
            adapters_per_step.append(len({c.lora_id for c in batch.chunks}))
        for out in engine.execute(batch):
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return got


@pytest.fixture(scope="module")
def reference(lora_model: tuple[Path, dict[str, Path]]) -> dict[tuple[str, int], list[int]]:
    """peft's greedy tokens per (adapter name, prompt index); "" is the base model."""
    from transformers import AutoModelForCausalLM

    base, adapters = lora_model
    out = {}
    for name, path in adapters.items():
        model = peft_model(base, path)
        for i, p in enumerate(PROMPTS):
            out[name, i] = peft_greedy(model, p, NEW_TOKENS)
    plain = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    plain.generation_config.eos_token_id = None
    for i, p in enumerate(PROMPTS):
        out["", i] = peft_greedy(plain, p, NEW_TOKENS)
    return out


def test_each_adapter_alone_equals_peft(lora_model, reference) -> None:
    base, adapters = lora_model
    engine = lora_engine(base)
    for name, path in adapters.items():
        ref = lora_ref(name, path)
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"{name}-{i}", p, greedy(), lora=ref)
            got = run_all(engine)
            assert got == {f"{name}-{i}": reference[name, i]}, (name, i)
    # The adapters change the output (a server ignoring them would fail above).
    assert all(reference[s.name, 0] != reference["", 0] for s in THREE_ADAPTERS)


def test_three_adapters_and_base_mixed_in_one_batch(lora_model, reference) -> None:
    base, adapters = lora_model
    engine = lora_engine(base)
    refs = {name: lora_ref(name, path) for name, path in adapters.items()}
    adapters_per_step: list[int] = []
    for rep in range(2):  # the second round hits the prefix cache, each adapter its own
        expected = {}
        for i, p in enumerate(PROMPTS):
            for name in ["", *refs]:
                rid = f"{rep}-{name or 'base'}-{i}"
                engine.add_request(rid, p, greedy(), lora=refs.get(name))
                expected[rid] = reference[name, i]
        hits_before = engine.stats().num_cached_tokens_hit
        assert run_all(engine, adapters_per_step) == expected
    assert max(adapters_per_step) == 4  # three adapters and the base in one step
    # Round 2: each of the 8 requests hit its own round-1 blocks (block size 4).
    assert engine.stats().num_cached_tokens_hit - hits_before == 4 * (16 + 8)
    assert engine.block_manager.integrity_errors() == []
