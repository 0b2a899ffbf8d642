"""LoRA adapters the engine refuses, the resident/host bounds, and a quantized base.

Every malformed or incompatible adapter is a `LoraError` that names the problem, and
nothing of it stays behind (no request queued, nothing registered, the next good
request still served). `max_loras` bounds the adapters of one step, `max_cpu_loras`
the host LRU (beyond it only while queued requests need the adapters); an adapter
evicted from both is read again and still exact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.lora import LoraError, LoraRef, lora_ref
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loading.loader import load_config
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.lora.checkpoint import load_lora
from pdserve.engine.lora.config import LoraConfig
from tests.engine.test_lora_peft import PROMPTS, greedy, lora_engine, run_all
from tests.helpers.lora_adapters import peft_greedy, peft_model
from tests.helpers.quant_checkpoints import write_dequantized

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, edit) -> None:
    t = load_file(str(d / "adapter_model.safetensors"))
    save_file({k: v.clone().contiguous() for k, v in edit(t).items()}, str(d / "adapter_model.safetensors"))


def _bad_adapters(good: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (adapter dir, words the error must contain)."""
    out: dict[str, tuple[Path, str]] = {}
    d = _copy(good, tmp / "no-weights")
    (d / "adapter_model.safetensors").unlink()
    out["no-weights"] = (d, "has no adapter_model.safetensors")
    d = _copy(good, tmp / "no-config")
    (d / "adapter_config.json").unlink()
    out["no-config"] = (d, "has no adapter_config.json")
    d = _copy(good, tmp / "bad-json")
    (d / "adapter_config.json").write_text("{not json")
    out["bad-json"] = (d, "not valid JSON")
    d = _copy(good, tmp / "wrong-shape")
    _edit_tensors(d, lambda t: {k: (v[:, :-1] if "lora_A" in k else v) for k, v in t.items()})
    out["wrong-shape"] = (d, "the model needs")
    d = _copy(good, tmp / "unknown-target")
    _edit_config(d, target_modules=["q_proj", "c_attn"])
    out["unknown-target"] = (d, "target modules ['c_attn'] are not among")
    d = _copy(good, tmp / "lm-head")
    _edit_tensors(d, lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})
    out["lm-head"] = (d, "is not a LoRA weight of a decoder projection")
    d = _copy(good, tmp / "dora")
    _edit_config(d, use_dora=True)
    out["dora"] = (d, "DoRA is not supported")
    d = _copy(good, tmp / "half")
    _edit_tensors(d, lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.q_proj.lora_B" not in k})
    out["half"] = (d, "has lora_A or lora_B only")
    d = _copy(good, tmp / "deep")
    _edit_tensors(d, lambda t: {**t, "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight":
                                t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                                "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight":
                                t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]})
    out["deep"] = (d, "layer 7 is beyond the model's 2 layers")
    return out


def test_malformed_adapters_are_refused_and_nothing_stays(lora_model, tmp_path: Path) -> None:
    base, adapters = lora_model
    engine = lora_engine(base)
    bad = _bad_adapters(adapters["attn-r4"], tmp_path)
    for name, (path, words) in bad.items():
        ref = LoraRef(name, str(path), "0" * 64)
        try:
            ref = lora_ref(name, path)  # a missing file is refused already here
        except LoraError as e:
            assert words in str(e), (name, e)
            continue
        with pytest.raises(LoraError) as err:
            engine.add_request(f"bad-{name}", PROMPTS[1], greedy(), lora=ref)
        assert words in str(err.value), (name, err.value)
        assert not engine.has_unfinished()
    counts = engine.runner.loras.counts()
    assert (counts.loads, counts.cached, counts.resident) == (0, 0, 0)
    # The engine still serves a good adapter and the base.
    good = lora_ref("attn-r4", adapters["attn-r4"])
    engine.add_request("good", PROMPTS[1], greedy(), lora=good)
    engine.add_request("base", PROMPTS[1], greedy())
    got = run_all(engine)
    assert got["good"] != got["base"] and len(got["good"]) == len(got["base"]) == 24


def test_rank_above_the_limit_and_changed_files_are_refused(lora_model, tmp_path: Path) -> None:
    base, adapters = lora_model
    engine = lora_engine(base, max_rank=8)
    with pytest.raises(LoraError, match=r"rank 16 of model.layers.0.self_attn.q_proj is above --max-lora-rank 8"):
        engine.add_request("big", PROMPTS[1], greedy(), lora=lora_ref("all", adapters["all-r16"]))
    moved = _copy(adapters["attn-r4"], tmp_path / "changed")
    ref = lora_ref("changed", moved)
    _edit_tensors(moved, lambda t: {k: v * 2 for k, v in t.items()})
    with pytest.raises(LoraError, match="has fingerprint .* the request expects"):
        engine.add_request("changed", PROMPTS[1], greedy(), lora=ref)
    assert not engine.has_unfinished() and engine.runner.loras.counts().cached == 0


def test_lora_needs_enable_lora(lora_model) -> None:
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    base, adapters = lora_model
    engine = LLMEngine(EngineConfig(model_dir=str(base), dtype="float32",
                                    cache=CacheConfig(block_size=4, num_blocks=64)))
    with pytest.raises(LoraError, match="LoRA is not enabled"):
        engine.add_request("x", PROMPTS[1], greedy(), lora=lora_ref("a", adapters["attn-r4"]))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_lora_with_tensor_or_pipeline_parallel_is_refused_before_any_rank_starts(lora_model, layout) -> None:
    base, _ = lora_model
    with pytest.raises(ValueError, match="--enable-lora serves dense models on one rank only"):
        EngineConfig(model_dir=str(base), lora=LoraConfig(), **layout)


def test_lora_on_a_moe_model_is_refused(tiny_model_dir) -> None:
    moe = tiny_model_dir("mixtral")
    with pytest.raises(ValueError, match=r"--enable-lora serves dense models on one rank only .*no MoE"):
        LLMEngine(EngineConfig(model_dir=str(moe), dtype="float32", lora=LoraConfig()))
    LLMEngine(EngineConfig(model_dir=str(moe), dtype="float32"))  # the same model serves without LoRA


def test_per_module_ranks_and_rslora_scales(lora_model) -> None:
    base, adapters = lora_model
    cfg: ModelConfig = load_config(str(base))
    w = load_lora(str(adapters["all-r16"]), "x", cfg, 16)
    layer = w.layers[0]
    assert set(layer) == {"qkv", "o", "gate_up", "down"}
    assert layer["qkv"].a.shape == (48, 64) and layer["o"].a.shape == (2, 64)  # rank_pattern o_proj: 2
    assert layer["o"].rank_scale.unique().tolist() == [32.0 / 2]
    rs = load_lora(str(adapters["mlp-r8-rslora"]), "y", cfg, 16)
    assert set(rs.layers[1]) == {"gate_up", "down"}
    assert rs.layers[1]["down"].rank_scale.unique().tolist() == [pytest.approx(16.0 / 8 ** 0.5)]
    assert rs.target_modules == ("gate_proj", "up_proj", "down_proj")


def test_max_loras_bounds_each_step_and_the_lru_reloads_exactly(lora_model) -> None:
    base, adapters = lora_model
    engine = lora_engine(base, max_loras=1, max_cpu_loras=2)
    refs = [lora_ref(n, p) for n, p in adapters.items()]
    alone = {}
    for r in refs:
        single = lora_engine(base)
        single.add_request(r.name, PROMPTS[0], greedy(), lora=r)
        alone.update(run_all(single))
    for rep in range(2):
        for r in refs:
            engine.add_request(f"{rep}-{r.name}", PROMPTS[0], greedy(), lora=r)
        engine.add_request(f"{rep}-base", PROMPTS[0], greedy())
        per_step: list[int] = []
        got = run_all(engine, per_step)
        assert {k: got[f"{rep}-{k}"] for k in alone} == alone
        assert max(per_step) <= 2  # one adapter and the base at most
        # While all three were queued, the host LRU kept them (no read again mid-round);
        # once they ended it is back within max_cpu_loras.
        assert engine.runner.loras.counts().cached == 2
    c = engine.runner.loras.counts()
    assert c.resident == 1 and c.cached == 2
    assert c.loads > 3  # adapters that fell out of the host LRU between rounds were read again
    assert c.evictions > 0


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_base_with_an_adapter_equals_peft_on_the_dequantized_base(
    lora_model, tmp_path: Path, scheme: str
) -> None:
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.lora.config import LoraConfig

    base, adapters = lora_model
    deq = write_dequantized(base, tmp_path / "deq", scheme)
    engine = LLMEngine(EngineConfig(model_dir=str(base), dtype="float32", quantization=scheme,
                                    cache=CacheConfig(block_size=4, num_blocks=128),
                                    lora=LoraConfig(max_loras=1, max_lora_rank=16)))
    path = adapters["all-r16"]
    engine.add_request("q", PROMPTS[0], greedy(), lora=lora_ref("all", path))
    engine.add_request("b", PROMPTS[0], greedy())
    got = run_all(engine)
    assert got["q"] == peft_greedy(peft_model(deq, path), PROMPTS[0], 24)
    assert got["q"] != got["b"]


def test_sampled_requests_under_an_adapter_are_reproducible(lora_model) -> None:
    base, adapters = lora_model
    ref = lora_ref("a", adapters["mlp-r8-rslora"])
    outs = []
    for _ in range(2):
        engine = lora_engine(base)
        engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=7), lora=ref)
        engine.add_request("t", PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=7))
        outs.append(run_all(engine))
    assert outs[0] == outs[1] and outs[0]["s"] != outs[0]["t"]


def test_plan_counts_the_adapters_the_engine_holds(lora_model, tmp_path: Path) -> None:
    from bench.lora import write_adapter
    from pdserve.common.lora_checkpoint import adapter_bytes
    from pdserve.engine.lora.checkpoint import projection_dims
    from pdserve.planner.capacity import compute_plan

    base, _ = lora_model
    cfg = load_config(str(base))
    full = write_adapter(str(base), tmp_path / "full", 8, seed=0)  # rank 8 on all 7 projections
    weights = load_lora(str(full), "f", cfg, 8)
    assert adapter_bytes(projection_dims(cfg), 8, 4) == weights.nbytes  # float32, as loaded
    plain = compute_plan(base, 1 << 30, 256, dtype="float32")
    lora = compute_plan(base, 1 << 30, 256, dtype="float32", max_loras=3, max_lora_rank=8)
    assert lora.lora_bytes == 2 * 3 * weights.nbytes
    assert plain.kv_budget_bytes - lora.kv_budget_bytes == lora.lora_bytes
    # bf16: the step's stacked copy pads each adapter's fused rank (to 4 columns, 32 on AMX):
    # the plan counts the most it can be.
    from pdserve.engine.lora.batch import MAX_ALIGN, LoraStack
    bf16 = weights.to(torch.bfloat16, torch.device("cpu"))
    stacked = sum(d.a.nbytes + d.b.nbytes + d.rank_scale.nbytes for layer in LoraStack([bf16]).layers
                  for d in layer.values())
    most = adapter_bytes(projection_dims(cfg), 8, 2, MAX_ALIGN)
    plan = compute_plan(base, 1 << 30, 256, dtype="bfloat16", max_loras=3, max_lora_rank=8)
    assert plan.lora_bytes == 3 * (bf16.nbytes + most) and bf16.nbytes <= stacked <= most
