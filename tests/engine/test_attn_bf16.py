"""The AVX-512 BF16 loop of the paged decode attention (pdserve/engine/kernels/_attn_bf16.c) and the
generic loop it replaces (`pd_attn_bf16_set(0)`), each against a float64 softmax within the
error its rounding allows, for the head sizes the fast loop takes (64, 128), query groups
over and under one register pass, and a head size it leaves to the generic loop."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from pdserve.engine.attention import native as native_attention
from pdserve.engine.attention.native import NativeAttention
from pdserve.engine.kernels import cpu_features
from pdserve.engine.kernels import native as native_kernels

BS, NBLOCKS = 16, 400
CPU_OK = native_kernels.LIB is not None and hasattr(native_kernels.LIB, "pd_attn_bf16_set")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def native() -> NativeAttention:
    assert native_attention.NATIVE is not None, "pdserve/engine/kernels/_cpu_kernels.c was not built (pip install -e .)"
    assert CPU_OK, "the library predates pdserve/engine/kernels/_attn_bf16.c"
    return native_attention.NATIVE


@pytest.fixture
def generic_loop() -> Iterator[None]:
    lib = native_kernels.LIB
    assert lib is not None
    was = lib.pd_attn_bf16_set(0)
    yield
    lib.pd_attn_bf16_set(was)


def _case(ctx: list[int], kvh: int, heads: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NBLOCKS, BS, kvh, d, generator=g).bfloat16()
    v = torch.randn(NBLOCKS, BS, kvh, d, generator=g).bfloat16()
    k[0] = v[0] = 1e4  # the null block: must never be read
    perm = (torch.randperm(NBLOCKS - 1, generator=g) + 1).tolist()
    width = max(math.ceil(n / BS) for n in ctx)
    tables = torch.zeros(len(ctx), width, dtype=torch.int64)
    taken = 0
    for i, n in enumerate(ctx):
        nb = math.ceil(n / BS)
        tables[i, :nb] = torch.tensor(perm[taken : taken + nb])
        taken += nb
    q = (torch.randn(len(ctx), heads, d, generator=g) * 2).bfloat16()  # peaky softmax too
    return q, k, v, tables, torch.tensor(ctx)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
               lens: torch.Tensor, weight_of_abs: bool = False) -> torch.Tensor:
    """Each row's attention in float64; weight_of_abs: sum_t p_t |v_t| instead (what a
    relative error in each p_t can move the output by)."""
    rows = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = torch.arange(n)
        blocks = tables[b][slots // BS]
        keys, vals = k[blocks, slots % BS].double(), v[blocks, slots % BS].double()  # [n, kvh, d]
        kvh, d = keys.shape[1], keys.shape[2]
        qh = q[b].double().view(kvh, -1, d)
        scores = torch.einsum("kgd,tkd->kgt", qh, keys) / math.sqrt(d)
        vals = vals.abs() if weight_of_abs else vals
        rows.append(torch.einsum("kgt,tkd->kgd", scores.softmax(-1), vals).reshape(-1))
    return torch.stack(rows)


def _assert_within_bf16(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        tables: torch.Tensor, lens: torch.Tensor) -> None:
    """got within what bf16 allows of the float64 attention: the output's one rounding
    (2^-9 relative), the fast loop's probabilities rounded to bf16 before p . V (each p_t
    within 2^-9, so the sum within 2^-9 sum_t p_t |v_t|), float32 sums and exp (far
    below): bounded by 2^-8 of each, plus 1e-4 for outputs near 0."""
    want = _reference(q, k, v, tables, lens)
    spread = _reference(q, k, v, tables, lens, weight_of_abs=True)
    err = (got.double() - want).abs()
    bound = 2.0**-8 * (want.abs() + spread) + 1e-4
    assert bool((err <= bound).all()), (err - bound).max()


SHAPES = [(4, 12, 64), (2, 4, 128), (1, 6, 64), (2, 2, 128), (2, 6, 96)]  # (KVH, H, D); G = 3, 2, 6, 1, 3


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"kvh{s[0]}-h{s[1]}-d{s[2]}")
def test_both_loops_match_float64_within_bf16(native: NativeAttention, shape: tuple[int, int, int],
                                                     request: pytest.FixtureRequest) -> None:
    kvh, heads, d = shape
    q, k, v, tables, lens = _case([1, 15, 16, 17, 300, 1029], kvh, heads, d)
    fast = native.decode(q, k, v, tables, lens, 1)
    assert torch.equal(native.decode(q, k, v, tables, lens, 2), fast)  # threads: same result
    _assert_within_bf16(fast, q, k, v, tables, lens)
    request.getfixturevalue("generic_loop")
    generic = native.decode(q, k, v, tables, lens, 1)
    _assert_within_bf16(generic, q, k, v, tables, lens)
    if d in (64, 128) and cpu_features.has("avx512_bf16"):  # the fast loop ran, not the generic one
        assert not torch.equal(fast, generic)


def test_fast_loop_refuses_bad_block_ids_before_reading(native: NativeAttention) -> None:
    q, k, v, tables, lens = _case([40], 4, 12, 64)
    for bad in (NBLOCKS, -1, 10**12):
        t = tables.clone()
        t[0, 2] = bad  # the last block of the 40 keys
        with pytest.raises(ValueError, match="block id outside the pool"):
            native.decode(q, k, v, t, lens, 1)


def test_long_context_softmax_is_stable(native: NativeAttention) -> None:
    """Scores far apart (large q) must not overflow exp: the max is subtracted first."""
    q, k, v, tables, lens = _case([2000], 4, 12, 64, seed=5)
    q = (q.float() * 40).bfloat16()
    out = native.decode(q, k, v, tables, lens, 1)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.double(), _reference(q, k, v, tables, lens), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"kvh{s[0]}-h{s[1]}-d{s[2]}")
@pytest.mark.parametrize("loop", ["fast", "generic"])
def test_prefill_rows_are_the_bits_of_the_decode_at_their_position(
        native: NativeAttention, shape: tuple[int, int, int], loop: str, request: pytest.FixtureRequest) -> None:
    """`prefill` attends a few consecutive rows per work item (_attn_bf16.c's row tiles, up to
    6 (row, head) pairs per p.V pass): each row has the bits of a decode at its position, for
    any start (a prefix-cache hit) and row count (tiles of 8 with ragged ends), thread count,
    and on the generic loop (head size 96, or the fast loop switched off)."""
    if loop == "generic":
        request.getfixturevalue("generic_loop")
    kvh, heads, d = shape
    q, k, v, tables, _ = _case([340], kvh, heads, d, seed=2)
    rows = (torch.randn(340, heads, d, generator=torch.Generator().manual_seed(4)) * 2).bfloat16()
    table = tables[0]
    for start, n in ((0, 1), (0, 23), (5, 6), (17, 40), (300, 40), (0, 340)):
        q = rows[start : start + n]
        got = native.prefill(q, k, v, table, start, 1)
        decodes = native.decode(q, k, v, table.view(1, -1).expand(n, -1).contiguous(),
                                torch.arange(start + 1, start + n + 1), 1)
        assert torch.equal(got.view(torch.int16), decodes.view(torch.int16)), (start, n)
        assert torch.equal(native.prefill(q, k, v, table, start, 2), got), (start, n)
    with pytest.raises(ValueError, match="bad context length"):
        native.prefill(rows[:30], k, v, table[:1], 0, 1)  # 30 rows need 2 blocks
    bad = table.clone()
    bad[1] = NBLOCKS
    with pytest.raises(ValueError, match="block id outside the pool"):
        native.prefill(rows[:20], k, v, bad, 0, 1)
