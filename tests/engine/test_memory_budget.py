"""KV pool sizing on a GPU: a fraction of the device's TOTAL memory per worker, minus the
weights and activations; `pdserve up` splits the default between workers on one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.cli import build_parser
from pdserve.cli.args import UsageError
from pdserve.cli.up import _worker_cmds, gpu_settings
from pdserve.cli.workers import check_gpu_args
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.runner.memory_budget import (
    activation_bytes,
    checkpoint_weight_bytes,
    default_gpu_memory_utilization,
    kv_cache_budget,
)

GIB = 1 << 30


def test_two_workers_on_one_device_split_its_total_not_its_free_memory() -> None:
    share = default_gpu_memory_utilization(2)
    assert share == pytest.approx(0.45)
    # 141 GiB device, 16 GiB of weights, 2 GiB of activations: each worker's pool is the
    # same whichever starts first (sizing from free memory gave the first one 0.9).
    budget = kv_cache_budget(141 * GIB, share, 16 * GIB, 2 * GIB)
    assert budget.worker_bytes == int(141 * GIB * 0.45)
    assert budget.kv_bytes == int(141 * GIB * 0.45) - 18 * GIB
    assert 2 * budget.worker_bytes <= 0.9 * 141 * GIB
    assert kv_cache_budget(141 * GIB, 0.9, 16 * GIB, 2 * GIB).kv_bytes == int(141 * GIB * 0.9) - 18 * GIB


def test_a_share_the_weights_fill_is_refused_with_the_figures() -> None:
    with pytest.raises(ValueError, match=r"gives this worker 8\.00 GiB .*weights \(16\.00 GiB\)"):
        kv_cache_budget(80 * GIB, 0.1, 16 * GIB, 1 * GIB)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        kv_cache_budget(80 * GIB, 1.5, 0, 0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=0.0)


def test_activations_grow_with_the_token_budget_and_logits_rows() -> None:
    # Llama-3-8B shape, bf16, 2048 tokens, 64 sequences.
    act = activation_bytes(4096, 4096, 1024, 14336, 128256, 2048, 64, 2)
    assert act == 2048 * (4 * 4096 + 4096 + 2048 + 3 * 14336) * 2 + 2 * 64 * 128256 * 4
    assert activation_bytes(4096, 4096, 1024, 14336, 128256, 4096, 64, 2) > act


def test_checkpoint_weight_bytes_counts_elements_in_the_compute_dtype(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(3, 5, dtype=torch.float32), "b": torch.zeros(7, dtype=torch.float16)}, str(path))
    assert checkpoint_weight_bytes([path], 2) == (15 + 7) * 2


def test_up_gives_each_cuda_worker_its_share_and_cpu_refuses_the_gpu_flags() -> None:
    args = build_parser().parse_args(["up", "--device", "cuda:0", "--no-cuda-graphs"])
    cmds = _worker_cmds(args, "tcp://127.0.0.1:5555")
    assert len(cmds) == 2
    for cmd in cmds:
        parsed = build_parser().parse_args(cmd[3:])
        assert parsed.gpu_memory_utilization == pytest.approx(0.45) and parsed.cuda_graphs is False
    three = build_parser().parse_args(["up", "--device", "cuda", "--prefill", "2"])
    assert gpu_settings(three, 3) == {"gpu_memory_utilization": 0.3}
    mine = build_parser().parse_args(["up", "--device", "cuda", "--gpu-memory-utilization", "0.6"])
    assert gpu_settings(mine, 2) == {"gpu_memory_utilization": 0.6}
    assert all("--gpu-memory-utilization" not in c for c in _worker_cmds(build_parser().parse_args(["up"]), "x"))
    with pytest.raises(UsageError, match="--cuda-graphs"):
        gpu_settings(build_parser().parse_args(["up", "--cuda-graphs"]), 2)
    with pytest.raises(UsageError, match="--gpu-memory-utilization"):
        check_gpu_args(build_parser().parse_args(["decode", "--gateway", "tcp://127.0.0.1:1",
                                                  "--gpu-memory-utilization", "0.5"]))
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        EngineConfig(model_dir="x", cuda_graphs=True)
