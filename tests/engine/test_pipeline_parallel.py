"""Pipeline parallel in micro-batches and the tensor x pipeline grid (pdserve/engine/parallel).

A step's chunks are cut into micro-batches and stage 0 starts micro-batch i + 1 before
the last stage has handed micro-batch i back; the logits stay those of one process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.parallel.pipeline import micro_batches, stage_links
from pdserve.engine.parallel.plan import HeadRange, rank_shard
from pdserve.engine.parallel.runner import TPRunner
from pdserve.engine.runner.model_runner import ModelRunner
from tests.engine.test_hf_equivalence import LOGIT_ATOL

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg() -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 100, 64, 64, 4, 4, 2, 16, 1e-6, 1e4, 128)


def test_grid_ranks_hold_their_stage_layers_and_tensor_slice() -> None:
    """tp 2 x pp 2: rank = stage * 2 + t; each stage's two ranks split its layers' heads."""
    got = [rank_shard(_cfg(), 2, 2, r) for r in range(4)]
    assert [(s.stage, s.rank, s.layers) for s in got] == [
        (0, 0, HeadRange(0, 2)), (0, 1, HeadRange(0, 2)), (1, 0, HeadRange(2, 4)), (1, 1, HeadRange(2, 4))]
    assert [(s.q_heads, s.kv_heads) for s in got[2:]] == [
        (HeadRange(0, 2), HeadRange(0, 1)), (HeadRange(2, 4), HeadRange(1, 2))]


def test_hidden_states_go_stage_to_stage_and_back_to_rank_0() -> None:
    links = [stage_links(r, 2, 2, HeadRange(0, 1)) for r in range(4)]
    assert [(ln.prev, ln.next) for ln in links] == [(None, 2), (None, 3), (0, 0), (1, None)]
    assert {ln.last for ln in links} == {2}


def test_micro_batches_cut_the_chunks_in_order() -> None:
    chunks = [SeqChunk([i], 0, [1], True) for i in range(5)]
    assert [[c.token_ids[0] for c in mb] for mb in micro_batches(chunks, 2)] == [[0, 1, 2], [3, 4]]
    assert len(micro_batches(chunks[:1], 4)) == 1
    assert [len(mb) for mb in micro_batches(chunks, 8)] == [1] * 5


def test_stage_0_starts_the_next_micro_batch_before_the_last_stage_returns_one(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """A step of three sequences through two stages: rank 0's own event order shows it
    started micro-batch 1 before micro-batch 0 came back from stage 1 (no timing: the
    order is what the pipeline does), and the logits are the single process's."""
    cfg = EngineConfig(model_dir=str(tiny_model_dir("llama")), dtype="float32", num_threads=1,
                       pipeline_parallel_size=2, cache=CacheConfig(num_blocks=32))
    chunks = [SeqChunk([3, 4, 5, 6], 0, [1], True), SeqChunk([7, 8], 0, [2], True),
              SeqChunk([9, 10, 11], 0, [3], True)]
    runner = TPRunner(cfg)
    events: list[tuple[str, int]] = []
    runner.on_pipe_event = lambda event, mb: events.append((event, mb))
    try:
        got = runner.execute(chunks)
        # A decode step over the same sequences reads the KV both micro-batches wrote.
        step2 = [SeqChunk([12], 4, [1], True), SeqChunk([13], 2, [2], True), SeqChunk([14], 3, [3], True)]
        got2 = runner.execute(step2)
    finally:
        runner.close()
    assert events[:6] == [("start", 0), ("sent", 0), ("start", 1), ("sent", 1), ("back", 0), ("back", 1)]
    single = ModelRunner(EngineConfig(model_dir=cfg.model_dir, dtype="float32", num_threads=1,
                                      cache=CacheConfig(num_blocks=32)))
    assert (got - single.execute(chunks)).abs().max().item() < LOGIT_ATOL
    assert (got2 - single.execute(step2)).abs().max().item() < LOGIT_ATOL
