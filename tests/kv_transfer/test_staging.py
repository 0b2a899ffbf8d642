"""The staging path on CPU: a pool that reports itself device memory (`HiddenHostPool`)
ships over plain tcp through host staging buffers, and device copies are waited on
outside the sender lock, with the write deadline checked once the copy is done."""

from __future__ import annotations

import threading
from typing import Any, cast

import numpy as np
import pytest

from kv_transfer.api import TransferState
from kv_transfer.faults import FaultConfig
from kv_transfer.links import Link, ZmqLinkFactory
from kv_transfer.pool.blocks import frame_nbytes
from kv_transfer.pool.copy_threads import CopyThreads
from kv_transfer.pool.staging import HiddenHostPool, HostStagedOps
from kv_transfer.receiver.receiver import ZmqReceiver
from kv_transfer.sender.chunks import ChunkMaker
from kv_transfer.sender.sender import Sender
from kv_transfer.sender.state import PeerRecord, TransferRecord
from tests.kv_transfer.harness import TINY, random_pool, wait_state, wait_terminal

pytestmark = pytest.mark.timeout(60)
SRC = [3, 16, 1, 7, 8]
DST = [9, 2, 14, 5, 6]


def _pools(src_hidden: bool, dst_hidden: bool) -> tuple[np.ndarray, np.ndarray, Any, Any]:
    src = random_pool(TINY, 20, seed=7)
    dst = np.zeros_like(src)
    return (src, dst, HiddenHostPool(src) if src_hidden else src,
            HiddenHostPool(dst) if dst_hidden else dst)


@pytest.mark.parametrize(("src_hidden", "dst_hidden"), [(True, True), (True, False), (False, True)])
def test_device_pools_ship_over_tcp_through_staging(src_hidden: bool, dst_hidden: bool) -> None:
    """Layer by layer, device -> staging -> tcp -> staging -> device, bit-identical; each
    side that holds a device pool staged every byte of the transfer."""
    src, dst, src_pool, dst_pool = _pools(src_hidden, dst_hidden)
    with ZmqReceiver(TINY, dst_pool, transport="tcp") as receiver, \
            Sender(TINY, src_pool, links=ZmqLinkFactory(),
                   chunk_bytes=TINY.block_bytes_per_layer * 2) as sender:
        receiver.expect("t", "r", DST, lease_s=20)
        sender.begin("t", "r", receiver.address, SRC, DST, lease_s=20)
        for layer in range(TINY.num_layers):
            sender.send_layer("t", layer)
        assert wait_terminal(sender.poll, "t") is TransferState.COMPLETE, sender.reason("t")
        assert receiver.poll("t") is TransferState.COMPLETE
        total = frame_nbytes(TINY, TINY.num_layers, len(SRC))
        assert sender.staged_bytes == (total if src_hidden else 0)
        assert receiver.stats().staged_bytes == (total if dst_hidden else 0)
    assert dst[:, :, DST].tobytes() == src[:, :, SRC].tobytes()


def test_corrupted_staged_frame_fails_the_checksum() -> None:
    src, _, src_pool, dst_pool = _pools(True, True)
    with ZmqReceiver(TINY, dst_pool, transport="tcp") as receiver, \
            Sender(TINY, src_pool, links=ZmqLinkFactory(), faults=FaultConfig(corrupt_chunk=0)) as sender:
        receiver.expect("t", "r", DST, lease_s=20)
        sender.begin("t", "r", receiver.address, SRC, DST, lease_s=20)
        sender.send_all("t")
        assert wait_terminal(sender.poll, "t") is TransferState.FAILED
        assert "checksum" in sender.reason("t")


def test_poll_and_cancel_do_not_wait_for_a_device_copy() -> None:
    """While a staged copy is still running (its event held back), the sender lock is
    free: cancel and poll answer at once, the transfer is CANCELLING (the copy still
    reads the source blocks) and forget refuses; once the copy is done it is ABORTED."""
    _, _, src_pool, dst_pool = _pools(True, True)
    gate, waiting = threading.Event(), threading.Event()
    src_pool.stream.gate = gate
    src_pool.stream.on_wait = waiting.set
    with ZmqReceiver(TINY, dst_pool, transport="tcp") as receiver, \
            Sender(TINY, src_pool, links=ZmqLinkFactory()) as sender:
        receiver.expect("t", "r", DST, lease_s=20)
        sender.begin("t", "r", receiver.address, SRC, DST, lease_s=20)
        sender.send_all("t")
        states: list[TransferState] = []
        answered = threading.Event()

        def worker_loop() -> None:
            sender.cancel("t")
            states.append(sender.poll("t"))
            answered.set()

        try:
            assert waiting.wait(10), "the copy never started"
            threading.Thread(target=worker_loop, daemon=True).start()
            assert answered.wait(5), "cancel/poll waited for the copy: the sender lock is held"
            assert states == [TransferState.CANCELLING]
            with pytest.raises(ValueError, match="CANCELLING"):
                sender.forget("t")
        finally:
            gate.set()
        wait_state(sender.poll, "t", TransferState.ABORTED)
        sender.forget("t")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _direct(deadline: float) -> tuple[ChunkMaker, PeerRecord, TransferRecord, _Clock,
                                       HiddenHostPool, np.ndarray]:
    src, dst, src_pool, dst_pool = _pools(True, True)
    clock = _Clock()
    ops = HostStagedOps(src_pool)
    maker = ChunkMaker(TINY, ops, CopyThreads(1), FaultConfig(), chunk_bytes=1 << 20,
                       shm_chunk_bytes=1 << 20, clock=clock)
    peer = PeerRecord("cuda+tcp://x", cast(Link, None), True, ready=True)
    peer.direct_ops = HostStagedOps(dst_pool)
    t = TransferRecord("t", "r", peer.address, tuple(SRC), tuple(DST), deadline=1e9,
                       granted=True, write_deadline=deadline, state=TransferState.TRANSFERRING)
    t.pending_layers.append((0, TINY.num_layers, None))
    maker.plan(peer, t)
    return maker, peer, t, clock, src_pool, dst


def test_direct_copy_waits_without_the_lock_and_then_checks_the_deadline() -> None:
    """A direct copy queued before the write deadline but finished after it (it waited on
    compute) fails the transfer and announces nothing; the wait happens lock-free."""
    maker, peer, t, clock, src_pool, _ = _direct(deadline=101.0)
    lock = threading.Lock()
    held: list[bool] = []

    def copy_runs_late() -> None:
        held.append(lock.locked())
        clock.now = 102.0

    src_pool.stream.on_wait = copy_runs_late
    assert maker.produce(lock, peer, t) is None
    assert held == [False]
    assert t.state is TransferState.FAILED and "during the copy" in t.reason
    assert t.copying == 0


def test_direct_copy_done_in_time_is_announced() -> None:
    maker, peer, t, _, src_pool, dst = _direct(deadline=101.0)
    made = maker.produce(threading.Lock(), peer, t)
    assert made is not None and made.buffer is None  # header only: the bytes are in place
    assert t.state is TransferState.TRANSFERRING
    assert dst[:, :, DST].tobytes() == src_pool.array[:, :, SRC].tobytes()
