"""Tier records (kv_transfer/tiers/record.py): a sound record decodes to its bytes;
every kind of damage decodes to the reason; the namespace changes with everything
that changes the KV bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kv_transfer.tiers.record import (
    HEADER_BYTES,
    MissReason,
    RecordMiss,
    block_payload_bytes,
    block_rows,
    decode_record,
    encode_record,
    tier_key,
    tier_namespace,
)
from pdserve.common.kv_layout import KVLayout

LAYOUT = KVLayout("cfg", 2, 2, 8, 4, "float32", weights="w1")
ROWS = block_rows(LAYOUT)
SIZE = block_payload_bytes(LAYOUT)
KEY = tier_key(tier_namespace(LAYOUT), b"d" * 32)


def payload(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


def test_a_sound_record_round_trips() -> None:
    p = payload()
    got = decode_record(encode_record(KEY, p, ROWS), KEY, SIZE, ROWS)
    assert isinstance(got, np.ndarray) and np.array_equal(got, p)


@pytest.mark.parametrize("offset", [0, HEADER_BYTES, HEADER_BYTES + SIZE // 2, HEADER_BYTES + SIZE - 1])
def test_any_flipped_bit_is_corrupt_or_foreign(offset: int) -> None:
    data = bytearray(encode_record(KEY, payload(), ROWS))
    data[offset] ^= 1
    got = decode_record(bytes(data), KEY, SIZE, ROWS)
    assert got == RecordMiss(MissReason.CORRUPT)


def test_a_flipped_key_or_length_is_not_served() -> None:
    data = bytearray(encode_record(KEY, payload(), ROWS))
    data[9] ^= 1  # inside the key
    assert decode_record(bytes(data), KEY, SIZE, ROWS) == RecordMiss(MissReason.FOREIGN)
    data = bytearray(encode_record(KEY, payload(), ROWS))
    data[44] ^= 1  # inside payload_len
    assert decode_record(bytes(data), KEY, SIZE, ROWS) == RecordMiss(MissReason.TRUNCATED)


@pytest.mark.parametrize("cut", [0, 5, HEADER_BYTES, HEADER_BYTES + 1, HEADER_BYTES + SIZE - 8])
def test_a_truncated_record_is_truncated(cut: int) -> None:
    data = encode_record(KEY, payload(), ROWS)[:cut]
    assert decode_record(data, KEY, SIZE, ROWS) == RecordMiss(MissReason.TRUNCATED)


def test_another_key_or_block_size_is_foreign() -> None:
    data = encode_record(KEY, payload(), ROWS)
    other = tier_key(tier_namespace(LAYOUT), b"e" * 32)
    assert decode_record(data, other, SIZE, ROWS) == RecordMiss(MissReason.FOREIGN)
    assert decode_record(data, KEY, SIZE // 2, ROWS) == RecordMiss(MissReason.FOREIGN)


@pytest.mark.parametrize("change", [
    {"model_id": "cfg2"}, {"weights": "w2"}, {"dtype": "bfloat16"}, {"compute_dtype": "bfloat16"},
    {"block_size": 8}, {"num_kv_heads": 1}, {"head_dim": 16}, {"num_layers": 3},
    {"quantization": "int8"}, {"lm_head": "int8"}, {"draft": "abc"}, {"dtype": "int8"},
])
def test_the_namespace_changes_with_whatever_changes_the_kv_bytes(change: dict[str, object]) -> None:
    assert tier_namespace(dataclasses.replace(LAYOUT, **change)) != tier_namespace(LAYOUT)  # type: ignore[arg-type]
    assert tier_namespace(dataclasses.replace(LAYOUT)) == tier_namespace(LAYOUT)
