"""How many bytes of a GPU a worker's KV pool may take.

`--gpu-memory-utilization` (vLLM's name) is the fraction of the device's TOTAL memory
this worker may use, weights and activations included; the KV pool gets what is left:

    kv bytes = total * utilization - weights - activations

Two workers that `pdserve up` places on one GPU default to 0.9 / 2 each, so neither
sizes itself from memory the other has not claimed yet (sizing from *free* memory made
the first worker to start take 0.9 of the device and the second fall short).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pdserve.engine.core.config import EngineConfig
    from pdserve.engine.loading.model_config import ModelConfig

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class KVBudget(NamedTuple):
    kv_bytes: int  # what the KV pool may take
    worker_bytes: int  # total * utilization: everything this worker may use
    weight_bytes: int
    activation_bytes: int


def default_gpu_memory_utilization(workers_on_device: int) -> float:
    """This worker's share when `workers_on_device` workers share one GPU."""
    if workers_on_device < 1:
        raise ValueError(f"workers_on_device must be >= 1, got {workers_on_device}")
    return DEFAULT_GPU_MEMORY_UTILIZATION / workers_on_device


def kv_cache_budget(total_bytes: int, utilization: float, weight_bytes: int,
                    activation_bytes: int) -> KVBudget:
    """The KV pool bytes of a worker allowed `utilization` of a `total_bytes` device.

    Raises ValueError, naming the figures, when the weights and activations leave nothing.
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    worker = int(total_bytes * utilization)
    kv = worker - weight_bytes - activation_bytes
    if kv <= 0:
        gib = 1 << 30
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g} gives this worker {worker / gib:.2f} GiB of the "
            f"device's {total_bytes / gib:.2f} GiB; weights ({weight_bytes / gib:.2f} GiB) and "
            f"activations ({activation_bytes / gib:.2f} GiB) leave nothing for the KV cache")
    return KVBudget(kv, worker, weight_bytes, activation_bytes)


def activation_bytes(hidden_size: int, q_size: int, kv_size: int, intermediate_size: int,
                     vocab_size: int, max_tokens: int, max_seqs: int, dtype_bytes: int) -> int:
    """Peak transient memory of one step of `max_tokens` tokens: a layer's residual,
    normed and attention states, q/k/v, and the MLP's gate/up/product (the allocator reuses
    them layer to layer), plus float32 logits and their softmax for `max_seqs` rows."""
    per_token = 4 * hidden_size + q_size + 2 * kv_size + 3 * intermediate_size
    return max_tokens * per_token * dtype_bytes + 2 * max_seqs * vocab_size * 4


def checkpoint_weight_bytes(files: list[Path], dtype_bytes: int) -> int:
    """Bytes the tensors of these safetensors files take in a `dtype_bytes` compute dtype
    (read from the headers only; an upper bound for weights quantized on load)."""
    from safetensors import safe_open

    elements = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                n = 1
                for dim in f.get_slice(name).get_shape():
                    n *= int(dim)
                elements += n
    return elements * dtype_bytes


def cuda_kv_budget(config: EngineConfig, model_config: ModelConfig, weight_bytes: int) -> KVBudget:
    """`kv_cache_budget` for `config`'s CUDA device (its dtype resolved), the weights taking
    `weight_bytes` and one step of the scheduler's token budget the activations."""
    import torch

    from pdserve.engine.runner.kv_pool import TORCH_DTYPES

    _, total = torch.cuda.mem_get_info(torch.device(config.device))
    sched = config.scheduler
    act = activation_bytes(model_config.hidden_size, model_config.q_size, model_config.kv_size,
                           model_config.intermediate_size, model_config.vocab_size,
                           sched.max_num_batched_tokens, sched.max_num_seqs,
                           TORCH_DTYPES[config.dtype].itemsize)
    return kv_cache_budget(int(total), config.cache.gpu_memory_utilization, weight_bytes, act)
