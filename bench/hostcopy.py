"""Host copy kernel micro-benchmark: the KV transfer's row copy and row sum in one thread.

One request's KV rows ((layer, K/V, block) rows at shuffled block ids, as a
transfer sees them) copied from one pool to another with their checksum sums,
and summed alone (the receiver's verification), next to a numpy memcpy of the
same byte count, the three taking turns (medians). No processes or sockets: this is the ceiling
that `bench/kv_transfer.py`'s shared-memory transfer works under.

    .venv/bin/python -m bench.hostcopy
    .venv/bin/python -m bench.hostcopy --tokens 8192 --repeats 15
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from bench import harness
from bench.kv_transfer import SHAPES, Memcpy
from kv_transfer.pool import hostcopy
from kv_transfer.pool.ops import pool_ops
from kv_transfer.pool.shm import create_shm_pool


@dataclass(frozen=True)
class KernelResult:
    nbytes: int
    memcpy_gbps: float  # numpy copy of the same source bytes, one contiguous buffer
    copy_gbps: float  # copy + sum of the rows, streaming stores (the shm transfer's copy)
    sum_gbps: float  # sum of the copied rows (the receiver's verification)


def bench_kernel(shape: str, tokens: int, repeats: int) -> KernelResult:
    layout = SHAPES[shape]
    n = -(-tokens // layout.block_size)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 1 << 15, layout.pool_shape(n + 1), dtype=np.int16).view(np.float16)
    src_ids = [int(b) for b in rng.permutation(np.arange(1, n + 1))]
    dst_ids = [int(b) for b in rng.permutation(np.arange(1, n + 1))]
    nbytes = n * layout.num_layers * layout.block_bytes_per_layer
    baseline = Memcpy(src, nbytes)
    with create_shm_pool(layout, n + 1) as shm:  # a decode worker's pool, as the sender sees it
        sender, receiver = pool_ops(src), pool_ops(shm.array)  # a shm transfer's two calls

        def copy() -> None:
            sender.copy_to(receiver, 0, layout.num_layers, src_ids, dst_ids)

        def verify() -> None:
            receiver.row_sums(0, layout.num_layers, dst_ids)

        t = harness.medians({"memcpy": baseline.copy, "copy": copy, "sum": verify}, repeats)
        return KernelResult(nbytes, *(nbytes / t[k] / 1e9 for k in ("memcpy", "copy", "sum")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    print(f"{harness.machine_line()}\nhost copy: {hostcopy.describe()}; medians of {args.repeats}, one thread")
    print(f"{'shape':<12} {'MiB':>7} {'memcpy GB/s':>12} {'copy+sum GB/s':>14} {'% memcpy':>9} "
          f"{'sum GB/s':>9}")
    for shape in args.shapes:
        r = bench_kernel(shape, args.tokens, args.repeats)
        print(f"{shape:<12} {r.nbytes / 2**20:>7.1f} {r.memcpy_gbps:>12.2f} {r.copy_gbps:>14.2f} "
              f"{100 * r.copy_gbps / r.memcpy_gbps:>8.0f}% {r.sum_gbps:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
