"""Flags written once: a frozen dataclass per group of flags (vLLM's `EngineArgs`).

Each field's `flag(...)` carries what argparse needs (help, type, default, choices,
action) plus two things a launcher needs: `roles`, the worker roles a flag applies
to (None: every command that registers the group), and `up`, whether `pdserve up`
offers the same flag (False: `up` sets the field per child, or never). From the
class come the parser (`add_to`), the reading of a namespace (`from_namespace`)
and a child's command line (`to_argv`, only the fields that differ from their
defaults, so child command lines stay short and a default lives in one place).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

T = TypeVar("T", bound="ArgGroup")


@dataclass(frozen=True)
class Flag:
    help: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    action: Any = None  # None (one value), "store_true", "append", argparse.BooleanOptionalAction
    nargs: str | None = None
    metavar: str | None = None
    required: bool = False
    render: Callable[[Any], str] = str  # a value as the text its `type` parses back
    roles: tuple[str, ...] | None = None  # worker roles (`pdserve.common.roles.Role`, a str)
    up: bool = True
    up_help: str | None = None  # the help `pdserve up` shows, when not `help` ("": none)
    group: str | None = None  # an argparse argument group's title


def flag(default: Any = None, help: str | None = None, **spec: Any) -> Any:
    """A dataclass field that is also a command-line flag `--field-name`."""
    return field(default=default, metadata={"flag": Flag(help=help, **spec)})


def name_of(f: Any) -> str:
    return "--" + f.name.replace("_", "-")


class ArgGroup:
    """Base of the frozen flag dataclasses; subclasses declare fields with `flag`."""

    @classmethod
    def flags(cls, *, up: bool = False) -> list[Any]:
        """The fields that are flags (`up`: only those `pdserve up` offers)."""
        return [f for f in fields(cls) if "flag" in f.metadata and (not up or f.metadata["flag"].up)]  # type: ignore[arg-type]

    @classmethod
    def add_to(cls, ap: argparse.ArgumentParser, *, up: bool = False, skip: frozenset[str] = frozenset(),
               only: tuple[str, ...] | None = None) -> None:
        """Register the group's flags on `ap` (`up`: those `pdserve up` offers, with its help;
        `only`: just these fields, for a command that shares a few of them)."""
        groups: dict[str, Any] = {}
        for f in cls.flags(up=up):
            spec: Flag = f.metadata["flag"]
            if f.name in skip or (only is not None and f.name not in only):
                continue
            target: Any = ap
            if spec.group is not None and not up:  # `up` lists its flags in one section
                target = groups.get(spec.group) or groups.setdefault(spec.group, ap.add_argument_group(spec.group))
            text = spec.up_help if up and spec.up_help is not None else spec.help
            kw: dict[str, Any] = {"dest": f.name, "help": text or None}
            if spec.action == "store_true":
                kw["action"] = "store_true"
            else:
                kw.update(default=list(f.default) if spec.action == "append" else f.default, type=spec.type)
                kw.update({k: v for k, v in (("action", spec.action), ("choices", spec.choices),
                                             ("nargs", spec.nargs), ("metavar", spec.metavar)) if v is not None})
            if spec.required and not up:
                kw.update(required=True, default=None)
            target.add_argument(name_of(f), **kw)

    @classmethod
    def from_namespace(cls: type[T], ns: argparse.Namespace, *, up: bool = False, **overrides: Any) -> T:
        """The group's values from parsed arguments (`up`: only the flags `pdserve up` offers;
        the others, and what `ns` lacks, keep their defaults unless `overrides` sets them)."""
        values = {f.name: getattr(ns, f.name) for f in cls.flags(up=up) if hasattr(ns, f.name)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return replace(cls(), **(values | overrides))  # type: ignore[type-var]

    def to_argv(self, role: str | None = None) -> list[str]:
        """The flags that reproduce this group for a command of `role`, defaults left out."""
        argv: list[str] = []
        for f in self.flags():
            spec: Flag = f.metadata["flag"]
            value = getattr(self, f.name)
            if value == f.default or (role is not None and spec.roles is not None and role not in spec.roles):
                continue
            if spec.action == "store_true":
                argv.append(name_of(f))
            elif spec.action is argparse.BooleanOptionalAction:
                argv.append(name_of(f) if value else "--no-" + name_of(f)[2:])
            elif spec.action == "append":
                argv += [x for v in value for x in (name_of(f), spec.render(v))]
            elif spec.nargs is not None:
                argv += [name_of(f), *map(spec.render, value)]
            else:
                argv += [name_of(f), spec.render(value)]
        return argv
