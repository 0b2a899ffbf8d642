"""The CUDA device a worker computes on, made explicit where CUDA would pick the current one.

A worker serves one device, `--device cuda:N`. Three things follow the process's *current*
device rather than the tensors': Triton launches its kernels on the current device (a
kernel given cuda:1 tensors while cuda:0 is current reads foreign addresses), a CUDA graph
captures on a stream of the current device, and `torch.cuda.Event().record()` marks the
current device's stream (an event meant to order a copy on cuda:1 would then wait for
cuda:0). `bind_device` makes the worker's device current once, before any of them;
`stream_event` records on the given device's stream whatever device is current.
"""

from __future__ import annotations

import torch


def bind_device(device: torch.device) -> None:
    """Make an indexed CUDA `device` this process's current device (no-op elsewhere:
    a bare `cuda` means the current device already)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def stream_event(device: torch.device) -> torch.cuda.Event:
    """An event recorded on `device`'s current stream, after the work queued there."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
