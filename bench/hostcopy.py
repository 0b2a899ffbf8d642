"""Host copy kernel micro-benchmark: the KV transfer's row copy and row sum in one thread.

One request's KV rows ((layer, K/V, block) rows at shuffled block ids, as a
transfer sees them) copied from one pool to another with their checksum sums,
and summed alone (the receiver's verification), next to a numpy memcpy of the
same byte count in the same run. No processes or sockets: this is the ceiling
that `bench/kv_transfer.py`'s shared-memory transfer works under.

    .venv/bin/python -m bench.hostcopy
    .venv/bin/python -m bench.hostcopy --tokens 8192 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.kv_transfer import SHAPES
from kv_transfer import hostcopy
from kv_transfer.blocks import copy_blocks_with_sums
from kv_transfer.checksum import pool_words
from kv_transfer.hostcopy import pool_row_offsets


@dataclass(frozen=True)
class KernelResult:
    nbytes: int
    memcpy_gbps: float  # numpy copy of one contiguous buffer of nbytes
    copy_gbps: float  # copy + sum of the rows, streaming stores (the shm transfer's copy)
    sum_gbps: float  # sum of the copied rows (the receiver's verification)


def _median_gbps(fn: Callable[[], object], nbytes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def page_aligned_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Like a shared-memory pool: page-aligned (streaming stores need 32-byte alignment)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def bench_kernel(shape: str, tokens: int, repeats: int) -> KernelResult:
    layout = SHAPES[shape]
    n = -(-tokens // layout.block_size)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 1 << 15, layout.pool_shape(n + 1), dtype=np.int16).view(np.float16)
    dst = page_aligned_zeros(src.shape, src.dtype)
    src_ids = [int(b) for b in rng.permutation(np.arange(1, n + 1))]
    dst_ids = [int(b) for b in rng.permutation(np.arange(1, n + 1))]
    nbytes = n * layout.num_layers * layout.block_bytes_per_layer
    words = pool_words(src)
    flat = src.reshape(-1).view(np.uint8)[:nbytes]
    scratch = flat.copy()

    def memcpy() -> None:
        scratch[...] = flat

    def copy() -> None:
        copy_blocks_with_sums(src, dst, words, 0, layout.num_layers, src_ids, dst_ids)

    copy()
    offsets = pool_row_offsets(dst, 0, layout.num_layers, dst_ids)
    row = nbytes // len(offsets)

    def verify() -> None:
        if hostcopy.NATIVE is not None:
            hostcopy.NATIVE.sum_rows(dst, offsets, row)
        else:
            np.add.reduce(dst.reshape(-1).view(np.uint64), dtype=np.uint64)

    return KernelResult(nbytes, _median_gbps(memcpy, nbytes, repeats),
                        _median_gbps(copy, nbytes, repeats), _median_gbps(verify, nbytes, repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    print(f"host copy: {hostcopy.describe()}; medians of {args.repeats}, one thread")
    print(f"{'shape':<12} {'MiB':>7} {'memcpy GB/s':>12} {'copy+sum GB/s':>14} {'% memcpy':>9} "
          f"{'sum GB/s':>9}")
    for shape in args.shapes:
        r = bench_kernel(shape, args.tokens, args.repeats)
        print(f"{shape:<12} {r.nbytes / 2**20:>7.1f} {r.memcpy_gbps:>12.2f} {r.copy_gbps:>14.2f} "
              f"{100 * r.copy_gbps / r.memcpy_gbps:>8.0f}% {r.sum_gbps:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
