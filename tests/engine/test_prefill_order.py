"""Short prompts first on chunked prefill (pdserve/engine/core/prefill_order.py through the
scheduler): a prompt that fits in one chunk gets a step without a long prompt's chunk,
the long one continues the step after, and a stream of short prompts holds a long
one back at most MAX_HELD_STEPS steps in a row."""

from __future__ import annotations

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.core.prefill_order import MAX_HELD_STEPS
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import SequenceStatus
from tests.engine.test_scheduler import run_step, seq

BS = 4
CAP = 8  # long_prefill_token_threshold: a prompt of more than 8 tokens is long


def make(cap: int = CAP, max_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64, long_prefill_token_threshold=cap)
    return Scheduler(cfg, BlockManager(64, BS), max_model_len=64)


def steps(s: Scheduler, n: int) -> list[list[tuple[str, int]]]:
    """(request id, tokens) of each of the next `n` steps."""
    done = []
    for _ in range(n):
        out = run_step(s)
        assert s.short_first.tracks(s.waiting)
        done.append([(q.request_id, c.num_tokens) for q, c in zip(out.seqs, out.chunks, strict=True)])
    return done


def test_a_short_prompt_gets_a_step_of_its_own_and_the_long_one_continues_after() -> None:
    s = make()
    s.add(seq(list(range(30)), "long"))
    assert steps(s, 1) == [[("long", 8)]]
    s.add(seq(list(range(100, 105)), "short"))  # arrives during the long prompt's first chunk
    # Its step holds only its 5 tokens (not 8 of the long prompt's too): its first token comes
    # a chunk earlier. Then the long prompt goes on beside the short one's decode tokens.
    assert steps(s, 3) == [[("short", 5)], [("long", 8), ("short", 1)], [("long", 8), ("short", 1)]]
    assert s.block_manager.check_integrity()


def test_a_waiting_long_prompt_is_passed_by_a_short_one_behind_it() -> None:
    s = make()
    s.add(seq(list(range(30)), "long"))
    s.add(seq(list(range(100, 103)), "short"))
    assert steps(s, 2) == [[("short", 3)], [("short", 1), ("long", 8)]]


def test_a_stream_of_short_prompts_holds_a_long_one_back_a_bounded_number_of_steps() -> None:
    s = make(max_seqs=32)
    s.add(seq(list(range(40)), "long"))
    assert steps(s, 1) == [[("long", 8)]]
    ran = []
    for i in range(2 * (MAX_HELD_STEPS + 1)):
        s.add(seq(list(range(200 + 10 * i, 203 + 10 * i)), f"s{i}"))
        out = run_step(s)
        ran.append(any(q.request_id == "long" for q in out.seqs))
    # Held back MAX_HELD_STEPS steps in a row, then it runs (with that step's short prompt).
    assert ran == ([False] * MAX_HELD_STEPS + [True]) * 2


def test_nothing_is_held_back_without_a_chunk_cap_or_without_room() -> None:
    s = make(cap=0)  # no cap: first come, first served, in one step
    s.add(seq(list(range(30)), "long"))
    s.add(seq(list(range(100, 103)), "short"))
    assert steps(s, 1) == [[("long", 30), ("short", 3)]]
    full = make(max_seqs=1)  # the short prompt cannot be admitted: the long one goes on
    full.add(seq(list(range(30)), "long"))
    run_step(full)
    full.add(seq(list(range(100, 103)), "short"))
    assert steps(full, 1) == [[("long", 8)]]


def test_preemption_and_ending_waiting_prompts_keep_the_waiting_classes_exact() -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=CAP)
    s = Scheduler(cfg, BlockManager(6, BS), max_model_len=64)  # 5 blocks: 20 tokens
    s.add(seq(list(range(8)), "a"))
    s.add(seq(list(range(100, 108)), "b"))
    steps(s, 1)  # both prefilled: 4 blocks
    out = run_step(s)  # a's first decode token takes the last block; b's finds none
    assert [q.request_id for q in out.preempted] == ["b"] and s.num_preemptions == 1
    # b went back with 8 + 1 tokens to recompute: a long prompt now, and so tracked.
    assert s.short_first.tracks(s.waiting) and not s.short_first.is_short(s.waiting[0])
    for prompt, rid in ((list(range(200, 230)), "long"), (list(range(300, 303)), "short")):
        s.add(seq(prompt, rid))
    for q in list(s.waiting):  # ended while waiting (an abort): they leave the classes too
        s.finish(q, SequenceStatus.FINISHED_ABORTED)
        assert s.short_first.tracks(s.waiting)
    assert not s.waiting
