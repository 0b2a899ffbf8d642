"""Devices and backends of a tensor/pipeline-parallel group (pdserve/engine/parallel/devices.py):
gloo on the CPU; on CUDA one GPU a rank with NCCL for the activations' collectives,
refused before any rank starts when fewer GPUs are visible than the group has ranks.
The NCCL all-reduce itself runs only where two GPUs are."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.parallel.comm import TPGroup, follower_store, leader_store
from pdserve.engine.parallel.devices import GLOO, NCCL, backend_for, group_devices
from pdserve.engine.parallel.plan import ParallelLayoutError
from pdserve.engine.parallel.runner import TPRunner

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}


def test_cpu_groups_use_gloo_and_cuda_groups_one_gpu_a_rank_over_nccl() -> None:
    assert group_devices("cpu", 4, 0) == (GLOO, ("cpu",) * 4)
    assert group_devices("cuda", 2, 2) == (NCCL, ("cuda:0", "cuda:1"))
    got = group_devices("cuda:2", 4, 8)
    assert got.backend == NCCL and [got.of(r) for r in range(4)] == ["cuda:2", "cuda:3", "cuda:4", "cuda:5"]
    assert (backend_for("cpu"), backend_for("cuda"), backend_for("cuda:3")) == (GLOO, NCCL, NCCL)


@pytest.mark.parametrize(("device", "size", "visible", "says"), [
    ("cuda", 4, 2, "a group of 4 ranks from cuda needs cuda:0..cuda:3 .* but 2 GPU"),
    ("cuda:1", 2, 2, "needs cuda:1..cuda:2 .* but 2 GPU"),
    ("cuda", 2, 0, "but 0 GPU"),
    ("mps", 2, 0, "cpu or cuda"),
    ("cuda:x", 2, 4, "cpu or cuda"),
])
def test_groups_the_gpus_cannot_hold_are_refused(device: str, size: int, visible: int, says: str) -> None:
    with pytest.raises(ParallelLayoutError, match=says):
        group_devices(device, size, visible)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal on a host with fewer than 2 GPUs")
def test_a_cuda_group_with_too_few_gpus_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))  # refused before any weight is read
    cfg = EngineConfig(model_dir=str(tmp_path), dtype="float32", device="cuda",
                       tensor_parallel_size=2, cache=CacheConfig(num_blocks=8))
    with pytest.raises(ParallelLayoutError, match="one GPU a rank"):
        TPRunner(cfg)
    assert multiprocessing.active_children() == []


def _nccl_rank(rank: int, port: int) -> None:
    torch.cuda.set_device(rank)
    group = TPGroup(follower_store(port, 3, 60.0), rank, 2, 60.0, device=f"cuda:{rank}")
    x = torch.full((4,), float(rank + 1), device=f"cuda:{rank}")
    group.all_reduce(x)
    steps = group.broadcast_longs(torch.tensor([7, 8]) if rank == 0 else None)  # control: gloo, on the CPU
    ok = torch.equal(x.cpu(), torch.full((4,), 3.0)) and steps.tolist() == [7, 8]
    raise SystemExit(0 if ok else 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_all_reduce_across_two_gpus_and_gloo_broadcast() -> None:
    store = leader_store(3, 60.0)  # this process hosts the store; the two ranks join it
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_nccl_rank, args=(r, store.port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
