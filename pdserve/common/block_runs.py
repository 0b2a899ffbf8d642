"""Runs of consecutive block ids: the unit in which blocks are copied and summed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Run(NamedTuple):
    """`length` blocks at frame position `pos`, source ids `src`.., destination ids `dst`.."""

    pos: int
    length: int
    src: int
    dst: int


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int] | None = None) -> list[Run]:
    """Maximal runs of positions where the ids (both lists, when two are given) step by +1.

    Block allocators often hand out consecutive ids; a run of k blocks of one
    (layer, K/V) row is one contiguous stretch of the pool, so it is copied and
    summed by one numpy call instead of k. `dst` is the frame position when only
    source ids are given.
    """
    runs: list[Run] = []
    if not src_ids:
        return runs
    dst = range(len(src_ids)) if dst_ids is None else dst_ids
    start, s0, d0 = 0, int(src_ids[0]), int(dst[0])
    for i in range(1, len(src_ids)):
        if src_ids[i] != s0 + (i - start) or dst[i] != d0 + (i - start):
            runs.append(Run(start, i - start, s0, d0))
            start, s0, d0 = i, int(src_ids[i]), int(dst[i])
    runs.append(Run(start, len(src_ids) - start, s0, d0))
    return runs
