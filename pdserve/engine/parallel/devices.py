"""Where each rank of a tensor/pipeline-parallel group runs, and which backend carries
its collectives (torch-free).

CPU: every rank on the CPU, all collectives over gloo. CUDA: rank r on its own device,
`cuda:<base + r>` (base: the worker's device index, 0 for plain `cuda`), so each rank's
weights and KV pool live on that device; the activations' collectives (all-reduce,
stage-to-stage sends) go over NCCL, while the step broadcast (a few int64 values per
sequence) and barriers stay on a gloo group on the CPU, where the step's inputs are.
A group that needs more GPUs than are visible is refused before any rank starts.
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.engine.parallel.plan import ParallelLayoutError

GLOO = "gloo"
NCCL = "nccl"


class GroupDevices(NamedTuple):
    backend: str  # the activations' collectives: gloo | nccl
    devices: tuple[str, ...]  # rank r's torch device

    def of(self, rank: int) -> str:
        return self.devices[rank]


def backend_for(device: str) -> str:
    """The collective backend for tensors on `device`: NCCL on CUDA, gloo on the CPU."""
    return NCCL if device.partition(":")[0] == "cuda" else GLOO


def group_devices(device: str, size: int, visible_gpus: int) -> GroupDevices:
    """The devices of a group of `size` ranks whose rank 0 runs on `device`, with
    `visible_gpus` CUDA devices visible; ParallelLayoutError when they do not fit."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return GroupDevices(GLOO, ("cpu",) * size)
    if kind != "cuda" or (index and not index.isdigit()):
        raise ParallelLayoutError(f"tensor/pipeline parallel runs on cpu or cuda[:N], not {device!r}")
    base = int(index or 0)
    if base + size > visible_gpus:
        raise ParallelLayoutError(
            f"a group of {size} ranks from {device} needs cuda:{base}..cuda:{base + size - 1} (one GPU a rank), "
            f"but {visible_gpus} GPU(s) are visible")
    return GroupDevices(NCCL, tuple(f"cuda:{base + r}" for r in range(size)))
