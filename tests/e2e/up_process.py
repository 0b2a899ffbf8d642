"""`pdserve up` as a real process for end-to-end tests: started on a free port, ready once
it prints its URL, stopped with SIGTERM (SIGKILL with `kill=True`) and, unless killed,
required to exit 0."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.hosts import free_port
from tests.e2e.cluster import ROOT, _env


@dataclass(frozen=True)
class UpProcess:
    url: str  # http://127.0.0.1:PORT/v1
    pid: int  # `pdserve up` itself, the leader of its process group


@contextlib.contextmanager
def pdserve_up(log: Path, *args: str, env: dict[str, str] | None = None,
               kill: bool = False) -> Iterator[UpProcess]:
    """`pdserve up --port FREE ARGS...`, its stderr appended to `log`."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--port", str(free_port()), *args],
                                cwd=ROOT, env=env if env is not None else _env(), stdout=subprocess.PIPE,
                                stderr=out, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # blocks until ready (or exit)
        assert line.startswith("pdserve ready at "), f"{line!r}\n{log.read_text()[-3000:]}"
        yield UpProcess(line.split()[-1], proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        assert kill or rc == 0, log.read_text()[-3000:]
