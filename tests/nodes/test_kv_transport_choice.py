"""`--kv-transport` on both sides: what the decode worker's receiver offers, and which
address the prefill worker sends to. Direct writes (shared memory, CUDA IPC) only for
same-host pairs that both asked for them; tcp otherwise, whatever the device."""

from __future__ import annotations

import pytest
import torch

from decode_node.main import receiver_transport
from pdserve.common import protocol as p
from pdserve.common.transport import host_id
from prefill_node.node import layer_ready, peer_address


@pytest.mark.parametrize(("flag", "on_cuda", "want"), [
    ("tcp", False, "tcp"), ("tcp", True, "tcp"),  # pods: plain frames, staged on a GPU
    ("auto", False, "shm+tcp"), ("shm", False, "shm+tcp"),
    ("auto", True, "cuda+tcp"),
])
def test_receiver_transport_follows_the_flag(flag: str, on_cuda: bool, want: str) -> None:
    assert receiver_transport(flag, on_cuda) == want


def test_shm_on_a_gpu_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="use auto .CUDA IPC with same-host peers. or tcp"):
        receiver_transport("shm", on_cuda=True)
    with pytest.raises(ValueError, match="unknown --kv-transport"):
        receiver_transport("rdma", on_cuda=False)


def _target(address: str, host: str) -> p.TransferTarget:
    return p.TransferTarget("r", "t", "d", host, address, "", [1])


@pytest.mark.parametrize("address", ["cuda+tcp://10.0.0.2:5000", "shm+tcp://10.0.0.2:5000"])
def test_direct_only_when_both_sides_asked_and_share_a_host(address: str) -> None:
    plain = address.split("+", 1)[1]
    assert peer_address(_target(address, host_id()), direct=True) == address
    assert peer_address(_target(address, host_id()), direct=False) == plain  # prefill said tcp
    assert peer_address(_target(address, "another-host"), direct=True) == plain
    assert peer_address(_target(plain, host_id()), direct=True) == plain  # decode said tcp


def test_no_ready_event_on_cpu() -> None:
    """On CPU a layer's KV is written when the step returns: nothing to wait for."""
    assert layer_ready(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ready_event_is_recorded_on_the_compute_stream() -> None:
    event = layer_ready(torch.device("cuda", 0))
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    assert event.query()
