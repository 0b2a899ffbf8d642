"""What the scheduler hands the model runner: one chunk of new tokens per sequence.

Slot of position `p` in a sequence = `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeqChunk:
    """The tokens of one sequence computed in one step.

    token_ids:   new tokens computed this step (a prefill chunk, or one decode token).
    start_pos:   tokens already in this sequence's KV cache before this step; the new
                 tokens occupy positions [start_pos, start_pos + len(token_ids)).
    block_table: physical block ids covering positions [0, start_pos + len(token_ids)).
    need_logits: return the logits of the last token of this chunk.
    num_draft_tokens: the last this many tokens are speculative drafts (pdserve.engine.spec);
                 with need_logits the runner returns the logits of each of them and
                 of the token before them, in position order.
    prompt_logits: return the logits of every token of this chunk, in position order
                 (prompt logprobs); never with drafts. With need_logits the last row is
                 also the one sampled from.
    lora_id:     the fingerprint of the LoRA adapter these tokens run under ("": the
                 base model); rows of different adapters share one step (pdserve.engine.lora).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_logits: bool
    num_draft_tokens: int = 0
    prompt_logits: bool = False
    lora_id: str = ""

    @property
    def num_logits(self) -> int:
        """Logits rows this chunk yields."""
        if self.prompt_logits:
            return len(self.token_ids)
        return 1 + self.num_draft_tokens if self.need_logits else 0

    @property
    def first_sampled_row(self) -> int:
        """The first of this chunk's rows sampled from (with need_logits): its last
        1 + num_draft_tokens rows are (a prompt_logits chunk has one per token before)."""
        return self.num_logits - 1 - self.num_draft_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        """Tokens in the KV cache once this chunk is computed."""
        return self.start_pos + len(self.token_ids)
