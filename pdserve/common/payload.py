"""What a request is to every worker: its prompt, typed sampling params and, for a
recovery, where it resumes. Carried whole by the control-plane messages that bring a
new request (`pdserve/common/protocol.py`: `DecodeReserve`, `PrefillRequest`, `RunRequest`)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.lora import LoraRef
from pdserve.common.sampling_params import SamplingParams


@dataclass(frozen=True)
class Resume:
    """Where a recovered request continues: choice `choice_index` already produced
    `output_token_ids` elsewhere. They are prefilled with the prompt but stay *output* to
    the engine, so sampling seeds (seed, choice, index) and presence/frequency penalties
    continue exactly."""

    output_token_ids: list[int]
    choice_index: int = 0


@dataclass(frozen=True)
class RequestPayload:
    """A request as every worker receives it, in `DecodeReserve`, `PrefillRequest` and
    `RunRequest`: the prompt, typed sampling params, for a recovery the resume point, and
    the LoRA adapter it runs under (None: the base model), identity and fingerprint, so
    prefill, decode and a recovery all apply the same weights; and the trace context when
    the request is traced."""

    prompt_token_ids: list[int]
    params: SamplingParams
    resume: Resume | None = None
    lora: LoraRef | None = None
    # W3C trace context of the gateway span this work belongs to (pdserve/common/tracing.py);
    # None when the request is not traced. A message from a peer without the field parses.
    traceparent: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.resume.output_token_ids) if self.resume else []

    @property
    def choice_index(self) -> int:
        return self.resume.choice_index if self.resume else 0

    @property
    def num_tokens(self) -> int:
        """Tokens to prefill: the prompt and any resumed output."""
        resumed = len(self.resume.output_token_ids) if self.resume else 0  # no copy: load() reads it every tick
        return len(self.prompt_token_ids) + resumed
