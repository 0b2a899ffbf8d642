"""`pdserve plan` accounts the KV tiers: each tier's bound, the bytes of one stored block
(exactly the record a real tier writes), and the blocks and prefix tokens it holds, in
the text report and in `--json`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kv_transfer.tiers.files import FileTier
from kv_transfer.tiers.record import HEADER_BYTES, block_payload_bytes, block_rows, encode_record
from pdserve.cli import main
from pdserve.common.kv_layout import SCALE_BYTES, KVLayout
from pdserve.planner import tiers
from pdserve.planner.capacity import PlanError, compute_plan
from tests.test_plan import GiB, _model


@pytest.fixture
def gqa_7b(tmp_path: Path) -> Path:
    return _model(tmp_path, "llama-7b-gqa", num_key_value_heads=8)


def test_the_planners_constants_are_the_tiers() -> None:
    assert tiers.RECORD_HEADER_BYTES == HEADER_BYTES and tiers.SCALE_BYTES == SCALE_BYTES
    from kv_transfer.tiers.remote import PREFIX

    assert len(PREFIX) + 64 == tiers.REMOTE_KEY_BYTES


@pytest.mark.parametrize("dtype", ["float16", "fp8_e4m3", "int8"])
def test_a_block_costs_what_a_real_tier_writes(tmp_path: Path, dtype: str) -> None:
    layout = KVLayout("m", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    record = encode_record(bytes(32), np.zeros(block_payload_bytes(layout), np.uint8), block_rows(layout))
    tier = FileTier("host", tmp_path / "host", 1 << 20)
    assert tier.put(bytes(32), record)
    written = sum(f.stat().st_size for f in (tmp_path / "host").rglob("*.kv"))
    kv_bytes = 2 if dtype == "float16" else 1
    assert tiers.record_bytes(3, 2, 8, kv_bytes, 4, quantized=dtype != "float16") == len(record) == written


def test_the_design_example_with_host_disk_and_remote_tiers(gqa_7b: Path) -> None:
    p = compute_plan(gqa_7b, 80 * GiB, 8192, dtype="float16",
                     tier_bytes={"remote": 64 * GiB, "host": 8 * GiB, "disk": 100 * GiB})
    record = 60 + 2 * 32 * (16 * 8 * 128 * 2)  # header + K and V of 32 layers, 16 tokens, fp16
    assert [t.name for t in p.tiers] == ["host", "disk", "remote"]
    host, disk, remote = p.tiers
    assert (host.record_bytes, host.blocks, host.tokens) == (record, 8 * GiB // record, 8 * GiB // record * 16)
    assert host.blocks == 4095 and disk.blocks == 100 * GiB // record == 51_198
    assert remote.record_bytes == record + len(b"pdserve:kv:") + 64
    assert host.pool_multiple == pytest.approx(host.tokens / p.token_budget)
    assert compute_plan(gqa_7b, 80 * GiB, 8192, dtype="float16").tiers == ()
    with pytest.raises(PlanError, match="KV tiers are"):
        compute_plan(gqa_7b, 80 * GiB, 8192, tier_bytes={"tape": GiB})


def test_cli_reports_the_tiers_in_text_and_json(gqa_7b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", str(gqa_7b), "--device-memory", "80GiB", "--max-model-len", "8192",
            "--dtype", "float16", "--kv-offload-memory", "8GiB", "--kv-offload-disk", "100GiB"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "host tier:" in out and "4,095 blocks = 65,520 prefix tokens" in out
    assert "disk tier:" in out and "51,198 blocks" in out and "remote tier" not in out
    assert main([*base, "--kv-remote-memory", "1GiB", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [(t["name"], t["blocks"], t["tokens"]) for t in got["tiers"]] == [
        ("host", 4095, 65_520), ("disk", 51_198, 51_198 * 16), ("remote", GiB // (2_097_212 + 75), 511 * 16)]
