"""`--attention-backend auto|torch|triton|flashinfer`: which attention backend a runner uses.

    auto        CUDA over a plain pool: flashinfer if installed, else triton if installed,
                else torch; CPU (or a quantized pool): the native/torch default
    torch       gather + SDPA (on CPU the in-place native decode kernel where it is built)
    triton      the Triton kernels; CUDA, triton installed, an unquantized pool
    flashinfer  FlashInfer's paged wrappers; CUDA, flashinfer installed, an unquantized pool,
                a head size its prebuilt kernels cover (FLASHINFER_HEAD_DIMS; auto skips it else)

Asking for triton or flashinfer where it cannot run is a one-line error naming why
(`refusal`), never a silent fallback.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pdserve.engine.attention.paged import AttentionBackend

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def installed(package: str) -> bool:
    """Whether `package` is importable here (without importing it)."""
    return importlib.util.find_spec(package) is not None


def refusal(choice: str, device_type: str, quantized_kv: bool, have_package: bool,
            head_dim: int | None = None) -> str | None:
    """Why `--attention-backend choice` cannot serve here (None: it can). `have_package`:
    whether the package the choice needs (triton or flashinfer) is installed; `head_dim`:
    the model's head size, where known."""
    if choice not in ATTENTION_BACKENDS:
        return f"unknown attention backend {choice!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
    if choice in ("auto", "torch"):
        return None
    if device_type != "cuda":
        return f"{choice} needs a CUDA device, not {device_type}"
    if not have_package:
        return f"{choice} needs the {choice} package, which is not installed here"
    if quantized_kv:
        return (f"{choice} reads only a plain KV pool (unquantized, not a tensor-parallel head "
                "slice); serve --kv-cache-dtype fp8/int8 with torch")
    if choice == "flashinfer" and head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        return (f"flashinfer has kernels for head sizes {', '.join(map(str, FLASHINFER_HEAD_DIMS))}, "
                f"not {head_dim}; use triton")
    return None


def resolve(choice: str, device_type: str, quantized_kv: bool, have_triton: bool,
            have_flashinfer: bool, head_dim: int | None = None) -> str:
    """The backend `choice` means here: torch, triton or flashinfer (ValueError when refused)."""
    have = {"triton": have_triton, "flashinfer": have_flashinfer}.get(choice, True)
    why = refusal(choice, device_type, quantized_kv, have, head_dim)
    if why is not None:
        raise ValueError(f"--attention-backend {why}")
    if choice != "auto":
        return choice
    if device_type != "cuda" or quantized_kv:
        return "torch"
    if have_flashinfer and refusal("flashinfer", device_type, quantized_kv, True, head_dim) is None:
        return "flashinfer"
    return "triton" if have_triton else "torch"


def make_backend(choice: str, dtype: torch.dtype, device: torch.device, plain_kv: bool = True,
                 head_dim: int | None = None, quantized_kv: bool = False) -> AttentionBackend:
    """The backend `choice` resolves to for a runner on `device` (`plain_kv`: an unquantized
    pool whose views are whole and contiguous; `head_dim`: the model's head size;
    `quantized_kv`: an fp8/int8 pool, which the CPU in-place kernel also reads)."""
    name = resolve(choice, device.type, not plain_kv, installed("triton"), installed("flashinfer"),
                   head_dim)
    if name == "flashinfer":
        from pdserve.engine.attention.flashinfer import FlashInferAttention

        return FlashInferAttention(device)
    if name == "triton":
        from pdserve.engine.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention()
    from pdserve.engine.attention.native import default_backend

    return default_backend(dtype, device, plain_kv, quantized_kv)
