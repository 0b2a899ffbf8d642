"""Decode admission: a reservation never takes the blocks running streams need to grow.

The rule with exact block counts on the scheduler alone, then a decode engine
under KV pressure (a pool far smaller than the streams it serves) fed by a real
prefill engine: no stream is ever preempted and the tokens equal an unpressured run.
"""

from __future__ import annotations

import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.reservation import ReserveCheck
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import Sequence, SequenceStatus
from pdserve.engine.llm_engine import LLMEngine

BS = 4
_ids = iter(range(10_000))


def make_scheduler(num_blocks: int, reserve_tokens: int = 8, watermark: float = 0.1) -> Scheduler:
    cfg = SchedulerConfig(reserve_decode_tokens=reserve_tokens, watermark=watermark)
    return Scheduler(cfg, BlockManager(num_blocks, BS), max_model_len=64)


def seq(num_prompt: int, max_tokens: int, pending_forks: int = 0) -> Sequence:
    return Sequence(next(_ids), "r", 0, list(range(3, 3 + num_prompt)), SamplingParams(max_tokens=max_tokens),
                    sampling_seed=0, pending_forks=pending_forks)


def start_running(s: Scheduler, sq: Sequence) -> None:
    """What the decode node does: reserve the prompt, KV arrives, first token, run."""
    assert s.block_manager.allocate_slots(sq.seq_id, sq.num_tokens, 0) is not None
    s.add_waiting_for_kv(sq)
    sq.num_computed_tokens = sq.num_tokens
    sq.append_token(7)
    s.admit([sq])


def test_reserve_check_keeps_running_growth_and_watermark_free() -> None:
    # 12 allocatable blocks of 4 tokens; watermark 10% -> 1 block.
    s = make_scheduler(num_blocks=13)
    running = seq(6, max_tokens=20)
    start_running(s, running)  # 7 tokens in 2 blocks; 8 more tokens -> 15 tokens = 4 blocks: grows by 2
    nearly_done = seq(5, max_tokens=3)
    start_running(s, nearly_done)  # 6 tokens in 2 blocks; only 2 tokens left -> 8 tokens = 2 blocks: grows by 0
    filler = 999  # blocks held outside the scheduler (e.g. a transfer being cancelled)
    assert s.block_manager.allocate_slots(filler, 3 * BS, 0) is not None
    new = seq(9, max_tokens=4)  # prompt: 3 blocks; 13 tokens -> 4 blocks: grows by 1

    # Free 12 - 2 - 2 - 3 = 5: after the prompt's 3, 2 are left < growth 3 + watermark 1.
    check = s.check_reserve(new)
    assert check == ReserveCheck(prompt_blocks=3, free_blocks=5, growth_blocks=3, watermark_blocks=1, idle=False)
    assert not check.ok
    assert "5 free, the prompt needs 3, running streams keep 3 to grow + 1 watermark" in check.reason

    s.block_manager.free(filler)
    assert s.block_manager.allocate_slots(filler, 1 * BS, 0) is not None
    # Free 7: exactly 3 + 1 left after the prompt -> granted.
    check = s.check_reserve(new)
    assert (check.free_blocks, check.growth_blocks, check.ok) == (7, 3, True)
    assert check.reason == ""
    # The prompt-only rule (old behaviour) also grants one block less; this rule does not.
    assert s.block_manager.allocate_slots(filler, 2 * BS, 0) is not None
    assert not s.check_reserve(new).ok

    # Once the running streams are gone, the worker is idle: what fits is granted.
    s.finish(running, SequenceStatus.FINISHED_ABORTED)
    s.finish(nearly_done, SequenceStatus.FINISHED_ABORTED)
    s.block_manager.free(filler)
    assert s.block_manager.allocate_slots(filler, 9 * BS, 0) is not None  # 3 free == the prompt
    check = s.check_reserve(new)
    assert check.idle and check.ok and check.free_blocks - check.prompt_blocks == 0


def test_reserve_check_counts_choices_still_to_fork_and_queued_streams() -> None:
    s = make_scheduler(num_blocks=40, reserve_tokens=8, watermark=0.0)
    # n=3: 9 prompt tokens (2 full blocks + 1 partial), 4 more tokens -> 4 blocks each.
    forked = seq(9, max_tokens=4, pending_forks=2)
    # Parent grows 4 - 3 = 1; each choice to fork shares the 2 full blocks: 4 - 2 = 2.
    assert s.check_reserve(forked).growth_blocks == 1 + 2 * 2
    assert s.check_reserve(forked).prompt_blocks == 3
    # A stream queued behind max_num_seqs (or preempted) counts its whole need.
    queued = seq(6, max_tokens=2)
    s.add(queued)  # holds no blocks: 8 tokens -> 2 blocks
    assert s.check_reserve(seq(4, max_tokens=1)).growth_blocks == 2 + (2 - 1)


def test_bad_admission_settings_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="watermark must be in"):
        SchedulerConfig(watermark=1.0)
    with pytest.raises(ValueError, match="reserve_decode_tokens must be >= 0"):
        SchedulerConfig(reserve_decode_tokens=-1)
    done = subprocess.run([sys.executable, "-m", "pdserve", "decode", "--gateway", "tcp://127.0.0.1:9",
                           "--kv-watermark", "1.5"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2
    assert done.stderr.strip() == ("pdserve decode: error: argument --kv-watermark: expected a fraction "
                                   "0 <= x < 1, got '1.5' (see pdserve decode --help)")


# ------------------------------------------------------------- engine under pressure


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=99, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def engine(model_dir: Path, num_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model_dir), cache=CacheConfig(block_size=BS, num_blocks=num_blocks)))


@pytest.mark.usefixtures("one_torch_thread")
def test_decode_under_kv_pressure_never_preempts_and_equals_unpressured(model_dir: Path) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (10, 13, 11, 12, 9, 13, 10, 11)]
    params = [GREEDY if i % 2 == 0 else SEEDED for i in range(len(prompts))]
    ref = engine(model_dir, 256).generate(prompts, params)
    # Each stream grows to <= 37 tokens = 10 blocks; 8 of them need ~75 blocks, the pool has 24.
    prefill, decode = engine(model_dir, 256), engine(model_dir, 25)
    rids = [f"r{i}" for i in range(len(prompts))]
    firsts: dict[str, list[int]] = {}
    for rid, prompt, sp in zip(rids, prompts, params, strict=True):
        prefill.add_request(rid, prompt, sp, prefill_only=True)
    while prefill.has_unfinished():
        for out in prefill.step():
            firsts[out.request_id] = [c.token_ids[0] for c in out.outputs]

    got = {rid: list(firsts[rid]) for rid in rids}
    pending = deque(range(len(rids)))
    refused_while_busy = max_running = 0
    while pending or decode.has_unfinished():
        while pending:  # FCFS: a refused head waits, as the gateway retries it
            i = pending[0]
            reservation = decode.reserve_remote(rids[i], prompts[i], params[i])
            if not reservation.ok:
                refused_while_busy += 1
                break
            src = torch.tensor(prefill.held_blocks(rids[i]))
            decode.runner.pool.kv[:, :, torch.tensor(reservation.block_ids)] = prefill.runner.pool.kv[:, :, src]
            prefill.release(rids[i])
            decode.start_remote(rids[i], firsts[rids[i]])
            pending.popleft()
        max_running = max(max_running, len(decode.scheduler.running))
        for out in decode.step():
            got[out.request_id] += [t for c in out.outputs for t in c.token_ids]

    assert decode.stats().num_preemptions == 0
    assert [got[rid] for rid in rids] == [list(r.choices[0].token_ids) for r in ref]
    # The pool really was contended: streams shared it and arrivals had to wait.
    assert max_running >= 2 and refused_while_busy > 0
    for e in (prefill, decode):
        assert not e.has_unfinished() and e.stats().num_free_blocks == e.stats().num_total_blocks
        assert e.block_manager.check_integrity(), e.block_manager.integrity_errors()
