"""The one reader of a model's `generation_config.json`: its EOS/BOS ids (the engine stops on
them) and the sampling defaults its authors recommend (the gateway applies them).

Torch-free and stdlib-only, so the engine (`pdserve/engine/loading/model_config.py`), the gateway's
tokenizer and the CLI all read the file the same way.

Sampling defaults follow vLLM's `--generation-config auto`: of the file's values only
`temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` count, and only where they
differ from `transformers.GenerationConfig()`'s own defaults (vLLM reads `to_diff_dict()`),
so a file's `top_k: 50` (the transformers default) sets nothing. `do_sample` is ignored,
as vLLM does, and `max_new_tokens` is not a default for `max_tokens`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

FILE_NAME = "generation_config.json"

# transformers.GenerationConfig() defaults of the fields vLLM takes as sampling defaults.
_HF_DEFAULTS: dict[str, float | int | None] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
}


class GenerationConfigError(ValueError):
    """generation_config.json is unreadable or holds a value of the wrong type or range."""


@dataclass(frozen=True)
class SamplingDefaults:
    """Per-server defaults for request fields the client left out (None: the API default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        checks = {
            "temperature": lambda v: v >= 0,
            "top_p": lambda v: 0 < v <= 1,
            "top_k": lambda v: v >= -1,
            "min_p": lambda v: 0 <= v <= 1,
            "repetition_penalty": lambda v: v > 0,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise GenerationConfigError(f"{name} {value!r} is out of range")

    def as_dict(self) -> dict[str, float | int]:
        """The set defaults only, keyed like the request fields."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()  # empty: the file names none (use config.json's)
    bos_token_id: int | None = None
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


def read_generation_config(model_dir: str | Path, *, sampling: bool = True) -> GenerationConfig:
    """`model_dir/generation_config.json`, parsed; an empty config when there is no such file.
    Without `sampling` the defaults are neither parsed nor checked (readers that need only
    the token ids do not fail on a sampling value nobody applies)."""
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return GenerationConfig()
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise GenerationConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path} must hold a JSON object")
    return parse_generation_config(raw, str(path), sampling=sampling)


def parse_generation_config(
    raw: dict[str, Any], source: str = FILE_NAME, *, sampling: bool = True
) -> GenerationConfig:
    """A parsed generation_config.json object -> GenerationConfig. Raises GenerationConfigError."""
    try:
        return GenerationConfig(
            eos_token_ids=token_ids(raw.get("eos_token_id")),
            bos_token_id=_bos(raw.get("bos_token_id")),
            defaults=_defaults(raw) if sampling else SamplingDefaults(),
        )
    except GenerationConfigError as e:
        raise GenerationConfigError(f"{source}: {e}") from None


def _defaults(raw: dict[str, Any]) -> SamplingDefaults:
    return SamplingDefaults(
        temperature=_number(raw, "temperature"),
        top_p=_number(raw, "top_p"),
        top_k=_top_k(raw),
        min_p=_number(raw, "min_p"),
        repetition_penalty=_number(raw, "repetition_penalty"),
    )


def token_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` field (an id, a list of ids or null) as a tuple."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise GenerationConfigError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(items)


def _bos(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _set(raw: dict[str, Any], name: str) -> Any:
    """The file's value of `name`, None where it is absent or transformers' default."""
    value = raw.get(name)
    return None if value is None or value == _HF_DEFAULTS[name] else value


def _number(raw: dict[str, Any], name: str) -> float | None:
    value = _set(raw, name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise GenerationConfigError(f"{name} must be a number, got {value!r}")
    return float(value)


def _top_k(raw: dict[str, Any]) -> int | None:
    value = _set(raw, "top_k")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise GenerationConfigError(f"top_k must be an integer, got {value!r}")
    return value
