"""Weight quantization of mixture-of-experts models (Mixtral, Qwen3-MoE): every expert's
fused gate/up and down projections are int8/int4 layers, the router stays in the compute
dtype, a quantized sparse layer equals a float one holding the dequantized weights, each
expert's kernel runs on exactly the tokens routed to it, and the bytes the loaded model
holds are the bytes `pdserve plan` counts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.loading.loader import load_model_with
from pdserve.engine.models.moe import MoEForCausalLM, SparseMoE
from pdserve.engine.quant.formats import INT4_GROUP
from pdserve.engine.quant.linear import Int4Linear, Int8Linear
from pdserve.engine.quant.pack import quantize_int4, quantize_int8
from pdserve.planner.capacity import compute_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAMILIES = ("mixtral", "qwen3_moe")
LAYER_CLASS = {"int8": Int8Linear, "int4": Int4Linear}


def _load(d: Path, dtype: torch.dtype, scheme: str = "none") -> MoEForCausalLM:
    _, model = load_model_with(d, dtype, "cpu", None, quantization=scheme)
    assert isinstance(model, MoEForCausalLM)
    return model


def _moe(model: MoEForCausalLM, layer: int) -> SparseMoE:
    mlp = model.layers[layer].mlp
    assert isinstance(mlp, SparseMoE)
    return mlp


def _dequantized(w: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight a quantized layer computes with, from the float checkpoint weight `w`:
    scales (and int4 offsets) rounded to the compute dtype, as the layers store them."""
    if scheme == "int8":
        parts = quantize_int8(w)
        return parts.q.float() * parts.scales.to(dtype).float()[:, None]
    k = w.shape[1]
    parts = quantize_int4(F.pad(w.float(), (0, -k % INT4_GROUP)), INT4_GROUP)
    scales = parts.scales.to(dtype).float()
    offsets = ((8.0 - parts.zeros) * parts.scales).to(dtype).float()  # the kernel's form
    n, kp = parts.q.shape
    g = (parts.q.float() - 8.0).reshape(n, kp // INT4_GROUP, INT4_GROUP)
    return (g * scales[..., None] + offsets[..., None]).reshape(n, kp)[:, :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_sparse_layers_equal_a_float_model_of_the_dequantized_weights(
    tiny_model_dir: Callable[..., Path], family: str, scheme: str, dtype: torch.dtype
) -> None:
    d = tiny_model_dir(family)
    original, ref, quant = _load(d, torch.float32), _load(d, dtype), _load(d, dtype, scheme)
    for i in quant.moe.sparse_layers:
        moe, ref_moe = _moe(quant, i), _moe(ref, i)
        assert isinstance(moe.router_weight, nn.Parameter) and moe.router_weight.dtype == dtype
        assert torch.equal(moe.router_weight, ref_moe.router_weight)
        for e, expert in enumerate(moe.experts):
            for name in ("gate_up_weight", "down_weight"):
                assert isinstance(getattr(expert, name), LAYER_CLASS[scheme]), (i, e, name)
                w = getattr(_moe(original, i).experts[e], name)
                getattr(ref_moe.experts[e], name).copy_(_dequantized(w, scheme, dtype).to(dtype))
        # 3 rows: each expert's few tokens take the small-M kernels; 96: the wide paths too.
        for rows in (3, 96):
            x = torch.randn(rows, quant.cfg.hidden_size, generator=torch.Generator().manual_seed(rows)).to(dtype)
            got, want = moe(x).float(), ref_moe(x).float()
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            assert (got - want).abs().max().item() <= tol * want.abs().max().item(), (i, rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_expert_kernel_runs_on_exactly_its_routed_tokens(
    tiny_model_dir: Callable[..., Path], family: str
) -> None:
    quant = _load(tiny_model_dir(family), torch.bfloat16, "int8")
    moe = _moe(quant, quant.moe.sparse_layers[0])
    rows: dict[int, list[int]] = {}
    for e, expert in enumerate(moe.experts):
        for layer in (expert.gate_up_weight, expert.down_weight):
            assert isinstance(layer, nn.Module)
            layer.register_forward_hook(lambda _m, args, _out, e=e: rows.setdefault(e, []).append(args[0].shape[0]))
    x = torch.randn(24, quant.cfg.hidden_size).to(torch.bfloat16)
    _, experts = moe.route(x)
    moe(x)
    want = {e: [n, n] for e in range(quant.moe.num_experts) if (n := int((experts == e).sum())) > 0}
    assert rows == want  # gate/up then down, once per picked expert, over its tokens only
    assert sum(r[0] for r in rows.values()) == 24 * quant.moe.top_k


def _held_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (float32: no native copies)."""
    return sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())


def _expert_bytes(model: MoEForCausalLM) -> int:
    return sum(_held_bytes(_moe(model, i).experts) for i in model.moe.sparse_layers)


# Shapes the int4 kernel needs no padding for (K a multiple of 128, N of 64), so the
# bytes held are exactly the scheme's.
ALIGNED = {"mixtral": {"hidden_size": 128, "intermediate_size": 128},
           "qwen3_moe": {"hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 128}}


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_experts_shrink_and_plan_counts_the_bytes_held(
    tiny_model_dir: Callable[..., Path], family: str
) -> None:
    d = tiny_model_dir(family, **ALIGNED[family])
    full = _load(d, torch.float32)
    assert _held_bytes(full) == compute_plan(d, 1 << 30, 128, dtype="float32").weight_bytes
    for scheme, ratio in (("int8", 0.26), ("int4", 0.15)):
        quant = _load(d, torch.float32, scheme)
        # int8: 1 byte a weight + a scale a row; int4: half a byte + a (scale, offset) per 128.
        assert _expert_bytes(quant) <= ratio * _expert_bytes(full), scheme
        plan = compute_plan(d, 1 << 30, 128, dtype="float32", quantization=scheme)
        assert plan.weight_bytes == _held_bytes(quant), scheme


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cuda_sparse_layers_match_their_cpu_twins(tiny_model_dir: Callable[..., Path], scheme: str) -> None:
    d = tiny_model_dir("mixtral")
    cpu = _load(d, torch.float32, scheme)
    _, gpu = load_model_with(d, torch.float32, "cuda", None, quantization=scheme)
    assert isinstance(gpu, MoEForCausalLM)
    x = torch.randn(40, cpu.cfg.hidden_size)
    for i in cpu.moe.sparse_layers:
        assert isinstance(_moe(gpu, i).experts[0].down_weight, LAYER_CLASS[scheme])
        want = _moe(cpu, i)(x)
        got = _moe(gpu, i)(x.cuda()).cpu()
        # CUDA int4 runs in bf16 (the kernel's only dtype): within a bf16 rounding.
        assert (got - want).abs().max().item() <= 3e-2 * want.abs().max().item(), i
