"""`pdserve plan`: will this model, at this context length, fit on this device?

Prints the capacity arithmetic of `pdserve.planner.capacity` (weights, KV per token and per
request, token budget, max concurrency; with a GPU price the cost per 1M output tokens;
with `--kv-offload-memory/--kv-offload-disk/--kv-remote-memory` the blocks and prefix
tokens each KV tier holds) from the model's own config.json. With `--simulate PROFILE`: the predicted
TTFT, ITL and goodput of each P:D split for a workload (pdserve/cli/plan_simulate.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdserve.cli.args import (
    UsageError,
    add_model_arg,
    device,
    fraction,
    model_dir,
    positive_float,
    positive_int,
)
from pdserve.cli.plan_simulate import add_simulate_args, run_simulate
from pdserve.cli.worker_args import WorkerArgs
from pdserve.planner.capacity import (
    KV_CACHE_DTYPES,
    PlanError,
    compute_plan,
    format_plan,
    parse_size,
)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="capacity arithmetic for a model on a device",
        description=__doc__.splitlines()[0],
    )
    add_model_arg(p)
    p.add_argument("--device-memory", type=_size, default=None, help="e.g. 80GiB, 80GB, 24GiB (required "
                   "unless --simulate)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="tokens per full request (required unless --simulate)")
    p.add_argument("--concurrency", type=positive_int, default=None, help="check this many full requests")
    WorkerArgs.add_to(p, only=("dtype", "quantization", "lm_head_quantization"))
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV element type to plan for (auto: the serving dtype; fp8 and int8: 1 byte)")
    p.add_argument("--gpu-hourly-cost", type=positive_float, default=None, metavar="USD",
                   help="with --throughput: print the cost per 1M output tokens")
    p.add_argument("--throughput", type=positive_float, default=None, metavar="TOK_PER_S",
                   help="output tokens/s the cost is stated at")
    p.add_argument("--device", type=device, default="cpu", help="cpu | cuda | cuda:N: what `auto` resolves for")
    p.add_argument("--block-size", type=positive_int, default=16, help="KV block size in tokens")
    p.add_argument(
        "--overhead", type=fraction, default=0.10, help="fraction of device memory held back"
    )
    p.add_argument("--devices", type=positive_int, default=None,
                   help="recommend the smallest tensor x pipeline parallel layout of at most this many "
                   "devices of --device-memory each that holds the weights and --concurrency (default 1) "
                   "full requests")
    p.add_argument("--devices-per-node", type=positive_int, default=8,
                   help="with --devices: the largest tensor-parallel group (TP inside a node)")
    p.add_argument("--max-loras", type=positive_int, default=0,
                   help="with --enable-lora: count this many resident LoRA adapters (0: none)")
    p.add_argument("--max-lora-rank", type=positive_int, default=16, help="their rank (all 7 projections)")
    p.add_argument("--kv-offload-memory", type=_size, default=None, metavar="SIZE",
                   help="account a host KV tier of this size (a worker's --kv-offload-memory)")
    p.add_argument("--kv-offload-disk", type=_size, default=None, metavar="SIZE",
                   help="account a disk KV tier of this size (a worker's --kv-offload-disk)")
    p.add_argument("--kv-remote-memory", type=_size, default=None, metavar="SIZE",
                   help="account a remote (Redis) KV tier with this much memory for the model's blocks "
                   "(the server's maxmemory bounds it)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    add_simulate_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.simulate is not None:
        return run_simulate(args)
    for flag, value in (("--device-memory", args.device_memory), ("--max-model-len", args.max_model_len)):
        if value is None:
            raise UsageError(flag, "is required (unless --simulate)")
    model = model_dir(args.model)
    if not model.is_dir():
        raise UsageError("--model", f"{model} is not a directory")
    try:
        plan = compute_plan(
            model,
            args.device_memory,
            args.max_model_len,
            dtype=args.dtype,
            device=args.device,
            concurrency=args.concurrency,
            overhead_fraction=args.overhead,
            block_size=args.block_size,
            quantization=args.quantization,
            lm_head_quantization=args.lm_head_quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            gpu_hourly_cost=args.gpu_hourly_cost,
            throughput=args.throughput,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            tier_bytes={name: size for name, size in (("host", args.kv_offload_memory),
                                                      ("disk", args.kv_offload_disk),
                                                      ("remote", args.kv_remote_memory)) if size},
        )
    except PlanError as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    if args.devices is None:
        print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
        return 0
    from pdserve.planner.capacity import read_model_config
    from pdserve.planner.parallel import format_parallel, recommend

    wanted = args.concurrency or 1
    layout = recommend(plan, read_model_config(model), args.devices, args.devices_per_node, wanted)
    if args.json:
        print(json.dumps({**plan.to_dict(), "parallel": None if layout is None else layout.to_dict()}, indent=2))
    else:
        print(format_plan(plan) + "\n" + format_parallel(layout, args.devices, wanted))
    return 0
