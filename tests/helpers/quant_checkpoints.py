"""AWQ and GPTQ checkpoints written from a float tiny model, following each format's
published layout (AutoAWQ's `WQLinear_GEMM`, AutoGPTQ/GPTQModel's `QuantLinear`), with
packing loops written out here independently of `pdserve/engine/quant/pack.py`.

`write_quantized(src, dst, method, ...)` quantizes every decoder linear of `src` to
4 bits (AutoAWQ's min/max asymmetric scheme), writes `dst` in the format, and returns
the dequantized float weights; `write_fake_quant(src, dst, weights)` writes a float
checkpoint holding exactly those weights (the reference a served quantized checkpoint
must agree with).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Decoder linears by checkpoint name; MoE experts' too (Qwen3-MoE's share the dense names,
# Mixtral's are w1/w3/w2). Routers (`...gate.weight`) stay float, as AutoAWQ/GPTQModel keep them.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map for 4 bits


def _quantize(w: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ `pseudo_quantize_tensor` (sym: GPTQ's symmetric grid, zero 8): codes [N, K],
    fp16 scales [N, G], int zeros [N, G]."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    hi, lo = g.amax(-1), g.amin(-1)
    if sym:
        scales = (torch.maximum(hi.abs(), lo.abs()).clamp(min=1e-5) * 2 / 15).half()
        zeros = torch.full_like(hi, 8.0)
    else:
        scales = ((hi - lo).clamp(min=1e-5) / 15).half()
        zeros = (-torch.round(lo / scales.float())).clamp(0, 15)
    s = scales.float()
    q = (torch.round(g / s[..., None]) + zeros[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.int32), scales, zeros.to(torch.int32)


def _pack_awq(q_kn: torch.Tensor) -> torch.Tensor:
    """[K, N] codes -> int32 [K, N/8]: nibble i of column c holds output channel 8c + AWQ_ORDER[i]."""
    k, n = q_kn.shape
    out = torch.zeros(k, n // 8, dtype=torch.int64)
    for col in range(n // 8):
        for i in range(8):
            out[:, col] |= q_kn[:, col * 8 + AWQ_ORDER[i]].to(torch.int64) << (4 * i)
    return _as_int32(out)


def _pack_rows(q_kn: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: [K, N] -> int32 [K/8, N]; row r holds input channels 8r..8r+7, lowest first."""
    k, n = q_kn.shape
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for r in range(k // 8):
        for j in range(8):
            out[r] |= q_kn[8 * r + j].to(torch.int64) << (4 * j)
    return _as_int32(out)


def _pack_cols(v: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[G, N] -> int32 [G, N/8] along N (GPTQ qzeros: order 0..7; AWQ: AWQ_ORDER)."""
    g, n = v.shape
    out = torch.zeros(g, n // 8, dtype=torch.int64)
    for col in range(n // 8):
        for i in range(8):
            out[:, col] |= v[:, col * 8 + order[i]].to(torch.int64) << (4 * i)
    return _as_int32(out)


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def write_quantized(src: Path, dst: Path, method: str, group: int, *, desc_act: bool = False,
                    checkpoint_format: str = "gptq", sym: bool = False, seed: int = 0
                    ) -> dict[str, torch.Tensor]:
    """Write `src` as a 4-bit `method` (awq | gptq) checkpoint in `dst`; returns the
    dequantized float32 weight of every quantized linear by its float tensor name.
    GPTQ v1 (`checkpoint_format="gptq"`) stores zero - 1, which only round-trips for
    zeros >= 1: use it with `sym=True` (zero 8), as GPTQ v1 checkpoints do."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    for name, w in tensors.items():
        if not any(name.endswith(f".{lin}.weight") for lin in LINEARS):
            out[name] = w
            continue
        prefix = name.removesuffix("weight")
        n, k = w.shape
        g = group if group > 0 else k
        perm = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
        q_p, scales, zeros = _quantize(w.float()[:, perm], g, sym)  # groups over channels in perm order
        q = torch.empty_like(q_p)
        q[:, perm] = q_p
        d_p = ((q_p.reshape(n, k // g, g) - zeros[..., None]) * scales.float()[..., None]).reshape(n, k)
        deq[name] = torch.empty_like(d_p)
        deq[name][:, perm] = d_p
        out[prefix + "scales"] = scales.t().contiguous()
        if method == "awq":
            out[prefix + "qweight"] = _pack_awq(q.t())
            out[prefix + "qzeros"] = _pack_cols(zeros.t(), AWQ_ORDER)
        else:
            stored = zeros - 1 if checkpoint_format == "gptq" else zeros
            out[prefix + "qweight"] = _pack_rows(q.t())
            out[prefix + "qzeros"] = _pack_cols(stored.t() & 0xF, list(range(8)))
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
            out[prefix + "g_idx"] = g_idx
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    if method == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                      "zero_point": True, "version": "gemm"}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                      "desc_act": desc_act, "sym": sym,
                                      "checkpoint_format": checkpoint_format}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return deq


def write_fake_quant(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    """`src` with the given float weights replaced (the dequantized reference model)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update({k: v.to(tensors[k].dtype).contiguous() for k, v in weights.items()})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def write_dequantized(src: Path, dst: Path, scheme: str) -> Path:
    """`src` as a float checkpoint whose decoder linears (experts included) hold the
    weights on-the-fly `scheme` (int8 | int4) quantization serves in float32: what a
    float32 worker started with `--quantization scheme` on `src` must compute."""
    from pdserve.engine.quant.formats import INT4_GROUP
    from pdserve.engine.quant.pack import quantize_int4, quantize_int8

    deq = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not any(name.endswith(f".{lin}.weight") for lin in LINEARS):
            continue
        if scheme == "int8":  # per row: quantizing a fused parameter's parts alone is the same
            parts = quantize_int8(w)
            deq[name] = parts.q.float() * parts.scales[:, None]
        else:  # groups run along K within a row: likewise
            k = w.shape[1]
            padded = torch.nn.functional.pad(w.float(), (0, -k % INT4_GROUP))
            deq[name] = quantize_int4(padded, INT4_GROUP).dequantize()[:, :k]
    return write_fake_quant(src, dst, deq)
