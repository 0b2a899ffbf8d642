"""FlashInfer as an optional attention backend: the block table -> page list conversion,
the backend's wiring (over a test double of flashinfer's two paged wrappers that computes
what their documentation says they compute), the choice and refusal of
`--attention-backend`, and, with CUDA and flashinfer installed, parity in bf16 against
`TorchPagedAttention`."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch

from pdserve.cli import build_parser
from pdserve.cli.args import UsageError
from pdserve.cli.up import _worker_cmds, gpu_settings
from pdserve.cli.workers import check_gpu_args
from pdserve.common.kv_layout import NULL_BLOCK
from pdserve.engine.attention.backend_choice import installed, make_backend, refusal, resolve
from pdserve.engine.attention.flashinfer import FlashInferAttention, paged_kv_index, prefill_index
from pdserve.engine.attention.paged import TorchPagedAttention, build_metadata, order_chunks
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.cuda_graphs import graph_support

T = torch.tensor
NUM_BLOCKS = 64


def _index(tables: list[list[int]], lens: list[int], bs: int) -> list[list[int]]:
    idx = paged_kv_index(T(tables), T(lens), bs)
    assert idx.indptr.dtype == idx.indices.dtype == idx.last_page_len.dtype == torch.int32
    return [idx.indptr.tolist(), idx.indices.tolist(), idx.last_page_len.tolist()]


def test_block_tables_become_csr_pages_with_last_page_lengths() -> None:
    # Fragmented tables padded with the null block (0) and stale entries past each context.
    assert _index([[9, 3, 41, 0], [7, 0, 0, 0], [12, 2, 5, 8]], [33, 5, 60], 16) == [
        [0, 3, 4, 8], [9, 3, 41, 7, 12, 2, 5, 8], [1, 5, 12]]
    # Contexts that are whole multiples of the block size: the last page is full, never 0,
    # and no extra page is listed (the stale 30 and 31 are not read).
    assert _index([[4, 30, 31], [6, 17, 31]], [16, 32], 16) == [[0, 1, 3], [4, 6, 17], [16, 16]]
    assert _index([[5], [11]], [1, 4], 4) == [[0, 1, 2], [5, 11], [1, 4]]  # 1 token; a full block
    assert _index([[2, 9, 1]], [9], 3) == [[0, 3], [2, 9, 1], [3]]  # block size 3: 9 = 3 x 3
    empty = paged_kv_index(torch.empty(0, 4, dtype=torch.long), torch.empty(0, dtype=torch.long), 16)
    assert empty.indptr.tolist() == [0] and empty.indices.numel() == 0


def test_bad_tables_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="needs 3 blocks; the tables hold 2"):
        paged_kv_index(T([[1, 2]]), T([33]), 16)
    with pytest.raises(ValueError, match="context length < 1"):
        paged_kv_index(T([[1, 2]]), T([0]), 16)
    with pytest.raises(ValueError, match="one batch"):
        paged_kv_index(T([[1, 2]]), T([3, 4]), 16)


def test_prefill_chunks_become_query_and_page_lists() -> None:
    chunks = [SeqChunk([1] * 7, 0, [4], True), SeqChunk([1] * 5, 27, [9, 3], True),
              SeqChunk([1] * 4, 28, [8, 2, 6, 13], True)]  # the last table is longer than needed
    meta = build_metadata(chunks, order_chunks(chunks), 16, torch.float32, torch.device("cpu"))
    qo, idx = prefill_index(meta.prefills, 16)
    assert qo.tolist() == [0, 7, 12, 16] and qo.dtype == torch.int32
    assert idx.indptr.tolist() == [0, 1, 3, 5] and idx.indices.tolist() == [4, 9, 3, 8, 2]
    assert idx.last_page_len.tolist() == [7, 16, 16]


# -- the backend over a test double of flashinfer's documented paged wrappers ------------

def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, first: int) -> torch.Tensor:
    """q [n, H, D] at positions first .. first + n - 1 over keys/vals [L, KVH, D], causal."""
    g = q.shape[1] // keys.shape[1]
    keys, vals = keys.repeat_interleave(g, 1).float(), vals.repeat_interleave(g, 1).float()
    s = torch.einsum("nhd,lhd->hnl", q.float(), keys) / math.sqrt(q.shape[2])
    pos = torch.arange(keys.shape[0])[None, :] <= torch.arange(first, first + q.shape[0])[:, None]
    s = s.masked_fill(~pos[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), vals).to(q.dtype)


class _Wrapper:
    calls: list[str]

    def __init__(self, workspace: torch.Tensor, layout: str, **_: Any) -> None:
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.plan_args: tuple[Any, ...] = ()

    def _pages(self, i: int, k: torch.Tensor, v: torch.Tensor, page: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        indptr, indices, last = self.plan_args[-3:]
        ids = indices[indptr[i]:indptr[i + 1]].long()
        n = (len(ids) - 1) * page + int(last[i])
        kvh, d = k.shape[2], k.shape[3]
        return k[ids].reshape(-1, kvh, d)[:n], v[ids].reshape(-1, kvh, d)[:n]


class _Decode(_Wrapper):
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, h: int, kvh: int,
             d: int, page: int, **kw: Any) -> None:
        assert kw["pos_encoding_mode"] == "NONE" and indices.dtype == torch.int32
        self.page, self.plan_args = page, (indptr, indices, last)
        _Wrapper.calls.append("decode")

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = []
        for i in range(q.shape[0]):
            keys, vals = self._pages(i, *kv, self.page)
            out.append(_attend(q[i:i + 1], keys, vals, keys.shape[0] - 1))
        return torch.cat(out)


class _Prefill(_Wrapper):
    def plan(self, qo: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor,
             h: int, kvh: int, d: int, page: int, **kw: Any) -> None:
        assert kw["causal"] is True
        self.page, self.qo, self.plan_args = page, qo, (indptr, indices, last)
        _Wrapper.calls.append("prefill")

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = []
        for i in range(len(self.qo) - 1):
            rows = q[int(self.qo[i]):int(self.qo[i + 1])]
            keys, vals = self._pages(i, *kv, self.page)
            out.append(_attend(rows, keys, vals, keys.shape[0] - rows.shape[0]))  # bottom-right
        return torch.cat(out)


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = _Decode  # type: ignore[attr-defined]
    mod.BatchPrefillWithPagedKVCacheWrapper = _Prefill  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    _Wrapper.calls = []
    return _Wrapper.calls


def _step(ctx: list[int], prefills: list[tuple[int, int]], bs: int, heads: int, kvh: int, d: int,
          dtype: torch.dtype, device: str, seed: int = 0) -> tuple[Any, ...]:
    """Decodes at `ctx`, then chunks of (start_pos, n) tokens, on fragmented block tables."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc = (torch.randn(NUM_BLOCKS, bs, kvh, d, generator=gen) for _ in range(2))
    kc[NULL_BLOCK] = vc[NULL_BLOCK] = 1e4  # padding must never reach the output
    perm = [b for b in torch.randperm(NUM_BLOCKS, generator=gen).tolist() if b != NULL_BLOCK]
    chunks, taken = [], 0
    for start, n in [(c - 1, 1) for c in ctx] + prefills:
        nb = math.ceil((start + n) / bs)
        chunks.append(SeqChunk([1] * n, start, perm[taken:taken + nb], True))
        taken += nb
    dev = torch.device(device)
    meta = build_metadata(chunks, order_chunks(chunks), bs, torch.float32, dev)
    flat = build_metadata(chunks, order_chunks(chunks), bs, dtype, dev, flat_decode=True)
    q, k, v = (torch.randn(meta.num_tokens, h, d, generator=gen) for h in (heads, kvh, kvh))
    ins = [x.to(device, dtype) for x in (q, k, v, kc, vc)]
    return ins, meta, flat


def _parity(ins: list[torch.Tensor], meta: Any, flat: Any, backend: FlashInferAttention,
            layers: int = 1, **tol: float) -> None:
    ref = [x.float() for x in ins]  # exact copies: bf16 values are float32 values
    want = TorchPagedAttention().forward(*ref, meta)
    for _ in range(layers):  # every layer of a step shares its metadata
        got = backend.forward(*ins, flat)
    assert got.shape == want.shape and got.dtype == ins[0].dtype
    assert torch.equal(ins[3].float(), ref[3]) and torch.equal(ins[4].float(), ref[4])  # K/V written
    torch.testing.assert_close(got.float(), want, **tol)


def test_backend_matches_torch_and_plans_once_per_step(fake_flashinfer: list[str]) -> None:
    """Decodes on and off block boundaries, a whole prompt, a prefix hit and a later chunk
    in one step; three layers plan once; the next step plans again."""
    backend = FlashInferAttention(torch.device("cpu"), workspace_bytes=1024)
    ins, meta, flat = _step([1, 16, 17, 47, 130], [(0, 21), (16, 5), (13, 40), (37, 17)],
                            16, 8, 2, 16, torch.float32, "cpu")
    _parity(ins, meta, flat, backend, layers=3, rtol=1e-5, atol=1e-5)
    assert fake_flashinfer == ["decode", "prefill"]
    ins, meta, flat = _step([3, 9], [], 4, 4, 4, 8, torch.float32, "cpu", seed=1)  # decodes only
    _parity(ins, meta, flat, backend, rtol=1e-5, atol=1e-5)
    assert fake_flashinfer == ["decode", "prefill", "decode"]
    assert graph_support(None, torch.device("cuda"), backend, False, False, False) \
        == "FlashInferAttention (it plans each step on the host)"


# -- choosing a backend --------------------------------------------------------------------

def test_auto_prefers_flashinfer_then_triton_on_cuda_and_explicit_choices_are_checked() -> None:
    assert resolve("auto", "cuda", False, True, True) == "flashinfer"
    assert resolve("auto", "cuda", False, True, False) == "triton"
    assert resolve("auto", "cuda", False, False, False) == "torch"
    assert resolve("auto", "cuda", True, True, True) == "torch"  # a quantized pool
    assert resolve("auto", "cpu", False, True, True) == "torch"
    assert resolve("triton", "cuda", False, True, True) == "triton"
    assert resolve("flashinfer", "cuda", False, False, True) == "flashinfer"
    assert resolve("torch", "cuda", False, True, True) == "torch"
    assert resolve("auto", "cuda", False, True, True, head_dim=128) == "flashinfer"
    assert resolve("auto", "cuda", False, True, True, head_dim=16) == "triton"  # no flashinfer kernel
    with pytest.raises(ValueError, match="flashinfer has kernels for head sizes 64, 128, 256, not 16"):
        resolve("flashinfer", "cuda", False, True, True, head_dim=16)
    for choice in ("triton", "flashinfer"):
        with pytest.raises(ValueError, match=f"^--attention-backend {choice} needs a CUDA device, not cpu$"):
            resolve(choice, "cpu", False, True, True)
        with pytest.raises(ValueError, match=f"needs the {choice} package, which is not installed"):
            resolve(choice, "cuda", False, False, False)
        assert "plain KV pool" in (refusal(choice, "cuda", True, True) or "")
    assert refusal("cudnn", "cuda", False, True) == \
        "unknown attention backend 'cudnn'; choose one of auto, torch, triton, flashinfer"
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn'"):
        EngineConfig(model_dir="x", attention_backend="cudnn")


def test_cpu_runners_keep_the_native_or_torch_backend_and_refuse_gpu_ones() -> None:
    cpu = torch.device("cpu")
    for choice in ("auto", "torch"):
        assert isinstance(make_backend(choice, torch.float32, cpu), TorchPagedAttention)
        assert isinstance(make_backend(choice, torch.bfloat16, cpu, plain_kv=False), TorchPagedAttention)
    with pytest.raises(ValueError, match="flashinfer needs a CUDA device"):
        make_backend("flashinfer", torch.float32, cpu)


def _worker(*flags: str) -> Any:
    return build_parser().parse_args(["prefill", "--gateway", "tcp://127.0.0.1:1", *flags])


def test_the_cli_refuses_what_cannot_run_and_up_passes_the_choice_on() -> None:
    with pytest.raises(UsageError, match="argument --attention-backend: flashinfer needs a CUDA device, not cpu"):
        check_gpu_args(_worker("--attention-backend", "flashinfer"))
    if not installed("flashinfer"):
        with pytest.raises(UsageError, match="flashinfer package, which is not installed"):
            check_gpu_args(_worker("--device", "cuda", "--attention-backend", "flashinfer"))
    check_gpu_args(_worker("--attention-backend", "torch"))
    cmds = _worker_cmds(build_parser().parse_args(["up", "--device", "cuda", "--attention-backend", "triton"]), "tcp://x:1")
    assert all(build_parser().parse_args(c[3:]).attention_backend == "triton" for c in cmds)
    with pytest.raises(UsageError, match="--attention-backend"):
        gpu_settings(build_parser().parse_args(["up", "--attention-backend", "triton"]), 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not installed("flashinfer"),
                    reason="needs CUDA and flashinfer (an optional package)")
def test_flashinfer_matches_torch_paged_attention_on_cuda() -> None:
    backend = FlashInferAttention(torch.device("cuda"))
    for seed, (ctx, pre) in enumerate([([1, 16, 17, 300], []), ([9, 40], [(0, 21), (16, 5), (37, 17)]),
                                       ([], [(0, 64), (48, 80)])]):
        ins, meta, flat = _step(ctx, pre, 16, 32, 8, 128, torch.bfloat16, "cuda", seed=seed)
        _parity(ins, meta, flat, backend, layers=2, rtol=2e-2, atol=3e-2)
