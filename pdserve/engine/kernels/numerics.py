"""Which kernels a worker's low-precision arithmetic comes from, named for the KV layout's
compatibility hash (pdserve/common/kv_layout.py, docs/determinism.md).

A bf16 row's bits are the same on every row count, chunk and worker of one CPU kind, but
not between kinds: AMX tiles sum a dot product in another order than `vdpbf16ps` does. A
prefill worker on an AMX host and a decode worker on an AMD EPYC would each give answers
right within bf16 rounding, but their pair would give neither's, and a stream recovered
from one on the other would change mid-way. So the kernels a worker's bf16, int8 and int4
layers route to are part of what two pools must share to exchange blocks; kernels that
give the same bits share a name (`bf16_emulated` computes `vdpbf16ps` step for step,
tests/engine/test_cpu_masks.py; `int4_gemm_vnni` is the int4 GEMV's arithmetic over more rows,
tests/engine/test_int4_tiles.py). The paged attention is named too: on AVX-512 BF16 its loop
rounds the softmax weights to bf16 and sums by `vdpbf16ps` (pdserve/engine/kernels/_attn_bf16.c),
elsewhere a float32 loop runs, so the emulation's linears pair with `bf16_avx512` but its
attention does not. float32 runs aten's kernels on every kind and is left out, as is a GPU
(one device kind per pool there)."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.kernels import table

# Kernels whose results are bit-identical: one name in the hash.
SAME_BITS = {"bf16_emulated": "bf16_avx512", "int4_gemm_vnni": "int4_gemv"}
INT4_SCHEMES = ("int4", "awq", "gptq")


def _spec(op: str, act_dtype: str) -> table.LinearSpec:
    """A layer of a typical size: the routes depend on the op, the dtype and the host, and
    on a shape only past limits no model's projections reach."""
    return table.LinearSpec(op, act_dtype, "cpu", 4096, 4096, 128 if op == "int4" else 0)


def numerics(device_type: str, dtype: str, quantization: str = "none", lm_head: str = "none",
             features: Iterable[str] | None = None) -> str:
    """The kernel families of a worker computing in `dtype` on `device_type` with weight
    `quantization` and LM head `lm_head`, on a CPU with `features` (None: this process's,
    `PDSERVE_CPU_FEATURES` applied): "" where they cannot differ between CPU kinds."""
    if device_type != "cpu" or dtype not in ("bfloat16", "float16"):
        return ""
    ops = ["bf16"]
    if quantization == "int8" or lm_head == "int8":
        ops.append("int8")
    if quantization in INT4_SCHEMES:
        ops.append("int4")
    parts = []
    for op in ops:
        names = {SAME_BITS.get(r.kernel.name, r.kernel.name) for r in table.plan(_spec(op, dtype), features).routes}
        parts.append(f"{op}:{'+'.join(sorted(names))}")
    parts.append(f"attn:{attention(dtype, features)}")
    return ",".join(parts)


def attention(dtype: str, features: Iterable[str] | None = None) -> str:
    """The paged attention's arithmetic on a CPU with `features` (None: this process's):
    `vdpbf16ps` (bf16 weights, pdserve/engine/kernels/_attn_bf16.c) where AVX-512 BF16 runs a bf16
    model, else `float32` (the generic loop, or torch's for float16). Head sizes the fast loop
    does not take (other than 64 and 128) run the generic loop on every kind: named by the
    CPU all the same, which refuses pairs that would agree rather than admit any that would not."""
    feats = frozenset(table.available_features() if features is None else features)
    return "vdpbf16ps" if dtype == "bfloat16" and "avx512_bf16" in feats else "float32"
