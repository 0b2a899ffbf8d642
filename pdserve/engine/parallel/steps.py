"""Rank 0's step inputs as one int64 tensor: what every follower rank needs to run
the same step over its slice (token ids, positions, block tables).

    [kind, num_chunks, (num_tokens, start_pos, num_blocks) * num_chunks,
     token ids of every chunk..., block ids of every chunk...]

Sampling happens on rank 0 alone (the LM head is replicated), so no sampling rows
travel. Decoding checks every count against the tensor's length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.core.runner_types import SeqChunk

STEP = 1
STOP = 2
_HEADER = 3


class StepFormatError(ValueError):
    """A step tensor whose counts do not add up."""


def encode_step(chunks: Sequence[SeqChunk]) -> torch.Tensor:
    head = [STEP, len(chunks)]
    tokens: list[int] = []
    blocks: list[int] = []
    for c in chunks:
        head += [len(c.token_ids), c.start_pos, len(c.block_table)]
        tokens += c.token_ids
        blocks += c.block_table
    return torch.tensor(head + tokens + blocks, dtype=torch.int64)


def encode_stop() -> torch.Tensor:
    return torch.tensor([STOP, 0], dtype=torch.int64)


def decode_step(msg: torch.Tensor) -> list[SeqChunk] | None:
    """The step's chunks (none need logits: followers never sample); None for STOP."""
    v = msg.tolist()
    if len(v) < 2 or v[0] not in (STEP, STOP):
        raise StepFormatError(f"not a step message: {v[:2]}")
    if v[0] == STOP:
        return None
    n = v[1]
    heads = v[2: 2 + _HEADER * n]
    if n < 0 or len(heads) != _HEADER * n:
        raise StepFormatError(f"step of {n} chunks is truncated")
    sizes = [(heads[i], heads[i + 1], heads[i + 2]) for i in range(0, len(heads), _HEADER)]
    if len(v) != 2 + _HEADER * n + sum(t + b for t, _, b in sizes):
        raise StepFormatError("step length does not match its chunk sizes")
    at = 2 + _HEADER * n
    toks = []
    for t, _, _ in sizes:
        toks.append(v[at: at + t])
        at += t
    chunks = []
    for (_, start, b), ids in zip(sizes, toks, strict=True):
        chunks.append(SeqChunk(ids, start, v[at: at + b], False))
        at += b
    return chunks
