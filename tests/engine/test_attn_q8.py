"""Decode attention over an fp8/int8 KV pool read in place (pdserve/engine/kernels/_attn_q8.c) against a
float64 softmax over the gathered, dequantized blocks; the routing that picks it; the
engine's greedy output against the gather + dequantize + SDPA path; and bad input.

Bound (stated, and why): the codes decode to float32 exactly and the scales are applied
in float32, so against float64 the loop is off by float32 accumulation only (<= 1e-5 of
the largest |V| here); a bf16 output adds one rounding (2^-8 of the value).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import pytest
import torch

from bench.quality import heldout_rows
from pdserve.builtin.default_model import write_builtin_model
from pdserve.common.kv_layout import KVLayout
from pdserve.engine.attention import native as native_attention
from pdserve.engine.attention.native import InPlacePagedAttention, NativeAttention, default_backend
from pdserve.engine.attention.paged import TorchPagedAttention, build_metadata, order_chunks
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.kv_pool import KVPool
from pdserve.engine.runner.kv_quant import QuantizedCache, read_blocks, write_kv
from pdserve.engine.runner.model_runner import ModelRunner

KINDS = ("fp8_e4m3", "int8")
BS, KVH, HEADS, NBLOCKS = 16, 2, 6, 130
CTX = [1, 15, 16, 17, 33, 129, 250, 700, 1500]  # one key, block edges, ragged, long


@pytest.fixture(scope="module")
def native() -> NativeAttention:
    assert native_attention.NATIVE is not None, "pdserve/engine/kernels/_cpu_kernels.c was not built (pip install -e .)"
    assert native_attention.NATIVE.reads_quantized, "the build lacks pdserve/engine/kernels/_attn_q8.c"
    return native_attention.NATIVE


@contextmanager
def simd(native: NativeAttention, on: bool) -> Iterator[None]:
    """The AVX-512 loop (where the CPU has it) or the portable one, for the block."""
    was = native._lib.pd_attn_q8_simd_set(int(on))
    try:
        yield
    finally:
        native._lib.pd_attn_q8_simd_set(was)


@cache
def _pool(kind: str, d: int, seed: int) -> tuple[KVPool, QuantizedCache, QuantizedCache]:
    """A pool whose every block holds values of its own magnitude per head (so scales vary
    per block and head), some small enough for e4m3's subnormal codes."""
    layout = KVLayout("m", num_layers=1, num_kv_heads=KVH, head_dim=d, block_size=BS, dtype=kind,
                      compute_dtype="bfloat16")
    pool = KVPool(layout, num_blocks=NBLOCKS)
    k, v = pool.layer_views(0)
    assert isinstance(k, QuantizedCache) and isinstance(v, QuantizedCache)
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(BS, NBLOCKS * BS)  # every block but the null one, from slot 0
    for view in (k, v):
        mag = torch.randn(NBLOCKS - 1, 1, KVH, 1, generator=g).exp()
        x = torch.randn(NBLOCKS - 1, BS, KVH, d, generator=g) * mag
        x[torch.rand(x.shape, generator=g) < 0.05] *= 1e-5
        write_kv(view, slots, x.view(-1, KVH, d))
    scales = k.scales[1:]
    assert scales.std() > 0.3 * scales.mean()  # the scales really do vary per block and head
    return pool, k, v


def _chunks(ctx: list[int], seed: int) -> list[SeqChunk]:
    perm = (torch.randperm(NBLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    chunks, taken = [], 0
    for n in ctx:  # fragmented tables; a long context may reuse blocks another holds
        nb = math.ceil(n / BS)
        chunks.append(SeqChunk([1], n - 1, [perm[(taken + i) % len(perm)] for i in range(nb)], True))
        taken += nb
    return chunks


def _reference(q: torch.Tensor, k: QuantizedCache, v: QuantizedCache, c: SeqChunk, d: int) -> torch.Tensor:
    """float64 softmax attention of one decode over its own dequantized keys."""
    n = c.start_pos + 1
    table = torch.tensor(c.block_table)
    keys = read_blocks(k, table, torch.float64).view(-1, KVH, d)[:n]
    vals = read_blocks(v, table, torch.float64).view(-1, KVH, d)[:n]
    qh = q.double().view(KVH, HEADS // KVH, d)
    scores = torch.einsum("kgd,tkd->kgt", qh, keys) / math.sqrt(d)
    return torch.einsum("kgt,tkd->kgd", scores.softmax(-1), vals).reshape(-1)


def _decode(native: NativeAttention, q: torch.Tensor, k: QuantizedCache, v: QuantizedCache,
            chunks: list[SeqChunk]) -> torch.Tensor:
    meta = build_metadata(chunks, list(range(len(chunks))), BS, q.dtype, torch.device("cpu"),
                          flat_decode=True)
    assert meta.decode is not None and meta.decode.block_tables is not None
    assert meta.decode.ctx_lens is not None
    return native.decode_quantized(q, k, v, meta.decode.block_tables, meta.decode.ctx_lens, 2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d, dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (32, torch.float32),
                                      (48, torch.bfloat16)])
def test_decode_equals_float64_attention_over_the_dequantized_blocks(
    native: NativeAttention, kind: str, d: int, dtype: torch.dtype
) -> None:
    _, k, v = _pool(kind, d, seed=d)
    vmax = float(read_blocks(v, torch.arange(1, NBLOCKS), torch.float32).abs().max())
    for seed in (0, 1):  # two sets of block tables over the same pool
        chunks = _chunks(CTX, seed)
        g = torch.Generator().manual_seed(seed)
        # q as the model hands it over: a view into the qkv projection, rows apart.
        q = torch.randn(len(CTX), HEADS + 2 * KVH, d, generator=g).to(dtype)[:, :HEADS]
        want = [_reference(q[row], k, v, c, d) for row, c in enumerate(chunks)]
        for on in (True, False):
            with simd(native, on):
                out = _decode(native, q, k, v, chunks)
            assert out.dtype == dtype and out.shape == (len(CTX), HEADS * d)
            for row, c in enumerate(chunks):
                bound = 1e-5 * vmax + (2.0**-8 * want[row].abs() if dtype == torch.bfloat16 else 0.0)
                err = (out[row].double() - want[row]).abs()
                assert bool((err <= bound).all()), \
                    f"simd={on} ctx {c.start_pos + 1}: error {float(err.max()):.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_backend_routes_a_quantized_pool_in_place_and_agrees_with_the_gather_path(
    native: NativeAttention, kind: str
) -> None:
    backend = default_backend(torch.bfloat16, torch.device("cpu"), plain_kv=False, quantized_kv=True)
    assert isinstance(backend, InPlacePagedAttention)
    assert isinstance(default_backend(torch.float32, torch.device("cpu"), False, True), TorchPagedAttention)
    _, k, v = _pool(kind, 64, seed=7)
    chunks = _chunks([40, 300, 1, 129], seed=3)
    order = order_chunks(chunks)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(chunks), HEADS, 64, generator=g).bfloat16()
    new = torch.randn(len(chunks), KVH, 64, generator=g).bfloat16()
    flat = build_metadata(chunks, order, BS, torch.bfloat16, torch.device("cpu"), flat_decode=True)
    grouped = build_metadata(chunks, order, BS, torch.bfloat16, torch.device("cpu"))
    got = backend.forward(q, new, new, k, v, flat)  # writes the new token, then reads in place
    want = TorchPagedAttention().forward(q, new, new, k, v, grouped)
    # Both read the same codes; SDPA rounds its dequantized K/V to bf16, this loop does not.
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("trained"))


def test_runner_with_quantized_kv_uses_the_in_place_kernel_unless_turned_off(
    native: NativeAttention, trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = EngineConfig(model_dir=str(trained), dtype="bfloat16", kv_cache_dtype="fp8",
                       cache=CacheConfig(block_size=BS, num_blocks=20))
    assert isinstance(ModelRunner(cfg).backend, InPlacePagedAttention)
    monkeypatch.setattr(native_attention, "NATIVE", None)  # what PDSERVE_NATIVE_KERNELS=0 leaves
    assert type(ModelRunner(cfg).backend) is TorchPagedAttention


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_greedy_decode_equals_the_gather_path(native: NativeAttention, kv: str, trained: Path) -> None:
    """The trained built-in model in bf16 over a quantized cache, greedy from held-out
    text, through either loop: the same tokens as the gather + dequantize + SDPA path,
    logits within bf16 rounding of it (the arithmetic order differs, so not bit for bit)."""
    cfg = EngineConfig(model_dir=str(trained), dtype="bfloat16", kv_cache_dtype=kv,
                       cache=CacheConfig(block_size=BS, num_blocks=40))
    prompts = [row[:n] for row, n in zip(heldout_rows(trained, 3, 80), (70, 33, 5), strict=True)]
    tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(3)]

    def greedy(runner: ModelRunner) -> torch.Tensor:
        logits = [runner.execute([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])]
        for step in range(24):
            last = logits[-1].argmax(-1).tolist()
            logits.append(runner.execute([SeqChunk([last[i]], len(p) + step, t, True)
                                          for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]))
        return torch.stack(logits)

    gather = greedy(ModelRunner(cfg, backend=TorchPagedAttention()))
    runner = ModelRunner(cfg)
    assert isinstance(runner.backend, InPlacePagedAttention)
    for on in (True, False):
        with simd(native, on):
            in_place = greedy(runner)
        assert torch.equal(in_place.argmax(-1), gather.argmax(-1)), f"simd={on}"
        assert float((in_place - gather).abs().max()) <= 0.05 * float(gather.abs().max())


def test_bad_input_is_refused_before_anything_is_read(native: NativeAttention) -> None:
    _, k, v = _pool("int8", 64, seed=1)
    q = torch.randn(1, HEADS, 64).bfloat16()
    lens = torch.tensor([20])
    with pytest.raises(ValueError, match="block id outside the pool"):
        native.decode_quantized(q, k, v, torch.tensor([[3, NBLOCKS]]), lens, 1)
    with pytest.raises(ValueError, match="bad context length"):
        native.decode_quantized(q, k, v, torch.tensor([[3]]), lens, 1)
    _, k8, _ = _pool("fp8_e4m3", 64, seed=1)
    with pytest.raises(ValueError, match="alike"):
        native.decode_quantized(q, k8, v, torch.tensor([[3, 4]]), lens, 1)
    squeezed = QuantizedCache(k.codes.transpose(2, 3), k.scales, k.kind)
    with pytest.raises(ValueError, match="do not fit|laid out"):
        native.decode_quantized(q, squeezed, v, torch.tensor([[3, 4]]), lens, 1)
    with pytest.raises(ValueError, match="query heads"):
        native.decode_quantized(torch.randn(1, 5, 64).bfloat16(), k, v, torch.tensor([[3, 4]]), lens, 1)
