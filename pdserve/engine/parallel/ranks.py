"""Follower ranks of a tensor-parallel group: started with spawn by rank 0, each loads
its slice of the weights, maps the group's shared KV pool and then runs every step
rank 0 broadcasts, until rank 0 says stop or goes away.

A follower never outlives rank 0: it watches its parent's sentinel and exits when the
parent dies (a collective with a dead peer fails too). Rank 0 watches the followers
the same way (`RankWatch`): a dead rank takes the whole group down.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from pdserve.common.kv_layout import KVLayout
from pdserve.engine.core.config import EngineConfig

log = logging.getLogger(__name__)

# A follower whose parent is gone exits with this code.
ORPHANED = 3


@dataclass(frozen=True)
class RankArgs:
    """Everything a spawned follower needs (plain values: spawn passes them to the child)."""

    config: EngineConfig
    layout: KVLayout
    rank: int
    size: int
    store_port: int
    pool_name: str  # the shared KV segment under /dev/shm
    pool_bytes: int
    timeout_s: float


def start_followers(args: list[RankArgs]) -> list[Any]:
    """Spawn one process per follower rank (spawn, never fork: torch and threads)."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for a in args:
        proc = ctx.Process(target=follower_main, args=(a,), name=f"pdserve-tp-rank{a.rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def follower_main(args: RankArgs) -> None:
    """A follower rank's process: load, join the group, run steps until STOP."""
    _exit_with_parent()
    _name_process(args.rank)
    # The group lives as long as rank 0: a signal to the worker's process group (SIGTERM
    # to drain, Ctrl-C under `pdserve up`) is rank 0's to act on; it then says STOP.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from pdserve.engine.loading.loader import load_config
    from pdserve.engine.parallel.comm import TPGroup, follower_store, reduce_group
    from pdserve.engine.parallel.pipeline import stage_links, stage_step
    from pdserve.engine.parallel.plan import rank_shard
    from pdserve.engine.parallel.shared_pool import attach_segment
    from pdserve.engine.parallel.steps import decode_step
    from pdserve.engine.runner.model_runner import ModelRunner

    segment = attach_segment(args.pool_name, args.pool_bytes)
    cfg = args.config
    shard = rank_shard(load_config(cfg.model_dir), cfg.tensor_parallel_size, cfg.pipeline_parallel_size,
                       args.rank)
    runner = ModelRunner(args.config, kv_buffer=segment.tensor, layout=args.layout, shard=shard)
    store = follower_store(args.store_port, args.size, args.timeout_s)
    group = TPGroup(store, args.rank, args.size, args.timeout_s)
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    reduce = reduce_group(store, group, tp, pp, args.timeout_s)
    if reduce is not None:  # tensor parallel: sum the row-parallel partials
        runner.model.reduce = reduce.all_reduce
    links = None if shard.layers is None else stage_links(args.rank, tp, pp, shard.layers)
    group.barrier()  # every rank has mapped the pool: rank 0 may unlink its name
    with torch.inference_mode():
        while True:
            chunks = decode_step(group.broadcast_longs(None))
            if chunks is None:
                return
            if links is not None:
                stage_step(runner, group, chunks, links)
            else:
                runner.execute(chunks)


def _name_process(rank: int) -> None:
    """`pdserve-rank<r>` as the process name (`ps`, /proc/<pid>/comm), so an operator or
    a test can tell the ranks apart; Linux only, best effort."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(f"pdserve-rank{rank}")


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        wait([sentinel])
        os._exit(ORPHANED)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


class RankWatch:
    """Calls `on_death(rank, exitcode)` once if any follower exits before `stop()`."""

    def __init__(self, procs: list[Any], on_death: Callable[[int, int | None], None]) -> None:
        self._procs = procs
        self._on_death = on_death
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-rank-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ready = wait([p.sentinel for p in self._procs])
        if self._stopping.is_set():
            return
        for rank, proc in enumerate(self._procs, start=1):
            if proc.sentinel in ready:
                proc.join(5.0)
                self._on_death(rank, proc.exitcode)
                return

    def stop(self) -> None:
        self._stopping.set()


def exit_process(rank: int, exitcode: int | None) -> None:
    """The default reaction to a dead rank: this process (the group's rank 0, the worker)
    exits too, so no half-alive group serves; the gateway recovers its requests."""
    log.error("tensor-parallel rank %d exited (code %s); the worker exits", rank, exitcode)
    logging.shutdown()
    os._exit(70)
