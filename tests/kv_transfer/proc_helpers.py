"""Entry points of the worker processes that the kill tests start (spawn context)."""

from __future__ import annotations

import time
from multiprocessing.queues import Queue

import numpy as np

from kv_transfer.faults import FaultConfig
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.pool.shm import create_shm_pool
from kv_transfer.receiver.receiver import ZmqReceiver
from kv_transfer.sender.sender import Sender
from tests.kv_transfer.harness import TINY, random_pool

NUM_BLOCKS = 16
CHUNK_BYTES = TINY.block_bytes_per_layer  # one block of one layer per chunk: many chunks
SLOW = FaultConfig(delay_s=0.05)


def slow_sender(address: str, events: Queue) -> None:
    """Send every block slowly (about 2.4 s in all), then linger until killed."""
    with Sender(TINY, random_pool(TINY, NUM_BLOCKS + 1, seed=3), links=ZmqLinkFactory(),
                faults=SLOW, chunk_bytes=CHUNK_BYTES, shm_chunk_bytes=CHUNK_BYTES) as sender:
        ids = list(range(1, NUM_BLOCKS + 1))
        sender.begin("t", "r", address, ids, ids, lease_s=60)
        sender.send_all("t")
        events.put("sending")
        time.sleep(60)


def idle_receiver(transport: str, events: Queue) -> None:
    """Reserve blocks 1..16 with a long lease, publish the address, then wait to be killed."""
    shm = create_shm_pool(TINY, NUM_BLOCKS + 1) if transport == "shm" else None
    pool = shm if shm is not None else np.zeros(TINY.pool_shape(NUM_BLOCKS + 1), np.float16)
    with ZmqReceiver(TINY, pool, transport=transport) as receiver:
        receiver.expect("t", "r", list(range(1, NUM_BLOCKS + 1)), lease_s=60)
        events.put(receiver.address)
        time.sleep(60)


def cuda_receiver(events: Queue, results: Queue, dst_ids: list[int], lease_s: float) -> None:
    """Decode worker with a CUDA IPC pool: report the final state and the received blocks."""
    from kv_transfer.pool.cuda_ipc import create_cuda_pool

    pool = create_cuda_pool(TINY, NUM_BLOCKS + 1)
    with ZmqReceiver(TINY, pool, transport="cuda") as receiver:
        receiver.expect("t", "r", dst_ids, lease_s=lease_s)
        events.put(receiver.address)
        end = time.monotonic() + lease_s + 5
        while not receiver.poll("t").terminal and time.monotonic() < end:
            time.sleep(0.005)
        state = receiver.poll("t")
        results.put((state.name, receiver.reason("t"),
                     pool.array[:, :, dst_ids].get().tobytes()))
    pool.close()
