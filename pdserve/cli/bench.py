"""`pdserve bench`: load-test any OpenAI-compatible endpoint from the client side.

Arguments become a frozen `pdserve.loadgen.config.BenchConfig`; everything else
lives in `pdserve/loadgen`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdserve.cli.args import (
    http_url,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from pdserve.loadgen.config import (
    BenchConfig,
    Endpoint,
    EndpointConfig,
    LenDistribution,
    LoadConfig,
    MixedConfig,
    OutputConfig,
    WorkloadConfig,
    WorkloadKind,
    parse_slo,
)


def _json_object(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text[:60]!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text[:60]!r}")
    return text


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is None:
        return str(args.api_key) if args.api_key is not None else None
    from pdserve.cli.gateway_options import read_key_file

    try:
        keys = read_key_file(args.api_key_file)
    except OSError as e:
        raise ValueError(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None
    if not keys:
        raise ValueError(f"--api-key-file {args.api_key_file}: no key in it")
    return keys[0]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible endpoint",
        description=__doc__.splitlines()[0],
    )
    e = p.add_argument_group("endpoint")
    e.add_argument("--base-url", type=http_url, default="http://127.0.0.1:8000")
    e.add_argument("--endpoint", choices=[x.value for x in Endpoint], default="completions")
    e.add_argument("--api-key", default=None, help="visible in the process list: prefer --api-key-file")
    e.add_argument("--api-key-file", default=None, metavar="FILE", help="the key: the file's first key line")
    e.add_argument("--model", default=None, help="default: first id from GET /v1/models")
    e.add_argument("--models", default=None, metavar="ID,ID,...",
                   help="ids the requests take in turn, e.g. LoRA adapter names (instead of --model)")
    e.add_argument("--request-timeout", type=positive_float, default=600.0, help="seconds per request")
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    e.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help='merged into every request, e.g. \'{"response_format": {...}}\'')

    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=[x.value for x in WorkloadKind],
        default=None,
        help="default: dataset with --dataset, else random",
    )
    w.add_argument(
        "--input-len", type=positive_int, default=128, help="prompt tokens (decode streams: mixed)"
    )
    w.add_argument("--output-len", type=positive_int, default=128, help="max_tokens per request")
    w.add_argument(
        "--len-distribution", choices=[x.value for x in LenDistribution], default="fixed"
    )
    w.add_argument(
        "--len-range", type=non_negative_float, default=0.5, help="uniform: mean*[1-r,1+r]; normal: sigma=mean*r"
    )
    w.add_argument("--shared-prefix-len", type=non_negative_int, default=1024)
    w.add_argument("--num-prefixes", type=positive_int, default=1)
    w.add_argument("--dataset", default=None, help="JSONL with 'prompt' or 'messages' per line")
    w.add_argument(
        "--tokenizer", default=None, help="dir with tokenizer.json: size prompts exactly"
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--long-prompt-len", type=positive_int, default=1500, help="mixed: long prompt tokens")
    w.add_argument("--long-prompt-output-len", type=positive_int, default=16)
    w.add_argument("--long-prompt-interval", type=positive_float, default=3.0, help="mixed: seconds")

    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", type=positive_int, default=1)
    ld.add_argument("--request-rate", type=positive_float, default=None, help="Poisson arrivals, req/s")
    ld.add_argument("--max-concurrency", type=positive_int, default=None, help="cap with --request-rate")
    ld.add_argument("--sweep", type=_positive_ints, default=(), help="concurrencies, e.g. 1,4,16")
    ld.add_argument("--warmup", type=non_negative_int, default=0, help="requests sent first and not measured")
    ld.add_argument("--num-requests", type=positive_int, default=100)
    ld.add_argument("--max-duration", type=positive_float, default=600.0, help="seconds per run")
    ld.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=60.0,
        help="seconds in-flight requests get after --max-duration",
    )
    ld.add_argument("--slo", default="", help="e.g. ttft=0.5,tpot=0.05,itl=0.2,e2e=10 (seconds)")

    o = p.add_argument_group("output")
    o.add_argument("--output-json", default=None)
    o.add_argument("--output-png", default=None)
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Validated `BenchConfig`; raises ValueError with a one-line reason."""
    kind = args.workload or ("dataset" if args.dataset else "random")
    if kind == "dataset" and not args.dataset:
        raise ValueError("--workload dataset needs --dataset FILE")
    if args.sweep and args.request_rate is not None:
        raise ValueError("--sweep and --request-rate are separate modes")
    for name in ("concurrency", "input_len", "output_len", "num_requests"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if args.max_duration <= 0:
        raise ValueError("--max-duration must be > 0")
    return BenchConfig(
        endpoint=EndpointConfig(
            base_url=args.base_url,
            endpoint=Endpoint(args.endpoint),
            api_key=_api_key(args),
            model=args.model,
            models=tuple(m for m in (args.models or "").split(",") if m),
            request_timeout_s=args.request_timeout,
            ignore_eos=not args.no_ignore_eos,
            temperature=args.temperature,
            extra_body=args.extra_body,
        ),
        workload=WorkloadConfig(
            kind=WorkloadKind(kind),
            input_len=args.input_len,
            output_len=args.output_len,
            len_distribution=LenDistribution(args.len_distribution),
            len_range=args.len_range,
            shared_prefix_len=args.shared_prefix_len,
            num_prefixes=args.num_prefixes,
            dataset_path=args.dataset,
            tokenizer_dir=args.tokenizer,
            seed=args.seed,
            mixed=MixedConfig(
                long_prompt_len=args.long_prompt_len,
                long_prompt_output_len=args.long_prompt_output_len,
                long_prompt_interval_s=args.long_prompt_interval,
            ),
        ),
        load=LoadConfig(
            concurrency=args.concurrency,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            sweep=tuple(args.sweep),
            warmup=args.warmup,
            num_requests=args.num_requests,
            max_duration_s=args.max_duration,
            drain_timeout_s=args.drain_timeout,
        ),
        slo=parse_slo(args.slo),
        output=OutputConfig(
            json_path=args.output_json,
            png_path=args.output_png,
            progress=not args.no_progress,
        ),
    )


def run(args: argparse.Namespace) -> int:
    from pdserve.loadgen.client import EndpointError
    from pdserve.loadgen.report import format_report, write_json
    from pdserve.loadgen.runner import run_benchmark

    try:
        cfg = config_from_args(args)
        result = run_benchmark(cfg)
    except (ValueError, FileNotFoundError, EndpointError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    print(format_report(result))
    if cfg.output.json_path:
        write_json(result, cfg.output.json_path)
        print(f"wrote {cfg.output.json_path}")
    if cfg.output.png_path:
        from pdserve.loadgen.plots import write_png

        write_png(result, cfg.output.png_path)
        print(f"wrote {cfg.output.png_path}")
    completed = sum(run.summary["completed"] for run in result.runs)
    return 0 if completed else 1
