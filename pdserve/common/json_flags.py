"""Flags that take vLLM's JSON objects (`--speculative-config`, `--kv-events-config`), read
into frozen dataclasses: the object's keys must be the dataclass's fields, and a config is
handed to a child process as the JSON it was read from (None fields left out)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any


def json_object(text: str, cls: type) -> dict[str, Any]:
    """`text` as a JSON object whose every key is a field of dataclass `cls`; ValueError
    with one line naming what is wrong. The values are the caller's to check."""
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError("must be a JSON object")
    unknown = sorted(set(raw) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}")
    return raw


def to_json(config: Any) -> str:
    """The JSON `json_object` reads back into dataclass `config`'s type."""
    return json.dumps({f.name: getattr(config, f.name) for f in fields(config) if getattr(config, f.name) is not None})
