"""Pure verdict logic for `bench/soak.py`: samples in, PASS/FAIL and reasons out.

Rules (printed by the soak script):
- RSS: for every process sampled both after warm-up and at the end, growth
  `end - start` must be <= max(RSS_ABS_BOUND, RSS_REL_BOUND * start)
  (i.e. 50 MiB or 10 %, whichever is larger).
- File descriptors: `|end - start| <= FD_BOUND` (5) for the same processes.
- KV: every live worker at the end (after drain) reports KV usage 0 (all
  blocks free, nothing running).
- Liveness: every process except the deliberately killed one is alive.
- Hung worker: a decode worker made to hang (main loop blocked, heartbeats
  going on) must be marked stalled by the gateway and stay alive until the
  soak kills it; it is then counted like the killed worker (its streams are
  recovered; after the run it is killed and left out of the
  RSS/fd/KV/liveness checks).
- Twins: when a worker was killed or hung, every recovered stream that
  completed must equal its undisturbed twin (the single-process engine, same
  parameters and seed): same text, same finish reason. At least one of the
  streams compared must be sampled (temperature > 0), or the run proved
  nothing about sampled recovery.
- Errors: zero unexplained. An error is *explained* only if it is the
  expected consequence of the injected restart: its code is one the gateway
  uses for "no worker / pool empty" (`no_workers`, HTTP 503) and it happened
  while the killed worker's pool was short of workers, i.e. inside the
  restart window [kill, replacement registered + grace]. With two decode
  workers one survives the kill, so a correct system produces no errors at
  all; recovered streams (mid-stream failover) are not errors.
  Client-initiated aborts are not errors either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20
RSS_ABS_BOUND = 50 * MIB
RSS_REL_BOUND = 0.10
FD_BOUND = 5
EXPLAINABLE_CODES = frozenset({"no_workers", "http_503"})
SHOWN_MISMATCHES = 10


@dataclass(frozen=True)
class ProcSample:
    rss_bytes: int
    fds: int


@dataclass(frozen=True)
class ErrorEvent:
    t: float  # seconds since the run started
    kind: str  # e.g. "stream_error:no_workers", "http_503", "timeout", "incomplete_stream"
    detail: str = ""


@dataclass(frozen=True)
class TwinCheck:
    """Recovered streams that completed, each compared with its undisturbed twin."""

    checked: int  # recovered, completed streams compared
    sampled: int  # of which sampled (temperature > 0)
    mismatches: tuple[str, ...] = ()  # one line per stream whose output differed


@dataclass(frozen=True)
class HungWorker:
    """The worker made to hang, and when the gateway marked it stalled (None: never)."""

    name: str
    stalled_t: float | None
    alive_at_end: bool = True  # until the soak killed it: a hang, not a crash


@dataclass
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    explained: list[ErrorEvent] = field(default_factory=list)
    unexplained: list[ErrorEvent] = field(default_factory=list)


def error_code(kind: str) -> str:
    """`stream_error:no_workers` / `http_503:no_workers` -> `no_workers`; `http_503` stays."""
    return kind.split(":", 1)[1] if ":" in kind else kind


def is_explained(err: ErrorEvent, window: tuple[float, float] | None) -> bool:
    if window is None:
        return False
    lo, hi = window
    return error_code(err.kind) in EXPLAINABLE_CODES and lo <= err.t <= hi


def rss_bound(start_rss: int) -> float:
    return max(RSS_ABS_BOUND, RSS_REL_BOUND * start_rss)


def judge(
    start: dict[str, ProcSample],
    end: dict[str, ProcSample],
    kv_usage_end: dict[str, float],
    alive_end: dict[str, bool],
    errors: list[ErrorEvent],
    restart_window: tuple[float, float] | None,
    killed: frozenset[str] = frozenset(),
    *,
    hung: HungWorker | None = None,
    twins: TwinCheck | None = None,
) -> Verdict:
    """Apply the rules above. Keys of `start`/`end`/`alive_end` are process names;
    `kv_usage_end` maps worker names to their final usage ratio (0-1). `twins` is
    None when no worker was killed or hung (nothing was recovered)."""
    v = Verdict(passed=True)
    if hung is not None:
        killed = killed | {hung.name}
        if hung.stalled_t is None:
            v.reasons.append(f"{hung.name}: hung but never marked stalled by the gateway")
        if not hung.alive_at_end:
            v.reasons.append(f"{hung.name}: exited by itself before the soak killed it (a crash, not a hang)")
    if twins is not None:
        if twins.mismatches:
            v.reasons.append(f"{len(twins.mismatches)} of {twins.checked} recovered stream(s) differ from "
                             "their undisturbed twin")
            v.reasons.extend(f"  {m}" for m in twins.mismatches[:SHOWN_MISMATCHES])
        if twins.sampled == 0:
            v.reasons.append(f"no recovered sampled stream was checked against its twin "
                             f"({twins.checked} recovered stream(s) checked)")
    for name, s in sorted(start.items()):
        if name in killed:
            continue
        e = end.get(name)
        if e is None:
            v.reasons.append(f"{name}: no end sample (process gone?)")
            continue
        growth = e.rss_bytes - s.rss_bytes
        bound = rss_bound(s.rss_bytes)
        if growth > bound:
            v.reasons.append(f"{name}: RSS grew {growth / MIB:.1f} MiB > bound {bound / MIB:.1f} MiB")
        if abs(e.fds - s.fds) > FD_BOUND:
            v.reasons.append(f"{name}: open fds {s.fds} -> {e.fds} (more than ±{FD_BOUND})")
    for name, usage in sorted(kv_usage_end.items()):
        if usage > 0.0 and name not in killed:
            v.reasons.append(f"{name}: KV usage {usage:.4f} at end, not back to idle (0)")
    for name, alive in sorted(alive_end.items()):
        if not alive and name not in killed:
            v.reasons.append(f"{name}: process died (not the deliberately killed one)")
    for err in errors:
        (v.explained if is_explained(err, restart_window) else v.unexplained).append(err)
    if v.unexplained:
        kinds: dict[str, int] = {}
        for err in v.unexplained:
            kinds[err.kind] = kinds.get(err.kind, 0) + 1
        v.reasons.append(f"{len(v.unexplained)} unexplained error(s): {kinds}")
    v.passed = not v.reasons
    return v
