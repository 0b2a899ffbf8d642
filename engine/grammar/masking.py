"""The sampler hook of structured outputs: mask each constrained row's logits to the
tokens its grammar allows, before the sampler draws (greedy, sampled and logprobs all
see the masked row, as in vLLM)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.grammar.compiler import GrammarCompiler
from engine.grammar.matcher import GrammarMatcher
from engine.sampler import SampleRow
from engine.sequence import Sequence


def matcher_for(seq: Sequence, compiler: GrammarCompiler) -> GrammarMatcher:
    """The sequence's matcher, built on first use and synced to its output so far."""
    c = seq.params.structured
    assert c is not None
    if seq.grammar is None:
        seq.grammar = GrammarMatcher(compiler.compile(c))
    seq.grammar.sync(seq.output_token_ids)
    return seq.grammar


def constrain(logits: torch.Tensor, rows: Seq[SampleRow], seqs: Seq[Sequence], compiler: GrammarCompiler) -> None:
    """Set to -inf, in place, every logit a constrained row's grammar disallows.

    Rows of sibling choices forked at their first token share one logits row; they
    share the grammar state too (no output yet), so masking it twice is idempotent."""
    vocab = logits.shape[-1]
    for row, seq in zip(rows, seqs, strict=True):
        if seq.params.structured is None:
            continue
        allowed = torch.from_numpy(matcher_for(seq, compiler).allowed(vocab)).to(logits.device)
        with torch.inference_mode():  # the runner's logits are inference tensors
            logits[row.logits_index].masked_fill_(~allowed, float("-inf"))
