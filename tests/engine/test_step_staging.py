"""A step's int64 metadata crosses to the device as views of one packed buffer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention import build_metadata, order_chunks
from engine.runner_types import SeqChunk
from engine.step_staging import PinnedStager, pack_int64, stage_metadata, unpack

CPU = torch.device("cpu")


def test_pack_unpack_round_trip_keeps_shapes_and_values() -> None:
    parts = [torch.arange(5), torch.tensor([[7, 8, 9], [1, 2, 3]]), torch.empty(0, dtype=torch.long),
             torch.tensor([-4])]
    flat = torch.full((16,), -1, dtype=torch.long)
    spans = pack_int64(parts, flat)
    assert [s.offset for s in spans] == [0, 5, 11, 11]
    assert flat[:12].tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 1, 2, 3, -4]
    back = unpack(flat, spans)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(parts, back, strict=True))


def _step(flat_decode: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
    chunks = [SeqChunk([5], 40, [3, 4, 9], True), SeqChunk([6], 600, list(range(10, 48)), True),
              SeqChunk([1, 2, 3], 17, [2, 6], True)]
    order = order_chunks(chunks)
    meta = build_metadata(chunks, order, 16, torch.float32, CPU, flat_decode)
    ids = torch.tensor([5, 6, 1, 2, 3])
    pos = torch.tensor([40, 600, 17, 18, 19])
    return ids, pos, meta


@pytest.mark.parametrize("flat_decode", [True, False])
def test_stage_metadata_moves_every_int64_tensor_in_one_copy(flat_decode: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ids, pos, meta = _step(flat_decode)
    stager = PinnedStager(CPU)
    copies: list[int] = []
    real = PinnedStager.stage

    def spy(self: PinnedStager, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        copies.append(len(parts))
        return real(self, parts)

    monkeypatch.setattr(PinnedStager, "stage", spy)
    s_ids, s_pos, s_meta = stage_metadata(ids, pos, meta, stager)
    before = [ids, pos, meta.slot_mapping, *[p.block_table for p in meta.prefills]]
    after = [s_ids, s_pos, s_meta.slot_mapping, *[p.block_table for p in s_meta.prefills]]
    assert meta.decode is not None and s_meta.decode is not None
    if flat_decode:
        before += [meta.decode.block_tables, meta.decode.ctx_lens]
        after += [s_meta.decode.block_tables, s_meta.decode.ctx_lens]
    else:
        assert len(meta.decode.groups) == 2  # contexts 41 and 601 split: rows and tables each
        for g, sg in zip(meta.decode.groups, s_meta.decode.groups, strict=True):
            before += [g.block_tables, g.rows]
            after += [sg.block_tables, sg.rows]
            assert sg.max_ctx_len == g.max_ctx_len
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    storage = {t.untyped_storage().data_ptr() for t in after}
    assert len(storage) == 1 and copies == [len(after)]  # one buffer, one copy
    assert s_meta.num_tokens == meta.num_tokens and s_meta.decode.num_seqs == 2


def test_the_host_buffer_grows_and_steps_do_not_alias() -> None:
    stager = PinnedStager(CPU)
    (a,) = stager.stage([torch.arange(3)])
    (b,) = stager.stage([torch.arange(100, 200)])
    assert a.tolist() == [0, 1, 2] and b.tolist() == list(range(100, 200))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
def test_staging_to_cuda_uses_pinned_memory() -> None:
    ids, pos, meta = _step(True)
    stager = PinnedStager(torch.device("cuda"))
    s_ids, _, s_meta = stage_metadata(ids, pos, meta, stager)
    assert stager._host.is_pinned() and s_ids.is_cuda and s_meta.slot_mapping.is_cuda
    assert torch.equal(s_ids.cpu(), ids)
