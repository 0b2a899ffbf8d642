"""bench/prefill_breakdown.py: every part of a real bf16 prefill is timed under its own name,
the parts and "the rest" add up to the total, and the model's functions are the originals
again afterwards (the timers must not leak into other tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from bench import prefill_breakdown
from bench.invariance import linear_shapes
from pdserve.engine.attention import native as native_attention
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.models import llama
from pdserve.engine.runner.model_runner import ModelRunner


def test_every_part_is_timed_and_the_parts_add_up(tiny_model_dir: Callable[..., Path]) -> None:
    runner = ModelRunner(EngineConfig(model_dir=str(tiny_model_dir("llama")), dtype="bfloat16", num_threads=1,
                                      cache=CacheConfig(num_blocks=16)))
    originals = (llama.linear, llama.silu_mul, llama.rope_qk, llama.add_rms_norm,
                 native_attention.NativeAttention.prefill)
    prompt = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    med = prefill_breakdown.breakdown(runner, prompt, list(range(16)), reps=1)
    assert (llama.linear, llama.silu_mul, llama.rope_qk, llama.add_rms_norm,
            native_attention.NativeAttention.prefill) == originals
    layer_linears = {f"linear {n}x{k}" for n, k in linear_shapes(runner)}
    assert layer_linears <= med.keys()
    assert {"attention", "silu_mul", "add_rms_norm", "total", "the rest"} <= med.keys()
    parts = sum(v for k, v in med.items() if k not in ("total", "the rest"))
    assert abs(parts + med["the rest"] - med["total"]) < 1e-9
    assert all(med[k] > 0 for k in layer_linears | {"attention", "total"})
