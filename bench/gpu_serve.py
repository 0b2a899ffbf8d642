"""End-to-end serving on a GPU: prefill and decode tokens/s of a random-weight Llama
through the real stack, and decode as a fraction of the HBM-bandwidth limit.

    .venv/bin/python -m bench.gpu_serve --shape llama3-8b --measure-hbm --output-json gpu.json
    .venv/bin/python -m bench.gpu_serve --shape tiny --device cpu --batches 1,4   # CPU smoke run

1. Writes the model (`--shape`, random weights, `--dtype`) into `--model-dir`, or reuses
   the one there when its config matches (a different one is an error, never replaced).
2. Starts a gateway and 1 prefill + 1 decode worker, each in its own process group, with
   the commands `pdserve up` runs (with `--dtype` and a KV size per worker). All three are
   stopped on exit.
3. Through the gateway, with `pdserve.loadgen` (each step after a same-sized warm-up):
   prefill: `--prefill-requests` prompts of `--prefill-len` tokens sent together, 1 output
   token each; tokens/s = sum of prompt tokens / wall time of the batch.
   decode at each B of `--batches`: B streams of `--output-len` tokens from
   `--prompt-len`-token prompts, started together; tokens/s = B x per-stream rate, the
   per-stream rate being sum(output tokens - 1) / sum(E2E - TTFT).
4. HBM limit at B = B x HBM bytes/s / bytes read per decode step, where a step reads every
   weight but the embedding table (only B of its rows) plus B sequences' KV at the mean
   decode context (prompt + output/2). HBM GB/s is `--hbm-gbps` (nominal: 4800 for H200);
   `--measure-hbm` also times a device-to-device copy and reports the fraction of that.
5. Prefill as a fraction of peak: FLOP/s = requests x FLOPs of one prompt / wall time,
   against `--peak-tflops` (H200 SXM dense bf16 by the datasheet: 989). One prompt of L
   tokens costs 2 x (matmul weights of every layer) per token, one LM-head row, and causal
   attention, 4 x heads x head_dim x L(L+1)/2 per layer (`prefill_flops`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from bench import harness
from bench.stack import StackConfig, serving_stack
from pdserve.builtin.default_model import DefaultModelSpec, WeightFormat, write_default_model
from pdserve.engine.loading.model_config import ModelConfig, ModelConfigError
from pdserve.loadgen.config import (
    BenchConfig,
    EndpointConfig,
    LoadConfig,
    OutputConfig,
    WorkloadConfig,
)
from pdserve.loadgen.runner import run_benchmark

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """What the byte arithmetic needs of a Llama (untied embedding and LM head)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> LlamaShape:
        """The shape of a model dir's config.json as the engine reads it."""
        return cls(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size, cfg.vocab_size)


LLAMA3_8B = LlamaShape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256)


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named model to write: its layer shape, padded vocabulary and fill."""

    spec: DefaultModelSpec
    vocab_size: int | None  # None: the built-in tokenizer's own size
    tiled: bool  # cheap fill (see WeightFormat): 8e9 drawn values would take minutes


_LLAMA3_8B_SPEC = DefaultModelSpec(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                   intermediate_size=14336, max_position_embeddings=8192, rope_theta=500000.0)
PRESETS = {"llama3-8b": Preset(_LLAMA3_8B_SPEC, LLAMA3_8B.vocab, tiled=True),
           "tiny": Preset(DefaultModelSpec(), None, tiled=False)}


# --- arithmetic -------------------------------------------------------------------------


def param_count(s: LlamaShape) -> int:
    """Parameters: embedding + LM head + per layer (Q, K, V, O, gate/up/down, 2 norms) + final norm."""
    attn = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2
    layer = attn + 3 * s.hidden * s.ffn + 2 * s.hidden
    return 2 * s.vocab * s.hidden + s.layers * layer + s.hidden


def weight_bytes(s: LlamaShape, dtype_bytes: int) -> int:
    return param_count(s) * dtype_bytes


def kv_bytes_per_token(s: LlamaShape, dtype_bytes: int) -> int:
    """K and V of one token across all layers."""
    return 2 * s.layers * s.kv_heads * s.head_dim * dtype_bytes


def mean_decode_context(prompt_tokens: float, output_len: int) -> float:
    """Mean attended length over the decode steps: step k (1..n-1) attends prompt + k tokens."""
    return prompt_tokens + output_len / 2


def decode_step_bytes(s: LlamaShape, batch: int, context: float, dtype_bytes: int) -> float:
    """HBM bytes one decode step must read: every weight but the embedding table (of which
    only `batch` rows are gathered), plus `batch` sequences' KV at `context` tokens each."""
    weights = (param_count(s) - s.vocab * s.hidden + batch * s.hidden) * dtype_bytes
    return weights + batch * context * kv_bytes_per_token(s, dtype_bytes)


class HbmLimit(NamedTuple):
    step_bytes: float
    limit_tokens_per_s: float  # batch x bandwidth / step bytes
    fraction: float  # measured / limit


def hbm_limit(measured_tps: float, batch: int, step_bytes: float, hbm_gbps: float) -> HbmLimit:
    limit = batch * hbm_gbps * 1e9 / step_bytes
    return HbmLimit(step_bytes, limit, measured_tps / limit)


def prefill_flops(s: LlamaShape, prompt_len: int) -> float:
    """FLOPs of one prompt's prefill (module docstring, step 5); norms and RoPE not counted."""
    attn_w = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2
    layer_w = attn_w + 3 * s.hidden * s.ffn
    causal = 4 * s.heads * s.head_dim * prompt_len * (prompt_len + 1) / 2
    return prompt_len * 2 * s.layers * layer_w + 2 * s.vocab * s.hidden + s.layers * causal


def prefill_peak_fraction(p: PrefillResult, s: LlamaShape, peak_tflops: float) -> dict[str, float]:
    """Achieved prefill FLOP/s and its fraction of `peak_tflops` (the prompts' mean length)."""
    if not p.requests or p.tokens_per_s <= 0:
        return {"flops_per_s": 0.0, "fraction_of_peak": 0.0}
    mean_len = p.prompt_tokens / p.requests
    flops_per_s = p.tokens_per_s / mean_len * prefill_flops(s, round(mean_len))
    return {"flops_per_s": flops_per_s, "fraction_of_peak": flops_per_s / (peak_tflops * 1e12)}


def copy_gbps(nbytes: int, copies: int, seconds: float) -> float:
    """Bandwidth of `copies` device-to-device copies of `nbytes`: each byte is read and written."""
    return 2 * nbytes * copies / seconds / 1e9


def measure_hbm_gbps(device: str, nbytes: int = 4 << 30, copies: int = 20) -> float:
    """Time `copies` copies of an `nbytes` buffer on the GPU (before the stack starts)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = harness.device_seconds(functools.partial(dst.copy_, src), copies, 1, device) * copies
    del src, dst
    torch.cuda.empty_cache()
    return copy_gbps(nbytes, copies, seconds)


# --- model and stack --------------------------------------------------------------------


def expected_config(preset: Preset, dtype: str) -> dict[str, Any]:
    """`ModelConfig` fields a written preset has."""
    s = preset.spec
    want: dict[str, Any] = {"hidden_size": s.hidden_size, "num_layers": s.num_layers,
                            "num_heads": s.num_heads, "num_kv_heads": s.num_kv_heads,
                            "intermediate_size": s.intermediate_size, "rope_theta": s.rope_theta,
                            "torch_dtype": dtype}
    if preset.vocab_size is not None:
        want["vocab_size"] = preset.vocab_size
    return want


def ensure_model(model_dir: Path, preset: Preset, dtype: str) -> bool:
    """Write the model unless a matching one is there; True if written. Written into a
    temporary sibling and renamed into place, so a directory with a config is complete."""
    want = expected_config(preset, dtype)
    if (model_dir / "config.json").is_file():
        try:
            cfg = ModelConfig.from_hf_dir(model_dir)
        except ModelConfigError as e:
            raise SystemExit(f"{model_dir} holds a model this bench cannot use: {e}") from e
        diff = {k: (getattr(cfg, k), v) for k, v in want.items() if getattr(cfg, k) != v}
        if diff:
            raise SystemExit(f"{model_dir} holds another model (have, want): {diff}")
        return False
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
    try:
        write_default_model(tmp, preset.spec, WeightFormat(dtype, preset.vocab_size, preset.tiled))
        tmp.chmod(0o755)
        os.rename(tmp, model_dir)  # fails if model_dir is a non-empty directory without a config
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


# --- measurements -----------------------------------------------------------------------


class PrefillResult(NamedTuple):
    requests: int
    prompt_tokens: int
    tokens_per_s: float  # sum of prompt tokens / wall time of the batch
    per_request_p50_tokens_per_s: float | None  # prompt tokens / TTFT, p50
    ttft_p50_s: float | None
    failed: int


class DecodeResult(NamedTuple):
    batch: int
    mean_prompt_tokens: float
    tokens_per_s: float  # batch x per-stream rate
    tpot_p50_s: float | None
    itl_p50_s: float | None
    failed: int


def _run(url: str, tok: str, prompt_len: int, output_len: int, n: int) -> dict[str, Any]:
    """n requests sent together after n warm-up requests; the loadgen summary."""
    cfg = BenchConfig(
        endpoint=EndpointConfig(base_url=url),
        workload=WorkloadConfig(input_len=prompt_len, output_len=output_len, tokenizer_dir=tok),
        load=LoadConfig(concurrency=n, warmup=n, num_requests=n, max_duration_s=600),
        output=OutputConfig(progress=False, print_table=False),
    )
    return run_benchmark(cfg).runs[0].summary


def measure_prefill(url: str, tok: str, prompt_len: int, requests: int) -> PrefillResult:
    s = _run(url, tok, prompt_len, 1, requests)
    return PrefillResult(s["completed"], s["total_prompt_tokens"], s["prefill_throughput"] or 0.0,
                         s["prefill_rate_per_request"]["p50"], s["ttft"]["p50"], s["failed"])


def measure_decode(url: str, tok: str, prompt_len: int, output_len: int, batch: int) -> DecodeResult:
    s = _run(url, tok, prompt_len, output_len, batch)
    mean_prompt = s["total_prompt_tokens"] / max(1, s["completed"])
    rate = (s["decode_rate_per_stream"] or 0.0) * batch  # all `batch` streams decode together
    return DecodeResult(batch, mean_prompt, rate, s["tpot"]["p50"], s["itl"]["p50"], s["failed"])


# --- command line -----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, model_help=None)
    ap.add_argument("--shape", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    ap.add_argument("--model-dir", default=None, help="default: <PDSERVE_HOME>/models/gpu-serve-SHAPE-DTYPE")
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    ap.add_argument("--batches", default="1,32", help="decode concurrencies")
    ap.add_argument("--prompt-len", type=int, default=128, help="decode prompts, tokens")
    ap.add_argument("--output-len", type=int, default=128, help="decode outputs, tokens (>= 2)")
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--prefill-requests", type=int, default=32)
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="nominal HBM GB/s (H200: 4800)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 peak TFLOP/s (H200 SXM datasheet: 989)")
    ap.add_argument("--measure-hbm", action="store_true", help="also time a device copy (CUDA only)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="per worker")
    ap.add_argument("--kv-cache-memory", default=None, help="per worker (default: 8GiB on CUDA)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    if args.measure_hbm and not args.device.startswith("cuda"):
        ap.error("--measure-hbm needs a CUDA --device")
    if args.output_len < 2:
        ap.error("--output-len must be >= 2 (decode needs tokens after the first)")
    return args


def decode_row(d: DecodeResult, shape: LlamaShape, output_len: int, dtype_bytes: int,
               hbm_gbps: float, measured_gbps: float | None) -> dict[str, Any]:
    """The decode result with its bytes per step and HBM limits (nominal, measured)."""
    context = mean_decode_context(d.mean_prompt_tokens, output_len)
    step = decode_step_bytes(shape, d.batch, context, dtype_bytes)
    nominal = hbm_limit(d.tokens_per_s, d.batch, step, hbm_gbps)
    meas = hbm_limit(d.tokens_per_s, d.batch, step, measured_gbps) if measured_gbps else None
    return {**d._asdict(), "mean_context": context, "step_bytes": step,
            "limit_tokens_per_s": nominal.limit_tokens_per_s, "fraction": nominal.fraction,
            "limit_tokens_per_s_measured": meas.limit_tokens_per_s if meas else None,
            "fraction_measured": meas.fraction if meas else None}


def _fmt(v: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def report(meta: Mapping[str, Any], prefill: PrefillResult, rows: list[dict[str, Any]]) -> None:
    print(f"{harness.machine_line()}\n{meta['shape']} {meta['dtype']} on {meta['device']}: {meta['param_count']:,} params, "
          f"{meta['weight_bytes'] / 1e9:.2f} GB weights; HBM {meta['hbm_gbps']:.0f} GB/s nominal, "
          f"{_fmt(meta['hbm_gbps_measured'], '.0f')} measured")
    print(f"prefill: {prefill.requests} x {meta['prefill_len']} tokens: {prefill.tokens_per_s:.1f} tok/s "
          f"(per request p50 {_fmt(prefill.per_request_p50_tokens_per_s)} tok/s, "
          f"TTFT p50 {_fmt(prefill.ttft_p50_s, '.1f', 1e3)} ms); "
          f"{meta['prefill_flops_per_s'] / 1e12:.1f} TFLOP/s = "
          f"{meta['prefill_fraction_of_peak']:.3g} of {meta['peak_tflops']:.0f}")
    print(f"{'batch':>6}{'decode tok/s':>14}{'TPOT p50 ms':>13}{'GB/step':>9}{'limit tok/s':>13}"
          f"{'fraction':>10}{'limit@meas':>12}{'frac@meas':>11}")
    for r in rows:
        print(f"{r['batch']:>6}{r['tokens_per_s']:>14.1f}{_fmt(r['tpot_p50_s'], '.2f', 1e3):>13}"
              f"{r['step_bytes'] / 1e9:>9.2f}{r['limit_tokens_per_s']:>13.1f}{r['fraction']:>10.3g}"
              f"{_fmt(r['limit_tokens_per_s_measured']):>12}{_fmt(r['fraction_measured'], '.3g'):>11}")
    print("limit = batch x HBM bytes/s / (weights but the embedding + batch x KV at prompt + output/2)")


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through `serving_stack`, which stops the stack


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The stack runs in process groups of its own, out of reach of a signal sent to this
    # one's group (`timeout`), so a SIGTERM here must stop it before exiting.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from pdserve.common import envs

    model_dir = Path(args.model_dir or envs.home() / "models" / f"gpu-serve-{args.shape}-{args.dtype}")
    t0 = time.perf_counter()
    written = ensure_model(model_dir, PRESETS[args.shape], args.dtype)
    print(f"[gpu_serve] model {'written' if written else 'reused'}: {model_dir} "
          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    shape = LlamaShape.from_model_config(ModelConfig.from_hf_dir(model_dir))
    nbytes = DTYPE_BYTES[args.dtype]
    measured_gbps = measure_hbm_gbps(args.device) if args.measure_hbm else None
    kv_mem = args.kv_cache_memory or ("8GiB" if args.device.startswith("cuda") else None)
    cfg = StackConfig(str(model_dir), args.device, args.dtype, args.threads, kv_mem,
                      args.max_num_batched_tokens, args.ready_timeout)
    tok = str(model_dir)  # the model dir holds tokenizer.json: prompts are sized exactly
    with serving_stack(cfg) as url:
        prefill = measure_prefill(url, tok, args.prefill_len, args.prefill_requests)
        decodes = [measure_decode(url, tok, args.prompt_len, args.output_len, int(b))
                   for b in args.batches.split(",")]
    rows = [
        decode_row(d, shape, args.output_len, nbytes, args.hbm_gbps, measured_gbps) for d in decodes
    ]
    meta = {"shape": args.shape, "dtype": args.dtype, "device": args.device, "model_dir": str(model_dir),
            "param_count": param_count(shape), "weight_bytes": weight_bytes(shape, nbytes),
            "hbm_gbps": args.hbm_gbps, "hbm_gbps_measured": measured_gbps, "prefill_len": args.prefill_len,
            "peak_tflops": args.peak_tflops}
    peak = prefill_peak_fraction(prefill, shape, args.peak_tflops)
    meta.update({f"prefill_{k}": v for k, v in peak.items()})
    report(meta, prefill, rows)
    harness.write_json(args.output_json, {"schema_version": 1, **meta, "args": vars(args),
                                          "prefill": {**prefill._asdict(), **peak},
                                          "decode": rows})
    failed = prefill.failed + sum(d.failed for d in decodes)
    if failed or prefill.tokens_per_s <= 0 or any(d.tokens_per_s <= 0 for d in decodes):
        print(
            f"gpu_serve: {failed} failed requests or a zero rate; see the stack log",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
