"""`--dtype auto`: one torch-free resolution (pdserve/engine/loading/dtype.py) used by the engine config,
the workers' CLI and `plan`; the resolved dtype is what the KV layout and the
compatibility hash carry."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.cli import build_parser
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.loading.dtype import (
    DTYPE_CHOICES,
    host_cpu_flags,
    model_dtype,
    resolve_dtype,
    resolved_config,
)
from pdserve.engine.runner.model_runner import ModelRunner

AMX = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
ONLY_AMX = frozenset({"avx2", "amx_tile", "amx_bf16"})
AVX2 = frozenset({"fpu", "avx2", "fma"})
AVX512 = frozenset({"avx2", "avx512f", "avx512bw"})  # no bf16 instructions
NONE: frozenset[str] = frozenset()

# (requested, checkpoint torch_dtype, device, cpu flags) -> served dtype
CASES = [
    # CPU with native bf16 (AVX-512 BF16 or AMX): bf16 whatever the checkpoint holds.
    ("auto", "float32", "cpu", AMX, "bfloat16"),
    ("auto", "float16", "cpu", AMX, "bfloat16"),
    ("auto", "bfloat16", "cpu", AMX, "bfloat16"),
    ("auto", None, "cpu", AMX, "bfloat16"),
    ("auto", "float32", "cpu", AVX512_BF16, "bfloat16"),
    ("auto", "float16", "cpu", ONLY_AMX, "bfloat16"),
    # CPU without it: float32, fp16 and bf16 checkpoints too (never fp16 on CPU).
    ("auto", "float32", "cpu", AVX2, "float32"),
    ("auto", "float16", "cpu", AVX2, "float32"),
    ("auto", "bfloat16", "cpu", AVX512, "float32"),
    ("auto", None, "cpu", NONE, "float32"),
    # CUDA: the checkpoint's dtype, full precision as bf16; CPU flags play no part.
    ("auto", "float16", "cuda", NONE, "float16"),
    ("auto", "bfloat16", "cuda:1", NONE, "bfloat16"),
    ("auto", "float32", "cuda", AMX, "bfloat16"),
    ("auto", None, "cuda", NONE, "bfloat16"),
    ("auto", "float64", "cuda:0", NONE, "bfloat16"),
    ("auto", "torch.float16", "cuda", NONE, "float16"),
    ("auto", "bf16", "cuda", NONE, "bfloat16"),
    # An explicit dtype is served as asked, on any device and CPU.
    ("float32", "bfloat16", "cpu", AMX, "float32"),
    ("float16", "float32", "cpu", AMX, "float16"),
    ("bfloat16", "float32", "cpu", AVX2, "bfloat16"),
    ("float32", "float16", "cuda", NONE, "float32"),
    ("bf16", None, "cpu", NONE, "bfloat16"),
    ("AUTO", "float16", "cuda", NONE, "float16"),
]


@pytest.mark.parametrize(("requested", "stored", "device", "flags", "want"), CASES)
def test_resolve_dtype_table(
    requested: str, stored: str | None, device: str, flags: frozenset[str], want: str
) -> None:
    assert resolve_dtype(requested, stored, device, flags) == want


def test_bad_names_and_devices_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'; choose one of auto, float32"):
        resolve_dtype("float8", None, "cpu", AMX)
    with pytest.raises(ValueError, match=r"unsupported device 'mps'"):
        resolve_dtype("auto", None, "mps", AMX)
    with pytest.raises(ValueError, match="unsupported dtype 'fp8'"):
        EngineConfig(model_dir="m", dtype="fp8")


def test_host_cpu_flags_reads_the_flags_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_CPU_FEATURES", raising=False)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\n"
                    "bugs\t\t: spectre\n\nprocessor\t: 1\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\n")
    assert host_cpu_flags(info) == frozenset({"fpu", "avx2", "amx_bf16", "avx512_bf16"})
    assert host_cpu_flags(tmp_path / "absent") == frozenset()  # not Linux: float32 on CPU
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert host_cpu_flags(arm) == frozenset()


def test_the_feature_mask_resolves_auto_as_the_smaller_cpu_would(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`PDSERVE_CPU_FEATURES` is the capability source `auto` reads (pdserve/engine/kernels/cpu_features.py)."""
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu avx2 fma avx512f avx512bw avx512dq avx512vl avx512_bf16 amx_tile amx_bf16\n")
    monkeypatch.setenv("PDSERVE_CPU_FEATURES", "-amx")
    flags = host_cpu_flags(info)
    assert "amx_bf16" not in flags and "avx512_bf16" in flags
    assert resolve_dtype("auto", None, "cpu", flags) == "bfloat16"
    for mask in ("avx2", "avx512", "-avx512_bf16", "portable"):
        monkeypatch.setenv("PDSERVE_CPU_FEATURES", mask)
        assert resolve_dtype("auto", None, "cpu", host_cpu_flags(info)) == "float32", mask
    monkeypatch.setenv("PDSERVE_CPU_FEATURES", "avx3")
    with pytest.raises(ValueError, match="unknown level 'avx3'"):
        host_cpu_flags(info)


def test_model_dtype_reads_the_checkpoint_dtype(tmp_path: Path, tiny_model_dir: Callable[..., Path]) -> None:
    d = tmp_path / "half"
    d.mkdir()
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16", "dtype": "float16"}))
    assert model_dtype("auto", d, "cuda", NONE) == "float16"
    assert model_dtype("auto", d, "cpu", AMX) == "bfloat16"
    assert model_dtype("auto", d, "cpu", AVX2) == "float32"
    # An explicit dtype never reads config.json (the directory may not even exist yet).
    assert model_dtype("float16", tmp_path / "missing", "cpu", AMX) == "float16"


def test_auto_runner_serves_the_resolved_dtype_and_layout_agrees(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """A runner built from `auto` holds weights and KV in what this host resolves to,
    and `layout_for` (how workers size shared pools before the runner exists) agrees."""
    cfg = EngineConfig(model_dir=str(tiny_model_dir("llama")), num_threads=1,
                       cache=CacheConfig(num_blocks=8))
    assert cfg.dtype == "auto"
    want = resolve_dtype("auto", "float32", "cpu", host_cpu_flags())
    runner = ModelRunner(cfg)
    assert runner.config.dtype == want
    assert runner.pool.kv.dtype == getattr(torch, want)
    assert runner.model.embed_tokens.dtype == getattr(torch, want)
    assert runner.layout == ModelRunner.layout_for(cfg)
    assert runner.layout == ModelRunner.layout_for(replace(cfg, dtype=want))


def test_hosts_that_resolve_differently_have_different_compat_hashes(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """The same `auto` flags on a bf16 host and on one without bf16 give layouts whose
    compatibility hashes differ, so the handshake refuses pairing them; two hosts
    that resolve alike agree."""
    cfg = EngineConfig(model_dir=str(tiny_model_dir("llama")))
    amx = ModelRunner.layout_for(resolved_config(cfg, AMX))
    avx2 = ModelRunner.layout_for(resolved_config(cfg, AVX2))
    assert (amx.dtype, avx2.dtype) == ("bfloat16", "float32")
    assert amx.compat_hash != avx2.compat_hash
    assert ModelRunner.layout_for(resolved_config(cfg, AVX512_BF16)).compat_hash == amx.compat_hash


@pytest.mark.parametrize(
    "argv",
    [
        ["prefill", "--gateway", "tcp://127.0.0.1:1"],
        ["decode", "--gateway", "tcp://127.0.0.1:1"],
        ["worker", "--colocated", "--gateway", "tcp://127.0.0.1:1"],
        ["up"],
        ["generate", "hi"],
        ["plan", "--device-memory", "1GiB", "--max-model-len", "8"],
    ],
)
def test_every_command_defaults_to_auto(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.dtype == "auto"
    if argv[0] != "plan":
        assert build_parser().parse_args([*argv, "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert set(DTYPE_CHOICES) == {"auto", "float32", "float16", "bfloat16"}


def test_up_passes_auto_to_every_worker() -> None:
    from pdserve.cli.up import _worker_cmds

    args = build_parser().parse_args(["up", "--prefill", "1", "--decode", "2"])
    cmds = _worker_cmds(args, "tcp://127.0.0.1:1")
    assert len(cmds) == 3 and all(build_parser().parse_args(c[3:]).dtype == "auto" for c in cmds)
