"""Lease rules: expiry never frees blocks that a writer may still touch."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kv_transfer import wire
from kv_transfer.api import TransferState
from kv_transfer.checksum import frame_checksum
from kv_transfer.faults import FaultConfig
from kv_transfer.pool.blocks import frame_rows, gather
from kv_transfer.receiver.core import ReceiverCore
from tests.kv_transfer.harness import TINY, make_pair, random_pool, wait_state, wait_terminal


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _core(clock: Clock, shared: bool) -> ReceiverCore:
    pool = np.zeros(TINY.pool_shape(8), np.float16)
    shm = wire.ShmDescriptor("seg", pool.shape, "float16") if shared else None
    return ReceiverCore(TINY, pool, shm=shm, grace_s=1.0, max_frame_bytes=1 << 20,
                        faults=FaultConfig(), wake=lambda: None, clock=clock)


def _grant(core: ReceiverCore, tid: str = "t", blocks: tuple[int, ...] = (2, 3)) -> None:
    core.handle(b"p", wire.encode(wire.Claim(tid, "r", TINY.compat_hash, blocks)), None)
    grants = [m for _, m in core.take_outbox() if isinstance(m, wire.Grant)]
    assert grants == [wire.Grant(tid, core._res[tid].deadline)]


def _inline_chunk(core: ReceiverCore, layer: int, src: np.ndarray) -> None:
    frame = gather(src, layer, layer + 1, [1, 2])
    header = wire.Chunk("t", "r", TINY.compat_hash, (2, 3), layer, layer + 1, frame.nbytes,
                        frame_checksum(frame, frame_rows(1, 2)), True)
    core.handle(b"p", wire.encode(header), frame.reshape(-1).view(np.uint8).data)


def test_inline_lease_expiry_is_immediate_and_blocks_later_writes() -> None:
    clock = Clock()
    core = _core(clock, shared=False)
    src = random_pool(TINY, 4, seed=1)
    core.expect("t", "r", [2, 3], lease_s=5)
    _grant(core)
    _inline_chunk(core, 0, src)
    assert core.poll("t") is TransferState.TRANSFERRING
    clock.now += 5
    assert core.poll("t") is TransferState.FAILED
    assert core.take_outbox() == [(b"p", wire.Cancel("t", "lease expired"))]
    before = core.pool.copy()
    _inline_chunk(core, 1, src)  # arrives after expiry: must not land
    assert np.array_equal(core.pool.view(np.uint16), before.view(np.uint16))
    core.forget("t")
    core.expect("u", "r", [2, 3], lease_s=5)  # the blocks can be reserved again


def test_shared_memory_expiry_waits_for_grace_unless_writer_stopped() -> None:
    clock = Clock()
    core = _core(clock, shared=True)
    core.expect("t", "r", [2, 3], lease_s=5)
    _grant(core)
    clock.now += 5
    # The sender may still be inside a copy it started just before the deadline.
    assert core.poll("t") is TransferState.TRANSFERRING
    with pytest.raises(ValueError):
        core.forget("t")
    clock.now += 0.99
    assert core.poll("t") is TransferState.TRANSFERRING
    clock.now += 0.02
    assert core.poll("t") is TransferState.FAILED
    assert "lease expired" in core.reason("t")

    core.expect("u", "r", [4, 5], lease_s=5)
    _grant(core, "u", (4, 5))
    clock.now += 5
    assert core.poll("u") is TransferState.TRANSFERRING
    core.handle(b"p", wire.encode(wire.Abort("u", "receiver cancelled")), None)
    assert core.poll("u") is TransferState.FAILED  # the writer said it stopped


def test_shared_memory_cancel_holds_until_the_writer_acknowledges() -> None:
    clock = Clock()
    core = _core(clock, shared=True)
    core.expect("t", "r", [2, 3], lease_s=5)
    _grant(core)
    core.cancel("t")
    assert core.poll("t") is TransferState.CANCELLING
    assert core.take_outbox() == [(b"p", wire.Cancel("t", "cancelled by receiver"))]
    core.handle(b"q", wire.encode(wire.Abort("t", "x")), None)  # not the writer: ignored
    assert core.poll("t") is TransferState.CANCELLING
    core.handle(b"p", wire.encode(wire.Abort("t", "receiver cancelled")), None)
    assert core.poll("t") is TransferState.ABORTED
    core.forget("t")


def test_ungranted_cancel_is_immediate() -> None:
    core = _core(Clock(), shared=True)
    core.expect("t", "r", [2, 3], lease_s=5)
    core.cancel("t")
    assert core.poll("t") is TransferState.ABORTED


@pytest.mark.parametrize("transport", ["shm", "ipc"])
def test_sender_never_writes_after_the_receivers_deadline(transport: str) -> None:
    """A slow sender (0.5 s per chunk) against a 0.3 s reservation writes nothing."""
    pair = make_pair(transport, sender_faults=FaultConfig(delay_s=0.5), grace_s=0.2)
    try:
        pair.receiver.expect("t", "r", [3, 4], lease_s=0.3)
        pair.sender.begin("t", "r", pair.receiver.address, [1, 2], [3, 4], lease_s=10)
        pair.sender.send_all("t")
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.FAILED
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert not pair.dst.any()
    finally:
        pair.close()


def test_a_lost_cancel_is_repeated_until_the_writer_answers() -> None:
    from kv_transfer.receiver.core import CANCEL_RESEND_S

    clock = Clock()
    core = _core(clock, shared=True)
    core.expect("t", "r", [2, 3], lease_s=30)
    _grant(core)
    core.cancel("t")
    assert core.take_outbox() == [(b"p", wire.Cancel("t", "cancelled by receiver"))]  # lost
    clock.now += CANCEL_RESEND_S
    assert core.poll("t") is TransferState.CANCELLING
    core.tick()
    assert core.take_outbox() == [(b"p", wire.Cancel("t", "cancelled by receiver"))]
    core.handle(b"p", wire.encode(wire.Abort("t", "not sending")), None)
    assert core.poll("t") is TransferState.ABORTED  # long before the 30 s lease


def test_cancel_of_a_forgotten_shm_transfer_releases_promptly() -> None:
    """The prefill worker cancels and forgets at once (its reaper does): the Abort it
    owes the receiver still goes out, so the decode side frees its blocks in well
    under the 30 s lease; a Cancel for a transfer the sender no longer knows is
    answered with Abort too."""
    pair = make_pair("shm", sender_faults=FaultConfig(delay_s=0.05), chunk_bytes=4096)
    try:
        dst = list(range(10, 42))
        for tid in ("t", "u"):
            pair.receiver.expect(tid, "r", dst if tid == "t" else [50, 51], lease_s=30)
        pair.sender.begin("t", "r", pair.receiver.address, list(range(1, 33)), dst, lease_s=30)
        pair.sender.send_all("t")
        wait_state(pair.receiver.poll, "t", TransferState.TRANSFERRING)
        pair.sender.cancel("t")
        pair.sender.forget("t")
        pair.receiver.cancel("t")
        start = time.monotonic()
        assert wait_terminal(pair.receiver.poll, "t", timeout=5).terminal
        assert time.monotonic() - start < 2.0

        # "u" was reserved but its sender's record is gone (as after forget): a claim
        # that is granted and then cancelled gets the sender's Abort reply.
        pair.sender.begin("u", "r", pair.receiver.address, [1, 2], [50, 51], lease_s=30)
        wait_state(pair.receiver.poll, "u", TransferState.TRANSFERRING)
        pair.sender.cancel("u")
        pair.receiver.cancel("u")
        pair.sender.forget("u")
        start = time.monotonic()
        assert wait_terminal(pair.receiver.poll, "u", timeout=5).terminal
        assert time.monotonic() - start < 2.0
    finally:
        pair.close()


def test_a_reservation_waits_for_its_writers_claim_then_the_transfer_has_its_own_lease() -> None:
    # The prompt queued behind others on its prefill worker for longer than a transfer's
    # lease: its reservation must still be there when the writer comes.
    clock = Clock()
    core = _core(clock, shared=False)
    src = random_pool(TINY, 4, seed=1)
    core.expect("t", "r", [2, 3], lease_s=5, claim_lease_s=600)
    clock.now += 100
    assert core.poll("t") is TransferState.RESERVED
    _grant(core)  # the claim restarts the deadline: the Grant states now + 5
    assert core._res["t"].deadline == clock.now + 5
    _inline_chunk(core, 0, src)
    clock.now += 5
    assert core.poll("t") is TransferState.FAILED  # the push itself still has its 5 s
    core.forget("t")
    core.expect("u", "r", [2, 3], lease_s=5, claim_lease_s=600)
    clock.now += 600
    assert core.poll("u") is TransferState.FAILED  # no writer ever came: the blocks come back
    with pytest.raises(ValueError, match="claim_lease_s"):
        core.expect("v", "r", [4], lease_s=5, claim_lease_s=0)
