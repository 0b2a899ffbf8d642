"""Where a Hugging Face MoE model's router sits on a tie: the steps of a greedy `generate`
at which some layer's k-th and (k+1)-th expert scores are within one bf16 ulp.

At such a step a rounding anywhere upstream (an attention kernel that rounds once where
SDPA rounds its probabilities to bf16 first, a fused projection) can pick the other
expert, and the logits then move by far more than a rounding: the MoE analogue of a
near-tie between the top two tokens (tests/engine/test_hf_equivalence.py)."""

from __future__ import annotations

import math
from typing import Any

import torch


def first_router_tie(hf: Any, prompt: list[int], new_tokens: int) -> int | None:
    """The first generate step (0: the prompt's forward) with a near-tie in any router
    of `hf`; None for a model without routers or a run without a tie."""
    routers = [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        return None
    k = int(hf.config.num_experts_per_tok)
    calls: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: calls.append(out[0].float())) for m in routers]
    try:
        hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    finally:
        for h in hooks:
            h.remove()
    for step in range(len(calls) // len(routers)):
        for logits in calls[step * len(routers):(step + 1) * len(routers)]:
            top = logits.sort(dim=-1, descending=True).values
            kth, nxt = top[:, k - 1], top[:, k]
            ulp = torch.tensor([2.0 ** (math.floor(math.log2(max(abs(float(v)), 2.0**-126))) - 7) for v in kth])
            if bool(((kth - nxt) <= ulp).any()):
                return step
    return None
