"""`--speculative-config`: vLLM's JSON shape parsed into a frozen dataclass.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}

`draft_kv` (draft_model only) says where the draft's KV for the prompt is made when
prefill and decode are split: "decode" (default) prefills the draft on the decode
worker; "prefill" has the prefill worker run the draft too and ship its KV with the
target's (pdserve/engine/spec/draft_model.py says which measures better and why).

`disable_by_batch_size` (vLLM's name) switches speculation off for a step whose
running batch holds more sequences than this. Unknown keys are errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.json_flags import json_object, to_json

METHODS = ("ngram", "draft_model")
DRAFT_KV_PLACEMENTS = ("decode", "prefill")
# Per-step switch-off when no value is given: above this many running sequences a
# decode step is batched well enough that verifying drafts costs more than it saves
# (measured with the trained model and its draft: a small gain at 4 running sequences,
# break-even at 8, a few percent lost at 16; bench/README.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # n-gram drafting: the longest suffix of n tokens (max down to min) that occurred
    # before proposes the tokens that followed it. vLLM's defaults: both 5 when neither
    # is given, else the one given for both.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: a checkpoint directory with the target's tokenizer.
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    draft_kv: str = "decode"  # where the draft's prompt KV is made: decode | prefill

    @property
    def ships_draft_kv(self) -> bool:
        """The prefill worker runs the draft and ships its KV (draft_kv=prefill)."""
        return self.method == "draft_model" and self.draft_kv == "prefill"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("num_speculative_tokens must be in [1, 32]")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")
        if self.draft_kv not in DRAFT_KV_PLACEMENTS:
            raise ValueError(f"draft_kv must be one of {', '.join(DRAFT_KV_PLACEMENTS)}, got {self.draft_kv!r}")
        if self.method == "ngram":
            if self.model is not None or self.draft_kv != "decode":
                raise ValueError("method ngram takes no model and no draft_kv")
            lo, hi = self.lookup_range
            if not 1 <= lo <= hi:
                raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        else:
            if not self.model:
                raise ValueError("method draft_model needs a model directory")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("prompt_lookup_min/max belong to method ngram")

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(min, max) n-gram sizes, vLLM's defaults filled in."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return 5, 5
        return (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)

    def to_json(self) -> str:
        """The JSON `from_json` reads back (for handing the config to a child process)."""
        return to_json(self)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse `--speculative-config`; ValueError with one line naming what is wrong."""
        raw = json_object(text, cls)
        for key in ("method", "num_speculative_tokens"):
            if key not in raw:
                raise ValueError(f"missing key {key!r}")
        for key, value in raw.items():
            want = str if key in ("method", "model", "draft_kv") else int
            if value is None and key not in ("method", "num_speculative_tokens"):
                continue
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(f"{key} must be a{'n integer' if want is int else ' string'}")
        return cls(**raw)
