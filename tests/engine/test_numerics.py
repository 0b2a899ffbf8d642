"""The KV layout's compatibility hash names the kernels a worker's bf16/int8/int4
arithmetic and its paged attention route to (pdserve/engine/kernels/numerics.py): pools whose
rows come out in different bits (AMX vs AVX-512 BF16, VNNI int8 vs aten, the bf16-weight
attention loop vs the float32 one) never exchange blocks, while kernels that give the same
bits (the float32 emulation of `vdpbf16ps`) share a name, and float32 and GPU pools are as
before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.common.kv_layout import KVLayout
from pdserve.engine.kernels import cpu_features, table
from pdserve.engine.kernels.numerics import numerics

AMX_HOST = cpu_features.LEVELS["amx"]
AVX512_BF16 = cpu_features.LEVELS["avx512_bf16"]
AVX2 = cpu_features.LEVELS["avx2"]
LAYOUT = KVLayout(model_id="m", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16",
                  weights="w", compute_dtype="bfloat16")


def _hash(n: str) -> str:
    return replace(LAYOUT, numerics=n).compat_hash


def test_amx_avx512_bf16_and_emulated_pools_do_not_pair() -> None:
    """The emulation's linears have bf16_avx512's bits (one name), but its attention is the
    float32 loop, so an emulated pool and an AVX-512 BF16 one do not pair either."""
    amx, dp, emulated = (numerics("cpu", "bfloat16", features=f) for f in (AMX_HOST, AVX512_BF16, AVX2))
    assert amx == "bf16:bf16_amx,attn:vdpbf16ps"
    assert dp == "bf16:bf16_avx512,attn:vdpbf16ps"
    assert emulated == "bf16:bf16_avx512,attn:float32"
    assert len({_hash(amx), _hash(dp), _hash(emulated)}) == 3


def test_int8_routes_of_each_cpu_kind_are_named() -> None:
    names = {f: numerics("cpu", "bfloat16", "int8", features=f) for f in (AMX_HOST, AVX512_BF16 | {"avx512_vnni"}, AVX2)}
    assert len(set(names.values())) == 3, names  # AMX int8, VNNI + vdpbf16ps, aten: three answers
    assert "int8_amx" in names[AMX_HOST] and "int8_vnni" in names[AVX512_BF16 | {"avx512_vnni"}]
    assert names[AVX2].startswith("bf16:bf16_avx512,int8:") and names[AVX2].endswith(",attn:float32")
    # An int8 LM head alone brings the int8 kernels into the name.
    assert numerics("cpu", "bfloat16", "none", "int8", features=AVX2) == names[AVX2]


def test_int4_rows_of_the_gemv_and_its_many_row_tiles_share_a_name_and_aten_does_not() -> None:
    """Without AMX, 1-4 int4 rows run the GEMV and 5 up the same arithmetic in tiles (same
    bits: one name); under avx2 aten's kernel takes those rows (other bits: another hash)."""
    names = {f: numerics("cpu", "bfloat16", "int4", features=f) for f in (AMX_HOST, AVX512_BF16, AVX2)}
    assert names[AVX512_BF16] == "bf16:bf16_avx512,int4:int4_dequant+int4_gemv,attn:vdpbf16ps"
    assert names[AVX2] == "bf16:bf16_avx512,int4:int4_aten+int4_dequant,attn:float32"
    assert "int4_gemm_amx" in names[AMX_HOST]
    assert len({_hash(n) for n in names.values()}) == 3


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cuda", "bfloat16"), ("cuda", "float32")])
def test_float32_and_gpu_pools_keep_the_hash_they_had(device: str, dtype: str) -> None:
    for f in (AMX_HOST, AVX2):
        assert numerics(device, dtype, "int8", features=f) == ""
    assert _hash("") == LAYOUT.compat_hash


def test_this_process_names_what_its_layers_route_to() -> None:
    feats = table.available_features()
    plan = table.plan(table.LinearSpec("bf16", "bfloat16", "cpu", 768, 2048))
    assert numerics("cpu", "bfloat16") == numerics("cpu", "bfloat16", features=feats)
    assert numerics("cpu", "bfloat16") == "bf16:" + {"bf16_emulated": "bf16_avx512"}.get(
        plan.routes[0].kernel.name, plan.routes[0].kernel.name) + ",attn:" + (
        "vdpbf16ps" if cpu_features.has("avx512_bf16") else "float32")
