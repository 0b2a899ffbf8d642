"""Each worker flag written once (pdserve/cli/worker_args.py): the `WorkerArgs` fields make
the worker commands' parser, `pdserve up`'s worker flags and each child's command line."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import build_parser
from pdserve.cli.args import positive_int
from pdserve.cli.argspec import flag
from pdserve.cli.up import _worker_cmds
from pdserve.cli.worker_args import WorkerArgs

GW = "tcp://127.0.0.1:5555"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:7100", "topic": "kv"})
# Texts tried in turn for a field's value other than its default; each field takes the first its type parses.
CANDIDATES = ("3", "5", "0.25", "cuda", "64MiB", "bfloat16", "fp8", "0-1", "127.0.0.2", "tcp://127.0.0.1:7001",
              "/tmp/pdserve-x", "pirate=/tmp/pdserve-lora", NGRAM, EVENTS)
# Set by `up` for each child (or never offered): `up` defines its own flags of these names.
UP_OWN = {"model", "revision", "download_dir", "threads", "thread_policy"}


def _other(f: Any) -> tuple[list[str], Any]:
    """Command-line words setting field `f` to a value that is not its default, and that value."""
    spec = f.metadata["flag"]
    name = "--" + f.name.replace("_", "-")
    if spec.action == "store_true":
        return [name], True
    if spec.action is argparse.BooleanOptionalAction:
        return ["--no-" + name[2:]], False
    if spec.choices:
        choice = next(c for c in spec.choices if c != f.default)
        return [name, choice], choice
    for text in CANDIDATES:
        try:
            value = spec.type(text) if spec.type else text
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        if value != f.default and value not in ((), None):
            return [name, text], (value,) if spec.action == "append" or spec.nargs else value
    raise AssertionError(f"no candidate value for {name}")


def _parse_child(cmd: list[str]) -> WorkerArgs:
    return WorkerArgs.from_namespace(build_parser().parse_args(cmd[3:]))


def test_every_flag_up_offers_reaches_each_worker_and_round_trips() -> None:
    offered = WorkerArgs.flags(up=True)
    argv: list[str] = []
    want: dict[str, Any] = {}
    for f in offered:
        words, want[f.name] = _other(f)
        argv += words
    args = build_parser().parse_args(["up", "--prefill-num-blocks", "5", *argv])
    cmds = _worker_cmds(args, GW)
    assert [c[3] for c in cmds] == ["prefill", "decode"]
    prefill, decode = map(_parse_child, cmds)
    for f in offered:
        roles = f.metadata["flag"].roles  # a role-scoped flag reaches only its roles
        # the second worker publishes its KV events on the next port (vLLM's rule for a second rank)
        own = want[f.name].for_worker(1) if f.name == "kv_events_config" else want[f.name]
        assert getattr(decode, f.name) == (own if roles is None or "decode" in roles else f.default), f.name
        expected = {"num_blocks": 5, "speculative_config": None}.get(f.name, want[f.name])  # prefill's own
        assert getattr(prefill, f.name) == (expected if roles is None or "prefill" in roles else f.default), f.name
    assert decode.gateway == prefill.gateway == (GW,)
    # What the child parsed reproduces the child's command line exactly.
    assert [*cmds[1][:4], *decode.to_argv("decode")] == cmds[1]


def test_a_worker_args_value_round_trips_through_its_command_line() -> None:
    values = {f.name: _other(f)[1] for f in WorkerArgs.flags()}
    full = WorkerArgs(**values)
    assert all(getattr(full, f.name) != f.default for f in fields(WorkerArgs))
    def as_seen_by(role: str) -> WorkerArgs:
        """`full` with the role-scoped flags of other roles at their defaults."""
        return replace(full, **{f.name: f.default for f in WorkerArgs.flags()
                                if f.metadata["flag"].roles is not None and role not in f.metadata["flag"].roles})

    decode = _parse_child(["python", "-m", "pdserve", "decode", *full.to_argv("decode")])
    assert decode == as_seen_by("decode")
    colocated = _parse_child(["python", "-m", "pdserve", "worker", "--colocated", *full.to_argv("colocated")])
    # role-scoped flags stay off the other roles' command lines
    assert colocated == as_seen_by("colocated")
    assert as_seen_by("colocated").kv_transport == "auto" and as_seen_by("colocated").borrow_cores is None


def test_defaults_are_not_emitted() -> None:
    assert WorkerArgs().to_argv() == []
    assert WorkerArgs(gateway=(GW,), block_size=16, kv_watermark=0.01).to_argv() == ["--gateway", GW]
    per_child = {"--gateway", "--threads", "--spin-wait", "--cpu-cores", "--core-share", "--borrow-cores"}
    for layout in ([], ["--colocated"]):
        for cmd in _worker_cmds(build_parser().parse_args(["up", *layout]), GW):
            assert {w for w in cmd[4:] if w.startswith("--")} <= per_child | {"--colocated"}, cmd


def test_up_offers_exactly_the_fields_marked_up() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    up_dests = {a.dest for a in sub.choices["up"]._actions}
    offered = {f.name for f in WorkerArgs.flags(up=True)}
    assert offered <= up_dests
    assert {f.name for f in WorkerArgs.flags()} & up_dests == offered | UP_OWN
    for command in ("prefill", "decode", "worker"):
        assert {f.name for f in WorkerArgs.flags()} <= {a.dest for a in sub.choices[command]._actions}
    with pytest.raises(SystemExit):  # a worker's own port or id: not an `up` flag, still an error
        build_parser().parse_args(["up", "--kv-port", "7000"])


@dataclass(frozen=True)
class KnobArgs(WorkerArgs):
    new_knob: int = flag(7, "an example knob", type=positive_int)


def test_a_field_alone_adds_the_flag_to_the_worker_commands_and_to_up(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdserve.cli.up as up
    import pdserve.cli.workers as workers

    monkeypatch.setattr(workers, "WorkerArgs", KnobArgs)
    monkeypatch.setattr(up, "WorkerArgs", KnobArgs)
    parser = build_parser()
    for command in (["prefill"], ["decode"], ["worker", "--colocated"]):
        assert parser.parse_args([*command, "--gateway", GW, "--new-knob", "9"]).new_knob == 9
        assert parser.parse_args([*command, "--gateway", GW]).new_knob == 7
    cmds = up._worker_cmds(parser.parse_args(["up", "--new-knob", "9"]), GW)
    assert all(c[c.index("--new-knob") + 1] == "9" for c in cmds)
    assert all(KnobArgs.from_namespace(parser.parse_args(c[3:])).new_knob == 9 for c in cmds)
    assert all("--new-knob" not in c for c in up._worker_cmds(parser.parse_args(["up"]), GW))


def test_every_gateway_flag_up_offers_reaches_the_gateway_and_round_trips(tmp_path: Path) -> None:
    from pdserve.cli.gateway_args import GatewayArgs
    from pdserve.cli.up import _gateway_cmd, gateway_env

    argv: list[str] = []
    want: dict[str, Any] = {}
    for f in GatewayArgs.flags(up=True):
        words, want[f.name] = _other(f)
        argv += words
    keys = tmp_path / "keys"
    argv[argv.index("--api-key-file") + 1] = str(keys)  # made absolute for the child
    argv[argv.index("--generation-config") + 1] = str(tmp_path)
    argv[argv.index("--api-key") + 1] = "sk-only-in-the-environment"
    argv[argv.index("--lora-dir") + 1] = str(tmp_path / "adapters")
    want.update(api_key_file=(str(keys),), generation_config=str(tmp_path), lora_dir=str(tmp_path / "adapters"))
    up_args = build_parser().parse_args(["up", *argv])
    cmd = _gateway_cmd(up_args, 5555)
    parsed = GatewayArgs.from_namespace(build_parser().parse_args(cmd[3:]))
    # --api-key travels by the gateway's environment, never its command line (docs/security.md).
    want.pop("api_key")
    assert "--api-key" not in cmd and "sk-only-in-the-environment" not in cmd
    assert gateway_env(up_args)["PDSERVE_API_KEYS"].split(",")[-1] == "sk-only-in-the-environment"
    assert {name: getattr(parsed, name) for name in want} == want
    assert parsed.control_port == 5555 and parsed.port == GatewayArgs().port
    assert [*cmd[:4], *parsed.to_argv()] == cmd  # what the child parsed reproduces its command line
    # --max-model-len is registered once in `up` and reaches both the gateway and the workers
    assert "max_model_len" in want and GatewayArgs.flags(up=True) and WorkerArgs.flags(up=True)
    assert _parse_child(_worker_cmds(build_parser().parse_args(["up", *argv]), GW)[0]).max_model_len == \
        want["max_model_len"]
    plain = _gateway_cmd(build_parser().parse_args(["up"]), 5555)
    assert plain[3:] == ["gateway", "--control-port", "5555"]  # defaults are not emitted
