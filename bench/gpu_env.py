"""What a GPU machine offers pdserve: versions, the device, and whether CUDA IPC works there.

    python -m bench.gpu_env --output-json env.json

1. Versions of Python and of every package pdserve (or its GPU checks) imports; a missing
   one is reported as missing, never an error.
2. The device as torch and cupy see it, and `nvidia-smi -L` with the driver version.
3. A two-process CUDA IPC probe, independent of pdserve's transport code: this process
   allocates a device buffer, fills it and exports its IPC handle; a spawned process opens
   the handle, checks the bytes, writes a pattern back and closes it; this process checks
   the pattern. Some VMs and sandboxes refuse IPC handles; the same-host CUDA fast path
   (kv_transfer.pool.cuda_ipc) cannot work there, whatever its code does.

Exit status 0 when the probe passed, 1 otherwise (the JSON says which step failed).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

PACKAGES = ("torch", "triton", "cupy", "numpy", "zmq", "msgpack", "llguidance", "transformers",
            "safetensors", "tokenizers", "aiohttp", "uvloop", "huggingface_hub", "pytest")
PROBE_BYTES = 1 << 20
FILL, PATTERN = 0x5A, 0xC3


@dataclass(frozen=True)
class IpcProbe:
    ok: bool
    step: str  # the last step reached: alloc, export, open, read, write, verify, done
    error: str | None


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """`package: version` (None where it is not importable)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            mod = importlib.import_module(name)
        except Exception:  # missing, or broken by a missing library: both "not usable"
            out[name] = None
            continue
        out[name] = str(getattr(mod, "__version__", "unknown"))
    try:  # the native host copy (built by gpu_check.sh's `native` phase) or numpy
        from kv_transfer.pool import hostcopy

        out["kv_transfer.pool.hostcopy"] = hostcopy.describe()
    except Exception as e:
        out["kv_transfer.pool.hostcopy"] = f"unavailable: {e!r}"
    return out


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {"torch_cuda": None, "cupy_devices": None, "nvidia_smi": None}
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["torch_cuda"] = {"cuda": torch.version.cuda, "name": p.name,
                                  "capability": list(torch.cuda.get_device_capability(0)),
                                  "memory_bytes": p.total_memory,
                                  "multiprocessors": p.multi_processor_count,
                                  "bf16": torch.cuda.is_bf16_supported()}
    except Exception as e:
        info["torch_cuda"] = {"error": repr(e)}
    try:
        import cupy

        info["cupy_devices"] = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        info["cupy_devices"] = repr(e)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = repr(e)
    return info


def _peer(handle: bytes, conn: Connection) -> None:
    """The spawned side: open, read, write the pattern, close; report the step reached."""
    step = "open"
    try:
        import cupy

        ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        mem = cupy.cuda.UnownedMemory(ptr, PROBE_BYTES, None, 0)
        view = cupy.ndarray((PROBE_BYTES,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
        step = "read"
        if int((view == FILL).sum()) != PROBE_BYTES:
            raise RuntimeError("the peer read other bytes than the owner wrote")
        step = "write"
        view.fill(PATTERN)
        cupy.cuda.runtime.deviceSynchronize()
        del view, mem
        cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        conn.send(("done", None))
    except Exception as e:
        conn.send((step, repr(e)))


def probe_cuda_ipc(timeout_s: float = 60.0) -> IpcProbe:
    step = "alloc"
    try:
        import cupy

        # One cudaMalloc of its own: a handle covers a whole allocation, never a slice of
        # cupy's memory pool.
        memory = cupy.cuda.Memory(PROBE_BYTES)
        buf = cupy.ndarray((PROBE_BYTES,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
        buf.fill(FILL)
        cupy.cuda.runtime.deviceSynchronize()
        step = "export"
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))
    except Exception as e:
        return IpcProbe(False, step, repr(e))
    ctx = multiprocessing.get_context("spawn")  # a fresh CUDA context, as a real peer has
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(handle, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(timeout_s):
            return IpcProbe(False, "open", f"no answer from the peer in {timeout_s:.0f} s")
        step, error = parent.recv()
        if error is not None:
            return IpcProbe(False, step, error)
        if int((buf == PATTERN).sum()) != PROBE_BYTES:
            return IpcProbe(False, "verify", "the owner does not see the peer's writes")
        return IpcProbe(True, "done", None)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", required=True)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds for the IPC peer")
    args = ap.parse_args(argv)
    probe = probe_cuda_ipc(args.timeout)
    result = {"versions": versions(), "device": device_info(), "cuda_ipc": asdict(probe)}
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0 if probe.ok else 1


if __name__ == "__main__":
    sys.exit(main())
