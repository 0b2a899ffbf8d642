"""A step's small host -> device copies, packed into one pinned buffer and one copy.

Token ids, positions, slot mapping, block tables, context lengths, decode-group rows and
the rows whose logits are computed are all int64. Built on the host, they are packed end to end into one pinned buffer,
copied with one `non_blocking` copy, and handed to the model as views of the one device
tensor: one transfer per step instead of several synchronous ones.

    stager = PinnedStager(torch.device("cuda:0"))
    ids, positions, meta, logit_rows = stage_metadata(ids, positions, meta, stager, logit_rows)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdserve.engine.attention.paged import AttentionMetadata
from pdserve.engine.runner.cuda_device import stream_event


class Span(NamedTuple):
    """Where one packed tensor sits in the flat buffer."""

    offset: int
    shape: tuple[int, ...]


def pack_int64(parts: Sequence[torch.Tensor], out: torch.Tensor) -> list[Span]:
    """Write `parts` end to end into the 1-D int64 `out`; their spans, in order."""
    spans = []
    offset = 0
    for t in parts:
        n = t.numel()
        out[offset:offset + n].copy_(t.reshape(-1))
        spans.append(Span(offset, tuple(t.shape)))
        offset += n
    return spans


def unpack(flat: torch.Tensor, spans: Sequence[Span]) -> list[torch.Tensor]:
    """Views of `flat` with the packed tensors' shapes."""
    out = []
    for s in spans:
        n = 1
        for dim in s.shape:
            n *= dim
        out.append(flat[s.offset:s.offset + n].view(s.shape))
    return out


class PinnedStager:
    """One reusable host buffer (pinned on CUDA) and one copy per `stage` call.

    The host buffer is rewritten only after the previous copy out of it has finished (an
    event). Each call's device tensor is fresh from the caching allocator, so a step's
    metadata never aliases the next step's.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.long)
        self._copied: torch.cuda.Event | None = None

    def stage(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`parts` (int64, on the host) as views of one device tensor."""
        total = sum(t.numel() for t in parts)
        if self._copied is not None:
            self._copied.synchronize()
        if self._host.numel() < total:
            self._host = torch.empty(max(total, 2 * self._host.numel()), dtype=torch.long,
                                     pin_memory=self._pin)
        spans = pack_int64(parts, self._host)
        dev = torch.empty(total, dtype=torch.long, device=self.device)
        dev.copy_(self._host[:total], non_blocking=self._pin)
        if self._pin:
            self._copied = stream_event(self.device)  # the copy's stream: the device's own
        return unpack(dev, spans)


class StagedStep(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor | None  # the rows `ModelRunner.logits` selects; None if not given


def stage_metadata(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   stager: PinnedStager, logit_rows: torch.Tensor | None = None) -> StagedStep:
    """Host-built step inputs (and the logits' row index, if given) on `stager.device`,
    every int64 tensor in one copy (a decode group's float padding mask, built only on the
    gather path, travels on its own)."""
    parts: list[torch.Tensor] = [input_ids, positions, meta.slot_mapping]
    if logit_rows is not None:
        parts.append(logit_rows)
    dec = meta.decode
    if dec is not None:
        parts += [t for t in (dec.block_tables, dec.ctx_lens) if t is not None]
        for g in dec.groups:
            parts += [g.block_tables] + ([g.rows] if g.rows is not None else [])
    parts += [p.block_table for p in meta.prefills]
    staged = iter(stager.stage(parts))
    ids, pos, slots = next(staged), next(staged), next(staged)
    rows_index = next(staged) if logit_rows is not None else None
    decode = None
    if dec is not None:
        tables = next(staged) if dec.block_tables is not None else None
        lens = next(staged) if dec.ctx_lens is not None else None
        groups = []
        for g in dec.groups:
            g_tables = next(staged)
            rows = next(staged) if g.rows is not None else None
            mask = g.mask.to(stager.device, non_blocking=True) if g.mask is not None else None
            groups.append(dataclasses.replace(g, rows=rows, block_tables=g_tables, mask=mask))
        decode = dataclasses.replace(dec, groups=tuple(groups), block_tables=tables, ctx_lens=lens)
    prefills = tuple(dataclasses.replace(p, block_table=next(staged)) for p in meta.prefills)
    staged_meta = dataclasses.replace(meta, slot_mapping=slots, decode=decode, prefills=prefills)
    return StagedStep(ids, pos, staged_meta, rows_index)

