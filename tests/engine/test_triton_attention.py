"""Triton paged attention against `TorchPagedAttention`: on CPU under TRITON_INTERPRET=1 in
float32, and on CUDA compiled, in bfloat16 (bench/gpu_check.sh runs these with `-m gpu`).

TRITON_INTERPRET is read when the kernels are defined, so one process runs them either
interpreted or compiled: interpreted where there is no CUDA (the CPU cases run, the CUDA
ones skip), compiled where there is (the CUDA cases run, the CPU ones skip), unless the
variable is set by hand. The bf16 cases check against the float32 reference run on the
same bf16-rounded inputs, so the tolerance covers the kernel's own roundings only."""

from __future__ import annotations

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
os.environ.setdefault("TRITON_INTERPRET", "0" if CUDA else "1")  # see the module docstring
INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from pdserve.common.kv_layout import NULL_BLOCK  # noqa: E402
from pdserve.engine.attention.paged import TorchPagedAttention, build_metadata, order_chunks  # noqa: E402
from pdserve.engine.attention.triton_paged import TritonPagedAttention, plan_splits, select_backend  # noqa: E402
from pdserve.engine.core.runner_types import SeqChunk  # noqa: E402
from pdserve.engine.runner.kv_quant import QuantizedCache  # noqa: E402

NUM_BLOCKS = 64
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
# bf16 rounds q/k/v, the probabilities and the output (8 significant bits; outputs are
# averages of N(0, 1) values, |x| < 4): a few bf16 steps at most.
TOLERANCES = {"cpu": {"rtol": 1e-4, "atol": 1e-4}, "cuda": {"rtol": 2e-2, "atol": 3e-2}}
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not INTERPRET, reason="kernels compiled for CUDA in this process (TRITON_INTERPRET=0)")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not CUDA or INTERPRET, reason="needs CUDA and compiled kernels (TRITON_INTERPRET!=1)")]),
]


def _batch(ctx: list[int], prefills: list[tuple[int, int]], bs: int, heads: int, kvh: int,
           d: int, seed: int, device: str = "cpu"):
    """Decodes at `ctx`, then chunks of (start_pos, n) tokens, on fragmented block tables.
    Tensors on the CPU in float32; the reference's metadata (float32) and the Triton
    backend's (flat, in the device's dtype) on `device`."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, bs, kvh, d, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, bs, kvh, d, generator=gen)
    k_cache[NULL_BLOCK] = 1e4  # padding must never reach the output
    v_cache[NULL_BLOCK] = 1e4
    perm = [b for b in torch.randperm(NUM_BLOCKS, generator=gen).tolist() if b != NULL_BLOCK]
    chunks, taken = [], 0
    spans = [(n - 1, 1) for n in ctx] + prefills
    for start, n in spans:
        nb = math.ceil((start + n) / bs)
        table, taken = perm[taken : taken + nb], taken + nb
        chunks.append(SeqChunk([1] * n, start, table, True))
    order = order_chunks(chunks)
    dev = torch.device(device)
    meta = build_metadata(chunks, order, bs, torch.float32, dev)  # groups, for the torch path
    flat = build_metadata(chunks, order, bs, DTYPES[device], dev, flat_decode=True)
    t = meta.num_tokens
    q = torch.randn(t, heads, d, generator=gen)
    k = torch.randn(t, kvh, d, generator=gen)
    v = torch.randn(t, kvh, d, generator=gen)
    return q, k, v, k_cache, v_cache, meta, flat


def _parity(device: str, q, k, v, kc, vc, meta, flat, num_splits: int | None = None) -> None:
    """Triton on `device` in its dtype against the torch path in float32 on the same
    (rounded) inputs; both write the step's K/V alike."""
    dt = DTYPES[device]
    ins = [x.to(device, dt, copy=True) for x in (q, k, v, kc, vc)]
    ref = [x.to(torch.float32, copy=True) for x in ins]  # exact: bf16 values are float32 values
    want = TorchPagedAttention().forward(*ref, meta)
    got = TritonPagedAttention(num_splits=num_splits).forward(*ins, flat)
    assert got.dtype == dt and got.device.type == device
    assert torch.equal(ref[3].to(dt), ins[3]) and torch.equal(ref[4].to(dt), ins[4])
    torch.testing.assert_close(got.float(), want, **TOLERANCES[device])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("bs,d", [(16, 16), (4, 8)])  # tl.dot path, and the broadcast path
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_matches_torch_paged_attention(group: int, bs: int, d: int,
                                              num_splits: int | None, device: str) -> None:
    kvh = 2
    # Lengths on and off block boundaries; 300 forms its own decode group.
    ctx = [1, 5, 16, 17, 47, 130] if bs == 16 else [1, 3, 4, 9, 22, 61]
    if bs == 16:
        ctx.append(300)
    batch = _batch(ctx, [], bs, kvh * group, kvh, d, seed=group + bs, device=device)
    assert batch[5].decode is not None and batch[6].decode is not None
    _parity(device, *batch, num_splits=num_splits)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_step_keeps_prefill_rows_after_decodes(device: str) -> None:
    batch = _batch([9, 40], [(20, 7)], 16, 8, 2, 16, seed=7, device=device)
    assert batch[5].prefills and batch[5].decode is not None
    _parity(device, *batch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("bs,d", [(16, 16), (4, 8)])
def test_prefill_chunks_match_torch_paged_attention(group: int, bs: int, d: int,
                                                    device: str) -> None:
    """Whole prompts, prefix-cache hits and later chunks (start_pos > 0), lengths on and
    off block boundaries, rows spanning several query tiles."""
    kvh = 2
    chunks = [(0, 21), (0, 16), (16, 5), (13, 40), (37, 1 + bs)]
    batch = _batch([], chunks, bs, kvh * group, kvh, d, seed=3 * group + bs, device=device)
    assert len(batch[5].prefills) == len(chunks) and batch[5].decode is None
    _parity(device, *batch)


def test_split_plan_covers_every_block_once() -> None:
    for batch, blocks, forced in [(1, 256, None), (64, 256, None), (1, 3, None), (2, 10, 4),
                                  (1, 5, 99)]:
        plan = plan_splits(batch, 8, blocks, forced)
        assert plan.num_splits * plan.blocks_per_split >= blocks
        assert (plan.num_splits - 1) * plan.blocks_per_split < blocks  # no empty split
    assert plan_splits(1, 8, 256).num_splits > 1  # long context, small batch: split
    assert plan_splits(64, 8, 256).num_splits == 1  # enough programs already


def test_quantized_pool_is_refused_and_never_selected() -> None:
    codes = torch.zeros(4, 16, 2, 16, dtype=torch.uint8)
    qc = QuantizedCache(codes, torch.ones(4, 2), "int8")
    q, k, v, _, _, _, flat = _batch([5], [], 16, 4, 2, 16, seed=1)
    with pytest.raises(TypeError, match="unquantized"):
        TritonPagedAttention().forward(q, k, v, qc, qc, flat)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert type(select_backend(torch.bfloat16, cuda, plain_kv=False)) is TorchPagedAttention
    assert type(select_backend(torch.float32, cpu)) is TorchPagedAttention
    assert isinstance(select_backend(torch.bfloat16, cuda), TritonPagedAttention)
