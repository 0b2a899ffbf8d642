"""The serving dtype: what `--dtype auto`, the default everywhere, runs a model in.

`auto` picks, from the checkpoint's `torch_dtype`, the device and the CPU's flags:

- CPU: bfloat16 where the CPU computes bf16 natively (AVX-512 BF16 or AMX-BF16),
  whatever the checkpoint stores: float16 checkpoints run as bf16 (CPUs have no
  fast fp16 matmul) and float32 ones as bf16 too (vLLM's CPU default). float32
  where the CPU lacks native bf16: emulated bf16 is slower than float32 there.
- CUDA: the checkpoint's dtype; a float32 (or unlabelled) checkpoint runs as bf16.

An explicit dtype is used as given. Torch-free, so `pdserve plan` and the CLI
resolve exactly as the engine does. The resolved dtype is the compute and KV
dtype the compatibility hash covers: prefill and decode workers on one host
resolve alike; hosts that resolve differently are refused at the handshake.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from pdserve.engine.core.config import DTYPE_CHOICES, SERVING_DTYPES, EngineConfig
from pdserve.engine.kernels import cpu_features
from pdserve.engine.loading.model_config import ModelConfig

__all__ = ["DTYPE_CHOICES", "SERVING_DTYPES"]
# /proc/cpuinfo flags of a CPU with native bf16 arithmetic (either suffices).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_ALIASES = {
    "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
}
CPUINFO = cpu_features.CPUINFO
DTYPE_HELP = ("auto (default): bfloat16 on a CPU with native bf16 (AVX-512 BF16 or AMX), "
              "else float32; on CUDA the checkpoint's dtype, float32 as bfloat16")


def normalize_dtype(name: str) -> str:
    """`bf16` -> `bfloat16`, `torch.float16` -> `float16`; ValueError for an unknown name."""
    d = name.strip().lower().removeprefix("torch.")
    d = _ALIASES.get(d, d)
    if d not in DTYPE_CHOICES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return d


def has_native_bf16(cpu_flags: Iterable[str]) -> bool:
    return not BF16_CPU_FLAGS.isdisjoint(cpu_flags)


def resolve_dtype(
    requested: str, checkpoint_dtype: str | None, device: str, cpu_flags: Iterable[str]
) -> str:
    """The dtype to serve in (one of SERVING_DTYPES); see the module docstring.

    `checkpoint_dtype`: config.json's `torch_dtype` (None: not given, read as float32);
    `device`: cpu | cuda | cuda:N; `cpu_flags`: the host's CPU flags (`host_cpu_flags()`).
    """
    want = normalize_dtype(requested)
    if want != "auto":
        return want
    if device == "cpu":
        return "bfloat16" if has_native_bf16(cpu_flags) else "float32"
    if device == "cuda" or device.startswith("cuda:"):
        stored = _checkpoint(checkpoint_dtype)
        return stored if stored in ("float16", "bfloat16") else "bfloat16"
    raise ValueError(f"--dtype auto: unsupported device {device!r} (expected cpu, cuda or cuda:N)")


def _checkpoint(dtype: str | None) -> str:
    """A checkpoint's `torch_dtype` as a serving dtype; anything not half precision
    (float32, float64, absent, unknown) counts as full precision."""
    if dtype is None:
        return "float32"
    try:
        d = normalize_dtype(dtype)
    except ValueError:
        return "float32"
    return d if d in SERVING_DTYPES else "float32"


def host_cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU flags of this host from `/proc/cpuinfo` (x86 `flags` line) as
    `PDSERVE_CPU_FEATURES` leaves them (pdserve/engine/kernels/cpu_features.py, the one capability
    source: `-avx512_bf16` resolves `auto` as a CPU without it would); empty when
    unreadable (not Linux), which resolves `auto` on CPU to float32."""
    return cpu_features.masked_flags(cpu_features.read_flags(cpuinfo))


def model_dtype(
    requested: str, model_dir: str | Path, device: str, cpu_flags: Iterable[str] | None = None
) -> str:
    """`resolve_dtype` for the checkpoint in `model_dir` on this host (`cpu_flags`: None
    reads this host's). config.json is read only for `auto`."""
    if normalize_dtype(requested) != "auto":
        return normalize_dtype(requested)
    stored = ModelConfig.from_hf_dir(model_dir).torch_dtype
    flags = host_cpu_flags() if cpu_flags is None else cpu_flags
    return resolve_dtype(requested, stored, device, flags)


def resolved_config(config: EngineConfig, cpu_flags: Iterable[str] | None = None) -> EngineConfig:
    """`config` with its dtype resolved (`model_dtype`): what the runner and its KV
    layout use, so a worker's pool, weights and compatibility hash agree."""
    dtype = model_dtype(config.dtype, config.model_dir, config.device, cpu_flags)
    return config if dtype == config.dtype else replace(config, dtype=dtype)
