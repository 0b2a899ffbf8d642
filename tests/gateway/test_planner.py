"""The P:D planner's pure decision (gateway/planner.py) over load traces.

A trace is a demand per phase (prefill and decode load, in "workers' worth at the
SLO"); the tiny closed-loop model turns it into what the gateway would measure for the
current split (per-worker load scales as demand / workers, with seeded noise), so a
flip changes the next samples exactly as it would move load onto the survivors.
"""

from __future__ import annotations

import random

import pytest

from gateway.planner import (
    Action,
    LoadSample,
    PlannerConfig,
    PlannerState,
    decide,
    pressures,
    wanted_flip,
)
from pdserve.common.slo import Slo, parse_slo

SLO = Slo(ttft_s=1.0, itl_s=0.05)
CFG = PlannerConfig(SLO, dwell_s=20.0, cooldown_s=30.0, margin=0.2)
TICK_S = 2.0


def measured(t: float, p: int, d: int, demand: tuple[float, float], rng: random.Random,
             noise: float) -> LoadSample:
    """What the gateway sees at time t: TTFT and ITL scale with the load per worker."""
    jitter = (lambda: 1 + rng.uniform(-noise, noise)) if noise else (lambda: 1.0)
    return LoadSample(t, p, d, ttft_s=SLO.ttft_s * demand[0] / p * jitter(),
                      itl_s=SLO.itl_s * demand[1] / d * jitter(), kv_usage=0.3)


def run(phases: list[tuple[float, float]], split: tuple[int, int], phase_s: float = 300.0,
        noise: float = 0.0, seed: int = 0, cfg: PlannerConfig = CFG) -> tuple[list[list[Action]], tuple[int, int]]:
    """Flips made in each phase, and the split at the end."""
    rng = random.Random(seed)
    p, d = split
    state, t, flips = PlannerState(), 0.0, []
    for demand in phases:
        made: list[Action] = []
        end = t + phase_s
        while t < end:
            decision = decide(measured(t, p, d, demand, rng, noise), state, cfg)
            state = decision.state
            assert decision.desired_prefill >= 1 and decision.desired_decode >= 1
            if decision.action is Action.TO_PREFILL:
                p, d = p + 1, d - 1
            elif decision.action is Action.TO_DECODE:
                p, d = p - 1, d + 1
            if decision.action is not Action.HOLD:
                made.append(decision.action)
            assert p >= 1 and d >= 1
            t += TICK_S
        flips.append(made)
    return flips, (p, d)


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_ramp_flips_once_per_phase_and_never_under_constant_load(noise: float) -> None:
    ramp = [(3.0, 1.0), (1.0, 2.0), (1.2, 1.2)]  # prefill-heavy, decode-heavy, constant
    flips, split = run(ramp, (2, 2), noise=noise, seed=7)
    assert flips == [[Action.TO_PREFILL], [Action.TO_DECODE], []]
    assert split == (2, 2)


@pytest.mark.parametrize("demand", [(1.2, 1.2), (3.0, 3.0), (1.9, 1.7), (0.5, 0.2)])
@pytest.mark.parametrize("seed", range(4))
def test_noisy_constant_load_never_flips(demand: tuple[float, float], seed: int) -> None:
    """Balanced, overloaded on both sides (nothing to gain) or under the SLO: no flip, ever."""
    flips, _ = run([demand] * 4, (2, 2), noise=0.25, seed=seed)
    assert flips == [[], [], [], []]


def test_constant_imbalanced_load_flips_once_then_holds() -> None:
    flips, split = run([(3.0, 1.0)] * 5, (2, 2), noise=0.15, seed=3)
    assert sum(len(f) for f in flips) == 1 and split == (3, 1)


def test_load_moving_onto_survivors_is_counted() -> None:
    """Prefill misses its SLO (1.3) but decode would not survive losing a worker
    (0.9 * 2 / 1 = 1.8): no flip, though prefill is the hotter side."""
    s = LoadSample(0.0, 2, 2, ttft_s=1.3, itl_s=0.9 * SLO.itl_s)
    assert wanted_flip(s, pressures(s, CFG), CFG) == (Action.HOLD, "a flip would not help by the margin")
    helped = LoadSample(0.0, 2, 2, ttft_s=2.0, itl_s=0.3 * SLO.itl_s)
    assert wanted_flip(helped, pressures(helped, CFG), CFG)[0] is Action.TO_PREFILL


def test_never_scales_a_role_to_zero() -> None:
    flips, split = run([(9.0, 0.1), (0.1, 9.0)], (1, 1))
    assert flips == [[], []] and split == (1, 1)
    flips, split = run([(9.0, 0.1)], (2, 2))
    assert flips == [[Action.TO_PREFILL]] and split == (3, 1)  # one decode worker stays


def test_a_spike_shorter_than_the_dwell_does_not_flip() -> None:
    flips, _ = run([(1.0, 1.0), (4.0, 0.5), (1.0, 1.0)], (2, 2), phase_s=16.0)
    assert flips == [[], [], []]
    flips, _ = run([(1.0, 1.0), (4.0, 0.5)], (2, 2), phase_s=40.0)
    assert flips == [[], [Action.TO_PREFILL]]


def test_recorded_flicker_around_the_threshold_does_not_flip() -> None:
    """An open-loop trace whose prefill pressure crosses the SLO on every other
    sample: the want never holds for the dwell time."""
    state = PlannerState()
    for i in range(200):
        ttft = 2.0 if i % 2 else 0.95
        decision = decide(LoadSample(i * TICK_S, 2, 2, ttft_s=ttft, itl_s=0.01), state, CFG)
        state = decision.state
        assert decision.action is Action.HOLD


def test_queue_and_kv_usage_count_without_latencies() -> None:
    s = LoadSample(0.0, 1, 3, queued_prefill_tokens=3 * CFG.queue_tokens, kv_usage=0.2)
    assert wanted_flip(s, pressures(s, CFG), CFG)[0] is Action.TO_PREFILL
    s = LoadSample(0.0, 3, 1, kv_usage=1.0)
    assert pressures(s, CFG).decode == pytest.approx(1.0 / CFG.kv_high)
    assert wanted_flip(s, pressures(s, CFG), CFG)[0] is Action.TO_DECODE


def test_parse_slo() -> None:
    assert parse_slo("ttft=2,itl=50ms") == Slo(2.0, 0.05)
    assert parse_slo("itl=0.1s, ttft=1.5") == Slo(1.5, 0.1)
    for bad in ("ttft=2", "ttft=2,itl=x", "ttft=2,itl=0.1,ttft=3", "p99=1,itl=1", "ttft=-1,itl=1", ""):
        with pytest.raises(ValueError):
            parse_slo(bad)
    with pytest.raises(ValueError):
        PlannerConfig(SLO, min_per_role=0)
