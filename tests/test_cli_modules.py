"""`pdserve` registers every listed subcommand module, and a missing one is an error."""

from __future__ import annotations

import argparse

import pytest

import pdserve.cli as cli


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_every_listed_module_registers_its_commands() -> None:
    assert _commands(cli.build_parser()) == {
        "make-model", "train-model", "generate", "gateway", "prefill", "decode", "worker", "up", "plan", "profile", "bench", "keygen",
    }


def test_a_missing_subcommand_module_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "no_such_command"))
    with pytest.raises(ModuleNotFoundError, match=r"pdserve\.cli\.no_such_command"):
        cli.build_parser()
