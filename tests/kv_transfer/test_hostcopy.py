"""The native copy kernel (kv_transfer/pool/_hostcopy.c) against numpy, and its guard rails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.pool import hostcopy
from kv_transfer.pool.copy_threads import CopyThreads
from kv_transfer.pool.ops import HostPoolOps
from kv_transfer.pool.shm import create_shm_pool
from pdserve.common.kv_layout import KVLayout


@pytest.fixture(scope="module")
def native() -> hostcopy.NativeCopy:
    # `make install` / `pip install -e .` builds it; a missing build is a failure, not a skip:
    # without it shared-memory transfers silently run at numpy speed.
    assert hostcopy.NATIVE is not None, "kv_transfer/pool/_hostcopy.c was not built (pip install -e .)"
    assert hostcopy.NATIVE.kernel in ("avx2", "sse2", "c")
    return hostcopy.NATIVE


def _word_sums(rows: np.ndarray) -> np.ndarray:
    return np.add.reduce(rows.view(np.uint64), axis=-1, dtype=np.uint64)


@settings(max_examples=60, deadline=None)
@given(words=st.sampled_from([1, 2, 3, 15, 16, 17, 31, 64, 513, 4096]),
       nrows=st.integers(1, 12), shift=st.sampled_from([0, 8, 16, 24, 40]),
       stream=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_copy_rows_equals_numpy(native: hostcopy.NativeCopy, words: int, nrows: int,
                                shift: int, stream: bool, seed: int) -> None:
    """Any row length (in words), any 8-byte alignment of the destination, both store kinds,
    full and partial groups of rows: the bytes land exactly, nothing else is written, and
    the sums equal numpy's word sums."""
    _check_copy_rows(native, words, nrows, shift, stream, seed)


def _check_copy_rows(lib: hostcopy.NativeCopy, words: int, nrows: int, shift: int,
                     stream: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    row = 8 * words
    src = rng.integers(0, 256, (nrows + 3) * row, dtype=np.uint8)
    dst_buf = np.zeros((nrows + 3) * row + shift, np.uint8)
    dst = dst_buf[shift:]
    src_rows = rng.permutation(nrows + 3)[:nrows]
    dst_rows = rng.permutation(nrows + 3)[:nrows]
    src_off = (src_rows * row).astype(np.int64)
    dst_off = (dst_rows * row).astype(np.int64)
    sums = lib.copy_rows(src, dst, src_off, dst_off, row, stream=stream)
    want = np.zeros_like(dst)
    for s, d in zip(src_rows, dst_rows, strict=True):
        want[d * row:(d + 1) * row] = src[s * row:(s + 1) * row]
    assert np.array_equal(dst, want) and not dst_buf[:shift].any()
    expect = _word_sums(src.reshape(-1, row)[src_rows].copy())
    np.testing.assert_array_equal(sums, expect)
    np.testing.assert_array_equal(lib.sum_rows(dst, dst_off, row), expect)


@pytest.mark.parametrize(("define", "kernel"), [("-DPD_NO_AVX2", "sse2"), ("-DPD_PORTABLE", "c")])
def test_the_other_loops_equal_numpy_too(tmp_path: Path, define: str, kernel: str) -> None:
    """The SSE2 loop (x86-64 without AVX2) and the portable C one (every other CPU, e.g.
    ARM servers) never run on this machine's AVX2 build: compile each and check it."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler: the native kernel could not have been built either"
    lib = tmp_path / "hostcopy_variant.so"
    subprocess.run([cc, "-O3", "-shared", "-fPIC", define, "-o", str(lib),
                    str(Path(hostcopy.__file__).with_name("_hostcopy.c"))], check=True)
    variant = hostcopy.NativeCopy(str(lib))
    assert variant.kernel == kernel
    for words in (1, 3, 8, 17, 513):
        for nrows in (1, 4, 7):
            for shift, stream in ((0, True), (8, True), (16, False)):
                _check_copy_rows(variant, words, nrows, shift, stream, seed=words * nrows)


def test_sums_wrap_modulo_2_64(native: hostcopy.NativeCopy) -> None:
    rows = np.full((3, 64), np.iinfo(np.uint64).max, np.uint64).view(np.uint8)
    off = np.arange(3, dtype=np.int64) * 512
    got = native.sum_rows(rows, off, 512)
    np.testing.assert_array_equal(got, _word_sums(rows.reshape(3, 512)))
    assert int(got[0]) == (64 * (2**64 - 1)) % 2**64


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_thread_shares_give_the_same_result(native: hostcopy.NativeCopy, threads: int) -> None:
    rng = np.random.default_rng(threads)
    row, n = 256, 37
    src = rng.integers(0, 256, n * row, dtype=np.uint8)
    dst = np.zeros_like(src)
    off = (rng.permutation(n) * row).astype(np.int64)
    workers = CopyThreads(threads)
    try:
        sums = native.copy_rows(src, dst, off, off[::-1].copy(), row, stream=True,
                                workers=workers)
        again = native.sum_rows(dst, off[::-1].copy(), row, workers=workers)
    finally:
        workers.close()
    np.testing.assert_array_equal(sums, _word_sums(src.reshape(n, row)[off // row]))
    np.testing.assert_array_equal(again, sums)


def test_offsets_and_shapes_are_checked_before_any_memory_is_touched(
        native: hostcopy.NativeCopy) -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    ok = np.array([0, 32], np.int64)
    bad = [
        (dict(src_off=np.array([0, 40], np.int64)), "outside"),   # 40 + 32 > 64
        (dict(dst_off=np.array([-8, 0], np.int64)), "outside"),
        (dict(src_off=np.array([0, 32], np.int32)), "int64"),
        (dict(row_bytes=12), "words"),
        (dict(row_bytes=0), "words"),
        (dict(dst=np.zeros(64, np.uint8)[::2]), "contiguous"),
    ]
    for change, message in bad:
        args = dict(src=src, dst=dst, src_off=ok, dst_off=ok, row_bytes=32)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            native.copy_rows(args["src"], args["dst"], args["src_off"], args["dst_off"],
                             args["row_bytes"], stream=False)
    frozen = np.zeros(64, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        native.copy_rows(src, frozen, ok, ok, 32, stream=False)
    with pytest.raises(ValueError, match="outside"):
        native.sum_rows(src, np.array([48], np.int64), 32)
    assert not dst.any()


def test_pool_row_offsets_address_the_rows_numpy_indexes() -> None:
    layout = KVLayout("m", 3, 2, 8, 4, "float16")
    pool = np.random.default_rng(0).standard_normal(layout.pool_shape(9)).astype(np.float16)
    ids = [5, 2, 8]
    off = hostcopy.pool_row_offsets(pool, 1, 3, ids)
    row = pool[0, 0, 0].nbytes
    flat = pool.reshape(-1).view(np.uint8)
    got = np.stack([flat[o:o + row] for o in off]).reshape(2, 2, 3, row)
    want = pool[1:3][:, :, ids].reshape(2, 2, 3, -1).view(np.uint8)
    assert np.array_equal(got, want)


def test_host_pool_ops_native_and_numpy_agree_on_a_shared_memory_pool(
        native: hostcopy.NativeCopy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared-memory transport's two calls (copy into the peer pool, verify in place)."""
    layout = KVLayout("m", 4, 2, 16, 8, "bfloat16")
    rng = np.random.default_rng(3)
    src = rng.integers(0, 2**16, layout.pool_shape(20), dtype=np.uint16)
    src_ids, dst_ids = [4, 5, 6, 19, 1], [2, 3, 17, 9, 10]
    results = []
    for use_native in (True, False):
        monkeypatch.setattr(hostcopy, "NATIVE", native if use_native else None)
        with create_shm_pool(layout, 20) as shm:
            sent = HostPoolOps(src).copy_to(HostPoolOps(shm.array), 0, 4, src_ids, dst_ids)
            seen = HostPoolOps(shm.array).row_sums(0, 4, dst_ids)
            assert np.array_equal(shm.array[:, :, dst_ids], src[:, :, src_ids])
            results.append((sent, seen, shm.array.copy()))
    (a_sent, a_seen, a_pool), (b_sent, b_seen, b_pool) = results
    np.testing.assert_array_equal(a_sent, b_sent)
    np.testing.assert_array_equal(a_seen, a_sent)
    np.testing.assert_array_equal(b_seen, b_sent)
    assert np.array_equal(a_pool, b_pool)
