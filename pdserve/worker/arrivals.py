"""Which requests reached this worker, for its heartbeats (`Heartbeat.received`).

The gateway keeps counting a request it routed here as its own estimate of our load
until a heartbeat says the request arrived, so that heartbeat's load must already
count it. Hence the main loop records arrivals and publishes them in the same
immutable snapshot as the load (`LoadSnapshot`); the heartbeat thread reports, from
the snapshot it sends, the ids that arrived after those it reported last. Each id is
reported once.

The main loop keeps the ids of the last `MAX_RECEIVED` arrivals only; a heartbeat that
would have to list more lists None instead, and the gateway then takes its load as
covering everything it routed here (as it does for a worker that predates the list).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.common.protocol import MAX_RECEIVED


@dataclass(frozen=True)
class Arrivals:
    """How many requests have arrived in all, and the ids of the latest of them."""

    total: int = 0
    recent: tuple[str, ...] = ()

    def since(self, reported: int) -> list[str] | None:
        """The ids of the arrivals after the first `reported`; None when some of them
        are no longer kept."""
        new = self.total - reported
        if not 0 <= new <= len(self.recent):
            return None
        return list(self.recent[len(self.recent) - new:])


class ArrivalLog:
    """The main loop's record of arrivals. Main loop only."""

    def __init__(self, keep: int = MAX_RECEIVED) -> None:
        self._recent: deque[str] = deque(maxlen=keep)
        self._total = 0
        self._published = Arrivals()

    def record(self, request_id: str) -> None:
        self._recent.append(request_id)
        self._total += 1

    def snapshot(self) -> Arrivals:
        """The arrivals so far, immutable (the same object while nothing arrives)."""
        if self._published.total != self._total:
            self._published = Arrivals(self._total, tuple(self._recent))
        return self._published


class Report(NamedTuple):
    seq: int  # this heartbeat's number, from 1
    received: list[str] | None  # None: more arrived than are kept


class ArrivalCursor:
    """What the heartbeat thread has reported so far. Heartbeat thread only."""

    def __init__(self) -> None:
        self._reported = 0
        self._seq = 0

    def next_report(self, arrivals: Arrivals) -> Report:
        """The next heartbeat's number and the ids it lists, out of the snapshot it sends."""
        received = arrivals.since(self._reported)
        self._reported = arrivals.total
        self._seq += 1
        return Report(self._seq, received)
