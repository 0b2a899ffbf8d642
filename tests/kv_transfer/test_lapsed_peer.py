"""A dead decode worker's pool does not stay mapped in the sender until it exits: once
a transfer to it runs out of lease with nothing else live there, the mapping is closed
(the same code closes a CUDA IPC mapping; shared memory shows it on CPU)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from kv_transfer.api import TransferState
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.sender.sender import Sender
from tests.kv_transfer import proc_helpers
from tests.kv_transfer.harness import TINY, random_pool, wait_terminal

pytestmark = pytest.mark.timeout(60)
LEASE_S = 1.5


def _maps(pid: int) -> bool:
    """Whether this process maps a shared-memory KV pool that process `pid` created."""
    with open("/proc/self/maps") as f:
        return f"/pdkv_{pid}_" in f.read()


def test_dead_receivers_pool_is_unmapped_when_the_lease_lapses() -> None:
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    child = ctx.Process(target=proc_helpers.idle_receiver, args=("shm", events))
    child.start()
    sender = Sender(TINY, random_pool(TINY, proc_helpers.NUM_BLOCKS + 1, seed=5),
                    links=ZmqLinkFactory(), faults=proc_helpers.SLOW,
                    chunk_bytes=proc_helpers.CHUNK_BYTES,
                    shm_chunk_bytes=proc_helpers.CHUNK_BYTES)
    try:
        address = events.get(timeout=30)
        ids = list(range(1, proc_helpers.NUM_BLOCKS + 1))
        sender.begin("t", "r", address, ids, ids, lease_s=LEASE_S)
        sender.send_all("t")
        end = time.monotonic() + 10
        while not _maps(child.pid or 0):  # mapped at the handshake
            assert time.monotonic() < end, "the receiver's pool was never mapped"
            time.sleep(0.01)
        child.kill()
        child.join(10)
        assert wait_terminal(sender.poll, "t", LEASE_S + 5) is TransferState.FAILED
        assert "no ack" in sender.reason("t")
        end = time.monotonic() + 5  # the I/O thread's next round (20 ms idle ticks)
        while _maps(child.pid or 0):
            assert time.monotonic() < end, "the dead receiver's pool is still mapped"
            time.sleep(0.01)
    finally:
        if child.is_alive():
            child.kill()
        sender.close()
