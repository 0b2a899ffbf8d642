"""Child processes of `pdserve up`: started with their stderr read by a thread,
held back while the cluster starts and forwarded once it is ready, so a child
that fails to start is reported in one line (its last stderr line) instead of
a traceback followed by a timeout.

1. `Child.start` runs the command; a reader thread collects its stderr lines.
2. `wait_ready` polls the children and the gateway's `/ready`: the first child
   to exit ends the wait with its one-line reason, so a failed start never hangs.
3. `Child.forward` flushes what was held and forwards later lines as they come.
4. A worker that exits once the cluster is ready is restarted within a
   `RestartBudget` (pdserve/cli/up.py).
5. `stop` sends SIGTERM, waits, then kills what is left.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import IO, NamedTuple

HELD_LINES = 1000  # stderr lines kept per child until the cluster is ready
EOF_WAIT_S = 5.0  # after an exit: how long a grandchild may keep the pipe open


class Child:
    """One child process whose stderr is captured line by line."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self.name = name
        self.proc = proc
        self._lock = threading.Lock()
        self._held: deque[bytes] = deque(maxlen=HELD_LINES)
        self._last = b""
        self._live = False
        self._reader = threading.Thread(target=self._pump, name=f"stderr-{name}", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, name: str, cmd: Sequence[str], stdout: int | None = None,
              env: Mapping[str, str] | None = None) -> Child:
        """`env`: the child's whole environment (None: this process's)."""
        return cls(name, subprocess.Popen(list(cmd), stdout=stdout, stderr=subprocess.PIPE,
                                          env=dict(env) if env is not None else None))

    def _pump(self) -> None:
        stream: IO[bytes] | None = self.proc.stderr
        assert stream is not None
        for line in stream:
            with self._lock:
                if line.strip():
                    self._last = line
                if self._live:
                    _write(line)
                else:
                    self._held.append(line)

    def forward(self) -> None:
        """Write the held lines to our stderr, and every later line as it comes."""
        with self._lock:
            for line in self._held:
                _write(line)
            self._held.clear()
            self._live = True

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def exit_reason(self) -> str:
        """One line: who exited, how, and its last stderr line (call after it exited)."""
        self._reader.join(EOF_WAIT_S)  # the pipe's end: every line has been read
        with self._lock:
            last = " ".join(self._last.decode(errors="replace").split()) or "(no output)"
        code = self.proc.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"{self.name} {how}: {last}"


def _write(line: bytes) -> None:
    # A closed or broken stderr must not stop the reader: an undrained pipe would
    # block the child on its next log line.
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()


class Readiness(NamedTuple):
    ready: bool
    reason: str  # one line when not ready, "" when ready
    stopped: bool = False  # not ready because a stop was asked for: not a failure


def wait_ready(url: str, children: Sequence[Child], timeout_s: float,
               stopping: Callable[[], bool] = lambda: False) -> Readiness:
    """Until the gateway at `url` says ready, a child exits, `stopping()` or the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        failed = next((c for c in children if c.exited()), None)
        if failed is not None:
            return Readiness(False, failed.exit_reason())
        if stopping():
            return Readiness(False, "stopped before the cluster was ready", stopped=True)
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=1) as r:
                if json.load(r).get("ready"):
                    return Readiness(True, "")
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return Readiness(False, f"the cluster did not become ready within {timeout_s:g}s")


class RestartBudget:
    """At most `max_restarts` restarts of one child within `window_s` seconds: a child
    that keeps dying (a crash loop) is not restarted forever."""

    def __init__(self, max_restarts: int = 3, window_s: float = 60.0) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._at: dict[str, deque[float]] = {}

    def allow(self, name: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        recent = self._at.setdefault(name, deque())
        while recent and now - recent[0] > self.window_s:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            return False
        recent.append(now)
        return True


def stop(children: Sequence[Child], timeout_s: float = 20.0) -> None:
    """SIGTERM every child still running, wait up to `timeout_s`, then kill."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
