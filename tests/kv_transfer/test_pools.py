"""Shared-memory pools, the torch adapter, checksums, faults and interface parity."""

from __future__ import annotations

import inspect
import multiprocessing

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer import FakeReceiver, ZmqReceiver, make_receiver, make_sender
from kv_transfer.api import KVReceiver, KVSender, TransferState
from kv_transfer.checksum import block_row_sums, frame_checksum, pool_words, row_sums
from kv_transfer.faults import FaultConfig
from kv_transfer.pool.blocks import frame_rows, gather, plan_chunks
from kv_transfer.pool.shm import ShmPool, attach_shm_pool, create_shm_pool
from kv_transfer.pool.tensor_adapter import pool_array, shm_pool_tensor, tensor_from_array
from kv_transfer.sender.sender import Sender
from kv_transfer.wire import ShmDescriptor
from pdserve.common.kv_layout import KVLayout
from tests.kv_transfer.harness import TINY, random_pool, same_bytes, wait_terminal


def _child_writes(descriptor: ShmDescriptor) -> None:
    pool = attach_shm_pool(TINY, descriptor)
    pool.array[1, 1, 3] = 7.0
    pool.close()


def test_shm_pool_is_shared_across_processes_and_unlinked_by_its_owner() -> None:
    pool = create_shm_pool(TINY, 8)
    try:
        assert pool.array.shape == TINY.pool_shape(8) and not pool.array.any()
        assert str(multiprocessing.current_process().pid) in pool.descriptor.name
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=_child_writes, args=(pool.descriptor,))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert (pool.array[1, 1, 3] == 7.0).all()
        assert pool.array.sum() == 7.0 * TINY.block_elems_per_layer_kv
    finally:
        pool.close()
        pool.unlink()
    with pytest.raises(OSError):
        attach_shm_pool(TINY, pool.descriptor)


def test_shm_descriptor_must_match_the_layout() -> None:
    with create_shm_pool(TINY, 4) as pool:
        other = KVLayout("x", 3, 2, 4, 4, "float16")
        with pytest.raises(ValueError):
            attach_shm_pool(other, pool.descriptor)
        with pytest.raises(ValueError):
            attach_shm_pool(TINY, ShmDescriptor("../etc/passwd", pool.descriptor.shape,
                                                "float16"))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tensor_adapter_shares_memory(dtype: str) -> None:
    layout = KVLayout("m", 2, 1, 4, 2, dtype)
    tensor = torch.zeros(layout.pool_shape(3), dtype=getattr(torch, dtype))
    array = pool_array(tensor)
    tensor[1, 0, 2, 1, 0, 3] = 1.5
    assert array.reshape(-1).view(np.uint8).any()
    back = tensor_from_array(array, dtype)
    assert back.dtype == tensor.dtype and back.data_ptr() == tensor.data_ptr()
    with create_shm_pool(layout, 3) as pool:
        view = shm_pool_tensor(pool, layout)
        view[0, 1, 1] = 2.0
        assert pool.array.reshape(-1).view(np.uint8).any()


def test_engine_style_transfer_from_torch_pool_into_shm_torch_pool() -> None:
    layout = KVLayout("m", 2, 2, 4, 2, "bfloat16")
    src = torch.randn(layout.pool_shape(6)).to(torch.bfloat16)
    with create_shm_pool(layout, 6) as shm:
        dst = shm_pool_tensor(shm, layout)
        receiver = make_receiver(layout, shm, "shm")
        sender = make_sender(layout, pool_array(src))
        try:
            receiver.expect("t", "r", [5, 2], lease_s=10)
            sender.begin("t", "r", receiver.address, [1, 4], [5, 2], lease_s=10)
            sender.send_all("t")
            assert wait_terminal(sender.poll, "t") is TransferState.COMPLETE
            assert torch.equal(dst[:, :, [5, 2]], src[:, :, [1, 4]])
        finally:
            sender.close()
            receiver.close()


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.data())
def test_checksum_detects_any_flipped_byte_and_swapped_blocks(seed: int,
                                                             data: st.DataObject) -> None:
    pool = random_pool(TINY, 6, seed)
    ids = [4, 1, 3]
    frame = gather(pool, 0, 3, ids)
    rows = frame_rows(3, len(ids))
    base = frame_checksum(frame, rows)
    assert base == frame_checksum(gather(pool, 0, 3, ids), rows)
    np.testing.assert_array_equal(block_row_sums(pool_words(pool), 0, 3, ids),
                                  row_sums(frame, rows).reshape(3, 2, 3))
    flipped = frame.copy()
    raw = flipped.reshape(-1).view(np.uint8)
    pos = data.draw(st.integers(0, raw.size - 1))
    raw[pos] ^= data.draw(st.integers(1, 255))
    assert frame_checksum(flipped, rows) != base
    swapped = gather(pool, 0, 3, [1, 4, 3])
    if not same_bytes(swapped, frame):
        assert frame_checksum(swapped, rows) != base


def test_chunk_plan_covers_every_layer_and_block_once() -> None:
    for max_bytes in (1, 100, TINY.block_bytes_per_layer * 5, 1 << 20):
        cover = np.zeros((TINY.num_layers, 13), int)
        spans = plan_chunks(TINY, 13, 0, TINY.num_layers, max_bytes)
        for span in spans:
            cover[span.layer_start:span.layer_end, span.first:span.last] += 1
            nbytes = (span.layer_end - span.layer_start) * (span.last - span.first) \
                * TINY.block_bytes_per_layer
            assert nbytes <= max_bytes or span.last - span.first == 1
        assert (cover == 1).all()
        sizes = {s.last - s.first for s in spans}
        assert max(sizes) - min(sizes) <= 1  # blocks shared evenly: no small leftover chunk


def test_fault_config_parses_env_and_rejects_unknown_keys() -> None:
    env = {"PDSERVE_KV_FAULTS": "corrupt_chunk=2, delay_s=0.5,drop_acks=1"}
    assert FaultConfig.from_env(env) == FaultConfig(corrupt_chunk=2, delay_s=0.5,
                                                     drop_acks=True)
    assert FaultConfig.from_env({}) == FaultConfig() and not FaultConfig().active
    with pytest.raises(ValueError, match="unknown fault"):
        FaultConfig.parse("explode=1")


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls)
            if not name.startswith("_") and callable(fn)}


@pytest.mark.parametrize("impl,proto", [(FakeReceiver, KVReceiver), (ZmqReceiver, KVReceiver),
                                        (Sender, KVSender)])
def test_implementations_match_the_interface(impl: type, proto: type) -> None:
    """The fake and the real classes expose exactly the protocol's signatures."""
    want = _public(proto)
    have = _public(impl)
    for name, sig in want.items():
        assert name in have, f"{impl.__name__} lacks {name}"
        assert list(have[name].parameters) == list(sig.parameters), name
    if proto is KVReceiver:
        assert isinstance(inspect.getattr_static(impl, "address"), property)
    assert set(_public(FakeReceiver)) == set(_public(ZmqReceiver))


def test_shm_pool_type_is_exported() -> None:
    assert ShmPool.__module__ == "kv_transfer.pool.shm"


@pytest.mark.parametrize("fused_bytes", [1, 256 << 10])
def test_fused_copy_and_checksum_match_the_plain_ones(monkeypatch: pytest.MonkeyPatch,
                                                      fused_bytes: int) -> None:
    from kv_transfer.pool import blocks

    monkeypatch.setattr(blocks, "FUSED_BYTES", fused_bytes)  # 1: one layer at a time
    src = random_pool(TINY, 9, seed=4)
    ids, dst_ids = [7, 2, 5], [1, 8, 3]
    want = row_sums(gather(src, 1, 3, ids), frame_rows(2, 3)).reshape(2, 2, 3)
    frame, sums = blocks.gather_with_sums(src, 1, 3, ids)
    np.testing.assert_array_equal(sums, want)
    dst = np.zeros_like(src)
    np.testing.assert_array_equal(blocks.scatter_with_sums(dst, 1, 3, dst_ids, frame), want)
    assert same_bytes(dst[1:3, :, dst_ids], src[1:3, :, ids])
    dst2 = np.zeros_like(src)
    got = blocks.copy_blocks_with_sums(src, dst2, pool_words(src), 1, 3, ids, dst_ids)
    np.testing.assert_array_equal(got, want)
    assert same_bytes(dst2, dst)


def test_block_runs_coalesce_ids_that_step_together() -> None:
    from pdserve.common.block_runs import Run, block_runs

    assert block_runs([5, 6, 7, 2, 3, 9]) == [Run(0, 3, 5, 0), Run(3, 2, 2, 3), Run(5, 1, 9, 5)]
    # with destination ids, a run needs both sides to step by one
    assert block_runs([5, 6, 7, 8], [1, 2, 4, 5]) == [Run(0, 2, 5, 1), Run(2, 2, 7, 4)]
    assert block_runs([3], [8]) == [Run(0, 1, 3, 8)]
    assert block_runs([]) == []


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("fused_bytes", [1, 100, 256 << 10])
def test_runs_tiles_and_threads_match_a_per_block_copy(monkeypatch: pytest.MonkeyPatch,
                                                       fused_bytes: int, threads: int,
                                                       native: bool) -> None:
    """Consecutive runs, split tiles and helper threads give the per-block reference result,
    with the native copy kernel and with the numpy fallback."""
    from kv_transfer.pool import blocks, hostcopy

    monkeypatch.setattr(blocks, "FUSED_BYTES", fused_bytes)
    if native:
        assert hostcopy.NATIVE is not None, "native kernel not built (pip install -e .)"
    else:
        monkeypatch.setattr(hostcopy, "NATIVE", None)
    layout = KVLayout("m", 5, 2, 4, 2, "float16")
    src = random_pool(layout, 40, seed=11)
    ids = [3, 4, 5, 6, 20, 9, 10, 11, 30, 31, 1]
    dst_ids = [7, 8, 9, 10, 2, 25, 26, 3, 4, 5, 39]
    rows = frame_rows(4, len(ids))
    ref = np.stack([src[1:5, :, b] for b in ids], axis=2)  # the frame, one block at a time
    want = row_sums(ref, rows).reshape(4, 2, len(ids))
    workers = blocks.CopyThreads(threads)
    try:
        frame, sums = blocks.gather_with_sums(src, 1, 5, ids, workers=workers)
        assert same_bytes(frame, ref)
        np.testing.assert_array_equal(sums, want)
        np.testing.assert_array_equal(block_row_sums(pool_words(src), 1, 5, ids), want)
        dst = np.zeros_like(src)
        got = blocks.scatter_with_sums(dst, 1, 5, dst_ids, frame, workers=workers)
        np.testing.assert_array_equal(got, want)
        dst2 = np.zeros_like(src)
        got = blocks.copy_blocks_with_sums(src, dst2, pool_words(src), 1, 5, ids, dst_ids,
                                          workers=workers)
        np.testing.assert_array_equal(got, want)
        for d in (dst, dst2):
            assert same_bytes(d[1:5, :, dst_ids], src[1:5, :, ids])
            untouched = sorted(set(range(40)) - set(dst_ids))
            assert not d[:, :, untouched].any() and not d[[0]].any()
        plain = np.zeros_like(src)
        blocks.copy_blocks(src, plain, 1, 5, ids, dst_ids)
        assert same_bytes(plain, dst2)
        plain[...] = 0
        blocks.scatter(plain, 1, 5, dst_ids, blocks.gather(src, 1, 5, ids))
        assert same_bytes(plain, dst2)
    finally:
        workers.close()
