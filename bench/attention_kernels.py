"""Decode attention: the Triton paged kernel against gather + SDPA (`TorchPagedAttention`).

    python -m bench.attention_kernels --device cuda --batch 64 --context 4096   # the GPU check
    python -m bench.attention_kernels --device cpu --batch 2 --context 40 \\
        --heads 4 --kv-heads 2 --head-dim 16 --dtype float32 --iters 2        # CPU, interpreted

One decode step of one layer: `--batch` sequences at `--context` tokens each (Llama-3-8B
heads by default: 32 query, 8 KV, dim 128, blocks of 16), block tables shuffled over the
pool as a busy server's are. Both backends get the same q/k/v and pool; each forward
also writes the step's K/V, as in serving. Time per step: CUDA events over `--iters`
steps after `--warmup` (on CPU: wall time; triton runs under TRITON_INTERPRET=1 there,
so CPU timings check the path, not the speed). Reports both times, the speed-up, the
KV bytes read per step over the Triton time (GB/s) and the largest difference between
the two outputs (the comparison is only worth making if they agree).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass

import torch

from bench import harness


@dataclass(frozen=True)
class AttentionBench:
    batch: int = 64
    context: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    device: str = "cuda"
    warmup: int = 3
    iters: int = 20

    @property
    def kv_bytes_per_step(self) -> int:
        """K and V of every sequence's context, one layer."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.batch * self.context * self.kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class AttentionResult:
    triton_s: float  # per decode step
    torch_s: float
    speedup: float  # torch_s / triton_s
    triton_kv_gbps: float  # KV bytes read per step / triton_s
    max_abs_diff: float  # between the two outputs (float32)


def _inputs(cfg: AttentionBench) -> tuple[torch.Tensor, ...]:
    blocks_per_seq = math.ceil(cfg.context / cfg.block_size)
    num_blocks = cfg.batch * blocks_per_seq + 1  # + the null block
    dev, dt = torch.device(cfg.device), getattr(torch, cfg.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)  # drawn on the device: 1 GiB of pool at batch 64 x 4k

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev, dtype=dt)

    k_cache = randn(num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim)
    v_cache = randn(num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim)
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
    q = randn(cfg.batch, cfg.heads, cfg.head_dim)
    k, v = randn(cfg.batch, cfg.kv_heads, cfg.head_dim), randn(cfg.batch, cfg.kv_heads, cfg.head_dim)
    return q, k, v, k_cache, v_cache, perm.view(cfg.batch, blocks_per_seq)


def run(cfg: AttentionBench) -> AttentionResult:
    """Time both backends on one decode step (see the module docstring)."""
    if cfg.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from pdserve.engine.attention.paged import TorchPagedAttention, build_metadata, order_chunks
    from pdserve.engine.attention.triton_paged import TritonPagedAttention
    from pdserve.engine.core.runner_types import SeqChunk
    from pdserve.engine.runner.cuda_device import bind_device

    bind_device(torch.device(cfg.device))  # Triton and the timing events use the current device
    q, k, v, k_cache, v_cache, tables = _inputs(cfg)
    chunks = [SeqChunk([1], cfg.context - 1, tables[i].tolist(), True) for i in range(cfg.batch)]
    order = order_chunks(chunks)
    dev, dt = torch.device(cfg.device), getattr(torch, cfg.dtype)
    grouped = build_metadata(chunks, order, cfg.block_size, dt, dev)
    flat = build_metadata(chunks, order, cfg.block_size, dt, dev, flat_decode=True)
    tri, ref = TritonPagedAttention(), TorchPagedAttention()
    with torch.inference_mode():
        got = tri.forward(q, k, v, k_cache, v_cache, flat).float()
        want = ref.forward(q, k, v, k_cache, v_cache, grouped).float()
        diff = float((got - want).abs().max())
        triton_s = harness.device_seconds(lambda: tri.forward(q, k, v, k_cache, v_cache, flat),
                                          cfg.iters, cfg.warmup, cfg.device)
        torch_s = harness.device_seconds(lambda: ref.forward(q, k, v, k_cache, v_cache, grouped),
                                         cfg.iters, cfg.warmup, cfg.device)
    return AttentionResult(triton_s, torch_s, torch_s / triton_s,
                           cfg.kv_bytes_per_step / triton_s / 1e9, diff)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, model_help=None)
    defaults = AttentionBench()
    for name in ("batch", "context", "heads", "kv_heads", "head_dim", "block_size", "warmup",
                 "iters"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    ap.add_argument("--dtype", default=defaults.dtype, choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--device", default=defaults.device, help="cuda | cuda:N | cpu")
    args = ap.parse_args(argv)
    cfg = AttentionBench(**{k: v for k, v in vars(args).items() if k != "output_json"})
    result = run(cfg)
    print(f"{harness.machine_line()}\ndecode attention, batch {cfg.batch} x {cfg.context} tokens, {cfg.heads}/{cfg.kv_heads} "
          f"heads of {cfg.head_dim}, {cfg.dtype} on {cfg.device}: triton "
          f"{result.triton_s * 1e3:.3f} ms ({result.triton_kv_gbps:.0f} GB/s of KV), gather + SDPA "
          f"{result.torch_s * 1e3:.3f} ms: {result.speedup:.2f}x; max |diff| {result.max_abs_diff:.2e}")
    harness.write_json(args.output_json, {"config": asdict(cfg), "result": asdict(result)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
