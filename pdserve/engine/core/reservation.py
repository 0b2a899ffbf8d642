"""A decode reservation, as the scheduler grants or refuses it (`Scheduler.check_reserve`,
`LLMEngine.reserve_remote`): the figures in blocks, and the blocks granted."""

from __future__ import annotations

from typing import NamedTuple


class ReserveCheck(NamedTuple):
    """Decode admission of one reservation, in blocks (`Scheduler.check_reserve`).

    Granted when the prompt's blocks fit and, unless the worker is idle, the
    blocks left free afterwards still cover the growth of every live stream (the
    new one included) over its next `reserve_decode_tokens` tokens, capped by its
    max_tokens, plus the watermark. Like SGLang's decode prealloc queue with
    reserved decode tokens and vLLM's `watermark`: a request that does not pass
    waits (the decode worker refuses, the gateway retries on the decode pool)
    instead of taking blocks running streams need and forcing their recompute.
    With max_tokens within `reserve_decode_tokens` no decode step ever preempts;
    longer streams may still outgrow the pool after their first
    `reserve_decode_tokens` tokens.
    """

    prompt_blocks: int  # blocks the reservation takes now
    free_blocks: int  # free before it (free cached blocks included)
    growth_blocks: int  # more blocks the live streams and this one may need
    watermark_blocks: int
    idle: bool  # no other stream is running, queued or awaiting its KV

    @property
    def ok(self) -> bool:
        if self.prompt_blocks > self.free_blocks:
            return False
        return (
            self.idle
            or self.free_blocks - self.prompt_blocks >= self.growth_blocks + self.watermark_blocks
        )

    @property
    def reason(self) -> str:
        """Why it was refused, in blocks ("" when granted)."""
        if self.ok:
            return ""
        return (
            f"not enough free KV blocks: {self.free_blocks} free, the prompt needs "
            f"{self.prompt_blocks}, running streams keep {self.growth_blocks} to grow "
            f"+ {self.watermark_blocks} watermark"
        )


class Reservation(NamedTuple):
    """A decode reservation: the blocks granted for the KV to arrive in (empty when
    refused) and why; `cached_blocks`: leading blocks of the prompt already held here
    (pinned, not part of `block_ids`: suffix-only handoff)."""

    block_ids: list[int]
    check: ReserveCheck
    cached_blocks: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.block_ids)
