"""A plain-text progress bar on stderr (no dependencies).

Redrawn in place with a carriage return at most every `min_interval_s`; the
fraction shown is the larger of requests done / request bound and elapsed /
time bound, since whichever bound is hit first ends the run.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(
        self,
        label: str,
        total_requests: int,
        max_duration_s: float,
        enabled: bool = True,
        stream: TextIO | None = None,
        width: int = 30,
        min_interval_s: float = 0.1,
    ) -> None:
        self.label = label
        self.total = max(1, total_requests)
        self.max_duration_s = max_duration_s
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        # A log file (not a terminal) gets a redraw per second, not ten.
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.min_interval_s = min_interval_s if isatty else max(min_interval_s, 1.0)
        self.start = time.monotonic()
        self._last_draw = 0.0
        self.done = 0
        self.failed = 0

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        self.draw()

    def render(self) -> str:
        elapsed = time.monotonic() - self.start
        frac = min(
            1.0,
            max(
                self.done / self.total,
                elapsed / self.max_duration_s if self.max_duration_s > 0 else 0.0,
            ),
        )
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        return (
            f"\r{self.label} [{bar}] {self.done}/{self.total} req"
            f"  {self.failed} failed  {elapsed:6.1f}s"
        )

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last_draw < self.min_interval_s):
            return
        self._last_draw = now
        self.stream.write(self.render())
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
