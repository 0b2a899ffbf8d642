"""Decode CUDA graphs: bucket choice, padded static buffers, and the captured step's
output equal to the eager step's (on CPU through the same static buffers; on CUDA by
graph replay, skipped without a GPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.common.kv_layout import NULL_BLOCK
from pdserve.engine.attention.paged import TorchPagedAttention
from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.cuda_graphs import (
    DecodeBufferLayout,
    StaticDecodeStep,
    fill_decode_inputs,
    graph_buckets,
    graph_support,
    graphable,
    pick_bucket,
    requested_rows,
)
from pdserve.engine.runner.model_runner import ModelRunner

CPU = torch.device("cpu")


def test_buckets_cover_max_num_seqs_and_larger_batches_run_eagerly() -> None:
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_buckets(5) == (1, 2, 4, 8)
    assert graph_buckets(1000) == (1, 2, 4, 8, 16, 32, 64)
    assert [pick_bucket(n, graph_buckets(64)) for n in (1, 2, 3, 9, 33, 64, 65)] == [1, 2, 4, 16, 64, 64, None]
    assert graphable([SeqChunk([1], 4, [1], True)] * 3)
    assert not graphable([SeqChunk([1], 4, [1], True), SeqChunk([1, 2], 0, [2], True)])
    assert not graphable([SeqChunk([1, 2, 3], 4, [1], True, num_draft_tokens=2)])
    assert not graphable([])


def test_fill_pads_rows_into_the_null_block_and_tables_to_the_captured_width() -> None:
    layout = DecodeBufferLayout(max_batch=8, max_blocks=6)
    flat = torch.full((layout.size,), 99, dtype=torch.long)
    # Second sequence: entries past its context (block 77) are stale and must not be read.
    chunks = [SeqChunk([11], 3, [5], True), SeqChunk([12], 20, [7, 9, 77], True)]
    fill_decode_inputs(flat, layout, chunks, bucket=4, block_size=16)
    v = layout.views(flat, 4)
    assert v.input_ids.tolist() == [11, 12, 0, 0]
    assert v.positions.tolist() == [3, 20, 0, 0]
    assert v.slot_mapping.tolist() == [5 * 16 + 3, 9 * 16 + 4, NULL_BLOCK * 16, NULL_BLOCK * 16]
    assert v.ctx_lens.tolist() == [4, 21, 1, 1]
    assert v.block_tables.tolist() == [[5] + [NULL_BLOCK] * 5, [7, 9] + [NULL_BLOCK] * 4,
                                       [NULL_BLOCK] * 6, [NULL_BLOCK] * 6]
    assert v.block_tables.stride(0) == 6 and v.input_ids.data_ptr() == flat.data_ptr()
    with pytest.raises(ValueError, match="do not fit bucket 1"):
        fill_decode_inputs(flat, layout, chunks, bucket=1, block_size=16)
    with pytest.raises(ValueError, match="exceeds the 6 blocks"):
        fill_decode_inputs(flat, layout, [SeqChunk([1], 200, list(range(1, 14)), True)], 1, 16)


def test_graphs_are_refused_where_they_cannot_be_captured() -> None:
    cuda = torch.device("cuda")
    flat = type("Flat", (TorchPagedAttention,), {"flat_decode": True})()
    assert graph_support(None, cuda, flat, False, False, False) is None
    assert graph_support(False, cuda, flat, False, False, False) == "--no-cuda-graphs"
    assert graph_support(None, CPU, flat, False, False, False) == "the device is cpu"
    assert "Triton" in str(graph_support(None, cuda, TorchPagedAttention(), False, False, False))
    assert graph_support(None, cuda, flat, True, False, False) == "a quantized KV cache"
    assert "mixture-of-experts" in str(graph_support(None, cuda, flat, False, False, True))


def _prefilled(runner: ModelRunner, prompts: list[list[int]]) -> list[SeqChunk]:
    """Prefill `prompts` (each in its own blocks) and return one greedy decode chunk each."""
    chunks, nxt, bs = [], 1, runner.block_size
    for p in prompts:
        need = (len(p) + 1 + bs - 1) // bs
        chunks.append(SeqChunk(p, 0, list(range(nxt, nxt + need)), True))
        nxt += need
    first = torch.argmax(runner.execute(chunks), dim=-1).tolist()
    return [SeqChunk([t], len(c.token_ids), c.block_table, True) for t, c in zip(first, chunks, strict=True)]


def test_static_padded_step_computes_the_eager_step(tiny_model_dir: Callable[..., Path]) -> None:
    runner = ModelRunner(EngineConfig(model_dir=str(tiny_model_dir("llama")), dtype="bfloat16",
                                      cache=CacheConfig(num_blocks=24)))
    if not runner.backend.flat_decode:
        pytest.fail("the CPU bf16 backend should read the pool in place (flat decode)")
    decodes = _prefilled(runner, [list(range(3, 8)), list(range(40, 57)), list(range(9, 42))])
    eager = runner.execute(decodes)
    pool_after_eager = runner.pool.kv.clone()
    step = StaticDecodeStep(runner.model, runner.kv_layers, runner.backend, CPU, 8,
                            runner.max_model_len, runner.block_size)
    step.load(decodes, 4)  # 3 decodes and a padding row
    padded = step.forward(4)
    got = requested_rows(padded, decodes)
    assert got.shape == eager.shape
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    # Only the null block (the padding row's write) and this step's own slots changed.
    changed = (runner.pool.kv != pool_after_eager).flatten(3).any(-1).nonzero()[:, 2].unique().tolist()
    assert set(changed) <= {NULL_BLOCK, *[c.block_table[c.start_pos // 16] for c in decodes]}
    skip = [SeqChunk(c.token_ids, c.start_pos, c.block_table, i != 1) for i, c in enumerate(decodes)]
    assert torch.equal(requested_rows(padded, skip), padded[[0, 2]])
    assert runner._graphs is None  # never on CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_replay_draws_the_eager_tokens_on_cuda(tiny_model_dir: Callable[..., Path]) -> None:
    model = str(tiny_model_dir("llama"))
    tokens = {}
    for graphs in (True, False):
        runner = ModelRunner(EngineConfig(model_dir=model, dtype="bfloat16", device="cuda", cuda_graphs=graphs,
                                          cache=CacheConfig(num_blocks=64),
                                          scheduler=SchedulerConfig(max_num_seqs=8)))
        assert (runner._graphs is not None) == graphs
        decodes = _prefilled(runner, [list(range(3, 8)), list(range(40, 57)), list(range(9, 42))])
        out = []
        for _ in range(12):
            nxt = torch.argmax(runner.execute(decodes), dim=-1).tolist()
            out.append(nxt)
            decodes = [SeqChunk([t], c.start_pos + 1, c.block_table, True) for t, c in zip(nxt, decodes, strict=True)]
        tokens[graphs] = out
    assert tokens[True] == tokens[False]


def test_a_failed_capture_serves_eagerly_unless_graphs_were_asked_for(
        tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from pdserve.engine.runner import cuda_graphs, model_runner

    def fail(*_: object) -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(model_runner, "graph_support", lambda *_: None)  # as on a GPU
    monkeypatch.setattr(cuda_graphs, "DecodeGraphs", fail)
    cfg = EngineConfig(model_dir=str(tiny_model_dir("llama")), cache=CacheConfig(num_blocks=24),
                       scheduler=SchedulerConfig(max_num_seqs=4))
    with caplog.at_level("ERROR", logger="pdserve.engine.runner.cuda_graphs"):
        runner = ModelRunner(cfg)
    assert runner._graphs is None and "serving eagerly" in caplog.text
    decodes = _prefilled(runner, [list(range(3, 8))])
    assert runner.execute(decodes).shape == (1, runner.model_config.vocab_size)
    with pytest.raises(RuntimeError, match="stream is capturing"):  # --cuda-graphs given
        cuda_graphs.capture_or_eager(runner._graphs, (1, 2, 4), required=True)  # type: ignore[arg-type]
