"""The prompt in a response: vLLM's `prompt_logprobs` and OpenAI's `echo`.

`prompt_logprobs` (completions: on each choice; chat: on the response) is vLLM's
shape: one entry per prompt token, None for the first, else a map from token id (a
JSON string key) to `{"logprob", "decoded_token"}`: the prompt's own token first, then
the top-n alternatives (`rank` is not reported). `echo` on /v1/completions puts the
prompt text before each choice's text and, with `logprobs`, the prompt's tokens before
its logprobs (the first token's logprob null, as OpenAI and vLLM have it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.backend import Logprob


@dataclass(frozen=True)
class PromptView:
    """What a response shows of the prompt."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob | None, ...] | None  # None: not computed (not requested)
    echo: bool = False


def vllm_prompt_logprobs(lps: Sequence[Logprob | None], token: Callable[[int], str]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "decoded_token": token(lp.token_id)}}
        for t in lp.top:
            entry.setdefault(str(t.token_id), {"logprob": t.logprob, "decoded_token": token(t.token_id)})
        out.append(entry)
    return out


def echo_logprobs(view: PromptView, token: Callable[[int], str]) -> dict[str, list[Any]]:
    """The completions `logprobs` lists of the echoed prompt (offsets from 0)."""
    tokens = [token(t) for t in view.token_ids]
    lps = view.logprobs or (None,) * len(tokens)
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob if lp is not None else None for lp in lps],
        "top_logprobs": [{token(a.token_id): a.logprob for a in lp.top} if lp is not None else None for lp in lps],
        "text_offset": offsets,
    }


def prepend(echoed: dict[str, list[Any]], output: dict[str, Any]) -> dict[str, Any]:
    """Completions logprobs of the prompt followed by those of the output (whose text
    offsets already start past the prompt's tokens)."""
    return {
        "tokens": echoed["tokens"] + output["tokens"],
        "token_logprobs": echoed["token_logprobs"] + output["token_logprobs"],
        "top_logprobs": echoed["top_logprobs"] + output["top_logprobs"],
        "text_offset": echoed["text_offset"] + output["text_offset"],
    }
