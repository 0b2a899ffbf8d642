"""The multi-turn chat workload of `bench/multiturn.py`: conversation text, the KV pool
sizes that make routing matter, and the answers' comparison. No server, no torch.

Shape `chat` (the default; issue 18's "2,000-token conversation growing over 6 turns"):
every conversation opens with one shared system prompt (`system_words`, ~1,000 tokens:
the instructions / tool list / document a deployment sends with every chat), then a
document of its own (`opening_words`, ~300 tokens), then `turns` turns of a new user
message (`turn_words`, ~70 tokens) and the model's answer (`output_len` tokens), so
the last turn sends ~1,950 tokens. Shape `private` (the issue's words with nothing
shared between conversations): each conversation's own opening document
(~1,300 tokens with the bench/models.py tokenizer) and ~85-token user messages, ~1,950
tokens by turn 6; no prefix is hot on every worker, so a turn sent to the worker that
does not hold its conversation recomputes all of it; users think ~2 s (exponential)
before each turn, so turns arrive in no fixed order. Shape `legacy`: no shared prefix,
a one-line opening and ~180-token user messages (the workload before the chat shape).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.loadgen.prompts import WORDS

SHAPES = ("chat", "private", "legacy")
# Per shape: (system words, opening words, words per user message).
SHAPE_WORDS = {"chat": (600, 180, 40), "private": (0, 660, 42), "legacy": (0, 0, 100)}
# Per shape: mean seconds a user thinks before each turn (exponential; 0: none).
SHAPE_THINK_S = {"chat": 0.0, "private": 2.0, "legacy": 0.0}


@dataclass(frozen=True)
class ChatShape:
    conversations: int = 16
    turns: int = 6
    output_len: int = 32
    system_words: int = 600
    opening_words: int = 180
    turn_words: int = 40
    seed: int = 0
    think_s: float = 0.0

    @staticmethod
    def of(kind: str, conversations: int, turns: int, output_len: int, seed: int,
           turn_words: int | None = None, think_s: float | None = None) -> ChatShape:
        """The named shape, `turn_words` and `think_s` overriding its own."""
        if kind not in SHAPES:
            raise ValueError(f"shape must be one of {', '.join(SHAPES)}, not {kind!r}")
        system, opening, words = SHAPE_WORDS[kind]
        think = SHAPE_THINK_S[kind] if think_s is None else think_s
        return ChatShape(conversations, turns, output_len, system, opening, turn_words or words, seed, think)

    def think_times(self, c: int) -> list[float]:
        """Seconds conversation `c`'s user waits before each turn (the first included, so
        conversations start apart): with think time the turns of different
        conversations arrive in no fixed order, as users' do. Without it every
        conversation sends its turn as soon as the last answer ends, in lock step, and
        round-robin over an even pool sends each conversation back to the same worker."""
        if self.think_s <= 0:
            return [0.0] * self.turns
        rng = np.random.default_rng(self.seed * 1000 + c + 2 * 10**6)
        return [float(x) for x in rng.exponential(self.think_s, self.turns)]

    def system_prompt(self) -> str:
        """Shared by every conversation ("" in the legacy shape)."""
        if not self.system_words:
            return ""
        rng = np.random.default_rng(self.seed * 7919 + 1)
        return "System: " + " ".join(rng.choice(WORDS, self.system_words)) + "\n"

    def opening(self, c: int) -> str:
        """Conversation `c`'s first text after the system prompt."""
        rng = np.random.default_rng(self.seed * 1000 + c + 10**6)
        if not self.opening_words:
            return f"Conversation {c}."
        return f"Document {c}: " + " ".join(rng.choice(WORDS, self.opening_words))

    def user_messages(self, c: int) -> list[str]:
        rng = np.random.default_rng(self.seed * 1000 + c)
        return [" ".join(rng.choice(WORDS, self.turn_words)) for _ in range(self.turns)]

    @staticmethod
    def turn_text(user: str) -> str:
        """What a turn appends before the model answers."""
        return f"\nUser: {user}\nAssistant:"

    def final_text(self, c: int) -> str:
        """Conversation `c`'s prompt text at its last turn, less the earlier answers."""
        return self.system_prompt() + self.opening(c) + "".join(self.turn_text(u) for u in self.user_messages(c))


@dataclass(frozen=True)
class Pools:
    """KV blocks per worker and the working sets they are sized against (blocks of
    `block_size` tokens); see `size_pools`."""

    prefill_blocks: int
    decode_blocks: int
    shared_blocks: int  # the system prompt: every worker holds it once
    kv_aware_need: int  # one prefill worker's share under kv-aware routing
    round_robin_need: int  # every conversation, what each prefill worker meets under round-robin
    decode_need: int  # every conversation to its end + the running streams' growth

    def describe(self, prefill_workers: int) -> str:
        return (f"prefill pool {self.prefill_blocks} blocks: kv-aware's share {self.kv_aware_need} "
                f"(system prompt {self.shared_blocks} + the conversations of 1/{prefill_workers} + one "
                f"prompt in flight) fits, round-robin's {self.round_robin_need} (system prompt + every "
                f"conversation) does not; decode pool {self.decode_blocks} blocks >= {self.decode_need} "
                "(every conversation to its last token + each stream's growth), so suffix-only handoff "
                "always finds the history")


def size_pools(shape: ChatShape, count_tokens: Callable[[str], int], prefill_workers: int,
               block_size: int = 16) -> Pools:
    """Pool sizes from the workload's token counts (answers counted at `output_len`).

    A prefill worker caches the full blocks of every prompt it computes: the system
    prompt once, and each conversation's own blocks (its final prompt less the system
    prompt). Under kv-aware routing it keeps ~1/`prefill_workers` of the conversations;
    under round-robin every conversation's turns reach it. The prefill pool is the
    midpoint of the two (plus one whole prompt in flight on the kv-aware side), so the
    first fits and the second evicts. The decode worker must hold every conversation to
    its end (suffix-only handoff finds the history there) plus each stream's growth and
    the 1% watermark: that need x 1.25.
    """
    system = count_tokens(shape.system_prompt()) if shape.system_words else 0
    shared = system // block_size
    answers = (shape.turns - 1) * shape.output_len
    own = sorted((math.ceil((count_tokens(shape.final_text(c)) + answers - shared * block_size) / block_size)
                  for c in range(shape.conversations)), reverse=True)
    longest = max(own) + shared
    share = math.ceil(shape.conversations / max(prefill_workers, 1))
    kv_need = shared + sum(own[:share]) + longest
    rr_need = shared + sum(own)
    growth = shape.conversations * (math.ceil(shape.output_len / block_size) + 1)
    decode_need = shared + sum(own) + shape.conversations + growth
    return Pools(max(kv_need + 1, (kv_need + rr_need) // 2), math.ceil(decode_need * 1.25), shared,
                 kv_need, rr_need, decode_need)


def history_hits(prompt_tokens: Sequence[int], cached: Sequence[int], block_size: int = 16) -> tuple[int, int]:
    """(turns that found their previous turn's prompt cached, turns after the first) for
    one conversation: turn i hits when the worker served at least the full blocks of
    turn i - 1's prompt from its cache."""
    later = range(1, len(prompt_tokens))
    hits = sum(1 for i in later if cached[i] >= (prompt_tokens[i - 1] - 1) // block_size * block_size)
    return hits, len(later)


def differing(texts_a: dict[str, str], texts_b: dict[str, str]) -> list[str]:
    """Keys (conversation/turn) whose answers differ or are missing on one side."""
    return sorted(k for k in set(texts_a) | set(texts_b) if texts_a.get(k) != texts_b.get(k))
