"""The only module of kv_transfer that imports torch.

The engine owns its KV pool as a torch tensor; the transfer layer works on
arrays that share that memory: numpy for CPU pools, and for CUDA pools the
tensor itself, which `pool_ops` turns into a cupy view (via
`__cuda_array_interface__`). numpy and cupy have no bfloat16, so bfloat16 pools
are viewed as their raw uint16 bit patterns, and quantized pools (codes and scales)
are uint8 -- the transfer layer only moves and checksums bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kv_transfer.pool.shm import ShmPool
from pdserve.common.kv_layout import KVLayout

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "fp8_e4m3": torch.uint8, "int8": torch.uint8}


def pool_array(tensor: torch.Tensor) -> Any:
    """An array sharing the pool tensor's memory, for `Sender`/`ZmqReceiver`."""
    if not tensor.is_contiguous():
        raise ValueError("the KV pool tensor must be contiguous")
    raw = tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor
    if raw.device.type == "cpu":
        return raw.numpy()
    return raw


def tensor_from_array(array: Any, dtype: str) -> torch.Tensor:
    """A torch view (no copy) of a pool array: numpy (e.g. `ShmPool.array`) or a device array."""
    if isinstance(array, np.ndarray):
        tensor = torch.from_numpy(array)
    else:
        tensor = torch.from_dlpack(array)
    want = _TORCH_DTYPES[dtype]
    return tensor.view(want) if tensor.dtype != want else tensor


def shm_pool_tensor(pool: ShmPool, layout: KVLayout) -> torch.Tensor:
    """The decode worker's pool tensor, living inside the shared-memory segment."""
    return tensor_from_array(pool.array, layout.dtype)
