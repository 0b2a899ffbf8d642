"""Tensor and pipeline parallel (pdserve/engine/parallel): a group of spawned gloo ranks
computes what the single-process engine and Hugging Face compute.

Greedy tokens are equal and every step's float32 logits agree within LOGIT_ATOL (the
all-reduce only changes the summation order) for TP 2, TP 4 -- the tiny models have 2
KV heads, so TP 4 replicates each KV head on two ranks -- PP 2 and TP 2 x PP 2, across Llama,
Qwen2 (q/k/v bias) and Qwen3 (q/k norm).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.parallel.plan import (
    ParallelLayoutError,
    check_pp,
    check_tp,
    stage_layers,
    tp_shard,
)
from pdserve.engine.parallel.runner import TPRunner, make_runner
from pdserve.engine.parallel.steps import StepFormatError, decode_step, encode_step, encode_stop
from pdserve.engine.runner.model_runner import ModelRunner
from tests.engine.test_hf_equivalence import LOGIT_ATOL, greedy, hf_greedy, prompt_of

NEW_TOKENS = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(model_dir: Path, tp: int = 1, pp: int = 1) -> EngineConfig:
    return EngineConfig(model_dir=str(model_dir), dtype="float32", num_threads=1,
                        tensor_parallel_size=tp, pipeline_parallel_size=pp, cache=CacheConfig(num_blocks=64))


@pytest.fixture
def tp_runner() -> Iterator[Callable[[EngineConfig], ModelRunner]]:
    made: list[ModelRunner] = []

    def make(cfg: EngineConfig) -> ModelRunner:
        made.append(make_runner(cfg))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _model_cfg(heads: int, kv_heads: int, inter: int = 64) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 100, 64, inter, 2, heads, kv_heads, 16, 1e-6, 1e4, 128)


@pytest.mark.parametrize(("heads", "kv_heads", "size"),
                         [(4, 2, 4), (8, 2, 4), (8, 1, 4), (4, 4, 2), (8, 4, 2), (8, 2, 8), (4, 2, 2)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(heads: int, kv_heads: int, size: int) -> None:
    cfg = _model_cfg(heads, kv_heads)
    group = heads // kv_heads  # query head q reads KV head q // group
    for rank in range(size):
        s = tp_shard(cfg, size, rank)
        wanted = {q // group for q in range(s.q_heads.start, s.q_heads.stop)}
        assert set(range(s.kv_heads.start, s.kv_heads.stop)) == wanted, (rank, s)
        assert s.q_heads.count == heads // size
        assert s.inter.count == 64 // size
    # Together the ranks cover every KV head (replicated heads on consecutive ranks).
    covered = {h for r in range(size) for h in range(tp_shard(cfg, size, r).kv_heads.start,
                                                       tp_shard(cfg, size, r).kv_heads.stop)}
    assert covered == set(range(kv_heads))


@pytest.mark.parametrize(("heads", "kv_heads", "inter", "size", "says"), [
    (6, 2, 64, 4, "attention heads"),
    (8, 6, 64, 4, "KV heads"),
    (8, 2, 66, 4, "intermediate_size"),
])
def test_a_model_that_does_not_split_is_refused(heads: int, kv_heads: int, inter: int, size: int,
                                                says: str) -> None:
    with pytest.raises(ParallelLayoutError, match=says):
        check_tp(_model_cfg(heads, kv_heads, inter), size)


@pytest.mark.parametrize(("layers", "stages", "want"), [
    (2, 2, [(0, 1), (1, 2)]), (5, 2, [(0, 3), (3, 5)]), (7, 3, [(0, 3), (3, 5), (5, 7)])])
def test_pipeline_stages_split_the_layers_evenly(layers: int, stages: int, want: list[tuple[int, int]]) -> None:
    assert [(r.start, r.stop) for r in (stage_layers(layers, stages, s) for s in range(stages))] == want


def test_a_pipeline_that_does_not_split_is_refused() -> None:
    with pytest.raises(ParallelLayoutError, match="exceeds the 2 layers"):
        check_pp(_model_cfg(4, 2), 3)


def test_step_message_round_trip_and_bad_lengths() -> None:
    chunks = [SeqChunk([5], 33, [1, 2, 3], True), SeqChunk([7, 8, 9], 0, [4], True)]
    back = decode_step(encode_step(chunks))
    assert back == [dataclasses.replace(c, need_logits=False) for c in chunks]
    assert decode_step(encode_stop()) is None
    msg = encode_step(chunks)
    for bad in (msg[:-1], torch.cat([msg, msg[-1:]]), torch.tensor([9, 0]), torch.tensor([1, 5, 1])):
        with pytest.raises(StepFormatError):
            decode_step(bad)


@pytest.mark.parametrize(("family", "tp", "pp"), [
    *((f, tp, pp) for f in ("llama", "qwen2", "qwen3") for tp, pp in ((2, 1), (4, 1), (2, 2))),
    ("llama", 1, 2),  # pipeline alone (the grid above covers it for every family)
])
def test_parallel_greedy_and_logits_match_single_process_and_hf(
    tiny_model_dir: Callable[..., Path], tp_runner: Callable[[EngineConfig], ModelRunner], family: str, tp: int,
    pp: int,
) -> None:
    d = tiny_model_dir(family)
    runner = tp_runner(_config(d, tp, pp))
    assert isinstance(runner, TPRunner) and len(runner.rank_pids) == tp * pp - 1
    single = ModelRunner(_config(d))
    prompt = prompt_of(21, runner.model_config.vocab_size)
    tokens, logits = greedy(runner, prompt, chunk_size=8, new_tokens=NEW_TOKENS)
    ref_tokens, ref_logits = greedy(single, prompt, chunk_size=8, new_tokens=NEW_TOKENS)
    hf_tokens, hf_logits = hf_greedy(d, prompt)
    assert tokens == ref_tokens == hf_tokens[:NEW_TOKENS]
    assert (logits - ref_logits).abs().max().item() < LOGIT_ATOL
    assert (logits - hf_logits[:NEW_TOKENS]).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize(("family", "overrides"), [
    ("mqa", {}),  # one KV head: replicated on both ranks
    ("llama", {"num_key_value_heads": 4}),  # two KV heads per rank
    ("llama", {"attention_bias": True, "mlp_bias": True}),  # o_proj and down_proj biases added once
])
def test_tp2_kv_head_splits_and_row_parallel_biases(
    tiny_model_dir: Callable[..., Path], tp_runner: Callable[[EngineConfig], ModelRunner], family: str,
    overrides: dict[str, object],
) -> None:
    d = tiny_model_dir(family, **overrides)
    runner = tp_runner(_config(d, 2))
    prompt = prompt_of(19, runner.model_config.vocab_size)
    tokens, logits = greedy(runner, prompt, new_tokens=8)
    ref_tokens, ref_logits = greedy(ModelRunner(_config(d)), prompt, new_tokens=8)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
def test_parallel_engine_batches_prefix_hits_and_forks_like_one_process(
    tiny_model_dir: Callable[..., Path], tp: int, pp: int
) -> None:
    """Continuous batching, a prefix-cache hit and n=2 copy-on-write forks (block copies
    on rank 0 cover every rank's heads and layers in the shared pool) give the same tokens;
    with TP 2 x PP 2 a batched step runs as micro-batches through each stage's TP pair."""
    d = tiny_model_dir("qwen2")
    shared = prompt_of(40, 300, seed=3)
    prompts = [shared + [7, 8, 9], shared + [10, 11], prompt_of(9, 300, seed=4)]
    params = [SamplingParams(max_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=12, temperature=0.8, seed=11, n=2),
              SamplingParams(max_tokens=12, temperature=0.0)]
    group = LLMEngine(_config(d, tp, pp))
    try:
        assert isinstance(group.runner, TPRunner)
        # The first prompt's blocks are cached by the time the batch of the other two runs.
        got = group.generate(prompts[:1], params[:1]) + group.generate(prompts[1:], params[1:])
        assert group.stats().num_cached_tokens_hit >= 32
        assert group.block_manager.num_free_blocks == group.block_manager.num_allocatable
    finally:
        group.runner.close()
    single = LLMEngine(_config(d))
    want = single.generate(prompts[:1], params[:1]) + single.generate(prompts[1:], params[1:])
    assert [[c.token_ids for c in r.choices] for r in got] == [[c.token_ids for c in r.choices] for r in want]


def test_bad_chunks_are_refused_before_any_rank_sees_them(
    tiny_model_dir: Callable[..., Path], tp_runner: Callable[[EngineConfig], ModelRunner]
) -> None:
    d = tiny_model_dir("llama")
    runner = tp_runner(_config(d, 2))
    with pytest.raises(ValueError, match="block id out of range"):
        runner.execute([SeqChunk([3, 4], 0, [999], True)])
    # The group is still in step: the next real step matches the single process.
    good = [SeqChunk([3, 4, 5], 0, [1], True)]
    torch.testing.assert_close(runner.execute(good), ModelRunner(_config(d)).execute(good),
                               atol=LOGIT_ATOL, rtol=0)


def test_a_dead_follower_rank_is_reported(tiny_model_dir: Callable[..., Path]) -> None:
    dead = threading.Event()
    seen: list[int] = []

    def on_death(rank: int, code: int | None) -> None:
        seen.append(rank)
        dead.set()

    runner = TPRunner(_config(tiny_model_dir("llama"), 4), on_rank_death=on_death)
    os.kill(runner.rank_pids[1], signal.SIGKILL)  # rank 2
    assert dead.wait(30), "rank 0 never noticed its dead follower"
    assert seen == [2]
    for pid in (runner.rank_pids[0], runner.rank_pids[2]):
        os.kill(pid, signal.SIGKILL)


def test_bf16_ranks_attend_over_their_strided_head_slices(tiny_model_dir: Callable[..., Path]) -> None:
    """bf16 is the CPU default; a rank's KV heads are a strided slice of the shared pool,
    which the in-place bf16 kernel refuses, so ranks keep the gather path and serve."""
    cfg = dataclasses.replace(_config(tiny_model_dir("llama"), tp=2), dtype="bfloat16")
    group = LLMEngine(cfg)
    try:
        assert isinstance(group.runner, TPRunner)
        out = group.generate([prompt_of(9, 300, seed=5)], [SamplingParams(max_tokens=8, temperature=0.0)])
        assert len(out[0].choices[0].token_ids) == 8
        assert group.block_manager.num_free_blocks == group.block_manager.num_allocatable
    finally:
        group.runner.close()
