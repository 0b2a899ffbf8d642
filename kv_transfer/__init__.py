"""KV handoff from prefill to decode workers.

Worker-facing surface (see api.py for the state machine and docs/internals.md):

    receiver = make_receiver(layout, pool, "shm")      # decode side; pool from create_shm_pool
    receiver.expect(transfer_id, request_id, dst_block_ids, lease_s)
    receiver.poll(transfer_id) -> TransferState        # admit only on COMPLETE

    sender = make_sender(layout, pool_array)           # prefill side, one per worker
    sender.begin(transfer_id, request_id, receiver_address, src_ids, dst_ids, lease_s)
    sender.send_layer(transfer_id, layer)              # or send_all(transfer_id)
    sender.poll(transfer_id) -> TransferState          # free source blocks on a terminal state

torch stays in `kv_transfer.pool.tensor_adapter` (not imported here); cupy only in
`kv_transfer.pool.cuda_ipc`, imported lazily.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kv_transfer.api import TERMINAL_STATES, KVReceiver, KVSender, TransferState, UnknownTransfer
from kv_transfer.auth import CurveKeys
from kv_transfer.fake import FakeFabric, FakeReceiver, fake_sender
from kv_transfer.faults import FaultConfig
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.pool.shm import ShmPool, attach_shm_pool, create_shm_pool
from kv_transfer.pool.staging import HiddenHostPool
from kv_transfer.receiver.receiver import ZmqReceiver
from kv_transfer.sender.sender import Sender
from pdserve.common.kv_layout import KVLayout

__all__ = [
    "TERMINAL_STATES", "FakeFabric", "FakeReceiver", "FaultConfig", "HiddenHostPool", "KVReceiver",
    "KVSender",
    "Sender", "ShmPool", "TransferState", "UnknownTransfer", "ZmqReceiver", "attach_shm_pool",
    "create_shm_pool", "fake_sender", "make_receiver", "make_sender",
]


def make_receiver(layout: KVLayout, pool: Any, transport: str, *,
                  fabric: FakeFabric | None = None, **options: Any) -> ZmqReceiver | FakeReceiver:
    """A receiver for `transport`: "tcp", "ipc", "shm" (pool: ShmPool), "cuda" (pool:
    cuda_ipc.CudaPool), "shm"/"cuda" + "+tcp"/"+ipc" for the control socket, or "fake"
    (needs `fabric`). Its `address` tells senders the way."""
    if transport == "fake":
        if fabric is None:
            raise ValueError("the fake transport needs a FakeFabric")
        return FakeReceiver(layout, pool, fabric, **options)
    return ZmqReceiver(layout, pool, transport=transport, **options)


def make_sender(layout: KVLayout, pool: Any, *, fabric: FakeFabric | None = None,
                curve: CurveKeys | None = None, **options: Any) -> Sender:
    """A sender; each transfer's peer address picks the transport (tcp://, ipc://,
    shm+ipc://, cuda+ipc://...; fake:// when built with a `fabric`). `curve`: this
    worker's keys, for receivers that serve CURVE (kv_transfer/auth.py)."""
    if fabric is not None:
        return fake_sender(layout, pool, fabric, **options)
    if isinstance(pool, (np.ndarray, HiddenHostPool)) or hasattr(pool, "__cuda_array_interface__"):
        return Sender(layout, pool, links=ZmqLinkFactory(curve), **options)
    raise TypeError("pool must be a numpy array or a device array (see tensor_adapter)")
