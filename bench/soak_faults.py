"""The faults the soak injects into its cluster, each at a chosen time: one decode
worker killed with SIGKILL and replaced, and one extra decode worker that hangs
(its main loop blocks after some engine steps while its heartbeats go on) until
the gateway marks it stalled. Both record what happened, and when, in `info`."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

from tests.e2e.cluster import Cluster, Proc, remove_leaked_shm

# The hung worker has four times the others' KV, so the gateway sends it new work
# first: it hangs with streams in flight, and keeps drawing requests until marked stalled.
HUNG_BLOCKS = "1024"
STALL_WAIT_S = 120.0  # start, registration, first steps and the gateway's stall timeout


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _since(t0: float) -> float:
    return round(time.monotonic() - t0, 2)


def _find(cluster: Cluster, pid: int) -> dict[str, Any] | None:
    return next((w for w in cluster.worker_list() if int(w["pid"]) == pid), None)


async def restart_task(cluster: Cluster, procs: dict[str, Proc], at_s: float, n_decode: int,
                       t0: float, info: dict[str, Any], worker_args: tuple[str, ...] = ()) -> None:
    """At `at_s`: kill -9 the first decode worker (never the hung one), start a
    replacement, and wait until the gateway lists `n_decode` healthy decode workers."""
    await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
    victim_name = next(n for n in procs if n.startswith("decode") and n != info.get("hung"))
    victim = procs[victim_name]
    info["killed"] = victim_name
    info["kill_t"] = _since(t0)
    log(f"kill -9 {victim_name} (pid {victim.popen.pid}) at t={info['kill_t']}s")
    victim.signal(signal.SIGKILL)
    await asyncio.to_thread(victim.popen.wait, 10)
    remove_leaked_shm(victim.popen.pid)
    new = cluster.add_worker("decode", *worker_args)
    procs[new.name] = new
    info["replacement"] = new.name

    def replaced() -> bool:
        ws = cluster.worker_list()
        pids = {int(w["pid"]) for w in ws}
        if victim.popen.pid not in pids and "victim_gone_t" not in info:
            info["victim_gone_t"] = _since(t0)  # gateway noticed the death
        decodes = [w for w in ws if w["role"] == "decode" and int(w["pid"]) != info.get("hung_pid")]
        return victim.popen.pid not in pids and new.popen.pid in pids and len(decodes) == n_decode

    try:
        await asyncio.to_thread(cluster._wait, replaced, "replacement decode worker registered", 120.0)
    except AssertionError as e:
        info["replacement_error"] = str(e)[-2000:]
        log(f"replacement {new.name} did not register: {str(e)[-1500:]}")
        return
    info["replacement_ready_t"] = _since(t0)
    log(f"replacement {new.name} (pid {new.popen.pid}) registered at t={info['replacement_ready_t']}s")


async def hang_task(cluster: Cluster, procs: dict[str, Proc], at_s: float, hang_after_steps: int,
                    t0: float, info: dict[str, Any], worker_args: tuple[str, ...] = ()) -> None:
    """At `at_s`: start an extra decode worker with `hang_after_steps` armed, and wait
    until the gateway marks it stalled (its streams are then recovered elsewhere)."""
    await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
    hung = cluster.add_worker("decode", *worker_args, "--num-blocks", HUNG_BLOCKS, "--enable-fault-injection",
                              env={"PDSERVE_FAULTS": f"hang_after_steps={hang_after_steps}"})
    procs[hung.name] = hung
    info.update(hung=hung.name, hung_pid=hung.popen.pid, hung_start_t=_since(t0))
    log(f"started {hung.name} (pid {hung.popen.pid}) to hang after {hang_after_steps} engine steps")

    def stalled() -> bool:
        w = _find(cluster, hung.popen.pid)
        if w is not None and "hung_registered_t" not in info:
            info["hung_registered_t"] = _since(t0)
        return w is not None and bool(w["stalled"])

    try:
        await asyncio.to_thread(cluster._wait, stalled, f"{hung.name} marked stalled", STALL_WAIT_S)
    except AssertionError as e:
        info["hung_error"] = str(e)[-2000:]
        log(f"{hung.name} was not marked stalled: {str(e)[-1500:]}")
        return
    info["stalled_t"] = _since(t0)
    log(f"{hung.name} marked stalled at t={info['stalled_t']}s")


async def end_hang(cluster: Cluster, procs: dict[str, Proc], info: dict[str, Any]) -> None:
    """After the load: note the hung worker's last state, kill it, and wait until the
    gateway dropped it (a worker that never steps can never drain)."""
    if "hung" not in info:
        return
    hung = procs[info["hung"]]
    listed = _find(cluster, hung.popen.pid)
    # Still listed and stalled; or already dropped: a worker stops heartbeating once its
    # loop has been silent for a minute (pdserve/worker/runtime.py `stall_s`), and then expires.
    info["hung_at_end"] = "dropped (heartbeats stopped)" if listed is None else {
        k: v for k, v in listed.items()
        if k in ("stalled", "running_seqs", "inflight_requests", "free_blocks", "total_blocks")}
    info["hung_alive_at_end"] = hung.alive()
    hung.signal(signal.SIGKILL)
    await asyncio.to_thread(hung.popen.wait, 10)
    remove_leaked_shm(hung.popen.pid)
    try:
        await asyncio.to_thread(cluster._wait, lambda: _find(cluster, hung.popen.pid) is None,
                                f"{hung.name} dropped by the gateway", 30.0)
    except AssertionError:
        info["hung_not_dropped"] = True
