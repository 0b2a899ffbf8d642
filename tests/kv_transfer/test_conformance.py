"""One behavioural suite, run against the fake and every real CPU transport."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.api import TransferState, UnknownTransfer
from kv_transfer.faults import FaultConfig
from tests.kv_transfer.harness import CPU_TRANSPORTS, TINY, make_pair, same_bytes, wait_terminal

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=CPU_TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _ids(rng: np.random.Generator, pool_blocks: int, n: int) -> list[int]:
    """n distinct, shuffled (non-contiguous, out-of-order) non-null block ids."""
    return [int(b) for b in rng.permutation(np.arange(1, pool_blocks))[:n]]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("num_blocks", [1, 7, 64, 512])
def test_round_trip_is_bit_identical(transport: str, layerwise: bool, num_blocks: int) -> None:
    pair = make_pair(transport, src_blocks=num_blocks + 9, dst_blocks=num_blocks + 17,
                     chunk_bytes=4096, seed=num_blocks)
    try:
        rng = np.random.default_rng(num_blocks)
        src_ids = _ids(rng, num_blocks + 9, num_blocks)
        dst_ids = _ids(rng, num_blocks + 17, num_blocks)
        pair.receiver.expect("t", "req", dst_ids, lease_s=20)
        assert pair.receiver.poll("t") is TransferState.RESERVED
        pair.sender.begin("t", "req", pair.receiver.address, src_ids, dst_ids, lease_s=20)
        if layerwise:
            for layer in reversed(range(TINY.num_layers)):
                pair.sender.send_layer("t", layer)
        else:
            pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.COMPLETE
        assert pair.receiver.poll("t") is TransferState.COMPLETE
        assert same_bytes(pair.dst[:, :, dst_ids], pair.src[:, :, src_ids])
        untouched = sorted(set(range(num_blocks + 17)) - set(dst_ids))
        assert not pair.dst[:, :, untouched].any()
        pair.sender.forget("t")
        pair.receiver.forget("t")
        with pytest.raises(UnknownTransfer):
            pair.receiver.poll("t")
    finally:
        pair.close()


def test_round_trip_with_runs_of_consecutive_ids(transport: str) -> None:
    """Allocator-style ids (runs of consecutive blocks, on both sides or one) with helper
    copy threads: the coalesced copies are bit-identical too."""
    pair = make_pair(transport, src_blocks=80, dst_blocks=80, chunk_bytes=1 << 12,
                     copy_threads=2)
    try:
        src_ids = [*range(10, 30), 5, 6, 50, *range(60, 75)]
        dst_ids = [*range(40, 60), 7, 3, 4, *range(61, 76)]
        pair.receiver.expect("t", "req", dst_ids, lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, src_ids, dst_ids, lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.COMPLETE
        assert pair.receiver.poll("t") is TransferState.COMPLETE
        assert same_bytes(pair.dst[:, :, dst_ids], pair.src[:, :, src_ids])
        untouched = sorted(set(range(80)) - set(dst_ids))
        assert not pair.dst[:, :, untouched].any()
    finally:
        pair.close()


def test_receiver_not_complete_until_every_layer_arrived(transport: str) -> None:
    pair = make_pair(transport)
    try:
        pair.receiver.expect("t", "req", [3, 4], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3, 4], lease_s=20)
        pair.sender.send_layer("t", 0)
        pair.sender.send_layer("t", 2)
        end = time.monotonic() + 10
        while pair.sender.poll("t") is TransferState.RESERVED and time.monotonic() < end:
            time.sleep(0.002)  # until the receiver granted the claim
        time.sleep(0.2)
        assert pair.receiver.poll("t") is TransferState.TRANSFERRING
        assert pair.sender.poll("t") is TransferState.TRANSFERRING
        pair.sender.send_layer("t", 1)
        assert wait_terminal(pair.sender.poll, "t") is TransferState.COMPLETE
        assert pair.receiver.poll("t") is TransferState.COMPLETE
    finally:
        pair.close()


def test_flipped_byte_fails_both_sides_and_admits_nothing(transport: str) -> None:
    pair = make_pair(transport, sender_faults=FaultConfig(corrupt_chunk=1), chunk_bytes=256)
    try:
        pair.receiver.expect("t", "req", [9, 5, 7], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2, 3], [9, 5, 7], lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert "checksum" in pair.sender.reason("t")
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.FAILED
        assert "checksum" in pair.receiver.reason("t")
        pair.sender.forget("t")  # both sides may now free their blocks
        pair.receiver.forget("t")
    finally:
        pair.close()


def test_compat_mismatch_refused_by_both_sides(transport: str) -> None:
    other = TINY.__class__(**{**TINY.__dict__, "model_id": "another-model"})
    pair = make_pair(transport, receiver_layout=other)
    try:
        pair.receiver.expect("t", "req", [3], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1], [3], lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert "compatibility hash mismatch" in pair.sender.reason("t")
        assert TINY.compat_hash in pair.sender.reason("t")
        assert other.compat_hash not in pair.sender.reason("t")  # the receiver reveals nothing
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.FAILED
        assert "compatibility hash mismatch" in pair.receiver.reason("t")
        assert not pair.dst.any()
    finally:
        pair.close()


def test_lost_chunk_fails_both_sides_within_their_leases(transport: str) -> None:
    pair = make_pair(transport, sender_faults=FaultConfig(drop_chunk=0), grace_s=0.2)
    try:
        start = time.monotonic()
        pair.receiver.expect("t", "req", [3, 4], lease_s=0.6)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3, 4], lease_s=0.8)
        pair.sender.send_all("t")
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.FAILED
        assert "lease expired" in pair.receiver.reason("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert time.monotonic() - start < 0.8 + 0.2 + 1.0
    finally:
        pair.close()


def test_dropped_ack_frees_sender_at_its_deadline(transport: str) -> None:
    """The data arrived and verified, so decode keeps it; prefill frees on its deadline."""
    pair = make_pair(transport, receiver_faults=FaultConfig(drop_acks=True))
    try:
        start = time.monotonic()
        pair.receiver.expect("t", "req", [3], lease_s=5)
        pair.sender.begin("t", "req", pair.receiver.address, [1], [3], lease_s=0.5)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert "no ack" in pair.sender.reason("t")
        assert 0.5 <= time.monotonic() - start < 1.5
        assert pair.receiver.poll("t") is TransferState.COMPLETE
        assert same_bytes(pair.dst[:, :, [3]], pair.src[:, :, [1]])
    finally:
        pair.close()


def test_receiver_cancel_stops_sender(transport: str) -> None:
    pair = make_pair(transport)
    try:
        pair.receiver.expect("t", "req", [3, 4], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3, 4], lease_s=20)
        pair.sender.send_layer("t", 0)
        end = time.monotonic() + 5
        while pair.receiver.poll("t") is TransferState.RESERVED and time.monotonic() < end:
            time.sleep(0.002)
        pair.receiver.cancel("t")
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.ABORTED
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert "cancelled" in pair.sender.reason("t")
        pair.sender.send_layer("t", 1)  # a late layer from the worker loop is harmless
    finally:
        pair.close()


def test_sender_cancel_fails_receiver(transport: str) -> None:
    pair = make_pair(transport)
    try:
        pair.receiver.expect("t", "req", [3, 4], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3, 4], lease_s=20)
        pair.sender.send_layer("t", 0)
        pair.sender.cancel("t")
        assert pair.sender.poll("t") is TransferState.ABORTED
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.FAILED
        assert "sender aborted" in pair.receiver.reason("t")
    finally:
        pair.close()


def test_claim_before_expect_waits_for_the_reservation(transport: str) -> None:
    pair = make_pair(transport)
    try:
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [5, 6], lease_s=20)
        pair.sender.send_all("t")
        time.sleep(0.2)
        assert not pair.dst.any()  # nothing written before the reservation exists
        assert pair.sender.poll("t") is TransferState.RESERVED
        pair.receiver.expect("t", "req", [5, 6], lease_s=20)
        assert wait_terminal(pair.sender.poll, "t") is TransferState.COMPLETE
        assert same_bytes(pair.dst[:, :, [5, 6]], pair.src[:, :, [1, 2]])
    finally:
        pair.close()


def test_a_claim_after_the_reservation_was_cancelled_and_forgotten_is_refused_at_once(transport: str) -> None:
    # The decode worker gave up on a transfer before its sender claimed it (a draft KV
    # transfer left behind by admission): the late claim fails the sender now, not at
    # its 20 s lease.
    pair = make_pair(transport)
    try:
        pair.receiver.expect("t", "req", [5, 6], lease_s=20)
        pair.receiver.cancel("t")
        assert pair.receiver.poll("t") is TransferState.ABORTED
        pair.receiver.forget("t")
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [5, 6], lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED  # held: RESERVED
        assert "cancelled" in pair.sender.reason("t")
        assert not pair.dst.any()
    finally:
        pair.close()


def test_claim_for_other_blocks_is_refused(transport: str) -> None:
    pair = make_pair(transport)
    try:
        pair.receiver.expect("t", "req", [5, 6], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [5, 7], lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert "differ" in pair.sender.reason("t")
        assert not pair.dst.any()
        # The sender told the receiver it gave up, so decode need not wait for the lease.
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.FAILED
        assert "sender aborted" in pair.receiver.reason("t")
    finally:
        pair.close()


def test_64_concurrent_transfers_over_one_connection(transport: str) -> None:
    pair = make_pair(transport, src_blocks=4 * 64 + 1, dst_blocks=4 * 64 + 1, chunk_bytes=512)
    try:
        rng = np.random.default_rng(7)
        src_all = _ids(rng, 4 * 64 + 1, 4 * 64)
        dst_all = _ids(rng, 4 * 64 + 1, 4 * 64)
        plans = {f"t{i}": (src_all[4 * i:4 * i + 4], dst_all[4 * i:4 * i + 4]) for i in range(64)}
        for tid, (src, dst) in plans.items():
            pair.receiver.expect(tid, "r" + tid, dst, lease_s=30)
            pair.sender.begin(tid, "r" + tid, pair.receiver.address, src, dst, lease_s=30)
        for layer in range(TINY.num_layers):  # interleave layers of all requests
            for tid in plans:
                pair.sender.send_layer(tid, layer)
        for tid, (src, dst) in plans.items():
            assert wait_terminal(pair.sender.poll, tid) is TransferState.COMPLETE
            assert pair.receiver.poll(tid) is TransferState.COMPLETE
            assert same_bytes(pair.dst[:, :, dst], pair.src[:, :, src])
    finally:
        pair.close()


def test_api_rejects_bad_arguments(transport: str) -> None:
    pair = make_pair(transport, src_blocks=8, dst_blocks=8)
    try:
        with pytest.raises(ValueError):
            pair.receiver.expect("t", "req", [0, 1], lease_s=5)  # null block
        with pytest.raises(ValueError):
            pair.receiver.expect("t", "req", [1, 1], lease_s=5)  # duplicate
        with pytest.raises(ValueError):
            pair.receiver.expect("t", "req", [8], lease_s=5)  # outside the pool
        pair.receiver.expect("t", "req", [1, 2], lease_s=5)
        with pytest.raises(ValueError):
            pair.receiver.expect("u", "req", [2, 3], lease_s=5)  # block 2 already reserved
        with pytest.raises(ValueError):
            pair.receiver.forget("t")  # still live
        with pytest.raises(ValueError):
            pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3], lease_s=5)
        with pytest.raises(UnknownTransfer):
            pair.sender.send_layer("nope", 0)
    finally:
        pair.close()


def test_send_layer_returns_at_once_even_when_the_link_is_slow(transport: str) -> None:
    """The prefill loop hands layers off; the I/O thread does the slow part."""
    pair = make_pair(transport, sender_faults=FaultConfig(delay_s=0.3), chunk_bytes=64)
    try:
        pair.receiver.expect("t", "req", [3, 4], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3, 4], lease_s=20)
        start = time.perf_counter()
        for layer in range(TINY.num_layers):
            pair.sender.send_layer("t", layer)
            pair.sender.poll("t")
        assert time.perf_counter() - start < 0.25
        pair.sender.cancel("t")
        assert pair.sender.poll("t") is TransferState.ABORTED
    finally:
        pair.close()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 512), st.integers(0, 2**32 - 1), st.booleans())
def test_round_trip_property_on_the_fake(num_blocks: int, seed: int, layerwise: bool) -> None:
    """Any block count in 1..512, any permutation of ids: bit-identical (fake transport)."""
    pair = make_pair("fake", src_blocks=513, dst_blocks=513, chunk_bytes=1 << 12, seed=seed)
    try:
        rng = np.random.default_rng(seed)
        src_ids, dst_ids = _ids(rng, 513, num_blocks), _ids(rng, 513, num_blocks)
        pair.receiver.expect("t", "req", dst_ids, lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, src_ids, dst_ids, lease_s=20)
        for layer in range(TINY.num_layers) if layerwise else ():
            pair.sender.send_layer("t", layer)
        if not layerwise:
            pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.COMPLETE
        assert pair.receiver.poll("t") is TransferState.COMPLETE
        assert same_bytes(pair.dst[:, :, dst_ids], pair.src[:, :, src_ids])
    finally:
        pair.close()


def test_shm_chunks_stay_within_the_receivers_frame_limit() -> None:
    """A sender configured for larger shared-memory chunks than the receiver accepts
    splits them to the receiver's limit (it learns it in the handshake) instead of
    having every chunk rejected."""
    from kv_transfer.links import ZmqLinkFactory
    from kv_transfer.pool.shm import create_shm_pool
    from kv_transfer.receiver.receiver import ZmqReceiver
    from kv_transfer.sender.sender import Sender
    from tests.kv_transfer.harness import random_pool

    src = random_pool(TINY, 80, seed=5)
    limit = 4 * TINY.block_bytes_per_layer * TINY.num_layers
    with create_shm_pool(TINY, 90) as shm, \
            ZmqReceiver(TINY, shm, transport="shm", max_frame_bytes=limit) as receiver, \
            Sender(TINY, src, links=ZmqLinkFactory(), shm_chunk_bytes=64 * limit) as sender:
        rng = np.random.default_rng(5)
        src_ids, dst_ids = _ids(rng, 80, 70), _ids(rng, 90, 70)
        receiver.expect("t", "req", dst_ids, lease_s=20)
        sender.begin("t", "req", receiver.address, src_ids, dst_ids, lease_s=20)
        sender.send_all("t")
        assert wait_terminal(sender.poll, "t") is TransferState.COMPLETE, sender.reason("t")
        assert receiver.poll("t") is TransferState.COMPLETE
        assert same_bytes(shm.array[:, :, dst_ids], src[:, :, src_ids])
        assert receiver.stats().rejected == 0
