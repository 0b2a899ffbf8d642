"""A peer process killed mid-transfer: the survivor's blocks come back within its lease."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable

import numpy as np
import pytest

from kv_transfer.api import TransferState
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.pool.shm import create_shm_pool
from kv_transfer.receiver.receiver import ZmqReceiver
from kv_transfer.sender.sender import Sender
from tests.kv_transfer import proc_helpers
from tests.kv_transfer.harness import TINY, random_pool

pytestmark = pytest.mark.timeout(90)
LEASE_S = 3.0
GRACE_S = 0.3
SLACK_S = 1.0


def _wait(poll: Callable[[str], TransferState], tid: str, until: float) -> TransferState:
    """The worker loop: poll without ever raising, until terminal or `until`."""
    while True:
        state = poll(tid)
        if state.terminal or time.monotonic() > until:
            return state
        time.sleep(0.005)


@pytest.mark.parametrize("transport", ["tcp", "ipc", "shm"])
def test_sender_killed_mid_transfer(transport: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    shm = create_shm_pool(TINY, proc_helpers.NUM_BLOCKS + 1) if transport == "shm" else None
    pool = shm if shm is not None else np.zeros(TINY.pool_shape(proc_helpers.NUM_BLOCKS + 1),
                                                np.float16)
    receiver = ZmqReceiver(TINY, pool, transport=transport, grace_s=GRACE_S)
    events = ctx.Queue()
    child = ctx.Process(target=proc_helpers.slow_sender, args=(receiver.address, events))
    try:
        ids = list(range(1, proc_helpers.NUM_BLOCKS + 1))
        child.start()
        assert events.get(timeout=30) == "sending"
        # The child's claim waits for this reservation; the lease starts now.
        start = time.monotonic()
        receiver.expect("t", "r", ids, lease_s=LEASE_S)
        while receiver.poll("t") is TransferState.RESERVED and time.monotonic() < start + 1.5:
            time.sleep(0.005)
        time.sleep(0.3)  # some chunks have landed
        assert receiver.poll("t") is TransferState.TRANSFERRING
        child.kill()
        child.join(10)
        end = start + LEASE_S + GRACE_S + SLACK_S
        assert _wait(receiver.poll, "t", end) is TransferState.FAILED
        assert "lease expired" in receiver.reason("t")
        receiver.forget("t")
        receiver.expect("t2", "r2", ids, lease_s=5)  # every block is reservable again
    finally:
        if child.is_alive():
            child.kill()
        receiver.close()
        if shm is not None:
            shm.unlink()


def test_cancel_after_the_shm_sender_was_killed_releases_before_the_lease() -> None:
    """A killed writer is known dead (its liveness lock is gone): a cancelled transfer
    frees its blocks at once instead of at its 30 s lease."""
    ctx = multiprocessing.get_context("spawn")
    shm = create_shm_pool(TINY, proc_helpers.NUM_BLOCKS + 1)
    receiver = ZmqReceiver(TINY, shm, transport="shm", grace_s=GRACE_S)
    events = ctx.Queue()
    child = ctx.Process(target=proc_helpers.slow_sender, args=(receiver.address, events))
    try:
        ids = list(range(1, proc_helpers.NUM_BLOCKS + 1))
        child.start()
        assert events.get(timeout=30) == "sending"
        receiver.expect("t", "r", ids, lease_s=30)
        until = time.monotonic() + 5
        while receiver.poll("t") is not TransferState.TRANSFERRING and time.monotonic() < until:
            time.sleep(0.005)
        assert receiver.poll("t") is TransferState.TRANSFERRING
        child.kill()
        child.join(10)
        receiver.cancel("t")
        start = time.monotonic()
        assert _wait(receiver.poll, "t", start + 5) is TransferState.ABORTED
        assert time.monotonic() - start < 2.0
        assert "sender gone" in receiver.reason("t")
        receiver.forget("t")
        receiver.expect("t2", "r2", ids, lease_s=5)  # every block is reservable again
    finally:
        if child.is_alive():
            child.kill()
        receiver.close()
        shm.unlink()


@pytest.mark.parametrize("transport", ["tcp", "ipc", "shm"])
def test_receiver_killed_mid_transfer(transport: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    child = ctx.Process(target=proc_helpers.idle_receiver, args=(transport, events))
    child.start()
    sender = Sender(TINY, random_pool(TINY, proc_helpers.NUM_BLOCKS + 1, seed=5),
                    links=ZmqLinkFactory(), faults=proc_helpers.SLOW,
                    chunk_bytes=proc_helpers.CHUNK_BYTES,
                    shm_chunk_bytes=proc_helpers.CHUNK_BYTES)
    try:
        address = events.get(timeout=30)
        assert address.startswith("shm+" if transport == "shm" else transport)
        ids = list(range(1, proc_helpers.NUM_BLOCKS + 1))
        start = time.monotonic()
        sender.begin("t", "r", address, ids, ids, lease_s=LEASE_S)
        sender.send_all("t")
        while sender.poll("t") is TransferState.RESERVED and time.monotonic() < start + 1.5:
            time.sleep(0.005)
        time.sleep(0.3)
        assert sender.poll("t") is TransferState.TRANSFERRING
        child.kill()
        child.join(10)
        assert _wait(sender.poll, "t", start + LEASE_S + SLACK_S) is TransferState.FAILED
        assert "no ack" in sender.reason("t")
        sender.forget("t")  # the worker frees its source blocks
        sender.begin("t2", "r", "tcp://127.0.0.1:1", [1], [1], lease_s=0.2)
        assert _wait(sender.poll, "t2", time.monotonic() + 2) is TransferState.FAILED
    finally:
        if child.is_alive():
            child.kill()
        sender.close()
