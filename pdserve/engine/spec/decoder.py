"""Drafts in, accepted tokens out: the engine's one speculative-decoding component.

One step with speculation, per sequence (see `pdserve.engine.llm_engine`):

1. `propose` gives each RUNNING decode sequence (one uncomputed token, the
   request not opted out, the running batch no larger than
   `disable_by_batch_size`) up to K draft tokens in `Sequence.spec_token_ids`,
   capped so that neither max_tokens nor max_model_len can be crossed.
2. The scheduler puts them behind the sequence's last token in its chunk and
   allocates their slots (dropping them first when blocks run short); the
   runner returns the logits of that token and of every draft (one target
   forward over 1 + K tokens, in the same batch as sequences without drafts).
3. Row j is sampled exactly as output token len(output) + j would be without
   speculation: its own (seed, choice, index) generator, penalties over the
   output plus drafts[:j] (which row j's result is only used if they were all
   accepted, i.e. equal to the earlier rows' draws). `accepted_prefix` keeps
   draws up to and including the first that differs from its draft.
4. `settle`: the KV of the accepted drafts counts as computed, full blocks of
   it enter the prefix cache, and blocks past the computed length go back to
   the pool (the rejected slots of a partial block are simply overwritten later).

So every token equals the one speculation-off decoding would produce; drafts
only change how many of them one forward yields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.sequence import Sequence as Seq
from pdserve.engine.core.sequence import SequenceStatus
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.ngram import NgramProposer


class DraftInput(NamedTuple):
    """One sequence asking for drafts."""

    seq_id: int
    token_ids: Sequence[int]
    num_tokens: int  # drafts wanted at most


class Proposer(Protocol):
    """A stateless proposer (n-gram; tests' oracles)."""

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` guesses of the tokens that follow `token_ids`."""


@runtime_checkable
class BatchProposer(Protocol):
    """A proposer with per-sequence state (a draft model's KV)."""

    def propose_batch(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        """Drafts for each input, in order."""

    def retain(self, live: set[int]) -> None:
        """Drop the state of every sequence id not in `live`."""


class _Stateless:
    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer

    def propose_batch(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        return [self.proposer.propose(x.token_ids, x.num_tokens) for x in inputs]

    def retain(self, live: set[int]) -> None:
        return None


class SpecStats(NamedTuple):
    """Cumulative counters (vLLM's spec_decode_* metrics)."""

    num_drafts: int  # sequences verified with at least one draft token
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # [j]: drafts accepted at position j
    draft_prefill_tokens: int = 0  # tokens a draft model prefilled here (no shipped draft KV)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying forward: 1 + accepted drafts per draft (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many of `sampled` (one per draft, plus one) to keep: the draws up to and
    including the first that differs from its draft, or all of them."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return j + 1
    return len(drafts) + 1


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int,
                 proposer: Proposer | BatchProposer | None = None) -> None:
        """`proposer`: default n-gram (method ngram); a draft model's is built by the engine."""
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(f"speculative method {config.method!r} needs its proposer")
            proposer = NgramProposer(*config.lookup_range)
        self.proposer: BatchProposer = (proposer if isinstance(proposer, BatchProposer)
                                        else _Stateless(proposer))
        self._drafts = 0
        self._draft_tokens = 0
        self._accepted = 0
        self._per_pos = [0] * config.num_speculative_tokens

    def propose(self, running: Sequence[Seq], batch_size: int) -> None:
        """Set every running sequence's drafts for this step ([] where it does not speculate)."""
        self.retain(running)
        on = batch_size <= self.config.disable_by_batch_size
        wanted = [(seq, self._room(seq)) for seq in running] if on else []
        drafting = [(seq, room) for seq, room in wanted if room > 0]
        for seq in running:
            seq.spec_token_ids = []
        if not drafting:
            return
        drafts = self.proposer.propose_batch([DraftInput(s.seq_id, s.token_ids, room) for s, room in drafting])
        for (seq, room), draft in zip(drafting, drafts, strict=True):
            seq.spec_token_ids = list(draft[:room])

    def retain(self, running: Sequence[Seq]) -> None:
        """Free the proposer's state (a draft model's KV) of sequences no longer running."""
        self.proposer.retain({seq.seq_id for seq in running})

    def _room(self, seq: Seq) -> int:
        """Drafts `seq` may verify this step: none unless it decodes, at most K, and never
        past max_tokens or max_model_len."""
        # A structured-output request speculates too: the engine cuts its drafts at the
        # first token its grammar rejects and masks each row along them (pdserve.engine.grammar).
        if (seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1
                or seq.prefill_only or seq.pending_forks or not seq.params.speculative):
            return 0
        return min(self.config.num_speculative_tokens,
                   seq.params.max_tokens - len(seq.output_token_ids) - 1,
                   self.max_model_len - seq.num_tokens)

    def settle(self, seq: Seq, drafts: Sequence[int], kept: int) -> None:
        """After verification kept `kept` draws (`accepted_prefix`): count the accepted
        drafts' KV as computed and give back the blocks past it. A finished sequence has
        already freed its blocks."""
        accepted = min(kept - 1, len(drafts))
        self._record(len(drafts), accepted)
        if seq.is_finished:
            return
        bm = self.block_manager
        seq.num_computed_tokens += accepted
        bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.prefix_root)
        bm.trim(seq.seq_id, seq.num_computed_tokens)

    def _record(self, num_drafts: int, accepted: int) -> None:
        if not num_drafts:
            return
        self._drafts += 1
        self._draft_tokens += num_drafts
        self._accepted += accepted
        for j in range(accepted):
            self._per_pos[j] += 1

    def stats(self) -> SpecStats:
        return SpecStats(self._drafts, self._draft_tokens, self._accepted, tuple(self._per_pos),
                         int(getattr(self.proposer, "prefill_tokens", 0)))

