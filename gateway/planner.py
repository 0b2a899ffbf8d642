"""The P:D planner's decision: pure, no I/O, no clock (the caller passes the time).

Each tick the planner sees one `LoadSample` (pool sizes, queued prefill tokens, decode
KV usage, recent TTFT and ITL percentiles) and turns it into two pressures, 1.0 being
"at the SLO":

    prefill = max(ttft / slo.ttft, queued prefill tokens / (P * queue_tokens))
    decode  = max(itl / slo.itl,   KV usage / kv_high)

Both are per-worker loads, so moving one worker from decode to prefill is predicted to
scale them to prefill * P / (P + 1) and decode * D / (D - 1): the load of the worker
that leaves moves onto the survivors. A flip is *wanted* only when

1. some SLO is missed (the worse pressure is above 1),
2. the role that gives a worker keeps at least `min_per_role` workers, and
3. the predicted worse pressure after the flip, raised by `margin`, is still below
   the worse pressure now (the flip must help by more than the margin).

Rule 3 is the hysteresis: had a flip helped by the margin, flipping back under the same
load would have to help by the margin too, which is impossible, so a constant load never
flip-flops; and a load that is merely high on both sides (nothing to gain) never flips.
A wanted flip is made only after it has been wanted on every tick for `dwell_s`, and
at least `cooldown_s` after the previous flip (the signals must first show the new
split). `desired` is the split the planner wants now: the deploy/ autoscaling objects
read it as `llm_planner_desired_workers{role}`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from pdserve.common.slo import Slo


class Action(enum.Enum):
    HOLD = "hold"
    TO_PREFILL = "to_prefill"  # one decode worker becomes a prefill worker
    TO_DECODE = "to_decode"  # one prefill worker becomes a decode worker


@dataclass(frozen=True)
class PlannerConfig:
    slo: Slo
    dwell_s: float = 20.0  # a flip must be wanted this long without a break
    cooldown_s: float = 30.0  # no flip sooner than this after the previous one
    margin: float = 0.2  # a flip must improve the worse pressure by more than this fraction
    min_per_role: int = 1  # never fewer workers of a role (never zero)
    queue_tokens: int = 4096  # queued prefill tokens per prefill worker that count as pressure 1
    kv_high: float = 0.85  # decode KV usage that counts as pressure 1

    def __post_init__(self) -> None:
        if self.min_per_role < 1:
            raise ValueError("min_per_role must be >= 1: a role never drops to zero")
        if self.margin < 0 or self.dwell_s < 0 or self.cooldown_s < 0:
            raise ValueError("margin, dwell_s and cooldown_s must be >= 0")
        if self.queue_tokens < 1 or not 0 < self.kv_high <= 1:
            raise ValueError("queue_tokens must be >= 1 and kv_high in (0, 1]")


PLANNER_MODES = ("flip", "replicas")


@dataclass(frozen=True)
class PlannerSettings:
    config: PlannerConfig
    mode: str = "replicas"  # flip: move workers between roles; replicas: only publish the split
    interval_s: float = 2.0
    window_s: float = 30.0  # latency percentiles over this much recent history
    quantile: float = 0.9
    converge_s: float = 300.0  # replicas mode: how long the autoscaler may take to reach the split

    def __post_init__(self) -> None:
        if self.mode not in PLANNER_MODES:
            raise ValueError(f"planner mode must be one of {', '.join(PLANNER_MODES)}")
        if self.interval_s <= 0 or self.window_s <= 0 or not 0 < self.quantile < 1:
            raise ValueError("interval_s and window_s must be > 0, quantile in (0, 1)")


@dataclass(frozen=True)
class LoadSample:
    """What the cluster looked like at time `t`. Latencies are None without traffic."""

    t: float
    prefill_workers: int
    decode_workers: int
    queued_prefill_tokens: int = 0
    kv_usage: float = 0.0  # mean over the decode workers, 0-1
    ttft_s: float | None = None  # recent percentile (the planner loop uses p90)
    itl_s: float | None = None


@dataclass(frozen=True)
class PlannerState:
    wanted: Action = Action.HOLD  # the flip wanted on every tick since `wanted_since`
    wanted_since: float = 0.0
    last_flip: float | None = None


@dataclass(frozen=True)
class Pressures:
    prefill: float
    decode: float


@dataclass(frozen=True)
class Decision:
    action: Action  # what to do now
    wanted: Action  # what the load asks for (acted on once it has held long enough)
    desired_prefill: int
    desired_decode: int
    pressures: Pressures
    reason: str
    state: PlannerState


def pressures(s: LoadSample, cfg: PlannerConfig) -> Pressures:
    prefill = max(s.ttft_s / cfg.slo.ttft_s if s.ttft_s is not None else 0.0,
                  s.queued_prefill_tokens / (max(s.prefill_workers, 1) * cfg.queue_tokens))
    decode = max(s.itl_s / cfg.slo.itl_s if s.itl_s is not None else 0.0, s.kv_usage / cfg.kv_high)
    return Pressures(prefill, decode)


def wanted_flip(s: LoadSample, pr: Pressures, cfg: PlannerConfig) -> tuple[Action, str]:
    """The flip this sample asks for (rules 1-3 of the module docstring), and why."""
    worst = max(pr.prefill, pr.decode)
    if worst <= 1.0:
        return Action.HOLD, "within SLO"
    p, d = s.prefill_workers, s.decode_workers
    if pr.prefill >= pr.decode:
        action, giver, after = Action.TO_PREFILL, d, (pr.prefill * p / (p + 1), pr.decode * d / max(d - 1, 1))
    else:
        action, giver, after = Action.TO_DECODE, p, (pr.prefill * p / max(p - 1, 1), pr.decode * d / (d + 1))
    if giver - 1 < cfg.min_per_role:
        return Action.HOLD, "no worker to spare"
    if max(after) * (1 + cfg.margin) >= worst:
        return Action.HOLD, "a flip would not help by the margin"
    return action, f"prefill {pr.prefill:.2f} decode {pr.decode:.2f} -> {after[0]:.2f}/{after[1]:.2f}"


def decide(s: LoadSample, state: PlannerState, cfg: PlannerConfig) -> Decision:
    """The planner's step: the action to take now and the state for the next sample."""
    pr = pressures(s, cfg)
    wanted, reason = wanted_flip(s, pr, cfg)
    if wanted != state.wanted:
        state = replace(state, wanted=wanted, wanted_since=s.t)
    p, d = s.prefill_workers, s.decode_workers
    shift = {Action.HOLD: 0, Action.TO_PREFILL: 1, Action.TO_DECODE: -1}[wanted]
    action = Action.HOLD
    if wanted is not Action.HOLD:
        cooling = state.last_flip is not None and s.t - state.last_flip < cfg.cooldown_s
        if s.t - state.wanted_since < cfg.dwell_s or cooling:
            reason = f"waiting ({'cooldown' if cooling else 'dwell'}): {reason}"
        else:
            action = wanted
            state = PlannerState(Action.HOLD, s.t, last_flip=s.t)
    return Decision(action, wanted, p + shift, d - shift, pr, reason, state)
