"""Builds sender/receiver pairs for every CPU transport, for the conformance suite."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kv_transfer.api import TransferState
from kv_transfer.fake import FakeFabric, FakeReceiver, fake_sender
from kv_transfer.faults import FaultConfig
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.pool.blocks import numpy_dtype
from kv_transfer.pool.shm import ShmPool, create_shm_pool
from kv_transfer.receiver.receiver import ZmqReceiver
from kv_transfer.sender.sender import Sender
from pdserve.common.kv_layout import KVLayout
from pdserve.common.parallel_layout import ParallelLayout

CPU_TRANSPORTS = ["fake", "tcp", "ipc", "shm"]
TINY = KVLayout("tiny-model", num_layers=3, num_kv_heads=2, head_dim=4, block_size=2,
                dtype="float16")


def random_pool(layout: KVLayout, num_blocks: int, seed: int) -> np.ndarray:
    """A pool of random bit patterns (compared bytewise, so NaN patterns are fine)."""
    rng = np.random.default_rng(seed)
    dtype = numpy_dtype(layout)
    raw = rng.integers(0, 256, int(np.prod(layout.pool_shape(num_blocks))) * dtype.itemsize,
                       dtype=np.uint8)
    return raw.view(dtype).reshape(layout.pool_shape(num_blocks))


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.tobytes() == b.tobytes()


@dataclass
class Pair:
    transport: str
    sender: Sender
    receiver: ZmqReceiver | FakeReceiver
    src: np.ndarray
    dst: np.ndarray
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for fn in reversed(self.closers):
            fn()


def make_pair(transport: str, *, src_blocks: int = 64, dst_blocks: int = 64,
              layout: KVLayout = TINY, receiver_layout: KVLayout | None = None,
              sender_faults: FaultConfig = FaultConfig(),
              receiver_faults: FaultConfig = FaultConfig(), grace_s: float = 0.3,
              chunk_bytes: int = 1 << 20, seed: int = 0, copy_threads: int = 1,
              sender_parallel: ParallelLayout | None = None,
              receiver_parallel: ParallelLayout | None = None) -> Pair:
    rlayout = receiver_layout or layout
    src = random_pool(layout, src_blocks, seed)
    shm: ShmPool | None = None
    receiver: ZmqReceiver | FakeReceiver
    if transport == "fake":
        fabric = FakeFabric()
        dst = np.zeros(rlayout.pool_shape(dst_blocks), numpy_dtype(rlayout))
        receiver = FakeReceiver(rlayout, dst, fabric, faults=receiver_faults, grace_s=grace_s,
                                parallel=receiver_parallel)
        sender = fake_sender(layout, src, fabric, faults=sender_faults, chunk_bytes=chunk_bytes,
                             shm_chunk_bytes=chunk_bytes, copy_threads=copy_threads, parallel=sender_parallel)
    else:
        if transport == "shm":
            shm = create_shm_pool(rlayout, dst_blocks)
            dst = shm.array
            receiver = ZmqReceiver(rlayout, shm, transport="shm", faults=receiver_faults,
                                   grace_s=grace_s, copy_threads=copy_threads, parallel=receiver_parallel)
        else:
            dst = np.zeros(rlayout.pool_shape(dst_blocks), numpy_dtype(rlayout))
            receiver = ZmqReceiver(rlayout, dst, transport=transport, faults=receiver_faults,
                                   grace_s=grace_s, copy_threads=copy_threads, parallel=receiver_parallel)
        sender = Sender(layout, src, links=ZmqLinkFactory(), faults=sender_faults,
                        chunk_bytes=chunk_bytes, shm_chunk_bytes=chunk_bytes,
                        copy_threads=copy_threads, parallel=sender_parallel)
    pair = Pair(transport, sender, receiver, src, dst)
    pair.closers.append(receiver.close)
    if shm is not None:
        pair.closers.append(shm.unlink)
    pair.closers.append(sender.close)
    return pair


def wait_terminal(poll: Callable[[str], TransferState], tid: str,
                  timeout: float = 10.0) -> TransferState:
    """Poll like a worker loop would, until the transfer reaches a terminal state."""
    end = time.monotonic() + timeout
    while True:
        state = poll(tid)
        if state.terminal or time.monotonic() > end:
            return state
        time.sleep(0.002)


def wait_state(poll: Callable[[str], TransferState], tid: str, state: TransferState,
               timeout: float = 5.0) -> None:
    """Poll until the transfer is in `state`; fail the test after `timeout` seconds."""
    end = time.monotonic() + timeout
    while poll(tid) is not state:
        assert time.monotonic() < end, f"{tid} never reached {state.name}"
        time.sleep(0.002)
