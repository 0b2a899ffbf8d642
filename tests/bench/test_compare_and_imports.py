"""Driver helpers, and the rule that the load generator never imports torch."""

from __future__ import annotations

import subprocess
import sys

from pdserve.loadgen.compare import Column, Target, column_ratio, format_comparison


def test_comparison_table_and_targets() -> None:
    cols = (Column("ITL p99 ms", ("itl", "p99")), Column("tok/s", ("tput",), scale=1))
    a = {"itl": {"p99": 0.010}, "tput": 50.0}
    b = {"itl": {"p99": 0.100}, "tput": None}
    text = format_comparison(cols, [("disagg", a), ("colo", b)], [("ratio", "disagg", "colo")])
    lines = text.splitlines()
    assert lines[2].split() == ["disagg", "10.0", "50.0"]
    assert lines[3].split() == ["colo", "100.0", "-"]
    assert lines[4].split() == ["ratio", "0.100", "-"]
    r = column_ratio(cols, "ITL p99 ms", a, b)
    assert r is not None and abs(r - 0.1) < 1e-12
    assert Target("ITL p99 ms", 0.2).check(r).startswith("MET")
    assert Target("x", 3.0, at_most=False).check(2.0).startswith("MISSED")
    assert Target("x", 3.0).check(None) == "n/a"


def test_loadgen_does_not_import_torch() -> None:
    code = (
        "import sys, pdserve.loadgen.runner, pdserve.loadgen.report, pdserve.loadgen.plots, "
        "pdserve.loadgen.launch, pdserve.loadgen.compare, pdserve.cli.bench; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_stop_group_terminates_every_group_and_kills_what_ignores_it() -> None:
    from pdserve.loadgen.launch import stop_group

    polite = subprocess.Popen(["sleep", "100"], start_new_session=True)
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(100)"],
                                stdout=subprocess.PIPE, start_new_session=True)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"  # SIGTERM ignored from here
    done = subprocess.Popen(["true"], start_new_session=True)
    done.wait()
    stop_group(polite, stubborn, done, grace_s=1.0)
    assert (polite.returncode, stubborn.returncode, done.returncode) == (-15, -9, 0)
