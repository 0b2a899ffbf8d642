"""What a worker's registration says of its KV tiers (pdserve/worker/kv_tiers.py:
`tier_infos`), for the router (gateway/kv_tiers.py): each tier's kind, where it is (a
file tier's real directory, a Redis without its credentials) and how many blocks it holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.files import FileTier
from kv_transfer.tiers.record import HEADER_BYTES
from kv_transfer.tiers.remote import RedisTier
from pdserve.common.protocol import KvTierInfo
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker.kv_tiers import tier_infos

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_registration_names_each_tier_the_engine_uses(
        tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model_dir("llama")), dtype="float32",
                                    cache=CacheConfig(block_size=16, num_blocks=16)))
    assert tier_infos(engine) == ()
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")  # two names of one directory: one tier
    cache = TieredKVCache(engine.runner.layout, [FileTier("host", tmp_path / "link", 1 << 20),
                                                 RedisTier("redis://user:secret@kv.example:6379/2")])
    engine.attach_tiers(cache)
    record = HEADER_BYTES + cache.payload_bytes
    assert tier_infos(engine) == (KvTierInfo("host", str(tmp_path / "real"), (1 << 20) // record),
                                  KvTierInfo("remote", "redis://kv.example:6379/2", 0))
    cache.close()
