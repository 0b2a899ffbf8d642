"""bench/contention.py without servers: the commands it starts and the table it prints."""

from __future__ import annotations

import pytest

from bench.contention import Cell, parse_args, report, up_command
from pdserve.cli import build_parser


def test_each_policy_starts_a_colocated_up_the_cli_accepts() -> None:
    args = parse_args(["--model", "/m"])
    for policy, flag in (("fixed+spin", "fixed"), ("fixed+passive", "fixed"), ("adaptive+spin", "adaptive")):
        cmd = up_command(policy, args, "/m", 8123)
        up = build_parser().parse_args(cmd[cmd.index("up"):])
        assert up.colocated and up.thread_policy == flag and up.port == 8123
    with pytest.raises(SystemExit):
        parse_args(["--policies", "adaptive+passive"])


def test_the_report_gives_ratios_to_fixed_spin_quiet_and_checks_the_targets() -> None:
    cells = [Cell("quiet", "fixed+spin", "c16", 200.0, ""),
             Cell("quiet", "adaptive+spin", "c16", 196.0, "probe_won=0"),
             Cell("spinner", "fixed+passive", "c16", 150.0, ""),
             Cell("spinner", "adaptive+spin", "c16", 165.0, "contention=1")]
    text = report(cells)
    assert "| spinner | adaptive+spin | c16 | 165.0 | 0.82x | contention=1 |" in text
    assert "target c16 quiet: adaptive+spin / fixed+spin 0.98 (>= 0.95)" in text
    assert "target c16 spinner: adaptive+spin / fixed+passive 1.10 (>= 1.0)" in text
