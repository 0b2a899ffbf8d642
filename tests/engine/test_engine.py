"""LLMEngine end to end on a real tiny Llama: equivalence under every scheduling variation.

Greedy equals HF; batching, chunking, prefix caching, preemption, n-way forks and a
prefill-engine -> decode-engine handoff all leave the tokens unchanged; KV usage
returns to idle after every request.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.sequence import SequenceStatus
from pdserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def make_engine(
    model_dir: Path,
    *,
    block_size: int = 16,
    num_blocks: int = 128,
    budget: int = 2048,
    caching: bool = True,
    chunked: bool = True,
    max_seqs: int = 64,
    long_prefill: int = 0,
) -> LLMEngine:
    # float32: these tests hold the engine to exact equality (with HF, chunked with
    # unchunked, split with single); in bf16 those hold only up to near-ties
    # (tests/engine/test_hf_equivalence.py).
    cfg = EngineConfig(
        model_dir=str(model_dir),
        dtype="float32",
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
            long_prefill_token_threshold=long_prefill,
        ),
    )
    return LLMEngine(cfg)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def tokens(results: Any) -> list[list[tuple[int, ...]]]:
    return [[c.token_ids for c in r.choices] for r in results]


def assert_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished()
    assert stats.kv_usage == 0.0 and stats.num_free_blocks == stats.num_total_blocks
    assert engine.block_manager.check_integrity(), engine.block_manager.integrity_errors()


def test_greedy_equals_hf_generate_64_tokens(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for prompt in prompts(15, 16, 17):  # below, at and across a block boundary
        ref = hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=64,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        (res,) = engine.generate([prompt], params)
        assert list(res.token_ids) == ref
        assert res.choices[0].finish_reason == "length"
    assert_idle(engine)


def test_batched_equals_alone(model_dir: Path) -> None:
    ps = prompts(5, 16, 33, 9, 21)
    alone = [make_engine(model_dir, caching=False).generate([p], GREEDY)[0] for p in ps]
    engine = make_engine(model_dir, caching=False)
    together = engine.generate(ps, GREEDY)
    assert tokens(together) == tokens(alone)
    assert_idle(engine)


@pytest.mark.parametrize("budget", [1, 7, 16, 4096])
def test_chunked_prefill_equals_unchunked(model_dir: Path, budget: int) -> None:
    ps = prompts(5, 23, 40, seed=1)
    ref = make_engine(model_dir, chunked=False, caching=False).generate(ps, GREEDY)
    engine = make_engine(model_dir, budget=budget, caching=False)
    assert tokens(engine.generate(ps, GREEDY)) == tokens(ref)
    assert_idle(engine)


def test_capped_long_prefills_equal_uncapped(model_dir: Path) -> None:
    """A per-sequence prefill cap (long_prefill_token_threshold) changes only the chunking."""
    ps = prompts(5, 60, 23, 41, seed=4)
    ref = make_engine(model_dir, caching=False).generate(ps, GREEDY)
    engine = make_engine(model_dir, caching=False, long_prefill=8)
    assert tokens(engine.generate(ps, GREEDY)) == tokens(ref)
    assert_idle(engine)


def test_prefix_cache_hit_equals_miss_and_is_visible(model_dir: Path) -> None:
    shared = prompts(40, seed=2)[0]
    a, b = shared + [7, 8, 9], shared + [10, 11]
    miss = make_engine(model_dir, caching=False).generate([b], GREEDY)
    engine = make_engine(model_dir)
    engine.add_request("a", a, GREEDY, prefill_only=True)
    engine.add_request("b", b, GREEDY, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    # Admitted in the same step, neither could hit the other; now both are cached.
    engine.release("a")
    engine.release("b")
    before = engine.stats()
    res = engine.generate([b], GREEDY)
    after = engine.stats()
    assert tokens(res) == tokens(miss)
    assert res[0].num_cached_tokens == 32  # two full 16-token blocks of the shared prefix
    assert after.num_cached_tokens_hit - before.num_cached_tokens_hit == 32
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == len(b) - 32
    assert_idle(engine)


def test_prefix_hit_reuses_the_same_physical_blocks(model_dir: Path) -> None:
    shared = prompts(40, seed=3)[0]
    engine = make_engine(model_dir)
    engine.add_request("a", shared + [5], GREEDY, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", shared + [6, 7], GREEDY, prefill_only=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    held_a, held_b = engine.held_blocks("a"), engine.held_blocks("b")
    assert held_b[:2] == held_a[:2] and held_b[2] != held_a[2]
    assert outs[-1].num_cached_tokens == 32 and outs[-1].prefilled
    engine.release("a")
    engine.release("b")
    assert_idle(engine)


def test_preemption_under_tiny_kv_budget_gives_the_same_output(model_dir: Path) -> None:
    ps = prompts(10, 14, 7, 12, seed=4)
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    ref = make_engine(model_dir, block_size=4).generate(ps, params)
    # 11 blocks of 4 tokens: each request (<= 38 tokens) fits alone, not all at once.
    engine = make_engine(model_dir, block_size=4, num_blocks=12)
    res = engine.generate(ps, params)
    assert tokens(res) == tokens(ref)
    assert engine.stats().num_preemptions > 0
    assert_idle(engine)


def test_n_way_fork_shares_blocks_copy_on_write(model_dir: Path) -> None:
    prompt = prompts(21, seed=5)[0]  # partial last block shared by the forks
    engine = make_engine(model_dir)
    single = engine.generate([prompt], GREEDY)[0].token_ids
    greedy3 = engine.generate(
        [prompt], SamplingParams(**{**GREEDY.to_dict(), "n": 3, "stop_token_ids": ()})
    )[0]
    assert [c.token_ids for c in greedy3.choices] == [single] * 3
    seeded = SamplingParams(**{**SEEDED.to_dict(), "n": 3, "stop_token_ids": ()})
    first = engine.generate([prompt], seeded)[0]
    again = make_engine(model_dir, caching=False).generate([prompt], seeded)[0]
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    assert len({c.token_ids for c in first.choices}) == 3  # choices draw differently
    assert_idle(engine)


def _copy_kv(src: LLMEngine, src_blocks: list[int], dst: LLMEngine, dst_blocks: list[int]) -> None:
    kv_src, kv_dst = src.runner.pool.kv, dst.runner.pool.kv
    kv_dst[:, :, torch.tensor(dst_blocks)] = kv_src[:, :, torch.tensor(src_blocks)]


@pytest.mark.parametrize(
    "params", [GREEDY, SamplingParams(**{**SEEDED.to_dict(), "n": 3, "stop_token_ids": ()})]
)
def test_prefill_engine_to_decode_engine_equals_single_engine(
    model_dir: Path, params: SamplingParams
) -> None:
    ps = prompts(19, 32, seed=6)
    ref = make_engine(model_dir).generate(ps, params)
    prefill, decode = make_engine(model_dir), make_engine(model_dir, num_blocks=64)
    # Occupy some decode blocks so the two pools place the KV differently.
    decode.add_request("other", prompts(30, seed=9)[0], GREEDY)
    decode.step()
    got: dict[str, list[list[int]]] = {}
    for i, prompt in enumerate(ps):
        rid = f"r{i}"
        prefill.add_request(rid, prompt, params, prefill_only=True)
        reserved = decode.reserve_remote(rid, prompt, params).block_ids
        assert reserved
        assert decode.stats().num_waiting_for_kv == 1
        firsts: list[int] = []
        while prefill.has_unfinished():
            for out in prefill.step():
                assert out.finished and out.prefilled
                firsts = [c.token_ids[0] for c in sorted(out.outputs, key=lambda c: c.index)]
        assert len(firsts) == params.n
        _copy_kv(prefill, prefill.held_blocks(rid), decode, reserved)
        prefill.release(rid)
        decode.start_remote(rid, firsts)
        got[rid] = [[t] for t in firsts]
        while decode.has_unfinished():
            for out in decode.step():
                for c in out.outputs:
                    if out.request_id == rid:
                        got[rid][c.index] += c.token_ids
    assert [[tuple(t) for t in got[f"r{i}"]] for i in range(len(ps))] == tokens(ref)
    assert_idle(prefill)
    assert_idle(decode)


def test_reserve_remote_never_overcommits(model_dir: Path) -> None:
    engine = make_engine(model_dir, block_size=4, num_blocks=6)  # 5 blocks
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert engine.reserve_remote("a", list(range(3, 15)), params).block_ids == [1, 2, 3]
    refused = engine.reserve_remote("b", list(range(3, 15)), params)
    assert not refused.ok and refused.block_ids == []
    assert engine.stats().num_free_blocks == 2
    assert engine.abort("a")
    assert_idle(engine)


def test_abort_in_every_state_frees_blocks(model_dir: Path) -> None:
    engine = make_engine(model_dir, budget=8)
    ps = prompts(20, 6, 6, seed=7)
    engine.add_request("running", ps[0], GREEDY)
    engine.add_request("waiting", ps[1], GREEDY)
    engine.add_request("prefilled", ps[2], GREEDY, prefill_only=True)
    engine.reserve_remote("kv", ps[2], GREEDY)
    engine.step()
    assert engine._requests["running"].seqs[0].status is SequenceStatus.RUNNING
    assert engine._requests["waiting"].seqs[0].status is SequenceStatus.WAITING
    while engine._requests["prefilled"].seqs[0].status is not SequenceStatus.FINISHED_PREFILLED:
        engine.step()
    assert engine.stats().kv_usage > 0
    for rid in ("running", "waiting", "prefilled", "kv"):
        assert engine.abort(rid)
    assert not engine.abort("kv")
    assert_idle(engine)


def test_add_request_rejects_what_can_never_fit(model_dir: Path) -> None:
    engine = make_engine(model_dir, block_size=4, num_blocks=5)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("x", [5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("x", [5] * 10, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [], SamplingParams())
    engine.add_request("x", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [5, 6], SamplingParams(max_tokens=2))


def test_eos_stops_and_stop_token_ids(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    prompt = prompts(9, seed=8)[0]
    free_run = engine.generate([prompt], GREEDY)[0].token_ids
    stop_at = free_run[5]
    res = engine.generate(
        [prompt], SamplingParams(**{**GREEDY.to_dict(), "stop_token_ids": (stop_at,)})
    )[0]
    assert res.token_ids == free_run[: free_run.index(stop_at) + 1]
    assert res.choices[0].finish_reason == "stop"
    assert_idle(engine)


def test_resuming_with_generated_tokens_continues_the_same_seeded_stream(model_dir: Path) -> None:
    """Recovery re-prefills prompt + generated tokens; the (seed, choice, index) draws go on."""
    prompt = prompts(13, seed=10)[0]
    engine = make_engine(model_dir)
    full = engine.generate([prompt], SEEDED)[0].token_ids
    engine.add_request("resume", prompt, SEEDED, output_token_ids=full[:7])
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.outputs[0].token_ids
            assert out.num_prompt_tokens == len(prompt)
    assert tuple(got) == full[7:]
    assert_idle(engine)


def test_resuming_one_choice_of_several_continues_its_own_seeds_and_penalties(model_dir: Path) -> None:
    """Choice c of an n>1 request resumes alone (n=1, choice_index=c) with the same tokens."""
    prompt = prompts(11, seed=12)[0]
    engine = make_engine(model_dir)
    many = SamplingParams(**{**SEEDED.to_dict(), "n": 3, "presence_penalty": 0.8, "frequency_penalty": 0.5})
    full = engine.generate([prompt], many)[0].choices
    one = SamplingParams(**{**many.to_dict(), "n": 1})
    for c in (1, 2):
        engine.add_request(f"resume-{c}", prompt, one, output_token_ids=full[c].token_ids[:4], choice_index=c)
        got: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                assert [o.index for o in out.outputs] == [c]
                got += out.outputs[0].token_ids
        assert tuple(got) == full[c].token_ids[4:]
    with pytest.raises(ValueError, match="choice_index"):
        engine.add_request("bad", prompt, many, choice_index=1)
    assert_idle(engine)
