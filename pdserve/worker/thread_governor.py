"""The torch threads of a CPU worker (count, wait mode), chosen each step from how fast steps run.

Why: a worker whose OpenMP threads spin-wait (`--spin-wait`, libgomp's default) is
faster on cores of its own, and many times slower when one other busy process shares
them (bench/README.md, "OpenMP waiting" and the contention rows, has the figures): a thread waiting at a barrier spins through its time slice while its twin is
descheduled. OpenMP reads its wait policy once, but `torch.set_num_threads` works
at any step (with one thread there is no barrier to wait at), and libgomp throttles
its spinning while the process holds more OpenMP threads than CPUs
(pdserve/worker/spin_throttle.py).

The policy (`--thread-policy adaptive`), per step, from the outcome only:

1. Every step is observed as (mode, bucket, wall time); the bucket is the step's
   computed token count rounded up to a power of two (batch size drives a decode
   step's cost, chunk size a prefill's). Each (mode, bucket) keeps its last
   `window` times; its median is its level, and a level is *fresh* while its newest
   time is younger than `fresh_s`.
2. Two modes compete: the ceiling N spinning (the worker's threads, or the core
   grant of a 1P+1D worker borrowing the other's idle cores) and the low
   state (below). The one in use is *home*, the other *away*.
3. Collapse: `collapse_steps` (3) home steps in a row each above `collapse` (3x)
   their bucket's home median start a probe of away at once (unless a probe ended
   less than `first_interval_s` ago), with home's level taken as the least slow of
   them. One or two slow steps are a burst (prompts arriving: the gateway
   tokenizing and the client sharing the cores), not a neighbour that stays.
4. Drift: when each of home's last `recent` steps of a bucket runs above
   `margin` (1.15x) away's slowest fresh time there (of away's times since the
   last switch and within `fresh_s`, at least `min_samples`), switch to away.
5. Probe: every `interval` seconds (1 s, doubling to 32 s while probes confirm
   home; back to 1 s after a switch) away runs for `probe_steps` steps. A probe
   step above `cut` (2x) home's level ends the probe at once (so a probe under
   contention costs one slow step); otherwise, when every probe step (as a ratio
   to home's level in its bucket) beats home by `margin`, away becomes home.

Hysteresis: every one of `probe_steps` away steps must beat home's median by
`margin` (or home must collapse 3x for 3 steps and away then beat them), drift needs
`recent` home steps in a row slower than every fresh away step by `margin`, and a
switch restarts the probe clock. So under a steady load the count in use never
changes while it is the faster one, whatever the noise below the collapse factor,
nor when the two tie within +-6% (1/1.15 apart at worst); with +-20% noise around
a tie it switches (and back) about once in 500 s. tests/worker/test_thread_governor.py
drives thousands of such steps.

Reasons a switch is counted under: `contention` (down to the low state after a
collapse or drift), `probe_won` (a scheduled probe found the low state faster),
`recovered` (back up to N spinning: a probe or drift found it faster again).

The low state is N throttled threads wherever the process can throttle: with a
`SpinControl` (libgomp, more than one thread, OMP_WAIT_POLICY unset or ACTIVE:
pdserve/worker/thread_policy.py `governor_for`) the team keeps its N threads, and a step in
the low state runs with pdserve/worker/spin_throttle.py's throttle on: each waiting thread
spins ~100 times (libgomp's rule for more OpenMP threads than CPUs), then sleeps on a
futex, so a neighbour gets the core and the step keeps its N-way split. A step of N
spinning (home or a probe) runs with it off. Without a `SpinControl` (another OpenMP
runtime, OMP_WAIT_POLICY=PASSIVE, or a ceiling of 1) the low state falls back to 1
thread, which needs no spin remedy of its own: a 1-thread `at::parallel_for` runs
inline without entering a parallel region, so the docked pool thread spins out
libgomp's spin count once after the last N-thread region, then sleeps on a futex
(checked from each thread's CPU time in /proc/self/task/*/stat under either wait policy).

Pure logic with an injected clock; `apply` (torch.set_num_threads) and the
`SpinControl` are the hooks that touch the process.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

REASONS = ("contention", "probe_won", "recovered")


@dataclass(frozen=True)
class GovernorConfig:
    window: int = 16  # step times kept per (threads, bucket)
    min_samples: int = 3  # a level needs this many
    recent: int = 5  # home's last steps that drift compares
    margin: float = 1.15  # the other count must be this much faster
    collapse: float = 3.0  # home steps this far above their median: probe at once
    collapse_steps: int = 3  # ... when this many in a row are (fewer: a burst)
    recover_margin: float = 1.05  # a probe back up wins when its median step beats home by this
    cut: float = 2.0  # a probe step this far above home's level: probe over
    probe_steps: int = 3
    first_interval_s: float = 1.0
    max_interval_s: float = 32.0
    fresh_s: float = 10.0


class Mode(NamedTuple):
    """How a step runs: `threads` torch threads, their OpenMP spin-waits throttled or not."""

    threads: int
    throttled: bool = False


class Switch(NamedTuple):
    """A change of the thread count (or wait mode) the governor made."""

    threads: int
    reason: str
    throttled: bool = False


class SpinControl(Protocol):
    """Throttles the OpenMP spin-waits of the process (pdserve/worker/spin_throttle.py)."""

    def on(self, threads: int) -> None: ...

    def off(self) -> None: ...


class _Probe:
    def __init__(self, mode: Mode, home_level: float, recovery: bool) -> None:
        self.mode = mode
        self.home_level = home_level  # home's slowdown factor (1.0: its median as it is)
        self.recovery = recovery  # a probe of N spinning from the low state
        self.ratios: list[float] = []
        self.steps = 0
        self.collapse = home_level > 1.0


def bucket_of(tokens: int) -> int:
    """The power of two at or above `tokens` (at least 1)."""
    return 1 << max(tokens - 1, 0).bit_length()


class ThreadGovernor:
    """Picks N spinning threads or the low state for each step (module docstring)."""

    def __init__(self, ceiling: int, config: GovernorConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 apply: Callable[[int], None] | None = None,
                 spin: SpinControl | None = None) -> None:
        if ceiling < 1:
            raise ValueError(f"a worker needs at least one thread, got {ceiling}")
        self.cfg = config or GovernorConfig()
        self.clock = clock
        self._apply = apply or _set_torch_threads
        self.ceiling = ceiling
        self.low = False  # home is the low state (else the ceiling spinning)
        self.applied = ceiling  # what the process runs with now
        self.throttled = False  # whether its spin-waits are throttled now
        self._spin = spin
        self._times: dict[tuple[Mode, int], deque[tuple[float, float]]] = {}
        self._slow: list[float] = []  # home's consecutive collapsed steps (ratios to their level)
        self._probe: _Probe | None = None
        self.interval = self.cfg.first_interval_s
        self._next_probe = clock() + self.interval
        self._switched_at = self._probe_gap_end = float("-inf")

    # ------------------------------------------------------------------ public
    @property
    def low_mode(self) -> Mode:
        """The low state: N throttled threads with a SpinControl, else 1 thread."""
        return Mode(self.ceiling, True) if self._spin is not None and self.ceiling > 1 else Mode(1)

    @property
    def home(self) -> Mode:
        return self.low_mode if self.low else Mode(self.ceiling)

    @property
    def away(self) -> Mode:
        return Mode(self.ceiling) if self.low else self.low_mode

    def mode(self) -> Mode:
        """How the next step runs."""
        return self._probe.mode if self._probe is not None else self.home

    def threads(self) -> int:
        """The count the next step runs with."""
        return self.mode().threads

    def before_step(self) -> int:
        """Set the process's thread count (and wait mode) for the next step; returns the count."""
        mode = self.mode()
        if mode.threads != self.applied:
            self._apply(mode.threads)
            self.applied = mode.threads
        self._set_throttle(mode.throttled)
        return mode.threads

    def set_ceiling(self, ceiling: int) -> int:
        """The core grant changed (it was applied with `ceiling` threads): the count the
        governor wants under it, which the caller applies instead."""
        if ceiling < 1:
            raise ValueError(f"a worker needs at least one thread, got {ceiling}")
        if ceiling != self.ceiling:
            self.ceiling = ceiling
            self._probe = None
            self._slow.clear()
            self._set_throttle(False)  # sized for the old team: taken up again below if low
        mode = self.mode()
        self.applied = mode.threads
        self._set_throttle(mode.throttled)
        return self.applied

    def observe(self, tokens: int, seconds: float) -> Switch | None:
        """One step that computed `tokens` tokens in `seconds` at `self.applied` threads."""
        now, n, b = self.clock(), Mode(self.applied, self.throttled), bucket_of(tokens)
        self._times.setdefault((n, b), deque(maxlen=self.cfg.window)).append((now, seconds))
        if self.ceiling == 1:
            return None
        if self._probe is not None:
            return self._probe_step(b, seconds, now)
        return self._home_step(b, seconds, now)

    def level(self, mode: Mode | int, bucket: int, since: float | None = None) -> float | None:
        """Median step time of `mode` (a thread count: spinning) in `bucket`, of the times
        recorded at or after `since` (None: too few)."""
        key = Mode(mode) if isinstance(mode, int) else mode
        times = [t for at, t in self._times.get((key, bucket), ()) if since is None or at >= since]
        return statistics.median(times) if len(times) >= self.cfg.min_samples else None

    # --------------------------------------------------------------- internals
    def _home_step(self, b: int, seconds: float, now: float) -> Switch | None:
        home, away = self.home, self.away
        base = self._level_before_last(home, b)
        if base is not None and seconds > self.cfg.collapse * base:
            keep = self.cfg.collapse_steps - 1  # the streak's last steps: min() judges them
            self._slow = [*(self._slow[-keep:] if keep > 0 else []), seconds / base]
            if len(self._slow) >= self.cfg.collapse_steps and now >= self._probe_gap_end:  # not a burst
                self._probe = _Probe(away, min(self._slow), recovery=self.low)
                self._slow.clear()
            return None
        if base is not None:  # a step at its usual pace: the slowness was a burst
            self._slow.clear()
        # Away's times from before the last switch say nothing of it now (they are
        # what the switch judged): only later ones, and fresh ones, count.
        other = self._slowest(away, b, since=max(self._switched_at, now - self.cfg.fresh_s))
        recent = self._recent(home, b)
        if other is not None and recent is not None and recent > self.cfg.margin * other:
            return self._switch(now)
        if now >= self._next_probe and base is not None:
            self._probe = _Probe(away, 1.0, recovery=self.low)
        return None

    def _probe_step(self, b: int, seconds: float, now: float) -> Switch | None:
        probe = self._probe
        assert probe is not None
        probe.steps += 1
        base = self.level(self.home, b)
        if base is not None:
            ratio = seconds / (base * probe.home_level)
            if ratio > self.cfg.cut:
                self._probe_lost(now)
                return None
            probe.ratios.append(ratio)
        if len(probe.ratios) >= self.cfg.probe_steps:
            won = (statistics.median(probe.ratios) * self.cfg.recover_margin < 1.0 if probe.recovery
                   else max(probe.ratios) * self.cfg.margin < 1.0)
            if won:
                return self._switch(now, collapse=probe.collapse)
            self._probe_lost(now)
            return None
        if probe.steps >= 2 * self.cfg.probe_steps:  # buckets home has no level for
            self._probe_lost(now)
        return None

    def _probe_lost(self, now: float) -> None:
        self._probe = None
        self._probe_gap_end = now + self.cfg.first_interval_s
        self.interval = min(2 * self.interval, self.cfg.max_interval_s)
        self._next_probe = now + self.interval

    def _switch(self, now: float, collapse: bool = True) -> Switch:
        self._probe = None
        self._slow.clear()
        self.low = not self.low
        if not self.low:
            reason = "recovered"
        else:
            reason = "contention" if collapse else "probe_won"
        self.interval = self.cfg.first_interval_s
        self._next_probe = now + self.interval
        self._switched_at = self._probe_gap_end = now
        return Switch(self.home.threads, reason, self.home.throttled)

    def _set_throttle(self, on: bool) -> None:
        if on != self.throttled and self._spin is not None:
            if on:
                self._spin.on(self.applied)
            else:
                self._spin.off()
            self.throttled = on

    def _level_before_last(self, threads: Mode, bucket: int) -> float | None:
        """The median without the step just recorded (which a collapse is judged by)."""
        times = self._times.get((threads, bucket))
        if not times or len(times) <= self.cfg.min_samples:
            return None
        return statistics.median(t for _, t in list(times)[:-1])

    def _slowest(self, threads: Mode, bucket: int, since: float) -> float | None:
        """The slowest of `threads`' times since `since` (None: fewer than min_samples)."""
        times = [t for at, t in self._times.get((threads, bucket), ()) if at >= since]
        return max(times) if len(times) >= self.cfg.min_samples else None

    def _recent(self, threads: Mode, bucket: int) -> float | None:
        """The fastest of the last `recent` steps: drift needs every one of them slow."""
        times = self._times.get((threads, bucket))
        if not times or len(times) < self.cfg.recent:
            return None
        return min(t for _, t in list(times)[-self.cfg.recent:])


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
