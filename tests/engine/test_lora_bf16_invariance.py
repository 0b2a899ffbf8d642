"""bf16 batch invariance of adapter rows (docs/determinism.md, pdserve/engine/lora/batch.py):
a row under a LoRA adapter has the same bits alone as in a step that mixes it with rows
of other adapters and of the base model, under every CPU kind this host can emulate
(`PDSERVE_CPU_FEATURES`, set at load, so each mask runs the engine in its own process).

The stacked update itself (pdserve/engine/lora/batch.py) on synthetic adapters of ranks 3, 5
and 16 whose values span many binades (so float32 sums round and their order shows):
every element of an adapter's rows equals its value alone, in every order of the stack
(unpadded, a few in a million differed). Then six seeded sampled requests (three adapters of odd and even ranks, rslora among them, and
the base) are run one at a time and then all at once in a fresh engine: every request's
tokens, the logprobs of each sampled token with its top 5, and the prompt logprobs with
their top 5 (every prefill row's logits) are equal as floats, for 6 of 6 requests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.kernels import cpu_features, lora_expand
from pdserve.engine.kernels import native as native_kernels
from tests.engine.test_lora_peft import PROMPTS
from tests.helpers.lora_adapters import THREE_ADAPTERS, AdapterSpec, make_peft_adapter

ROOT = Path(__file__).resolve().parents[2]
MASKS = [m for m in ("native", "avx512", "avx2", "portable")
         if m == "native" or cpu_features.effective(m) <= cpu_features.host()]


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Odd ranks: whichever of these the stack puts second starts its block at an odd column,
# so its rows' products fall into other lanes of the kernels' k steps than alone.
ODD = (AdapterSpec("all-r3", 3, 6.0, ALL, seed=11), AdapterSpec("all-r5", 5, 5.0, ALL, rslora=True, seed=12))


@pytest.fixture(scope="module")
def odd_adapters(lora_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    base, three = lora_model
    root = tmp_path_factory.mktemp("lora-odd")
    made = {s.name: make_peft_adapter(base, root / s.name, s) for s in ODD}
    return base, {**made, THREE_ADAPTERS[2].name: three[THREE_ADAPTERS[2].name]}


@pytest.mark.parametrize("mask", MASKS)
def test_adapter_rows_have_the_same_bits_alone_and_in_a_mixed_batch(odd_adapters, mask: str) -> None:
    base, adapters = odd_adapters
    names = list(adapters)
    prompts = [*PROMPTS, [1, 9, 8, 7, 6, 5, 4, 3, 2], [1, 300, 301, 302, 303, 304, 305]]
    # adapter (or "" for the base), prompt, seed: every adapter twice-ish, the base once
    requests = [(f"r{i}", name, prompts[i % len(prompts)], 100 + i)
                for i, name in enumerate([names[0], names[1], names[2], "", names[2], names[0]])]
    env = {**os.environ, "PDSERVE_CPU_FEATURES": "" if mask == "native" else mask, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tests.helpers.lora_invariance", str(base),
                          json.dumps({n: str(p) for n, p in adapters.items()}), json.dumps(requests)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["kernel"] != "bf16_aten"  # the row-invariant native kernel ran
    assert out["width"] == 4  # one step ran the three adapters and the base together
    # The stacked update: each adapter's rows alone = in every mixed stack, element for element.
    assert out["stack_total"] > 1_000_000 and out["stack_differ"] == 0, out["stack_differ"]
    alone, mixed = out["alone"], out["mixed"]
    same = [rid for rid, *_ in requests if alone[rid] == mixed[rid]]
    assert len(same) == 6, {rid: (alone[rid]["tokens"], mixed[rid]["tokens"]) for rid, *_ in requests
                            if rid not in same}
    for rid, *_ in requests:
        assert len(alone[rid]["tokens"]) == 16 and alone[rid]["prompt"] is not None


@pytest.mark.skipif(not lora_expand.available(), reason="the native library lacks the LoRA expand")
@pytest.mark.parametrize("mask", [m for m in MASKS if m != "native"] + ["native"])
def test_the_expand_kernel_sums_each_rows_own_columns_in_order(mask: str) -> None:
    """pdserve/engine/kernels/_lora_expand.c equals its definition step for step (float32
    accumulation over the row's columns in ascending order, rounded to bf16, then added to
    `out` and rounded again), leaves base rows untouched, and refuses bad ranges."""
    feats = native_kernels.features() if mask == "native" else cpu_features.effective(mask) & native_kernels.features()
    previous = native_kernels.set_features(feats)
    try:
        g = torch.Generator().manual_seed(3)
        rows, rank, n = 37, 29, 200  # odd sizes: partial channel blocks
        h = torch.randn(rows, rank, generator=g).bfloat16()
        bt = (torch.randn(rank, n, generator=g) * 4).bfloat16()
        out = torch.randn(rows, n, generator=g).bfloat16()
        lo = torch.tensor([(t * 7) % 20 if t % 5 else 0 for t in range(rows)], dtype=torch.int32)
        hi = torch.where(torch.arange(rows) % 5 == 0, lo, torch.clamp(lo + 3 + torch.arange(rows) % 9, max=rank))
        hi = hi.to(torch.int32).contiguous()
        want = out.clone()
        for t in range(rows):
            if hi[t] > lo[t]:
                acc = torch.zeros(n)
                for j in range(int(lo[t]), int(hi[t])):
                    acc = acc + h[t, j].float() * bt[j].float()
                want[t] = (out[t].float() + acc.bfloat16().float()).bfloat16()
        got = out.clone()
        lora_expand.expand(h, bt, lo, hi, got)
        assert torch.equal(got, want)
        assert torch.equal(got[::5], out[::5])  # base rows (lo == hi) untouched
        with pytest.raises(ValueError, match="code 3"):
            lora_expand.expand(h, bt, lo, torch.full((rows,), rank + 1, dtype=torch.int32), got)
    finally:
        native_kernels.set_features(previous)
