"""pdserve/worker/spin_throttle.py against the real libgomp: while the throttle is on, an idle
OpenMP thread sleeps at once instead of spinning out libgomp's spin count, and off()
undoes it. Each case runs in a fresh interpreter: libgomp's pools are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pdserve.worker.spin_throttle import SpinThrottle, available

PROBE = textwrap.dedent("""
    import json, os, time
    import torch
    from pdserve.worker.spin_throttle import SpinThrottle

    torch.set_num_threads(2)
    x = torch.ones(1 << 17)

    def idle_cpu():
        # 60 tiny 2-thread regions, 2 ms apart: a spinning pool thread burns the gaps
        before = os.times()
        for _ in range(60):
            x.add_(1.0)
            time.sleep(0.002)
        after = os.times()
        return (after.user + after.system) - (before.user + before.system)

    def tasks():
        return len(os.listdir("/proc/self/task"))

    throttle = SpinThrottle()
    idle_cpu()
    out = {"spin": idle_cpu(), "tasks_before": tasks()}
    throttle.on(2)
    out.update(throttled=idle_cpu(), tasks_on=tasks(), threads_on=torch.get_num_threads(),
               helper=throttle.helper_threads(2))
    throttle.off()
    deadline = time.monotonic() + 30  # off() has joined the helper; wait for its pool to leave
    while tasks() != out["tasks_before"] and time.monotonic() < deadline:
        time.sleep(0.01)
    out.update(released=idle_cpu(), tasks_off=tasks(), threads_off=torch.get_num_threads())
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def probe() -> dict[str, float]:
    if not available():
        pytest.skip("torch's OpenMP here is not libgomp: the throttle is libgomp's rule")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_throttled_team_sleeps_between_regions_and_off_lets_it_spin_again(probe: dict[str, float]) -> None:
    # the idle pool thread's spinning shows as CPU time between regions
    assert probe["throttled"] < 0.5 * probe["spin"], probe
    assert probe["throttled"] < 0.5 * probe["released"], probe


def test_the_throttle_is_a_docked_pool_that_leaves_the_team_as_it_was(probe: dict[str, float]) -> None:
    # the helper thread and its pool's docked threads, gone after off()
    assert probe["tasks_on"] == probe["tasks_before"] + probe["helper"]
    assert probe["tasks_off"] == probe["tasks_before"]
    assert probe["threads_on"] == probe["threads_off"] == 2  # the worker's own count untouched


def test_the_helper_pool_lifts_the_thread_count_above_the_cpus() -> None:
    throttle = SpinThrottle(cpus=8)
    assert [throttle.helper_threads(n) for n in (1, 2, 8)] == [9, 8, 2]
    for n in (1, 2, 8):  # 1 main + (n - 1) in its pool + (helper - 1) docked > 8
        assert 1 + (n - 1) + (throttle.helper_threads(n) - 1) > 8
    with pytest.raises(ValueError):
        throttle.on(0)
