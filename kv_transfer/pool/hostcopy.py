"""Native host copy + checksum kernels (kv_transfer/pool/_hostcopy.c), loaded with ctypes.

The C library copies rows of a KV pool and sums each row's uint64 words in the
same pass, with non-temporal stores into destinations this core will not read
again soon (another process's shared-memory pool, a pool being filled from a
frame). numpy needs a copy pass plus a summing pass and always stores through
the cache. `pip install` builds the library (setup.py, optional: without a C
compiler the install still succeeds); `NATIVE` is None when it is missing or
`PDSERVE_NATIVE_COPY=0`, and kv_transfer.pool.blocks then uses numpy, with the
same results bit for bit (tests check both paths).

Rows are given as byte offsets into the arrays; every offset is checked
against the arrays' sizes here, before C touches memory.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Callable, Sequence

import numpy as np

from kv_transfer.pool.copy_threads import CopyThreads

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class NativeCopy:
    """The loaded library: row copies with sums, and row sums."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)  # CDLL (not PyDLL): calls release the GIL
        lib.pd_copy_rows.argtypes = [_P, _P, _P, _P, _I64, _I64, _P, ctypes.c_int]
        lib.pd_copy_rows.restype = None
        lib.pd_sum_rows.argtypes = [_P, _P, _I64, _I64, _P]
        lib.pd_sum_rows.restype = None
        lib.pd_kernel_name.argtypes = []
        lib.pd_kernel_name.restype = ctypes.c_char_p
        self._lib = lib
        self.path = path
        self.kernel: str = lib.pd_kernel_name().decode()  # "avx2", "sse2" or "c"

    def copy_rows(self, src: np.ndarray, dst: np.ndarray, src_off: np.ndarray,
                  dst_off: np.ndarray, row_bytes: int, *, stream: bool,
                  workers: CopyThreads | None = None) -> np.ndarray:
        """Copy row i from byte `src_off[i]` of `src` to `dst_off[i]` of `dst`; return row sums."""
        _check(src, src_off, row_bytes)
        _check(dst, dst_off, row_bytes)
        if dst.flags.writeable is False:
            raise ValueError("destination is read-only")
        sums = np.empty(len(src_off), np.uint64)
        s, d, o = _addr(src), _addr(dst), _addr(sums)

        def work(parts: Sequence[slice]) -> None:
            for p in parts:
                n = p.stop - p.start
                self._lib.pd_copy_rows(s, d, src_off[p].ctypes.data, dst_off[p].ctypes.data, n,
                                       row_bytes, o + 8 * p.start, int(stream))

        _split(work, len(sums), workers)
        return sums

    def sum_rows(self, base: np.ndarray, off: np.ndarray, row_bytes: int,
                 workers: CopyThreads | None = None) -> np.ndarray:
        """Word sums of the rows at byte offsets `off` of `base`."""
        _check(base, off, row_bytes)
        sums = np.empty(len(off), np.uint64)
        b, o = _addr(base), _addr(sums)

        def work(parts: Sequence[slice]) -> None:
            for p in parts:
                self._lib.pd_sum_rows(b, off[p].ctypes.data, p.stop - p.start, row_bytes,
                                      o + 8 * p.start)

        _split(work, len(sums), workers)
        return sums


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _check(a: np.ndarray, off: np.ndarray, row_bytes: int) -> None:
    if not a.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    if off.dtype != np.int64 or not off.flags.c_contiguous:
        raise ValueError("offsets must be contiguous int64")
    if row_bytes <= 0 or row_bytes % 8:
        raise ValueError(f"row of {row_bytes} bytes is not a whole number of uint64 words")
    if len(off) and (int(off.min()) < 0 or int(off.max()) + row_bytes > a.nbytes):
        raise ValueError("row offset outside the array")


def _split(work: Callable[[Sequence[slice]], None], nrows: int,
           workers: CopyThreads | None) -> None:
    """Run `work` over [0, nrows) in one contiguous share per copy thread."""
    threads = 1 if workers is None else max(1, min(workers.threads, nrows))
    bounds = [nrows * i // threads for i in range(threads + 1)]
    parts = [slice(bounds[i], bounds[i + 1]) for i in range(threads) if bounds[i] < bounds[i + 1]]
    if workers is None or len(parts) < 2:
        work(parts)
    else:
        workers.run(work, parts)


def pool_row_offsets(pool: np.ndarray, l0: int, l1: int, ids: Sequence[int]) -> np.ndarray:
    """Byte offsets of the rows (layer l0..l1-1, K/V, block ids) of a pool
    [layer, kv, block, ...], in frame row order (layer, K/V, position)."""
    nb = pool.shape[2]
    row = pool.nbytes // (pool.shape[0] * 2 * nb)
    lk = (np.arange(l0, l1, dtype=np.int64)[:, None] * 2 + np.arange(2, dtype=np.int64)) * nb
    return ((lk[:, :, None] + np.asarray(ids, np.int64)[None, None, :]) * row).reshape(-1)


def frame_row_offsets(num_rows: int, row_bytes: int) -> np.ndarray:
    """Byte offsets of the rows of a contiguous frame."""
    return np.arange(num_rows, dtype=np.int64) * row_bytes


def _load() -> NativeCopy | None:
    if os.environ.get("PDSERVE_NATIVE_COPY", "1") == "0":
        return None
    spec = importlib.util.find_spec("kv_transfer.pool._hostcopy")
    if spec is None or spec.origin is None:
        return None
    try:
        return NativeCopy(spec.origin)
    except OSError:
        return None


NATIVE: NativeCopy | None = _load()


def describe() -> str:
    """Which host copy path this process uses, for benchmark output and logs."""
    return f"native ({NATIVE.kernel})" if NATIVE is not None else "numpy (native kernel not built)"
