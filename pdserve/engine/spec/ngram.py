"""Prompt-lookup (n-gram) drafting: no model, only the sequence's own tokens.

The longest suffix of n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
that occurred earlier in prompt + output proposes the tokens that followed its most
recent earlier occurrence. A continuation that runs into the suffix itself copies on
with the overlap (the sequence is periodic there), so a loop proposes a full draft.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = array("q").itemsize


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens continuing `token_ids` ([] when no n-gram recurs)."""
        total = len(token_ids)
        if num_tokens <= 0 or total <= self.lookup_min:
            return []
        # bytes.rfind searches in C; a hit must start on a token boundary.
        buf = array("q", token_ids).tobytes()
        for n in range(min(self.lookup_max, total - 1), self.lookup_min - 1, -1):
            start = _rfind_token(buf, buf[-n * _ITEM:], (total - 1) * _ITEM)
            if start >= 0:
                return _continuation(token_ids, start + n, num_tokens)
        return []


def _rfind_token(buf: bytes, pattern: bytes, end: int) -> int:
    """Token index of the last occurrence of `pattern` inside buf[:end], aligned; -1 if none."""
    pos = buf.rfind(pattern, 0, end)
    while pos >= 0 and pos % _ITEM:
        pos = buf.rfind(pattern, 0, pos + len(pattern) - 1)
    return pos // _ITEM if pos >= 0 else -1


def _continuation(token_ids: Sequence[int], first: int, num_tokens: int) -> list[int]:
    total = len(token_ids)
    out: list[int] = []
    for i in range(first, first + num_tokens):
        out.append(token_ids[i] if i < total else out[i - total])
    return out
