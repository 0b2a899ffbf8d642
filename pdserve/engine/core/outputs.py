"""What the engine hands back: per-step deltas, whole generations, and load stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, cast

from pdserve.common.logprobs import Logprob
from pdserve.engine.core.sequence import FINISH_REASONS, Request, Sequence
from pdserve.engine.lora.config import LoraStats
from pdserve.engine.spec.decoder import SpecStats

if TYPE_CHECKING:
    from pdserve.engine.core.block_manager import BlockManager
    from pdserve.engine.core.scheduler import Scheduler

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class CompletionOutput:
    """One choice's delta for one step: the tokens it gained (stop tokens included)."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...] | None
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class RequestOutput:
    """A request's progress in one step.

    `finished` is True once every choice finished, or, for a prefill-only request,
    once its first token(s) are out; `prefilled` then says its KV blocks are held
    for transfer (see `LLMEngine.held_blocks` / `release`).
    """

    request_id: str
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    prefilled: bool = False
    # params.prompt_logprobs: set on the one output after the prompt was computed.
    prompt_logprobs: tuple[Logprob | None, ...] | None = None


@dataclass(frozen=True)
class ChoiceResult:
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...] | None
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class GenerationResult:
    """The whole generation of one prompt by `LLMEngine.generate`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    choices: tuple[ChoiceResult, ...]
    num_cached_tokens: int
    prompt_logprobs: tuple[Logprob | None, ...] | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The first choice's tokens (the common n=1 case)."""
        return self.choices[0].token_ids


class FailedRequest(NamedTuple):
    """A request the engine gave up on before running it (its grammar did not compile in
    time, or at all); it holds nothing. The caller answers it (a non-retryable error)."""

    request_id: str
    reason: str
    param: str = ""  # the request field that set the constraint


class EngineStats(NamedTuple):
    """Load figures for heartbeats and metrics."""

    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_waiting_for_grammar: int  # held off the scheduler until their grammar compiles
    num_free_blocks: int
    num_total_blocks: int  # allocatable blocks (the null block excluded)
    kv_usage: float
    num_prompt_tokens_computed: int
    num_cached_tokens_hit: int
    num_generated_tokens: int
    num_preemptions: int
    num_steps: int = 0  # scheduler steps taken: stands still only when the step loop does
    spec: SpecStats | None = None  # speculative decoding counters (None: off)
    lora: LoraStats | None = None  # --enable-lora: adapters held, running, waiting; loads


def engine_stats(s: Scheduler, bm: BlockManager, num_generated: int, num_steps: int,
                 spec: SpecStats | None, lora: LoraStats | None = None, num_compiling: int = 0) -> EngineStats:
    """The engine's load figures from its scheduler and block manager, and how many
    requests wait for their grammar (`num_compiling`: held outside the scheduler)."""
    return EngineStats(
        num_running=len(s.running),
        num_waiting=len(s.waiting),
        num_waiting_for_kv=len(s.waiting_for_kv),
        num_waiting_for_grammar=num_compiling,
        num_free_blocks=bm.num_free_blocks,
        num_total_blocks=bm.num_allocatable,
        kv_usage=bm.usage,
        num_prompt_tokens_computed=s.num_prompt_tokens_computed,
        num_cached_tokens_hit=s.num_cached_tokens_hit,
        num_generated_tokens=num_generated,
        num_preemptions=s.num_preemptions,
        num_steps=num_steps,
        spec=spec,
        lora=lora,
    )


@dataclass
class StepDeltas:
    """Tokens each (request, choice) gained during one step, in order."""

    tokens: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    logprobs: dict[str, dict[int, list[Logprob]]] = field(default_factory=dict)

    def add(self, seq: Sequence, token_id: int, logprob: Logprob | None) -> None:
        self.tokens.setdefault(seq.request_id, {}).setdefault(seq.choice_index, []).append(token_id)
        if logprob is not None:
            per_req = self.logprobs.setdefault(seq.request_id, {})
            per_req.setdefault(seq.choice_index, []).append(logprob)


def _finish_reason(seq: Sequence) -> FinishReason | None:
    reason = FINISH_REASONS.get(seq.status)
    return cast("FinishReason | None", reason)


def build_outputs(
    requests: list[Request],
    tokens: dict[str, dict[int, list[int]]],
    logprobs: dict[str, dict[int, list[Logprob]]],
    include_finished: bool = False,
) -> list[RequestOutput]:
    """One RequestOutput per request: the choices that gained tokens (or finished)."""
    outs = []
    for req in requests:
        new = tokens.get(req.request_id, {})
        lps = logprobs.get(req.request_id, {})
        want_lp = req.params.logprobs is not None
        choices = tuple(
            CompletionOutput(
                index=seq.choice_index,
                token_ids=tuple(new.get(seq.choice_index, ())),
                logprobs=tuple(lps.get(seq.choice_index, ())) if want_lp else None,
                finish_reason=_finish_reason(seq),
            )
            for seq in req.seqs
            if seq.choice_index in new or (include_finished and seq.is_finished)
        )
        prompt_lps = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_reported:
            prompt_lps, req.prompt_logprobs_reported = req.prompt_logprobs, True
        outs.append(
            RequestOutput(
                request_id=req.request_id,
                outputs=choices,
                finished=req.finished,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_cached_tokens=req.num_cached_tokens,
                prefilled=req.holds_blocks,
                prompt_logprobs=prompt_lps,
            )
        )
    return outs


def generation_result(req: Request) -> GenerationResult:
    """The whole generation of a finished request."""
    want_lp = req.params.logprobs is not None
    return GenerationResult(
        request_id=req.request_id,
        prompt_token_ids=tuple(req.prompt_token_ids),
        choices=tuple(
            ChoiceResult(
                index=seq.choice_index,
                token_ids=tuple(seq.output_token_ids),
                logprobs=tuple(seq.output_logprobs) if want_lp else None,
                finish_reason=_finish_reason(seq),
            )
            for seq in req.seqs
        ),
        num_cached_tokens=req.num_cached_tokens,
        prompt_logprobs=req.prompt_logprobs,
    )
