"""Speculative decoding's pieces without a model: the config, the n-gram proposer,
acceptance, the block manager's trim and the scheduler's handling of drafts."""

from __future__ import annotations

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import Sequence, SequenceStatus
from pdserve.engine.spec.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from pdserve.engine.spec.decoder import SpecDecoder, accepted_prefix
from pdserve.engine.spec.ngram import NgramProposer

BS = 4


def test_config_reads_vllm_shape_with_its_defaults() -> None:
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, '
                                    '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.lookup_range) == ("ngram", 3, (2, 4))
    assert c.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2}').lookup_range == (5, 5)
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2, '
                                       '"prompt_lookup_max": 3}').lookup_range == (3, 3)
    d = SpeculativeConfig.from_json('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 4, '
                                    '"disable_by_batch_size": 2}')
    assert (d.model, d.disable_by_batch_size) == ("/m", 2)
    assert SpeculativeConfig.from_json(c.to_json()) == c
    assert (d.draft_kv, d.ships_draft_kv) == ("decode", False)
    shipped = SpeculativeConfig.from_json('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 4, '
                                          '"draft_kv": "prefill"}')
    assert shipped.ships_draft_kv and SpeculativeConfig.from_json(shipped.to_json()) == shipped


@pytest.mark.parametrize("text, words", [
    ("[1]", "JSON object"),
    ("{", "not valid JSON"),
    ('{"method": "ngram"}', "missing key 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key 'lookahead'"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": "2"}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a model directory"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "draft_kv": "gateway"}',
     "draft_kv must be one of decode, prefill"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_kv": "prefill"}', "no draft_kv"),
])
def test_config_refuses_bad_input_in_one_line(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        SpeculativeConfig.from_json(text)


def test_ngram_takes_the_longest_recurring_suffix_and_its_latest_occurrence() -> None:
    p = NgramProposer(1, 3)
    #           0  1  2  3  4  5  6  7  8  9
    tokens = [7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9]
    # "7 8 9" occurred at 0 and 4; the latest (4) is followed by 2, 7, 8, 9.
    assert p.propose(tokens, 3) == [2, 7, 8]
    assert p.propose([5, 6, 1, 2, 3, 6], 2) == [1, 2]  # only the 1-gram "6" recurs
    assert p.propose([1, 2, 3, 4], 4) == []  # nothing recurs
    assert p.propose([1, 2, 3, 4], 0) == []
    assert NgramProposer(2, 2).propose([5, 6, 1, 2, 3, 6], 2) == []  # a 1-gram is below min


def test_ngram_copies_on_through_the_overlap_of_a_loop() -> None:
    # "4 5" recurs at 1: its continuation runs into the suffix itself and keeps the period.
    assert NgramProposer(2, 2).propose([3, 4, 5, 4, 5], 5) == [4, 5, 4, 5, 4]
    assert NgramProposer(1, 1).propose([9, 9], 4) == [9, 9, 9, 9]


def test_ngram_matches_only_on_token_boundaries() -> None:
    # Large ids whose byte patterns could match across token boundaries.
    a, b = 0x0100000000000000, 0x01
    # a's last byte and the zero token after it spell b's bytes, one byte off the grid.
    assert NgramProposer(1, 1).propose([b, a, 0, b], 2) == [a, 0]
    assert NgramProposer(1, 1).propose([a, 0, 5, b], 1) == []


def test_accepted_prefix_keeps_draws_up_to_the_first_mismatch() -> None:
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 4
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 2
    assert accepted_prefix([5, 6, 7], [1, 6, 7, 8]) == 1
    assert accepted_prefix([], [3]) == 1


def test_trim_returns_tail_blocks_to_the_pool_and_keeps_cached_ones() -> None:
    bm = BlockManager(10, BS)
    assert bm.allocate_slots(1, 14, 0) is not None  # 4 blocks
    bm.cache_full_blocks(1, list(range(14)), 9)  # blocks 0 and 1 cached
    assert bm.trim(1, 9) == 1  # 9 tokens need 3 blocks
    assert bm.block_table(1) == [1, 2, 3] and bm.num_free_blocks == 6
    assert bm.trim(1, 12) == 0
    assert bm.check_integrity(), bm.integrity_errors()
    bm.free(1)
    assert bm.num_free_blocks == 9 and bm.num_cached_blocks == 2 and bm.check_integrity()


def _running(s: Scheduler, prompt: list[int], output: list[int], drafts: list[int]) -> Sequence:
    seq = Sequence(len(s.running) + 100, "r", 0, prompt, SamplingParams(max_tokens=32), 0,
                   output_token_ids=output)
    assert s.block_manager.allocate_slots(seq.seq_id, seq.num_tokens - 1, 0) is not None
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    s.running.append(seq)
    seq.spec_token_ids = drafts
    return seq


def test_drafts_ride_behind_the_last_token_within_the_budget() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=5), BlockManager(20, BS), max_model_len=64)
    a = _running(s, [1, 2, 3], [4], [5, 6, 7])
    b = _running(s, [1, 2], [9], [8, 8, 8])
    out = s.schedule()
    ca, cb = out.chunks
    assert (ca.token_ids, ca.start_pos, ca.num_draft_tokens, ca.num_logits) == ([4, 5, 6, 7], 3, 3, 4)
    assert (cb.token_ids, cb.num_draft_tokens) == ([9], 0)  # 1 token of budget left: drafts cut
    assert a.spec_token_ids == [5, 6, 7] and b.spec_token_ids == []
    s.mark_computed(out)
    assert a.num_computed_tokens == 4  # the drafts count only once accepted
    assert len(s.block_manager.block_table(a.seq_id)) == 2  # slots up to position 6


def test_short_blocks_drop_drafts_instead_of_preempting() -> None:
    s = Scheduler(SchedulerConfig(), BlockManager(4, BS), max_model_len=64)  # 3 blocks
    a = _running(s, [1, 2, 3], [4], [5, 6, 7, 8, 9])  # holds 1 block, drafts want 2 more
    b = _running(s, [1, 2, 3, 4, 5], [6], [])  # holds 2 blocks
    out = s.schedule()
    assert not out.preempted and [c.num_draft_tokens for c in out.chunks] == [0, 0]
    assert a.spec_token_ids == [] and s.running == [a, b]


def test_decoder_never_drafts_past_max_tokens_or_for_opted_out_requests() -> None:
    cfg = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=1, disable_by_batch_size=3)
    s = Scheduler(SchedulerConfig(), BlockManager(20, BS), max_model_len=64)
    dec = SpecDecoder(cfg, s.block_manager, 64)
    near_end = _running(s, [1, 2, 1], [2], [])
    near_end.params = SamplingParams(max_tokens=3)  # 1 drawn, 2 to go: one draft at most
    opted_out = _running(s, [1, 2, 1], [2], [])
    opted_out.params = SamplingParams(max_tokens=30, speculative=False)
    free = _running(s, [1, 2, 1], [2], [])
    dec.propose(s.running, len(s.running))
    assert (near_end.spec_token_ids, opted_out.spec_token_ids, free.spec_token_ids) == ([1], [], [1, 2, 1, 2])
    dec.propose(s.running, 4)  # above disable_by_batch_size
    assert [q.spec_token_ids for q in s.running] == [[], [], []]
