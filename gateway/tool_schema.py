"""The JSON schema a forced tool call's arguments are generated under.

A function's `parameters` schema rarely says `additionalProperties: false`; read
literally it lets the model open one unnamed key after another, so a small model never
closes the object within a modest `max_tokens`. xgrammar and vLLM generate under the
strict reading by default: an object schema names every property it allows. `strict`
applies that reading to every object schema in the tree (properties, items, anyOf /
oneOf branches, `$defs`), leaving alone any schema that states its own
`additionalProperties` (or `unevaluatedProperties`) or `patternProperties`. The members
of an `allOf` are not closed themselves (each names only its share of the properties;
closing them would make the conjunction unsatisfiable), only what they contain.
"""

from __future__ import annotations

from typing import Any

_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def strict(schema: Any, close: bool = True) -> Any:
    """`schema` with every object schema that does not say otherwise closed
    (`additionalProperties: false`); a new value, `schema` itself is not changed.
    `close=False`: only what `schema` contains (an `allOf` member)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict(v) for v in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [strict(v, close=False) for v in out["allOf"]]
    for key in _SUBSCHEMA_ONE:
        if key in out:
            out[key] = strict(out[key])
    # A schema with allOf may name its properties in the members: left open too.
    if close and _is_object(out) and not any(k in out for k in (*_OPEN_KEYS, "allOf")):
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict[str, Any]) -> bool:
    """An object schema: typed `object` (alone or among types), or untyped with
    `properties` (combinator-only schemas are closed in their branches)."""
    kind = schema.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return kind is None and "properties" in schema
