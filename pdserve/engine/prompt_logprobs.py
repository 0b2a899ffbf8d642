"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-softmax, at float32, of the
logits at prompt position p, read at prompt token p+1, and the top-n alternatives.

A sequence that asks for them has every chunk that reaches into its prompt computed
with `prompt_logits` (all rows, pdserve/engine/core/runner_types.py) and never reads the prefix
cache (pdserve/engine/core/scheduler.py), so each position is computed here, wherever the prompt is
computed: the colocated engine, the prefill worker, a decode worker that prefills
locally or re-prefills in a recovery. Position 0 has no logprob (None), as in vLLM.

`collect_prompt_logprobs` fills the request's list chunk by chunk (a re-prefill after
a preemption overwrites the same positions with the same values); the engine reports
it once, with the output of the step that completes the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seqs

import torch

from pdserve.common.logprobs import Logprob, TopLogprob
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.core.sequence import Request, Sequence


def chunk_logprobs(logits: torch.Tensor, chunk: SeqChunk, prompt: Seqs[int], top_n: int
                   ) -> list[tuple[int, Logprob]]:
    """(position, logprob) of each prompt token the rows of `chunk` predict; `logits`
    are the chunk's rows, one per token, in position order."""
    first = chunk.start_pos + 1  # row k predicts the token at start_pos + k + 1
    last = min(chunk.end_pos, len(prompt) - 1)
    if last < first:
        return []
    rows = logits[: last - first + 1].float()
    lp = torch.log_softmax(rows, dim=-1)
    targets = torch.tensor(prompt[first:last + 1], dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
    tops: list[tuple[TopLogprob, ...]] = [()] * len(chosen)
    if top_n > 0:
        vals, ids = torch.topk(lp, min(top_n, lp.shape[-1]), dim=-1)
        tops = [tuple(TopLogprob(int(i), float(v)) for i, v in zip(ri, rv, strict=True))
                for ri, rv in zip(ids.tolist(), vals.tolist(), strict=True)]
    return [(first + k, Logprob(int(prompt[first + k]), float(chosen[k]), tops[k])) for k in range(len(chosen))]


def collect_prompt_logprobs(chunks: Seqs[SeqChunk], seqs: Seqs[Sequence], logits: torch.Tensor,
                            requests: Mapping[str, Request]) -> None:
    """Fill the requests' prompt logprobs from one step's logits; a request whose prompt
    this step completes gets `Request.prompt_logprobs`."""
    at = 0
    for chunk, seq in zip(chunks, seqs, strict=True):
        req = requests.get(seq.request_id)
        if chunk.prompt_logits and seq.params.prompt_logprobs is not None and req is not None:
            prompt = seq.prompt_token_ids
            if req.partial_prompt_logprobs is None:
                req.partial_prompt_logprobs = [None] * len(prompt)
            rows = logits[at:at + chunk.num_logits]
            for pos, lp in chunk_logprobs(rows, chunk, prompt, seq.params.prompt_logprobs):
                req.partial_prompt_logprobs[pos] = lp
            if chunk.end_pos >= len(prompt):
                req.prompt_logprobs, req.partial_prompt_logprobs = tuple(req.partial_prompt_logprobs), None
        at += chunk.num_logits
