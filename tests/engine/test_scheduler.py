"""Scheduler: exact chunks and block ids, chunked prefill, preemption, WAITING_FOR_KV.

No model: a step is 'computed' by `mark_computed`, and a chunk that needs logits
gets a fake next token (the position number), as a deterministic fake runner would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import SupportsIndex

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.core.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.core.sequence import Sequence, SequenceStatus

BS = 4


def make(
    num_blocks: int = 9, budget: int = 10, max_seqs: int = 8, chunked: bool = True
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
    )
    return Scheduler(cfg, BlockManager(num_blocks, BS), max_model_len=64)


_ids = iter(range(10_000))


def seq(prompt: list[int], rid: str = "r") -> Sequence:
    return Sequence(next(_ids), rid, 0, prompt, SamplingParams(max_tokens=8), sampling_seed=0)


def run_step(s: Scheduler) -> SchedulerOutput:
    """Schedule, 'execute', and append a fake token to every sequence that got logits."""
    out = s.schedule()
    s.mark_computed(out)
    for chunk, sq in zip(out.chunks, out.seqs, strict=True):
        if chunk.need_logits:
            sq.append_token(1000 + sq.num_tokens)
    assert s.block_manager.check_integrity(), s.block_manager.integrity_errors()
    return out


def shape(out: SchedulerOutput) -> list[tuple[int, int, list[int], bool]]:
    return [(c.start_pos, c.num_tokens, c.block_table, c.need_logits) for c in out.chunks]


def test_decode_first_then_chunked_prefill_into_leftover_budget() -> None:
    s = make(budget=10)
    a, b = seq(list(range(7))), seq(list(range(50, 56)))
    s.add(a)
    s.add(b)
    out = run_step(s)
    # a's whole prompt (7 tokens, blocks 1-2), then 3 of b's 6 tokens (block 3).
    assert shape(out) == [(0, 7, [1, 2], True), (0, 3, [3], False)]
    assert out.seqs == [a, b]
    out = run_step(s)
    # Running first: a decodes one token at position 7; b gets its last 3 prompt tokens.
    assert shape(out) == [(7, 1, [1, 2], True), (3, 3, [3, 4], True)]
    out = run_step(s)
    assert shape(out) == [(8, 1, [1, 2, 5], True), (6, 1, [3, 4], True)]
    assert a.status is b.status is SequenceStatus.RUNNING


def test_small_budget_chunks_a_long_prompt() -> None:
    s = make(budget=3)
    a = seq(list(range(8)))
    s.add(a)
    sizes = []
    while not a.output_token_ids:
        sizes.append(run_step(s).chunks[0].num_tokens)
    assert sizes == [3, 3, 2]
    assert a.num_computed_tokens == 8 and a.num_tokens == 9


def test_long_prefill_cap_lets_a_short_prompt_in_behind_a_long_one() -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, long_prefill_token_threshold=4)
    s = Scheduler(cfg, BlockManager(12, BS), max_model_len=64)
    long, short = seq(list(range(12)), "long"), seq(list(range(50, 53)), "short")
    s.add(long)
    out = run_step(s)
    assert [c.num_tokens for c in out.chunks] == [4]  # capped, though 10 would fit
    s.add(short)
    out = run_step(s)
    # the short prompt whole, in a step of its own (pdserve/engine/core/prefill_order.py: the long
    # prompt's chunk waits a step rather than lengthen the short one's)
    assert [(sq.request_id, c.num_tokens) for sq, c in zip(out.seqs, out.chunks, strict=True)] == [("short", 3)]
    assert short.output_token_ids  # its first token after 2 steps, not after long's 3
    for _ in range(2):
        out = run_step(s)
        assert [(sq.request_id, c.num_tokens) for sq, c in zip(out.seqs, out.chunks, strict=True)] == [
            ("long", 4), ("short", 1)]
    assert long.output_token_ids


def test_no_chunking_waits_for_a_step_that_fits() -> None:
    s = make(budget=8, chunked=False)
    a, b = seq(list(range(5))), seq(list(range(10, 15)))
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [c.num_tokens for c in out.chunks] == [5]  # b (5 tokens) does not fit in 3
    out = run_step(s)
    assert [c.num_tokens for c in out.chunks] == [1, 5]


def test_max_num_seqs() -> None:
    s = make(budget=100, max_seqs=2)
    seqs = [seq([i, i + 1]) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = run_step(s)
    assert out.seqs == seqs[:2] and list(s.waiting) == [seqs[2]]


def test_prefix_hit_starts_after_cached_blocks() -> None:
    s = make(num_blocks=12, budget=32)
    prompt = list(range(10))
    a = seq(prompt)
    s.add(a)
    run_step(s)  # blocks 1 2 3; blocks 1 and 2 are full and cached
    b = seq(prompt + [77])
    s.add(b)
    out = run_step(s)
    # a's decode (position 10) stays in its block 3; b shares 1, 2 and gets block 4.
    assert shape(out) == [(10, 1, [1, 2, 3], True), (8, 3, [1, 2, 4], True)]
    assert b.num_cached_tokens == 8 and s.num_cached_tokens_hit == 8


def test_recompute_preemption_frees_victim_and_requeues_it_first() -> None:
    s = make(num_blocks=5, budget=16)  # 4 allocatable blocks
    a, b = seq(list(range(8))), seq(list(range(20, 27)))
    s.add(a)
    s.add(b)
    run_step(s)  # a: blocks 1 2 (8 tokens), b: blocks 3 4 (7 tokens)
    out = run_step(s)  # b's decode fits in block 4; a's token 8 needs a 5th block
    # a (first) cannot grow: the latest admitted, b, is preempted to make room.
    assert out.preempted == [b]
    assert shape(out) == [(8, 1, [1, 2, 4], True)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    assert b.output_token_ids  # its output survives; it is recomputed with it
    s.finish(a, SequenceStatus.FINISHED_LENGTH)
    out = run_step(s)
    # b recomputes prompt + its first output token (8 tokens); its own full first
    # block survived in the prefix cache, so only positions 4..7 are computed again.
    assert shape(out) == [(4, 4, [3, 4], True)]


def test_a_sole_sequence_that_cannot_grow_preempts_itself() -> None:
    s = make(num_blocks=3, budget=16)  # 2 allocatable blocks
    a = seq(list(range(8)))
    s.add(a)
    run_step(s)
    out = run_step(s)
    assert out.preempted == [a] and out.chunks == []
    assert s.block_manager.num_free_blocks == 2


def test_waiting_for_kv_is_never_scheduled_until_admitted() -> None:
    s = make()
    a = seq(list(range(6)))
    bm = s.block_manager
    assert bm.allocate_slots(a.seq_id, 6, 0) is not None
    s.add_waiting_for_kv(a)
    assert run_step(s).chunks == []
    a.num_computed_tokens = 6  # the KV arrived: computed elsewhere
    a.append_token(42)
    s.admit([a])
    out = run_step(s)
    assert shape(out) == [(6, 1, [1, 2], True)]
    assert out.chunks[0].token_ids == [42]


def test_finish_frees_unless_prefilled_and_release_frees_later() -> None:
    s = make()
    a, b = seq([1, 2, 3, 4, 5]), seq([6, 7, 8])
    s.add(a)
    s.add(b)
    run_step(s)
    s.finish(a, SequenceStatus.FINISHED_PREFILLED)
    s.finish(b, SequenceStatus.FINISHED_STOPPED)
    bm = s.block_manager
    assert bm.block_table(a.seq_id) == [1, 2] and bm.num_free_blocks == 6
    assert s.num_unfinished == 0
    s.release(a)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


class _CountingDeque(deque[Sequence]):
    """WAITING that counts every element the scheduler touches (iteration, indexing, a
    linear `remove`), so a test can see a step's work without timing it."""

    touched = 0

    def __iter__(self) -> Iterator[Sequence]:
        for item in super().__iter__():
            self.touched += 1
            yield item

    def __getitem__(self, i: SupportsIndex) -> Sequence:  # type: ignore[override]
        self.touched += 1
        return super().__getitem__(i)

    def remove(self, value: Sequence) -> None:
        self.touched += len(self)
        super().remove(value)


def _touched_per_step(num_waiting: int, cap: int) -> tuple[list[int], list[str]]:
    """Queue `num_waiting` 4-token prompts; each step admits two (8-token budget), which
    then end. Returns the elements touched per step and the admitted request ids."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, long_prefill_token_threshold=cap)
    s = Scheduler(cfg, BlockManager(64, BS), max_model_len=64)
    s.waiting = queue = _CountingDeque()
    for i in range(num_waiting):
        s.add(seq([i % 50, 1, 2, 3], f"r{i}"))
    touched, admitted = [], []
    for _ in range(5):
        queue.touched = 0
        out = s.schedule()
        touched.append(queue.touched)
        admitted += [q.request_id for q in out.seqs]
        for q in out.seqs:
            s.finish(q, SequenceStatus.FINISHED_STOPPED)
    return touched, admitted


def test_a_step_admits_from_the_head_without_walking_a_long_queue() -> None:
    # FCFS from the head, and the same per-step work with 10 or 4,000 waiting: admitting
    # pops the head instead of copying the queue and removing from it.
    for cap in (0, 4):  # chunking off, and a cap every one of these prompts fits in
        small, small_order = _touched_per_step(10, cap)
        large, large_order = _touched_per_step(4000, cap)
        assert small_order == large_order == [f"r{i}" for i in range(10)]
        assert large == small and max(large) <= 4, (cap, small, large)
