"""bench/decode_floor.py: the bytes a decode step reads, against a hand count on the tiny
models, the vs_vllm mixed shapes it times, and one short timed step of the real engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench import decode_floor
from bench.profile_step import DecodeBench
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.kernels import bf16_gemv
from pdserve.engine.runner.model_runner import ModelRunner

# tests/helpers/tiny_models.py: hidden 64, 2 layers, 4 heads, 2 KV heads (head_dim 16),
# intermediate 128, vocabulary 384 (256 for "tied"); bf16: 2 bytes an element.
H, L, KVH, HD, INTER = 64, 2, 2, 16, 128
PER_LAYER = (H * H + 2 * H * KVH * HD + H * H  # q, k, v, o
             + 3 * H * INTER  # gate, up, down
             + 2 * H)  # input and post-attention RMSNorm
KV_PER_TOKEN = 2 * L * KVH * HD * 2  # K and V, every layer, bf16


def _runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model_dir=str(model_dir), dtype="bfloat16", num_threads=1,
                                    cache=CacheConfig(num_blocks=16)))


def test_step_bytes_match_a_hand_count(tiny_model_dir: Callable[..., Path]) -> None:
    runner = _runner(tiny_model_dir("llama"))
    contexts = (5, 40, 100)
    got = decode_floor.step_bytes(runner.model, runner.layout, contexts)
    lm_head, final_norm = 384 * H, H  # the embedding table (384 x 64) is not read
    assert got.weights == 2 * (L * PER_LAYER + final_norm + lm_head)
    assert got.kv == KV_PER_TOKEN * (6 + 41 + 101)  # each context and its new token
    assert got.total == got.weights + got.kv


def test_tied_embeddings_count_once_as_the_lm_head(tiny_model_dir: Callable[..., Path]) -> None:
    runner = _runner(tiny_model_dir("tied"))
    assert decode_floor.weight_bytes_per_step(runner.model) == 2 * (L * PER_LAYER + H + 256 * H)


def test_mixed_shapes_follow_vs_vllm() -> None:
    mean, largest = decode_floor.mixed_shapes()
    assert mean.contexts == (32 + 400,) * 8  # 8 streams of 32 + 800 tokens, halfway
    assert largest.contexts == (32 + 800,) * 8 + (1500 + 16,)  # last token, plus a long prompt


def test_timing_runs_the_real_step_and_the_checked_one(tiny_model_dir: Callable[..., Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The "checked" column runs every routed decode linear through `bf16_gemv.check` (the
    hot path before `linear` skipped it); the current one never does; both leave the
    thread count and the kernel call as they found them."""
    checks: list[int] = []
    check = bf16_gemv.check

    def counted(*args: torch.Tensor | None) -> None:
        checks.append(1)
        check(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(bf16_gemv, "check", counted)
    runner = _runner(tiny_model_dir("llama"))
    dec = DecodeBench(runner, (7, 20), steps=2, spare_tokens=0)
    run, threads = bf16_gemv._run, torch.get_num_threads()
    dec.run()
    assert not checks
    tm = decode_floor.time_step(dec, threads=1, reps=1, bw_mib=4)
    assert tm.bandwidth > 0 and tm.step > 0 and tm.checked > 0
    if bf16_gemv.enabled():  # 4 linears a layer (qkv and gate+up fused, o, down), the LM head; 2 steps
        assert len(checks) == 2 * (4 * L + 1)
    assert bf16_gemv._run is run and torch.get_num_threads() == threads
