"""Every (prefill layout, decode layout) pair through real processes, each layout
started once: one gateway per pair, each prefill worker registered with its row's
gateways and each decode worker with its column's (`--gateway` repeated), so a request
to pair (p, d)'s gateway is prefilled by p and decoded by d -- no routing hint needed.

Used by tests/e2e/test_layout_pairs.py (a subset) and bench/layout_pairs.py (all 16).
"""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

from tests.e2e.cluster import WORKER_BLOCKS, Cluster, Proc, http, remove_leaked_shm, start

# TP, PP in {1, 2}: a layout's name and its worker flags.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "tp1": (),
    "tp2": ("--tensor-parallel-size", "2"),
    "pp2": ("--pipeline-parallel-size", "2"),
    "tp2pp2": ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"),
}


class LayoutGrid:
    """Prefill workers of `prefill` layouts x decode workers of `decode` layouts."""

    def __init__(self, log_dir: Path, prefill: list[str], decode: list[str]) -> None:
        self.prefill = prefill
        self.decode = decode
        self._log_dir = log_dir
        self._gateways: dict[tuple[str, str], Cluster] = {}
        self._workers: list[Proc] = []

    def start(self) -> None:
        for p, d in itertools.product(self.prefill, self.decode):
            sub = self._log_dir / f"{p}-{d}"
            sub.mkdir(parents=True, exist_ok=True)
            c = Cluster(sub)
            self._gateways[(p, d)] = c
            c.start_gateway()
        for role, names in (("prefill", self.prefill), ("decode", self.decode)):
            for name in names:
                mine = [c for (p, d), c in self._gateways.items() if (p if role == "prefill" else d) == name]
                args = [role, *(a for c in mine for a in ("--gateway", c.control)), "--threads", "1",
                        "--num-blocks", WORKER_BLOCKS, "--heartbeat", "0.25", *LAYOUTS[name]]
                proc = start(f"{role}-{name}", args, self._log_dir)
                self._workers.append(proc)
                for c in mine:
                    c.workers.append(proc)  # their logs go with a gateway's timeout message
        for c in self._gateways.values():
            c.wait_roles(timeout=180, prefill=1, decode=1)

    def pairs(self) -> list[tuple[str, str]]:
        return list(self._gateways)

    def url(self, prefill: str, decode: str) -> str:
        return self._gateways[(prefill, decode)].url

    def complete(self, prefill: str, decode: str, body: dict[str, object]) -> str:
        status, out = http("POST", f"{self.url(prefill, decode)}/v1/completions", body, timeout=120)
        assert status == 200, (prefill, decode, out)
        return str(out["choices"][0]["text"])

    def wait_idle(self) -> None:
        for c in self._gateways.values():
            c.wait_idle(timeout=50)

    def stop(self) -> None:
        for w in self._workers:  # all drain at once, not one after another
            if w.alive():
                w.signal(signal.SIGTERM)
        for w in self._workers:
            w.stop()
            remove_leaked_shm(w.popen.pid)
        for c in self._gateways.values():
            if c.gateway is not None:
                c.gateway.stop()
