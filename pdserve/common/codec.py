"""A strict msgpack codec for nested frozen dataclasses, driven by their type hints.

`to_wire` turns a dataclass (and the dataclasses, lists, tuples and dicts inside it)
into msgpack-native data; `from_wire(cls, data)` checks that data field by field
against `cls`'s annotations, down to the leaves, and builds the typed value. Unknown
or missing fields, a wrong type at any depth, and map keys that are not strings
raise `WireError` naming the path; nothing else is ever raised for bad input.

Supported annotations: str, int, float, bool, None, a `str` enum (as its value), `X | None`, `list[X]`,
`tuple[X, ...]`, `frozenset[X]` (a sorted list on the wire), `dict[str, X]` and dataclasses
built of these. There is no `Any`:
every leaf has a type.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable
from typing import Any

Convert = Callable[[Any, str], Any]


class WireError(ValueError):
    """Data that does not match the declared type; the message names where."""


def to_wire(value: Any) -> Any:
    """Msgpack-native data for a dataclass value (tuples become lists). A field that is
    None and defaults to None is left out: decoding restores it, and a peer from before
    the field existed still parses the message (new optional fields stay compatible both
    ways while unset)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_wire(v) for f in dataclasses.fields(value)
                if (v := getattr(value, f.name)) is not None or f.default is not None}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if isinstance(value, frozenset):
        return [to_wire(v) for v in sorted(value)]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def from_wire(cls: type, data: Any, path: str = "") -> Any:
    """`data` checked against `cls` and built into it, or WireError."""
    return converter(cls)(data, path or cls.__name__)


def _fail(path: str, expected: str) -> typing.NoReturn:
    raise WireError(f"{path} is not {expected}")


def _leaf(tp: type) -> Convert:
    if tp is bool:
        def conv(v: Any, path: str) -> Any:
            return v if isinstance(v, bool) else _fail(path, "bool")
    elif tp is int:
        def conv(v: Any, path: str) -> Any:
            return v if isinstance(v, int) and not isinstance(v, bool) else _fail(path, "int")
    elif tp is float:
        def conv(v: Any, path: str) -> Any:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
            _fail(path, "float")
    elif tp is str:
        def conv(v: Any, path: str) -> Any:
            return v if isinstance(v, str) else _fail(path, "str")
    elif tp is type(None):
        def conv(v: Any, path: str) -> Any:
            return v if v is None else _fail(path, "None")
    else:
        raise TypeError(f"no wire form for {tp!r}")
    return conv


def _optional(inner: Convert) -> Convert:
    def conv(v: Any, path: str) -> Any:
        return None if v is None else inner(v, path)
    return conv


def _sequence(item: Convert, make: type) -> Convert:
    def conv(v: Any, path: str) -> Any:
        if not isinstance(v, list):
            _fail(path, "a list")
        return make(item(x, f"{path}[{i}]") for i, x in enumerate(v))
    return conv


def _mapping(value: Convert) -> Convert:
    def conv(v: Any, path: str) -> Any:
        if not isinstance(v, dict):
            _fail(path, "a map")
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                _fail(f"{path} key", "str")
            out[k] = value(x, f"{path}[{k[:40]!r}]")
        return out
    return conv


def _dataclass(cls: type) -> Convert:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    convs = {f.name: converter(hints[f.name]) for f in fields}
    required = {f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}

    def conv(v: Any, path: str) -> Any:
        if not isinstance(v, dict):
            _fail(path, f"a {cls.__name__} map")
        unknown = [k for k in v if k not in convs]
        if unknown:
            raise WireError(f"{path}: unknown field {str(unknown[0])[:40]!r}")
        missing = required - set(v)
        if missing:
            raise WireError(f"{path}: missing field {sorted(missing)[0]!r}")
        return cls(**{k: convs[k](x, f"{path}.{k}") for k, x in v.items()})
    return conv


@functools.cache
def converter(tp: Any) -> Convert:
    """The checking converter for one annotation (built once per type)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"only `X | None` unions travel, not {tp!r}")
        return _optional(converter(rest[0]))
    if origin is list:
        return _sequence(converter(args[0]), list)
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"only tuple[X, ...] travels, not {tp!r}")
        return _sequence(converter(args[0]), tuple)
    if origin is frozenset:
        return _sequence(converter(args[0]), frozenset)
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"only str-keyed dicts travel, not {tp!r}")
        return _mapping(converter(args[1]))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and issubclass(tp, str):
        return _str_enum(tp)
    return _leaf(tp)


def _str_enum(cls: type[enum.Enum]) -> Convert:
    names = ", ".join(m.value for m in cls)

    def conv(v: Any, path: str) -> Any:
        try:
            return cls(v) if isinstance(v, str) else _fail(path, f"one of {names}")
        except ValueError:
            _fail(path, f"one of {names}")
    return conv
