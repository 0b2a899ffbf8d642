"""One choice of one request, as the scheduler sees it.

Progress model: a sequence has `num_tokens` (prompt + output so far) and
`num_computed_tokens` whose KV is in the cache; each step computes some of the
difference. KV received from a prefill worker is simply tokens computed elsewhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.common.block_hash import prefix_root
from pdserve.common.logprobs import Logprob
from pdserve.common.lora import LoraRef
from pdserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.grammar.compiler import CompiledGrammar
    from pdserve.engine.grammar.matcher import GrammarMatcher


class SequenceStatus(enum.Enum):
    # Its grammar still compiles (in the compile pool): held by the engine, unseen by the
    # scheduler and holding no block, until the compile lands (then WAITING) or fails.
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    WAITING = "waiting"  # queued for (re)prefill; also where a preempted sequence returns
    # Blocks allocated, their KV still arriving: on a decode node from the prefill worker
    # (and the KV tiers); on any node, a prompt's prefix read from the KV tiers.
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # stop token or eos
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_PREFILLED = "finished_prefilled"  # prefill-only: first token out, blocks held


FINISHED_STATES = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_PREFILLED,
    }
)

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Sequence:
    """A single choice: the prompt, its output so far, and its scheduling progress."""

    seq_id: int
    request_id: str
    choice_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    # Seed of this request's stateless per-token generators (see pdserve.engine.sampler).
    sampling_seed: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    # Choices still to fork from this sequence when its first token is sampled.
    pending_forks: int = 0
    prefill_only: bool = False
    # Tokens of the prompt served from the prefix cache on its first admission.
    num_cached_tokens: int = 0
    # Structured outputs: the grammar state, built on first use by replaying the output
    # (pdserve/engine/grammar/masking.py); a fork builds its own.
    grammar: GrammarMatcher | None = field(default=None, repr=False)
    # The compiled constraint, set when the request is queued (its matcher is built from it).
    compiled_grammar: CompiledGrammar | None = field(default=None, repr=False)
    # Draft tokens this step verifies after the last token (pdserve.engine.spec); not part of
    # token_ids until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter every token of this sequence is computed under; None: the base.
    lora: LoraRef | None = None
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by output (do not mutate; use `append_token`)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def lora_id(self) -> str:
        """The adapter's fingerprint ("" for the base model): what the runner keys it by."""
        return self.lora.fingerprint if self.lora is not None else ""

    @property
    def prefix_root(self) -> bytes:
        """Where this sequence's prefix-cache chain starts (its adapter's own root)."""
        return prefix_root(self.lora_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATES

    @property
    def num_choices_when_running(self) -> int:
        """Sequences this one becomes once its first token forks the other choices."""
        return 1 + self.pending_forks

    def append_token(self, token_id: int, logprob: Logprob | None = None) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def reset_for_recompute(self) -> None:
        """Recompute preemption: its KV is gone; prompt + output will be prefilled again."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.spec_token_ids = []

    def fork(self, seq_id: int, choice_index: int) -> Sequence:
        """A sibling choice with the same tokens and progress (its blocks are forked apart)."""
        return Sequence(
            seq_id=seq_id,
            request_id=self.request_id,
            choice_index=choice_index,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            sampling_seed=self.sampling_seed,
            output_token_ids=list(self.output_token_ids),
            output_logprobs=list(self.output_logprobs),
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            prefill_only=self.prefill_only,
            num_cached_tokens=self.num_cached_tokens,
            compiled_grammar=self.compiled_grammar,
            lora=self.lora,
        )


def finish_status(
    seq: Sequence, eos_token_ids: frozenset[int], max_model_len: int
) -> SequenceStatus | None:
    """How `seq` ends after its latest token, or None if it goes on.

    A prefill-only sequence that goes on is FINISHED_PREFILLED: its first token is
    out and a decode node continues it.
    """
    p = seq.params
    token = seq.output_token_ids[-1]
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        return SequenceStatus.FINISHED_STOPPED
    if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    if seq.prefill_only:
        return SequenceStatus.FINISHED_PREFILLED
    return None


@dataclass(eq=False)
class Request:
    """All choices of one request; `seqs[c]` is choice c (one until the n-way fork)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool
    seqs: list[Sequence]
    # params.prompt_logprobs: one entry per prompt token (None at position 0), set once
    # the prompt is computed (pdserve/engine/prompt_logprobs.py, which fills `partial_prompt_logprobs`
    # chunk by chunk); reported with the request's next output, once.
    prompt_logprobs: tuple[Logprob | None, ...] | None = None
    prompt_logprobs_reported: bool = False
    partial_prompt_logprobs: list[Logprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def holds_blocks(self) -> bool:
        """A prefill-only request whose KV blocks await transfer and `release`."""
        return any(s.status is SequenceStatus.FINISHED_PREFILLED for s in self.seqs)

    @property
    def num_cached_tokens(self) -> int:
        return self.seqs[0].num_cached_tokens
