"""The weights fingerprint: content-sensitive, cached beside the checkpoint (or in the
user cache when the model dir is not writable), reused while name/size/mtime hold."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pdserve.common.kv_layout import KVLayout
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.loading.loader import weights_fingerprint
from pdserve.engine.loading.weights_fingerprint import CACHE_NAME, fingerprint_files
from pdserve.engine.runner.model_runner import ModelRunner
from tests.helpers.tiny_models import copy_with_one_weight_changed

HOUR_NS = 3600 * 10**9


def _backdate(path: Path, hours: int = 1) -> None:
    """Give `path` an mtime well in the past, out of the racily-clean window."""
    t = time.time_ns() - hours * HOUR_NS
    os.utime(path, ns=(t, t))


def _checkpoint(d: Path, shards: int = 1) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    files = []
    for i in range(shards):
        path = d / f"model-{i:05d}.safetensors"
        save_file({f"w{i}": rng.standard_normal((8, 4), dtype=np.float32)}, str(path))
        _backdate(path)
        files.append(path)
    return files


def test_digest_is_cached_and_reused_while_size_and_mtime_hold(tmp_path: Path) -> None:
    d, user = tmp_path / "m", tmp_path / "user"
    files = _checkpoint(d)
    first = fingerprint_files(d, files, user)
    assert first.hashed == ("model-00000.safetensors",)
    assert first.cache_path == d / CACHE_NAME
    cache = json.loads((d / CACHE_NAME).read_text())
    assert set(cache["files"]) == {"model-00000.safetensors"}

    again = fingerprint_files(d, files, user)
    assert again.hashed == () and again.digest == first.digest
    assert not user.exists()


def test_changed_file_is_rehashed_and_changes_the_digest(tmp_path: Path) -> None:
    d = tmp_path / "m"
    files = _checkpoint(d, shards=2)
    first = fingerprint_files(d, files, tmp_path / "user")
    assert first.hashed == ("model-00000.safetensors", "model-00001.safetensors")
    # Same size, one value different, mtime moved: only that shard is read again.
    raw = bytearray(files[1].read_bytes())
    raw[-1] ^= 0x01
    files[1].write_bytes(bytes(raw))
    _backdate(files[1], hours=2)
    second = fingerprint_files(d, files, tmp_path / "user")
    assert second.hashed == ("model-00001.safetensors",)
    assert second.digest != first.digest
    # An mtime change alone re-reads the file, and the same bytes give the same digest.
    _backdate(files[1], hours=3)
    third = fingerprint_files(d, files, tmp_path / "user")
    assert third.hashed == ("model-00001.safetensors",) and third.digest == second.digest
    assert fingerprint_files(d, files, tmp_path / "user").hashed == ()


def test_file_written_just_now_is_not_trusted_to_the_cache(tmp_path: Path) -> None:
    d = tmp_path / "m"
    files = _checkpoint(d)
    os.utime(files[0])  # mtime: now, inside the filesystem's timestamp granularity
    assert fingerprint_files(d, files, tmp_path / "user").hashed == ("model-00000.safetensors",)
    assert fingerprint_files(d, files, tmp_path / "user").hashed == ("model-00000.safetensors",)
    assert not (d / CACHE_NAME).exists()


def test_unwritable_model_dir_caches_in_the_user_dir(tmp_path: Path) -> None:
    d, user = tmp_path / "m", tmp_path / "user"
    files = _checkpoint(d)
    # Tests may run as root, where a 0555 directory still takes writes; a directory
    # where the cache file would go makes the write fail the way a read-only dir does.
    (d / CACHE_NAME).mkdir()
    first = fingerprint_files(d, files, user)
    assert first.cache_path is not None and first.cache_path.parent == user
    again = fingerprint_files(d, files, user)
    assert again.hashed == () and again.digest == first.digest
    assert again.cache_path == first.cache_path


@pytest.mark.parametrize("garbage", [b"{not json", b'{"version": 1, "files": {"model-00000.safetensors": '
                                     b'{"size": "big", "mtime_ns": 1, "sha256": "x"}}}', b"[]"])
def test_malformed_cache_is_ignored_and_replaced(tmp_path: Path, garbage: bytes) -> None:
    d = tmp_path / "m"
    files = _checkpoint(d)
    clean = fingerprint_files(d, files, tmp_path / "user").digest
    (d / CACHE_NAME).write_bytes(garbage)
    fp = fingerprint_files(d, files, tmp_path / "user")
    assert fp.hashed == ("model-00000.safetensors",) and fp.digest == clean
    assert fingerprint_files(d, files, tmp_path / "user").hashed == ()


def test_one_weight_value_changes_fingerprint_and_compat_hash(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    base = tiny_model_dir("llama")
    same = tmp_path / "same"
    shutil.copytree(base, same)
    tuned = copy_with_one_weight_changed(base, tmp_path / "tuned")
    assert (same / "config.json").read_bytes() == (tuned / "config.json").read_bytes()
    fps = [weights_fingerprint(d).digest for d in (base, same, tuned)]
    assert fps[0] == fps[1] != fps[2]

    def layout(d: Path, dtype: str = "float32", block: int = 16) -> str:
        cfg = EngineConfig(model_dir=str(d), dtype=dtype, cache=CacheConfig(block_size=block))
        return ModelRunner.layout_for(cfg).compat_hash

    assert layout(base) == layout(same)
    assert len({layout(base), layout(tuned), layout(base, dtype="bfloat16"),
                layout(base, block=32)}) == 4


def test_compat_hash_covers_every_identity_field() -> None:
    base = KVLayout("cfg", 2, 2, 16, 16, "float16", weights="w1", compute_dtype="float16")
    variants = [
        replace(base, model_id="cfg2"), replace(base, weights="w2"),
        replace(base, compute_dtype="bfloat16"), replace(base, quantization="awq"),
        replace(base, dtype="bfloat16"), replace(base, block_size=32),
        replace(base, num_layers=3), replace(base, num_kv_heads=1), replace(base, head_dim=8),
    ]
    hashes = {v.compat_hash for v in variants}
    assert len(hashes) == len(variants) and base.compat_hash not in hashes
    assert replace(base, compute_dtype=None).compat_hash == base.compat_hash  # None: the KV dtype


def test_runner_takes_the_callers_layout_without_fingerprinting_again(
    tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = EngineConfig(model_dir=str(tiny_model_dir("llama")), num_threads=1,
                       cache=CacheConfig(num_blocks=4))
    layout = ModelRunner.layout_for(cfg)

    def fail(model_dir: object) -> None:
        raise AssertionError("weights fingerprinted twice")

    monkeypatch.setattr("pdserve.engine.runner.model_runner.weights_fingerprint", fail)
    assert ModelRunner(cfg, layout=layout).layout == layout
    with pytest.raises(ValueError, match="does not belong"):
        ModelRunner(cfg, layout=replace(layout, block_size=32))
