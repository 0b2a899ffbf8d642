"""Sampler on fixed logits: support of top-k/top-p/min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence, SequenceStatus, finish_status
from pdserve.engine.sampler import (
    Sampler,
    SampleRow,
    apply_penalties,
    draw,
    generator_seed,
    sampling_probs,
)

torch.set_num_threads(1)

# Probabilities 0.5, 0.25, 0.15, 0.1 at temperature 1.
PROBS = torch.tensor([0.5, 0.25, 0.15, 0.1])
LOGITS = PROBS.log()


def row(
    params: SamplingParams,
    *,
    index: int = 0,
    seed: int = 7,
    choice: int = 0,
    token: int = 0,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
) -> SampleRow:
    return SampleRow(index, params, seed, choice, token, list(prompt), list(output))


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def test_temperature_scales_logits() -> None:
    probs = sampling_probs(LOGITS, SamplingParams(temperature=2.0))
    assert torch.allclose(probs, torch.softmax(LOGITS / 2.0, -1))


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    probs = sampling_probs(LOGITS, SamplingParams(top_k=2))
    assert support(probs) == {0, 1}
    assert torch.allclose(probs[:2], torch.tensor([2 / 3, 1 / 3]))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert support(sampling_probs(LOGITS, SamplingParams(top_p=0.4))) == {0}
    assert support(sampling_probs(LOGITS, SamplingParams(top_p=0.7))) == {0, 1}
    probs = sampling_probs(LOGITS, SamplingParams(top_p=0.8))
    assert support(probs) == {0, 1, 2}
    assert probs[0].item() == pytest.approx(0.5 / 0.9)


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    assert support(sampling_probs(LOGITS, SamplingParams(min_p=0.35))) == {0, 1}  # cut 0.175
    assert support(sampling_probs(LOGITS, SamplingParams(min_p=0.25))) == {0, 1, 2}  # cut 0.125
    assert support(sampling_probs(LOGITS, SamplingParams(min_p=0.9))) == {0}


def test_sampled_tokens_stay_in_support() -> None:
    params = SamplingParams(top_k=3, top_p=0.7, seed=1)
    toks = {draw(sampling_probs(LOGITS, params), s, 0, 0) for s in range(200)}
    assert toks == {0, 1}


def test_repetition_penalty_over_prompt_and_output() -> None:
    logits = torch.tensor([2.0, -1.0, 3.0, 0.5])
    out = apply_penalties(
        logits, row(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))
    )
    assert out.tolist() == [1.0, -2.0, 3.0, 0.5]


def test_frequency_and_presence_penalties_over_output_only() -> None:
    logits = torch.zeros(4)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, row(params, prompt=(0, 0, 1), output=(3, 3, 2)))
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.75, -1.25])


def test_greedy_applies_penalties_before_argmax() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert Sampler()(logits, [row(greedy)])[0].token_id == 0
    penalized = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, [row(penalized, output=(0,))])[0].token_id == 1


def test_seeded_draw_follows_the_seed_choice_index_contract() -> None:
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    params = SamplingParams(temperature=1.0, seed=123)
    gen = torch.Generator().manual_seed(generator_seed(123, 2, 5))
    noise = torch.empty(50).exponential_(generator=gen)
    expected = int(torch.argmax(probs / noise))
    logits = probs.log().unsqueeze(0)
    assert Sampler()(logits, [row(params, seed=123, choice=2, token=5)])[0].token_id == expected
    assert len({generator_seed(123, c, i) for c in range(4) for i in range(4)}) == 16


def test_a_rows_draw_does_not_depend_on_the_batch() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=99)
    alone = Sampler()(logits[2:3], [row(params, index=0, choice=1, token=4)])
    batch = Sampler()(
        logits,
        [
            row(SamplingParams(temperature=0.0), index=0),
            row(params, index=2, choice=1, token=4),
            row(params, index=1, choice=0, token=4),
        ],
    )
    assert batch[1].token_id == alone[0].token_id
    again = Sampler()(logits[2:3], [row(params, index=0, choice=1, token=4)])
    assert again == alone  # reproducible


def test_draws_follow_the_distribution() -> None:
    counts = torch.zeros(4)
    for s in range(4000):
        counts[draw(PROBS, s, 0, 0)] += 1
    assert torch.allclose(counts / 4000, PROBS, atol=0.03)


def test_logprobs_of_sampled_token_and_top_n() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    res = Sampler()(logits, [row(SamplingParams(temperature=0.0, logprobs=2))])[0]
    lp = torch.log_softmax(logits[0], -1)
    assert res.token_id == 1 and res.logprob is not None
    assert res.logprob.logprob == pytest.approx(lp[1].item())
    assert [t.token_id for t in res.logprob.top] == [1, 2]
    assert res.logprob.top[1].logprob == pytest.approx(lp[2].item())
    assert math.exp(res.logprob.logprob) < 1
    assert Sampler()(logits, [row(SamplingParams(temperature=0.0))])[0].logprob is None


def _seq(params: SamplingParams, prefill_only: bool = False) -> Sequence:
    return Sequence(0, "r", 0, [1, 2, 3], params, sampling_seed=0, prefill_only=prefill_only)


def test_finish_status_stop_ids_eos_and_length() -> None:
    eos = frozenset({2})
    s = _seq(SamplingParams(max_tokens=3, stop_token_ids=frozenset({9})))
    s.append_token(5)
    assert finish_status(s, eos, 100) is None
    s.append_token(9)
    assert finish_status(s, eos, 100) is SequenceStatus.FINISHED_STOPPED
    s = _seq(SamplingParams(max_tokens=3))
    s.append_token(2)
    assert finish_status(s, eos, 100) is SequenceStatus.FINISHED_STOPPED
    s = _seq(SamplingParams(max_tokens=2, ignore_eos=True))
    s.append_token(2)
    assert finish_status(s, eos, 100) is None
    s.append_token(2)
    assert finish_status(s, eos, 100) is SequenceStatus.FINISHED_LENGTH
    s = _seq(SamplingParams(max_tokens=9))
    s.append_token(5)
    assert finish_status(s, eos, 4) is SequenceStatus.FINISHED_LENGTH  # max_model_len
    s = _seq(SamplingParams(max_tokens=9), prefill_only=True)
    s.append_token(5)
    assert finish_status(s, eos, 100) is SequenceStatus.FINISHED_PREFILLED


def test_batched_draw_takes_the_tokens_each_row_drew_alone() -> None:
    """The sampler draws sampled rows in one batched op; each token equals the
    per-row draw of the same (seed, choice, index), over mixed knobs and penalties."""
    torch.manual_seed(3)
    vocab, n = 257, 24
    logits = torch.randn(n, vocab) * 3
    knobs = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=20),
             SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.9, min_p=0.05),
             SamplingParams(temperature=1.1, frequency_penalty=0.5, repetition_penalty=1.2),
             SamplingParams(temperature=0.0, presence_penalty=0.7), SamplingParams(temperature=0.0)]
    rows = [row(knobs[i % len(knobs)], index=i, seed=1000 + i // 3, choice=i % 3, token=i,
                prompt=(1, 2, 3), output=(5, 5, 9)) for i in range(n)]
    got = [r.token_id for r in Sampler()(logits, rows)]
    want = []
    for r in rows:
        x = apply_penalties(logits[r.logits_index], r)
        if r.params.greedy:
            want.append(int(torch.argmax(x)))
        else:
            want.append(draw(sampling_probs(x, r.params), r.seed, r.choice_index, r.token_index))
    assert got == want
    assert len(set(got)) > 5  # the seeds really differ


def test_sampled_rows_are_drawn_in_one_batched_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """No per-row draw: the sampled rows of a step reach `draw_batch` together."""
    from pdserve.engine import sampler as sampler_module

    calls: list[int] = []
    real = sampler_module.draw_batch

    def spy(probs: torch.Tensor, keys: list[tuple[int, int, int]]) -> list[int]:
        calls.append(len(keys))
        return real(probs, keys)

    monkeypatch.setattr(sampler_module, "draw_batch", spy)
    rows = [row(SamplingParams(temperature=1.0), index=0, seed=s) for s in range(6)]
    Sampler()(LOGITS[None].expand(1, 4).contiguous(), rows)
    assert calls == [6]
