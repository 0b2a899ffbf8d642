"""Typed readers of one JSON request field: the value, None when absent, or an
`APIError` (400, OpenAI envelope) naming the field and what it must be."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import excerpt, invalid


def int_field(body: Mapping[str, Any], name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(name, f"{name} must be an integer", "invalid_type")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise invalid(name, f"{name} must be in {bounds}, got {excerpt(value, 24)}")
    return value


def float_field(
    body: Mapping[str, Any], name: str, lo: float, hi: float | None, lo_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise invalid(name, f"{name} must be a number", "invalid_type")
    too_low = value <= lo if lo_open else value < lo
    if too_low or (hi is not None and value > hi):
        bounds = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{']' if hi is not None else ')'}"
        raise invalid(name, f"{name} must be in {bounds}, got {excerpt(value, 24)}")
    return float(value)


def bool_field(body: Mapping[str, Any], name: str, default: bool | None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be a boolean", "invalid_type")
    return value


def opt_str_field(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(name, f"{name} must be a string", "invalid_type")
    return value
