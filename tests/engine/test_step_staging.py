"""A step's int64 metadata crosses to the device as views of one packed buffer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.engine.attention.paged import build_metadata, order_chunks
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.step_staging import PinnedStager, pack_int64, stage_metadata, unpack

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
    rows = torch.tensor([0, 1, 4])  # the logits' row index travels in the same copy
    s_ids, s_pos, s_meta, s_rows = stage_metadata(ids, pos, meta, stager, rows)
    assert s_rows is not None
    before = [ids, pos, meta.slot_mapping, rows, *[p.block_table for p in meta.prefills]]
    after = [s_ids, s_pos, s_meta.slot_mapping, s_rows, *[p.block_table for p in s_meta.prefills]]
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
    s_ids, _, s_meta, s_rows = stage_metadata(ids, pos, meta, stager, torch.tensor([0, 1, 4]))
    assert stager._host.is_pinned() and s_ids.is_cuda and s_meta.slot_mapping.is_cuda
    assert s_rows is not None and s_rows.is_cuda and s_rows.tolist() == [0, 1, 4]
    assert torch.equal(s_ids.cpu(), ids)


def test_the_runner_selects_logits_through_the_staged_row_index(
        tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner that stages (on CUDA; forced here on the CPU) makes no copy of its own for
    the logits' rows: it indexes with the view staged with the step, and gets the same logits."""
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.runner.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model_dir=str(tiny_model_dir()), dtype="float32",
                                      cache=CacheConfig(num_blocks=16)))
    chunks = [SeqChunk([5], 3, [1], True), SeqChunk([1, 2, 3, 4], 0, [2], True),
              SeqChunk([7, 8], 0, [3], False)]
    want = runner.execute(chunks)
    runner._stager = PinnedStager(CPU)
    step = runner.step_inputs(chunks)
    assert step.logit_rows == [0, 4] and step.logit_index is not None
    assert step.logit_index.tolist() == [0, 4]
    assert step.logit_index.untyped_storage().data_ptr() == step.input_ids.untyped_storage().data_ptr()
    seen: list[Any] = []
    real = ModelRunner.logits

    def spy(self: ModelRunner, hidden: torch.Tensor, rows: list[int], index: Any = None) -> torch.Tensor:
        seen.append(index)
        return real(self, hidden, rows, index)

    monkeypatch.setattr(ModelRunner, "logits", spy)
    got = runner.execute(chunks)
    assert torch.equal(got, want)
    assert len(seen) == 1 and seen[0] is not None and seen[0].tolist() == [0, 4]
