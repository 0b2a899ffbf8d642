"""The sampler hook of structured outputs: mask each constrained row's logits to the
tokens its grammar allows, before the sampler draws (greedy, sampled and logprobs all
see the masked row, as in vLLM).

With speculative decoding a constrained sequence drafts too: `cut_drafts` cuts its
drafts at the first token the grammar rejects (before they are scheduled), and
`constrain` masks verification row j with the grammar state after drafts[:j] (a
scratch walk along the draft, rolled back), which is exactly the state the j-th
draw would see without speculation, so the output is token-identical."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pdserve.engine.core.sequence import Sequence
from pdserve.engine.grammar.compiler import GrammarCompiler
from pdserve.engine.grammar.matcher import GrammarMatcher
from pdserve.engine.sampler import SampleRow


def matcher_for(seq: Sequence, compiler: GrammarCompiler) -> GrammarMatcher:
    """The sequence's matcher, built on first use and synced to its output so far."""
    c = seq.params.structured
    assert c is not None
    if seq.grammar is None:  # compiled before the request was queued; the cache only as a fallback
        compiled = seq.compiled_grammar if seq.compiled_grammar is not None else compiler.compile(c)
        seq.grammar = GrammarMatcher(compiled)
    seq.grammar.sync(seq.output_token_ids)
    return seq.grammar


def any_constrained(seqs: Seq[Sequence]) -> bool:
    """The batch-level guard: does any sequence carry a constraint?"""
    return any(s.params.structured is not None for s in seqs)


def cut_drafts(seqs: Seq[Sequence], compiler: GrammarCompiler) -> int:
    """Cut each constrained sequence's drafts at the first token its grammar rejects
    (nothing is committed); returns how many draft tokens were dropped."""
    dropped = 0
    for seq in seqs:
        if not seq.spec_token_ids or seq.params.structured is None:
            continue
        take = matcher_for(seq, compiler).accepted_prefix(seq.spec_token_ids)
        dropped += len(seq.spec_token_ids) - take
        del seq.spec_token_ids[take:]
    return dropped


def constrain(logits: torch.Tensor, rows: Seq[SampleRow], seqs: Seq[Sequence], compiler: GrammarCompiler) -> None:
    """Set to -inf, in place, every logit a constrained row's grammar disallows.

    `seqs` are the sampled sequences in row order; each owns 1 + len(spec_token_ids)
    consecutive rows (one per draft position). Rows of sibling choices forked at their
    first token share one logits row; they share the grammar state too (no output
    yet), so masking it twice is idempotent."""
    vocab = logits.shape[-1]
    at = 0
    for seq in seqs:
        own = rows[at:at + 1 + len(seq.spec_token_ids)]
        at += len(own)
        if seq.params.structured is None:
            continue
        m = matcher_for(seq, compiler)
        masks = m.allowed_along(seq.spec_token_ids, vocab) if seq.spec_token_ids else [m.allowed(vocab)]
        # Past a draft token the grammar rejects (`cut_drafts` leaves none) that row's draw
        # differs from the draft, so the rows after it are discarded: any mask will do.
        masks += masks[-1:] * (len(own) - len(masks))
        with torch.inference_mode():  # the runner's logits are inference tensors
            for row, mask in zip(own, masks, strict=False):  # row by row: cheaper than index_put
                logits[row.logits_index].masked_fill_(torch.from_numpy(~mask).to(logits.device), float("-inf"))
    assert at == len(rows), "rows and sequences out of step"
