"""Block-level operations on a KV pool array: validation, chunk planning, gather/scatter.

The pool is `kv[layer, K/V, block, slot, kv_head, head_dim]` (see
pdserve/kv_layout.py). A frame holds layers [l0, l1) of an ordered list of
blocks as a contiguous array of shape (l1 - l0, 2, n, slot, head, dim); it has
`(l1 - l0) * 2 * n` checksum rows of one (layer, K/V, block) each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kv_transfer.checksum import word_dtype
from kv_transfer.pool import hostcopy
from kv_transfer.pool.copy_threads import CopyThreads, Work
from pdserve.common.block_runs import Run, block_runs
from pdserve.common.kv_layout import NULL_BLOCK, KVLayout

# numpy has no bfloat16: such pools are handled as their raw 16-bit patterns. Quantized
# pools are raw bytes: each row holds its codes and their scales (pdserve/common/kv_layout.py).
NUMPY_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                "bfloat16": np.dtype(np.uint16), "fp8_e4m3": np.dtype(np.uint8),
                "int8": np.dtype(np.uint8)}


def numpy_dtype(layout: KVLayout) -> np.dtype:
    return NUMPY_DTYPES[layout.dtype]


def check_pool(layout: KVLayout, pool: np.ndarray) -> int:
    """Raise ValueError unless `pool` is a C-contiguous pool of `layout`; return its block count."""
    if pool.ndim != 6 or pool.shape != layout.pool_shape(pool.shape[2]):
        raise ValueError(f"pool shape {pool.shape} does not match layout {layout.pool_shape(0)}")
    if pool.dtype != numpy_dtype(layout):
        raise ValueError(f"pool dtype {pool.dtype} does not match layout dtype {layout.dtype}")
    if not pool.flags.c_contiguous:
        raise ValueError("pool must be C-contiguous")
    return int(pool.shape[2])


def check_block_ids(ids: Sequence[int], num_blocks: int, what: str) -> tuple[int, ...]:
    """Block ids must be distinct, never the null block, and inside the pool."""
    out = tuple(int(b) for b in ids)
    if not out:
        raise ValueError(f"{what}: no blocks")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: duplicate block ids")
    bad = [b for b in out if b == NULL_BLOCK or not 0 < b < num_blocks]
    if bad:
        raise ValueError(f"{what}: block ids {bad[:4]} outside 1..{num_blocks - 1}")
    return out


def frame_nbytes(layout: KVLayout, num_layers: int, num_blocks: int) -> int:
    return num_layers * num_blocks * layout.block_bytes_per_layer


def frame_rows(num_layers: int, num_blocks: int) -> int:
    return num_layers * 2 * num_blocks


@dataclass(frozen=True)
class ChunkSpan:
    """Layers [layer_start, layer_end) of the transfer's blocks [first, last)."""

    layer_start: int
    layer_end: int
    first: int
    last: int


def plan_chunks(layout: KVLayout, num_blocks: int, layer_start: int, layer_end: int,
                max_bytes: int) -> list[ChunkSpan]:
    """Split a layer range of a transfer into frames of at most `max_bytes` (one block minimum).

    Chunks take as many layers as fit, then as many blocks: each block's part of a
    frame is then one long strided run, so the per-block numpy calls of
    gather/scatter stay few and each moves a lot of bytes. The blocks are shared
    evenly between the chunks a layer range needs.
    """
    per_layer_block = layout.block_bytes_per_layer
    layers = min(layer_end - layer_start, max(1, max_bytes // per_layer_block))
    blocks = max(1, max_bytes // (layers * per_layer_block))
    blocks = -(-num_blocks // -(-num_blocks // blocks))  # even chunks: no small leftover
    return [ChunkSpan(l0, min(l0 + layers, layer_end), b0, min(b0 + blocks, num_blocks))
            for l0 in range(layer_start, layer_end, layers)
            for b0 in range(0, num_blocks, blocks)]


class Tile(NamedTuple):
    """Layers [a, z) (relative to the copied range) of one run's blocks [pos, pos + k)."""

    a: int
    z: int
    pos: int
    k: int
    src: int
    dst: int


def tiles(pool: np.ndarray, num_layers: int, runs: Sequence[Run]) -> list[Tile]:
    """Cut runs into tiles of about FUSED_BYTES: a tile is copied, then summed from cache."""
    per_layer_block = 2 * int(np.prod(pool.shape[3:])) * pool.dtype.itemsize
    fused = FUSED_BYTES
    per_tile = max(1, fused // per_layer_block)  # blocks of one layer that fit a tile
    out: list[Tile] = []
    for r in runs:
        for off in range(0, r.length, per_tile):
            k = min(per_tile, r.length - off)
            step = max(1, fused // (k * per_layer_block))
            for a in range(0, num_layers, step):
                out.append(Tile(a, min(num_layers, a + step), r.pos + off, k, r.src + off,
                                r.dst + off))
    return out


def run_tiles(work: Work, todo: Sequence[Tile], workers: CopyThreads | None) -> None:
    if workers is None:
        work(todo)
    else:
        workers.run(work, todo)


def _frame(pool: np.ndarray, l0: int, l1: int, n: int, buffer: np.ndarray | None) -> np.ndarray:
    shape = (l1 - l0, 2, n) + pool.shape[3:]
    return np.empty(shape, pool.dtype) if buffer is None else buffer.view(pool.dtype).reshape(
        shape)


def gather(pool: np.ndarray, l0: int, l1: int, ids: Sequence[int],
           buffer: np.ndarray | None = None) -> np.ndarray:
    """Copy layers [l0, l1) of blocks `ids` into a contiguous frame.

    The frame lives in `buffer` (a flat uint8 array of exactly the frame's size)
    when given -- reusing buffers avoids a page fault per 4 KiB of fresh memory,
    which costs more than the copy itself. Runs of consecutive ids are copied as
    one slice; numpy fancy indexing over the block axis is much slower here.
    """
    out = _frame(pool, l0, l1, len(ids), buffer)
    for r in block_runs(ids):
        out[:, :, r.pos:r.pos + r.length] = pool[l0:l1, :, r.src:r.src + r.length]
    return out


def scatter(pool: np.ndarray, l0: int, l1: int, ids: Sequence[int], frame: np.ndarray) -> None:
    """Write a frame produced by `gather` into blocks `ids` of `pool`."""
    for r in block_runs(ids):
        pool[l0:l1, :, r.src:r.src + r.length] = frame[:, :, r.pos:r.pos + r.length]


def copy_blocks(src: np.ndarray, dst: np.ndarray, l0: int, l1: int, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> None:
    """Copy layers [l0, l1) of blocks src_ids[i] of `src` into dst_ids[i] of `dst`."""
    for r in block_runs(src_ids, dst_ids):
        dst[l0:l1, :, r.dst:r.dst + r.length] = src[l0:l1, :, r.src:r.src + r.length]


# Copy then sum this much at a time, so the sum reads the tile from cache, not
# memory (tile and its destination lines fit L2 with room; 1 MiB measured slower).
FUSED_BYTES = 256 << 10


def _frame_words(frame: np.ndarray) -> np.ndarray:
    """A frame (nl, 2, n, ...) as (nl, 2, n, words) of the checksum word type."""
    raw: np.ndarray = frame.reshape(tuple(frame.shape[:3]) + (-1,)).view(np.uint8)
    return raw.view(word_dtype(int(raw.shape[-1])))


def row_bytes(pool: np.ndarray) -> int:
    """Bytes of one (layer, K/V, block) row of a pool or frame."""
    return math.prod(pool.shape[3:]) * pool.dtype.itemsize  # per chunk: no numpy call


def native_for(pool: np.ndarray) -> hostcopy.NativeCopy | None:
    """The native kernel, when built and the rows are whole uint64 words."""
    return hostcopy.NATIVE if row_bytes(pool) % 8 == 0 else None


def gather_with_sums(pool: np.ndarray, l0: int, l1: int, ids: Sequence[int],
                     buffer: np.ndarray | None = None, workers: CopyThreads | None = None,
                     ) -> tuple[np.ndarray, np.ndarray]:
    """`gather`, also returning the frame's row sums, each taken while its tile is in cache."""
    frame = _frame(pool, l0, l1, len(ids), buffer)
    native = native_for(pool)
    if native is not None:
        r = row_bytes(pool)
        sums = native.copy_rows(pool, frame, hostcopy.pool_row_offsets(pool, l0, l1, ids),
                                hostcopy.frame_row_offsets((l1 - l0) * 2 * len(ids), r),
                                r, stream=True, workers=workers)
        return frame, sums.reshape(l1 - l0, 2, len(ids))
    words = _frame_words(frame)
    sums = np.empty((l1 - l0, 2, len(ids)), np.uint64)

    def work(part: Sequence[Tile]) -> None:
        for t in part:
            frame[t.a:t.z, :, t.pos:t.pos + t.k] = pool[l0 + t.a:l0 + t.z, :, t.src:t.src + t.k]
            np.add.reduce(words[t.a:t.z, :, t.pos:t.pos + t.k], axis=-1, dtype=np.uint64,
                          out=sums[t.a:t.z, :, t.pos:t.pos + t.k])

    run_tiles(work, tiles(pool, l1 - l0, block_runs(ids)), workers)
    return frame, sums


def scatter_with_sums(pool: np.ndarray, l0: int, l1: int, ids: Sequence[int],
                      frame: np.ndarray, workers: CopyThreads | None = None) -> np.ndarray:
    """`scatter`, returning the frame's row sums (each tile summed, then copied from cache)."""
    native = native_for(pool)
    if native is not None:
        r = row_bytes(pool)
        sums = native.copy_rows(np.ascontiguousarray(frame), pool,
                                hostcopy.frame_row_offsets((l1 - l0) * 2 * len(ids), r),
                                hostcopy.pool_row_offsets(pool, l0, l1, ids), r, stream=True,
                                workers=workers)
        return sums.reshape(l1 - l0, 2, len(ids))
    words = _frame_words(frame)
    sums = np.empty((l1 - l0, 2, len(ids)), np.uint64)

    def work(part: Sequence[Tile]) -> None:
        for t in part:
            np.add.reduce(words[t.a:t.z, :, t.pos:t.pos + t.k], axis=-1, dtype=np.uint64,
                          out=sums[t.a:t.z, :, t.pos:t.pos + t.k])
            pool[l0 + t.a:l0 + t.z, :, t.src:t.src + t.k] = frame[t.a:t.z, :, t.pos:t.pos + t.k]

    run_tiles(work, tiles(pool, l1 - l0, block_runs(ids)), workers)
    return sums


def copy_blocks_with_sums(src: np.ndarray, dst: np.ndarray, src_words: np.ndarray, l0: int,
                          l1: int, src_ids: Sequence[int], dst_ids: Sequence[int],
                          workers: CopyThreads | None = None) -> np.ndarray:
    """`copy_blocks`, returning the source row sums (`src_words` = checksum.pool_words(src))."""
    native = native_for(src)
    if native is not None and dst.shape[3:] == src.shape[3:] and dst.dtype == src.dtype:
        sums = native.copy_rows(src, dst, hostcopy.pool_row_offsets(src, l0, l1, src_ids),
                                hostcopy.pool_row_offsets(dst, l0, l1, dst_ids), row_bytes(src),
                                stream=True, workers=workers)
        return sums.reshape(l1 - l0, 2, len(src_ids))
    sums = np.empty((l1 - l0, 2, len(src_ids)), np.uint64)

    def work(part: Sequence[Tile]) -> None:
        for t in part:
            a, z = l0 + t.a, l0 + t.z
            dst[a:z, :, t.dst:t.dst + t.k] = src[a:z, :, t.src:t.src + t.k]
            np.add.reduce(src_words[a:z, :, t.src:t.src + t.k], axis=-1, dtype=np.uint64,
                          out=sums[t.a:t.z, :, t.pos:t.pos + t.k])

    run_tiles(work, tiles(src, l1 - l0, block_runs(src_ids, dst_ids)), workers)
    return sums
