"""Batched sampling over one step's logits with the OpenAI / vLLM knobs.

Order of processing for each row (vLLM semantics):
1. penalties on the raw logits: repetition (over prompt + output: a positive
   logit is divided by the penalty, a negative one multiplied), then frequency
   and presence (over output only: `logit -= freq * count + presence * (count > 0)`);
2. greedy rows (temperature 0 or top_k 1) take the argmax here;
3. temperature, then top-k, then top-p (smallest set of most likely tokens whose
   mass reaches top_p), then min-p (drop tokens below min_p x the top probability);
4. a draw from the remaining distribution.

Determinism contract: output token `i` of choice `c` of a request with seed `s`
is drawn with a fresh generator seeded from `(s, c, i)`, never from a stateful
per-request generator, so any node that continues a sequence draws the same
tokens as a single-process run. Noise is generated on the CPU so the draw does
not depend on the device either.

Logprobs are those of the model's raw distribution (before penalties and
temperature), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdserve.common.logprobs import Logprob, TopLogprob
from pdserve.common.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finalizer: a well-spread 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def generator_seed(seed: int, choice_index: int, token_index: int) -> int:
    """The seed of the generator that draws token `token_index` of choice `choice_index`."""
    h = _mix64(_mix64(_mix64(seed & _MASK64) ^ choice_index) ^ token_index)
    return h & ((1 << 63) - 1)  # manual_seed wants a non-negative int64


def request_seed(engine_seed: int, request_counter: int) -> int:
    """Seed for an unseeded sampled request: the engine seed and its arrival number."""
    return generator_seed(engine_seed, 0x5EED, request_counter)


class SampleRow(NamedTuple):
    """What the sampler needs to draw one token for one choice."""

    logits_index: int  # row of the step's logits tensor
    params: SamplingParams
    seed: int
    choice_index: int
    token_index: int  # index of the output token being drawn
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


class SampleResult(NamedTuple):
    token_id: int
    logprob: Logprob | None


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Penalized copy of one row of logits (returned unchanged when no penalty is set)."""
    p = row.params
    if _no_penalty(p):
        return logits
    vocab = logits.shape[-1]
    out = logits.clone()
    device = logits.device
    if p.repetition_penalty != 1.0:
        seen = [t for t in (*row.prompt_token_ids, *row.output_token_ids) if 0 <= t < vocab]
        if seen:
            idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=device)
            vals = out[idx]
            out[idx] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        outs = torch.tensor(
            [t for t in row.output_token_ids if 0 <= t < vocab], dtype=torch.long, device=device
        )
        counts = torch.bincount(outs, minlength=vocab).to(out.dtype)
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled (non-greedy) row draws from, after temperature,
    top-k, top-p and min-p; `logits` are already penalized. Zero outside the support."""
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop_sorted[0] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


def draw(probs: torch.Tensor, seed: int, choice_index: int, token_index: int) -> int:
    """Sample from `probs` with the stateless (seed, choice, index) generator.

    Exponential-race sampling: argmax(p / E) with E ~ Exp(1) picks token t with
    probability p_t, using one fixed-size noise draw per token.
    """
    gen = torch.Generator(device="cpu").manual_seed(generator_seed(seed, choice_index, token_index))
    noise = torch.empty(probs.shape[-1], dtype=torch.float32).exponential_(generator=gen)
    return int(torch.argmax(probs.cpu() / noise).item())


def _logprob(raw_logits: torch.Tensor, token_id: int, top_n: int) -> Logprob:
    lp = torch.log_softmax(raw_logits.float(), dim=-1)
    top: tuple[TopLogprob, ...] = ()
    if top_n > 0:
        vals, ids = torch.topk(lp, min(top_n, lp.shape[-1]))
        top = tuple(TopLogprob(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True))
    return Logprob(token_id, float(lp[token_id].item()), top)


class Sampler:
    """Draws one token per row; stateless, so one instance serves every step.

    Rows stay on the logits' device: greedy rows are one batched argmax, sampled rows one
    batched exponential race (`draw_batch`); only the chosen token ids reach the host.
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[SampleResult]:
        if not rows:
            return []
        tokens: list[int | None] = [None] * len(rows)
        # Fast path: greedy rows without penalties are one batched argmax.
        plain = [i for i, r in enumerate(rows) if r.params.greedy and _no_penalty(r.params)]
        if plain:
            idx = torch.tensor([rows[i].logits_index for i in plain], device=logits.device)
            for i, t in zip(plain, torch.argmax(logits[idx], dim=-1).tolist(), strict=True):
                tokens[i] = int(t)
        greedy: list[tuple[int, torch.Tensor]] = []
        sampled: list[tuple[int, torch.Tensor]] = []
        for i, row in enumerate(rows):
            if tokens[i] is None:
                x = apply_penalties(logits[row.logits_index].float(), row)
                if row.params.greedy:
                    greedy.append((i, x))
                else:
                    sampled.append((i, sampling_probs(x, row.params)))
        if greedy:
            ids = torch.argmax(torch.stack([x for _, x in greedy]), dim=-1).tolist()
            for (i, _), t in zip(greedy, ids, strict=True):
                tokens[i] = int(t)
        if sampled:
            keys = [(rows[i].seed, rows[i].choice_index, rows[i].token_index) for i, _ in sampled]
            drawn = draw_batch(torch.stack([p for _, p in sampled]), keys)
            for (i, _), t in zip(sampled, drawn, strict=True):
                tokens[i] = t
        results = []
        for row, tok in zip(rows, tokens, strict=True):
            assert tok is not None
            lp = None
            if row.params.logprobs is not None:
                lp = _logprob(logits[row.logits_index], tok, row.params.logprobs)
            results.append(SampleResult(tok, lp))
        return results


def draw_batch(probs: torch.Tensor, keys: Sequence[tuple[int, int, int]]) -> list[int]:
    """`draw` for each row of `probs` [R, vocab] (on any device) with its (seed, choice,
    index) key, as one batched op: the noise comes from the same CPU generators (so the
    tokens equal `draw`'s row by row), goes to the device in one copy, and only R token ids
    come back."""
    noise = torch.empty(len(keys), probs.shape[-1], dtype=torch.float32,
                        pin_memory=probs.device.type == "cuda")
    for row, (seed, choice, index) in enumerate(keys):
        gen = torch.Generator(device="cpu").manual_seed(generator_seed(seed, choice, index))
        noise[row].exponential_(generator=gen)
    noise = noise.to(probs.device, non_blocking=True)
    return [int(t) for t in torch.argmax(probs / noise, dim=-1).tolist()]


def _no_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
