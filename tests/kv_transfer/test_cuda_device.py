"""Device handling of the CUDA path: the device a peer handle is opened on (a pure
function, on CPU), and on a GPU the staging path between device pools over tcp, on
the pool's own device and copy stream whatever device is current."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer.api import TransferState
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.pool.blocks import frame_nbytes
from kv_transfer.pool.cuda_ipc import cuda_available, owner_device
from kv_transfer.receiver.receiver import ZmqReceiver
from kv_transfer.sender.sender import Sender
from kv_transfer.wire import ShmDescriptor
from tests.kv_transfer.harness import TINY, random_pool, wait_terminal

SRC, DST = [3, 16, 1, 7], [9, 2, 14, 5]


def _descriptor(name: str) -> ShmDescriptor:
    return ShmDescriptor(name, TINY.pool_shape(20), "float16")


def test_a_peer_handle_opens_on_its_owners_device() -> None:
    assert owner_device(_descriptor("cudaipc:3:00ff")) == 3
    assert owner_device(_descriptor("cudaipc:0:00ff")) == 0
    assert owner_device(_descriptor("cudaipc:3:00ff"), device=1) == 1  # explicit override


@pytest.mark.parametrize("name", ["cudaipc:x:00ff", "cudaipc:3", "cudaipc:3:", "pdkv_1_ab"])
def test_malformed_descriptors_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="CUDA IPC descriptor"):
        owner_device(_descriptor(name))


def _device_count() -> int:
    if not cuda_available():
        return 0
    import cupy as cp

    return int(cp.cuda.runtime.getDeviceCount())


def _staged_round_trip(src_device: int, dst_device: int) -> None:
    import cupy as cp

    host = random_pool(TINY, 20, seed=9)
    with cp.cuda.Device(src_device):
        src = cp.asarray(host)
    with cp.cuda.Device(dst_device):
        dst = cp.zeros_like(cp.asarray(host))
    with cp.cuda.Device(0), ZmqReceiver(TINY, dst, transport="tcp") as receiver, \
            Sender(TINY, src, links=ZmqLinkFactory()) as sender:
        receiver.expect("t", "r", DST, lease_s=20)
        sender.begin("t", "r", receiver.address, SRC, DST, lease_s=20)
        for layer in range(TINY.num_layers):
            sender.send_layer("t", layer)
        assert wait_terminal(sender.poll, "t") is TransferState.COMPLETE, sender.reason("t")
        moved = frame_nbytes(TINY, TINY.num_layers, len(SRC))
        assert sender.staged_bytes == moved and receiver.stats().staged_bytes == moved
    got = cp.asnumpy(dst)
    assert np.array_equal(got[:, :, DST].view(np.uint8), host[:, :, SRC].view(np.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(_device_count() < 1, reason="needs cupy and a CUDA device")
def test_device_pools_ship_over_tcp_through_pinned_staging() -> None:
    _staged_round_trip(0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(_device_count() < 2, reason="needs cupy and two CUDA devices")
def test_a_pool_on_the_second_device_copies_on_that_device() -> None:
    _staged_round_trip(1, 1)
    _staged_round_trip(1, 0)
