"""The int8 LM head (`--lm-head-quantization`): on by default under on-the-fly int8/int4
only, its logits within the int8 rounding bound of the float head's, a tied head's own
copy beside the float embedding, and the head in the KV compatibility hash."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.loading.loader import load_model_with
from pdserve.engine.quant.formats import QuantizationError, served_lm_head
from pdserve.engine.quant.linear import Int8Linear
from pdserve.engine.quant.pack import quantize_int8
from pdserve.engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_auto_gives_on_the_fly_schemes_an_int8_head_and_nothing_else() -> None:
    auto = {s: served_lm_head("auto", s) for s in ("none", "int8", "int4", "awq", "gptq")}
    assert auto == {"none": "none", "int8": "int8", "int4": "int8", "awq": "none", "gptq": "none"}
    assert served_lm_head("none", "int8") == "none" and served_lm_head("int8", "none") == "int8"
    with pytest.raises(QuantizationError, match="unknown LM head quantization 'int4'"):
        served_lm_head("int4", "int8")
    with pytest.raises(ValueError, match="unsupported lm_head_quantization 'fp8'"):
        EngineConfig(model_dir="x", lm_head_quantization="fp8")


@pytest.mark.parametrize("tied", [False, True])
def test_the_loader_swaps_in_the_int8_head_and_keeps_the_embedding(
    tiny_model_dir: Callable[..., Path], tied: bool
) -> None:
    d = tiny_model_dir("llama", tie_word_embeddings=tied)
    _, ref = load_model_with(d, torch.float32, "cpu", None, quantization="int8", lm_head_quantization="none")
    _, m = load_model_with(d, torch.float32, "cpu", None, quantization="int8")  # auto
    assert ref.lm_head_q is None and isinstance(m.lm_head_q, Int8Linear)
    assert torch.equal(m.embed_tokens, ref.embed_tokens)  # the lookup stays float
    assert m.lm_head is None and (ref.lm_head is None) == tied  # an untied float head is dropped
    float_head = ref.embed_tokens if tied else ref.lm_head
    assert float_head is not None
    parts = quantize_int8(float_head)
    assert m.lm_head_q.out_features == float_head.shape[0]
    assert m.lm_head_q.q is not None and torch.equal(m.lm_head_q.q, parts.q)
    _, plain = load_model_with(d, torch.float32, "cpu", None)  # no weight quantization: no int8 head
    assert plain.lm_head_q is None


@pytest.mark.parametrize("rows", [1, 3, 16, 20])  # GEMV, small-M and AMX paths for bf16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_head_logits_are_within_the_rounding_bound_of_the_float_heads(
    tiny_model_dir: Callable[..., Path], dtype: torch.dtype, rows: int
) -> None:
    d = tiny_model_dir("llama")
    _, ref = load_model_with(d, dtype, "cpu", None, quantization="int8", lm_head_quantization="none")
    _, m = load_model_with(d, dtype, "cpu", None, quantization="int8", lm_head_quantization="int8")
    assert ref.lm_head is not None
    w = ref.lm_head.double()
    hidden = torch.randn(rows, m.cfg.hidden_size, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got, want = m.compute_logits(hidden).double(), (hidden.double() @ w.t())
    assert got.shape == want.shape == (rows, m.cfg.vocab_size)
    # Each weight moves by at most half its row's step s_n, so |dy_n| <= |h|_1 * s_n / 2;
    # bf16 adds the output's own rounding (2^-8 relative) and the scales' (2^-8 relative).
    steps = quantize_int8(ref.lm_head).scales.double()
    bound = hidden.double().abs().sum(-1, keepdim=True) * steps / 2
    if dtype == torch.bfloat16:
        bound = bound + 2 ** -7 * want.abs() + 1e-3
    else:
        bound = bound + 1e-5
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().max() > 0  # the head really is quantized


def test_the_lm_head_is_in_the_compat_hash(tiny_model_dir: Callable[..., Path]) -> None:
    d = str(tiny_model_dir("llama"))

    def cfg(**kw: str) -> EngineConfig:
        return EngineConfig(model_dir=d, dtype="float32", cache=CacheConfig(num_blocks=8), **kw)

    head8 = ModelRunner.layout_for(cfg(quantization="int8"))
    float_head = ModelRunner.layout_for(cfg(quantization="int8", lm_head_quantization="none"))
    assert (head8.lm_head, float_head.lm_head) == ("int8", "none")
    assert head8.compat_hash != float_head.compat_hash  # such a prefill and decode pair refuse
    plain = ModelRunner.layout_for(cfg())
    assert plain.lm_head == "none" and plain.compat_hash == ModelRunner.layout_for(
        cfg(lm_head_quantization="none")).compat_hash
    assert ModelRunner.layout_for(cfg(lm_head_quantization="int8")).compat_hash != plain.compat_hash
    runner = ModelRunner(cfg(quantization="int8"))
    assert runner.layout == head8 and runner.lm_head_quantization == "int8"
