"""CUDA IPC transport: device-to-device block copies between processes (skips without a GPU)."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from kv_transfer.api import TransferState
from kv_transfer.faults import FaultConfig
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.pool.cuda_ipc import cuda_available
from kv_transfer.sender.sender import Sender
from tests.kv_transfer import proc_helpers
from tests.kv_transfer.harness import TINY, random_pool, wait_terminal

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not cuda_available(), reason="needs cupy and a CUDA device")]


def _transfer(faults: FaultConfig) -> tuple[str, str, bytes, np.ndarray, Sender]:
    import cupy as cp

    ctx = multiprocessing.get_context("spawn")
    events, results = ctx.Queue(), ctx.Queue()
    dst_ids = [9, 2, 14, 5]
    child = ctx.Process(target=proc_helpers.cuda_receiver, args=(events, results, dst_ids, 20.0))
    child.start()
    host_src = random_pool(TINY, proc_helpers.NUM_BLOCKS + 1, seed=11)
    sender = Sender(TINY, cp.asarray(host_src), links=ZmqLinkFactory(), faults=faults)
    try:
        address = events.get(timeout=60)
        assert address.startswith("cuda+ipc://")
        src_ids = [3, 16, 1, 7]
        sender.begin("t", "r", address, src_ids, dst_ids, lease_s=20)
        for layer in range(TINY.num_layers):
            sender.send_layer("t", layer)
        state, reason, got = results.get(timeout=60)
        child.join(30)
        assert wait_terminal(sender.poll, "t") is not None
        return state, reason, got, host_src[:, :, src_ids], sender
    finally:
        if child.is_alive():
            child.kill()


def test_cuda_ipc_round_trip_is_bit_identical() -> None:
    state, _, got, want, sender = _transfer(FaultConfig())
    try:
        assert state == "COMPLETE"
        assert sender.poll("t") is TransferState.COMPLETE
        assert got == want.tobytes()
    finally:
        sender.close()


def test_cuda_ipc_flipped_byte_fails() -> None:
    state, reason, _, _, sender = _transfer(FaultConfig(corrupt_chunk=1))
    try:
        assert state == "FAILED" and "checksum" in reason
        assert sender.poll("t") is TransferState.FAILED
    finally:
        sender.close()
