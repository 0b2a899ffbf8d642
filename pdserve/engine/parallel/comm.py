"""One tensor-parallel group's collectives, without torch's process-global default group.

Rank 0 hosts the rendezvous store on an ephemeral loopback port (a TP group lives on
one host); every rank builds a gloo group over it. So one process may hold several
groups (tests do), and nothing is ever pickled: the step inputs travel as int64
tensors (`pdserve.engine.parallel.steps`). A group on CUDA (`device` cuda:N, one GPU a rank,
`pdserve.engine.parallel.devices`) adds an NCCL group over the same store for the activations'
all-reduce and sends; the step broadcast and barriers stay on gloo.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.parallel.devices import GLOO, backend_for

HOST = "127.0.0.1"


class TPGroup:
    """All-reduce for the model's blocks and a broadcast of rank 0's step inputs."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float, device: str = "cpu") -> None:
        gloo: Any = dist.ProcessGroupGloo  # its stubs lack the collectives and _Options
        opts = gloo._Options()
        opts._devices = [gloo.create_device(hostname=HOST)]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self.size = size
        self.device = device
        self._pg = gloo(store, rank, size, opts)
        # The activations' collectives: gloo on the CPU, NCCL between the ranks' GPUs.
        self._data = self._pg if backend_for(device) == GLOO else _nccl(store, rank, size, timeout_s)
        self._bcast = dist.BroadcastOptions()
        self._bcast.rootRank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` (on this rank's device) over the ranks, in place; returns `x`."""
        self._data.allreduce([x]).wait()
        return x

    def broadcast_longs(self, values: torch.Tensor | None) -> torch.Tensor:
        """Rank 0 sends a 1-D int64 tensor (its length first); every rank returns it."""
        n = torch.tensor([0 if values is None else values.numel()], dtype=torch.int64)
        self._pg.broadcast([n], self._bcast).wait()
        buf = values if values is not None else torch.empty(int(n.item()), dtype=torch.int64)
        self._pg.broadcast([buf], self._bcast).wait()
        return buf

    def isend(self, x: torch.Tensor, dst: int, tag: int = 0) -> Any:
        """Point to point (pipeline stages), not waited for: returns the work to `wait()`
        on before `x` is reused; matched by `recv` on `dst` with the same tag, in order."""
        return self._data.send([x], dst, tag)

    def recv(self, x: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self._data.recv([x], src, tag).wait()
        return x

    def barrier(self) -> None:
        self._pg.barrier().wait()


def _nccl(store: dist.Store, rank: int, size: int, timeout_s: float) -> Any:
    """An NCCL group over `store` (its own key prefix); the caller's current CUDA device
    (`torch.cuda.set_device`, done by the rank's runner) is this rank's."""
    nccl: Any = dist.ProcessGroupNCCL  # absent from CPU builds' stubs
    opts = nccl.Options()
    opts.is_high_priority_stream = False
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return nccl(dist.PrefixStore("nccl/", store), rank, size, opts)


def sub_group(store: dist.Store, name: str, rank: int, size: int, timeout_s: float,
              device: str = "cpu") -> TPGroup:
    """A group of some of the ranks (one pipeline stage's tensor-parallel ranks), over the
    same rendezvous store under its own key prefix; `rank` is the rank within it."""
    return TPGroup(dist.PrefixStore(f"{name}/", store), rank, size, timeout_s, device)


def reduce_group(store: dist.Store, world: TPGroup, tp: int, pp: int, timeout_s: float) -> TPGroup | None:
    """The group whose all-reduce sums this rank's tensor-parallel partials: the whole
    group without pipeline parallel, the rank's own stage (`tp` ranks) with it; None
    without tensor parallel. Ranks are a grid: rank = stage * tp + t."""
    if tp == 1:
        return None
    if pp == 1:
        return world
    stage, t = divmod(world.rank, tp)
    return sub_group(store, f"stage{stage}", t, tp, timeout_s, world.device)


def leader_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`store.port`)."""
    return dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def follower_store(port: int, size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
