"""Tensor parallel over quantized weights (pdserve/engine/parallel/quant_shard.py).

A weight is quantized whole and then sliced, so a TP group holds the single process's
codes, scales and zeros: TP 2 greedy tokens equal TP 1's under the same scheme (bf16: up to
a step where the logits tie within their allowed difference, see `_compare`), and the
per-step logits agree within QUANT_F32_ATOL (float32: only the all-reduce's summation
order differs) or QUANT_BF16_ULPS bf16 ulp of the largest |logit| (bf16: each rank's
partial is rounded to bf16 before the sum, twice a layer, and the differences carry). int4 groups never straddle two ranks (refused), nor may
GPTQ act-order groups mix two ranks' input channels (refused).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.loading.loader import CheckpointError, load_config, load_model_with
from pdserve.engine.parallel.plan import (
    ParallelLayoutError,
    TPShard,
    check_tp_quant,
    rank_shard,
    tp_shard,
)
from pdserve.engine.parallel.quant_shard import slice_int4, slice_int8
from pdserve.engine.parallel.runner import TPRunner, make_runner
from pdserve.engine.parallel.weights import COLUMNS, ROWS, Span
from pdserve.engine.quant.formats import QuantizationError
from pdserve.engine.quant.pack import Int4Parts, quantize_int4, quantize_int8
from pdserve.engine.runner.model_runner import ModelRunner
from tests.engine.test_hf_equivalence import bf16_ulp, greedy, prompt_of
from tests.helpers.quant_checkpoints import write_quantized

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUANT_F32_ATOL = 1e-4
QUANT_BF16_ULPS = 8  # bf16 ulp of the largest |logit|: measured up to 5.5 (0.086 at |logit| < 4)
NEW_TOKENS = 12
# Wide enough for int4 under TP 2: o_proj's 256 and down_proj's 512 input channels give
# each rank whole 128-channel groups.
WIDE = {"hidden_size": 256, "intermediate_size": 512}


def _config(model_dir: Path, tp: int, quant: str, dtype: str) -> EngineConfig:
    return EngineConfig(model_dir=str(model_dir), dtype=dtype, num_threads=1, quantization=quant,
                        tensor_parallel_size=tp, cache=CacheConfig(num_blocks=64))


def _spans(k: int, size: int, axis: int) -> list[Span]:
    per = k // size
    return [Span(axis, r * per, (r + 1) * per) for r in range(size)]


def test_sliced_int8_and_int4_parts_sum_to_the_whole_layer() -> None:
    """Column slices stack to the whole quantized weight; row-parallel partial products
    (each rank's input channels through its codes) sum to the whole product."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 512, generator=g), torch.randn(3, 512, generator=g)
    i8, i4 = quantize_int8(w), quantize_int4(w, 128)
    whole8, whole4 = i8.q.float() * i8.scales[:, None], i4.dequantize()
    for size in (2, 4):
        cols8 = [slice_int8(i8, s) for s in _spans(64, size, COLUMNS)]
        assert torch.equal(torch.cat([p.q.float() * p.scales[:, None] for p in cols8]), whole8)
        cols4 = [slice_int4(i4, s, "w") for s in _spans(64, size, COLUMNS)]
        assert torch.equal(torch.cat([p.dequantize() for p in cols4]), whole4)
        rows8 = [(s, slice_int8(i8, s)) for s in _spans(512, size, ROWS)]
        got8 = sum(x[:, s.start:s.stop] @ (p.q.float() * p.scales[:, None]).t() for s, p in rows8)
        torch.testing.assert_close(got8, x @ whole8.t(), atol=1e-4, rtol=1e-5)
        rows4 = [(s, slice_int4(i4, s, "w")) for s in _spans(512, size, ROWS)]
        assert all(p.scales.shape == (64, 512 // size // 128) for _, p in rows4)
        got4 = sum(x[:, s.start:s.stop] @ p.dequantize().t() for s, p in rows4)
        torch.testing.assert_close(got4, x @ whole4.t(), atol=1e-4, rtol=1e-5)
    with pytest.raises(QuantizationError, match="straddle"):
        slice_int4(i4, Span(ROWS, 0, 64), "layers.0.mlp.down_weight")


def test_act_order_rows_shard_by_g_idx_when_groups_stay_on_one_rank() -> None:
    g = torch.Generator().manual_seed(1)
    base = quantize_int4(torch.randn(16, 256, generator=g), 32)
    # Groups of 32 channels, shuffled within each half: every group lies in one half.
    perm = torch.cat([torch.randperm(128, generator=g), 128 + torch.randperm(128, generator=g)])
    parts = Int4Parts(base.q, base.scales, base.zeros, 32, perm)
    whole = parts.dequantize()
    for span in _spans(256, 2, ROWS):
        local = slice_int4(parts, span, "o")
        assert local.perm is not None and local.q.shape == (16, 128)
        assert torch.equal(local.dequantize(), whole[:, span.start:span.stop])
    mixed = parts._replace(perm=torch.randperm(256, generator=g))
    with pytest.raises(QuantizationError, match="act-order"):
        slice_int4(mixed, Span(ROWS, 0, 128), "layers.0.self_attn.o_weight")


def test_int4_groups_that_would_straddle_ranks_are_refused_before_any_rank_starts(
    tiny_model_dir: Callable[..., Path],
) -> None:
    d = tiny_model_dir("llama")  # o_proj has 64 input channels: 32 a rank, under one group
    cfg = load_config(d)
    check_tp_quant(cfg, 2, "int8")
    check_tp_quant(cfg, 1, "int4")
    with pytest.raises(ParallelLayoutError, match="o_proj's 64 input channels give 32 per rank"):
        check_tp_quant(cfg, 2, "int4")
    with pytest.raises(ParallelLayoutError, match="straddle"):
        TPRunner(_config(d, 2, "int4", "float32"))
    assert multiprocessing.active_children() == []  # refused before spawning a rank
    with pytest.raises(CheckpointError, match="straddle"):
        load_model_with(d, torch.float32, "cpu", None, quantization="int4", shard=tp_shard(cfg, 2, 0))


def test_gptq_act_order_whose_groups_mix_ranks_is_refused(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    src = tiny_model_dir("llama")
    write_quantized(src, tmp_path / "gptq", "gptq", 32, desc_act=True, checkpoint_format="gptq_v2")
    cfg = load_config(tmp_path / "gptq")
    check_tp_quant(cfg, 2, "gptq")  # the group size fits; g_idx is known only at load
    shard: TPShard = tp_shard(cfg, 2, 1)
    with pytest.raises(CheckpointError, match="act-order .*o_weight|o_weight.*act-order"):
        load_model_with(tmp_path / "gptq", torch.float32, "cpu", None, shard=shard)


class ThreadRanks:
    """`size` tensor-parallel ranks in this process, a thread each, over one full-layout
    KV buffer, their partials summed through a barrier: the quantized slices under test
    without spawning a group (one case below runs the real gloo group)."""

    def __init__(self, cfg: EngineConfig, size: int) -> None:
        full = load_config(cfg.model_dir)
        layout = ModelRunner.layout_for(cfg)
        blocks = cfg.cache.num_blocks or 64
        buf = torch.zeros(blocks * layout.block_bytes_per_layer * layout.num_layers, dtype=torch.uint8)
        self.ranks = [ModelRunner(cfg, kv_buffer=buf, layout=layout, shard=rank_shard(full, size, 1, r))
                      for r in range(size)]
        self.block_size = self.ranks[0].block_size
        self._barrier = threading.Barrier(size)
        self._slots: list[torch.Tensor | None] = [None] * size
        for r, runner in enumerate(self.ranks):
            runner.model.reduce = self._reducer(r)

    def _reducer(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self._slots[rank] = x
            self._barrier.wait()
            total = torch.zeros_like(x)
            for t in self._slots:
                assert t is not None
                total += t
            self._barrier.wait()  # every rank has summed before any overwrites its partial
            return x.copy_(total)
        return reduce

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        out: list[torch.Tensor | BaseException | None] = [None] * len(self.ranks)

        def run(r: int) -> None:
            try:
                mine = chunks if r == 0 else [dataclasses.replace(c, need_logits=False) for c in chunks]
                out[r] = self.ranks[r].execute(mine)
            except BaseException as e:  # re-raised on the caller's thread
                self._barrier.abort()
                out[r] = e

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.ranks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for o in out:
            if isinstance(o, BaseException):
                raise o
        assert isinstance(out[0], torch.Tensor)
        return out[0]


def _compare(single: ModelRunner, group: ModelRunner | ThreadRanks, dtype: str) -> None:
    """Logits equal within `atol` at every step both runs share. float32: every token equal.
    bf16: the runs may part only at a step where the single run's top two logits are within
    twice that step's logit difference of each other (random weights tie exactly now and
    then), a tie the allowed difference breaks; the steps after it are different sequences."""
    prompt = prompt_of(21, single.model_config.vocab_size)
    want, want_logits = greedy(single, prompt, chunk_size=8, new_tokens=NEW_TOKENS)
    got, logits = greedy(group, prompt, chunk_size=8, new_tokens=NEW_TOKENS)  # type: ignore[arg-type]
    atol = QUANT_F32_ATOL if dtype == "float32" else QUANT_BF16_ULPS * bf16_ulp(float(want_logits.abs().max()))
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), NEW_TOKENS)
    diff = (logits[: first + 1].float() - want_logits[: first + 1].float()).abs()
    assert diff.max().item() <= atol
    if first < NEW_TOKENS:
        assert dtype != "float32", f"tokens part at step {first}"
        top2 = want_logits[first].float().topk(2).values
        assert (top2[0] - top2[1]).item() <= 2 * diff[first].max().item(), f"no tie at step {first}"


def test_tp2_int8_group_of_processes_equals_tp1(tiny_model_dir: Callable[..., Path]) -> None:
    d = tiny_model_dir("llama", **WIDE)
    group = make_runner(_config(d, 2, "int8", "float32"))
    try:
        assert isinstance(group, TPRunner) and group.layout.quantization == "int8"
        _compare(ModelRunner(_config(d, 1, "int8", "float32")), group, "float32")
    finally:
        group.close()


@pytest.mark.parametrize(("family", "quant", "dtype"), [
    ("qwen2", "int8", "float32"), ("qwen2", "int4", "float32"), ("llama", "int4", "float32"),
    ("qwen2", "int8", "bfloat16"), ("llama", "int4", "bfloat16"),
])
def test_tp2_quantized_equals_tp1_quantized(
    tiny_model_dir: Callable[..., Path], family: str, quant: str, dtype: str
) -> None:
    d = tiny_model_dir(family, **WIDE)
    cfg = _config(d, 1, quant, dtype)
    _compare(ModelRunner(cfg), ThreadRanks(cfg, 2), dtype)


@pytest.mark.parametrize(("method", "fmt", "sym", "family"), [
    ("awq", "gptq", False, "llama"), ("gptq", "gptq", True, "qwen2"),
])
def test_tp2_prequantized_checkpoint_equals_tp1(
    tiny_model_dir: Callable[..., Path], tmp_path: Path, method: str, fmt: str, sym: bool, family: str
) -> None:
    d = tmp_path / method
    write_quantized(tiny_model_dir(family), d, method, 32, checkpoint_format=fmt, sym=sym)
    cfg = _config(d, 1, "none", "float32")
    single = ModelRunner(cfg)
    assert single.layout.quantization == method
    _compare(single, ThreadRanks(cfg, 2), "float32")
