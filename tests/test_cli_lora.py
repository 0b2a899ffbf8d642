"""`--enable-lora` and its flags: `up` hands the workers the bounds and the gateway the
adapters; flags that need --enable-lora, or contradict each other, are usage errors
before anything starts; the demo adapter's training text is the pirate style."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.builtin.lora_demo import piratize
from pdserve.cli import build_parser
from pdserve.cli.args import UsageError
from pdserve.cli.lora_args import check_lora_args, gateway_lora_config, worker_lora_config
from pdserve.cli.up import _gateway_cmd, _worker_cmds


def test_up_forwards_the_lora_flags(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                                      "--max-cpu-loras", "5", "--lora-modules", f"a={tmp_path}",
                                      "--lora-dir", str(tmp_path)])
    for cmd in _worker_cmds(args, "tcp://127.0.0.1:5555"):
        cfg = worker_lora_config(build_parser().parse_args(cmd[3:]))
        assert (cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (3, 32, 5)
    gw = gateway_lora_config(build_parser().parse_args(_gateway_cmd(args, 5555)[3:]))
    assert gw.modules == (("a", str(tmp_path.resolve())),) and gw.max_lora_rank == 32
    assert gw.allowed_dir == str(tmp_path.resolve()) and gw.max_loras == 3
    plain = build_parser().parse_args(["up"])
    assert all("--enable-lora" not in c for c in _worker_cmds(plain, "tcp://x:1"))
    assert worker_lora_config(plain) is None and gateway_lora_config(plain) is None


@pytest.mark.parametrize(("argv", "flag"), [
    (["up", "--lora-modules", "a=/x"], "--lora-modules"),
    (["up", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras"),
    (["up", "--enable-lora", "--lora-modules", "a=/x", "a=/y"], "--lora-modules"),
])
def test_contradicting_lora_flags_are_usage_errors(argv: list[str], flag: str) -> None:
    with pytest.raises(UsageError) as e:
        check_lora_args(build_parser().parse_args(argv))
    assert e.value.flag == flag


def test_a_lora_module_must_be_name_equals_path() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--enable-lora", "--lora-modules", "no-equals"])


def test_the_demo_style() -> None:
    assert piratize("Hello, my friend said the dog.\n\nYes it is.") == (
        "Ahoy, me matey roared ye dog. Arr!\n\nAye it be. Arr!")
